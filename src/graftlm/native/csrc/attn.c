/* RMS norm, RoPE, attention through the KV cache (decode steps; prompts: attn_prompt.c), and
 * the gated activation of the feed-forward block: the float32 pieces of a decoder layer. */
#include "graftlm.h"

/* ---------------------------------------------------------------- norms, RoPE, attention */

/* o = o * c + p * v */
static inline void scale_axpy(float *o, float c, float p, const float *v, int64_t n) {
    const __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_mul_ps(cv, _mm256_loadu_ps(o + i))));
    for (; i < n; i++) o[i] = o[i] * c + p * v[i];
}

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w over rows of n values: each square in float, their
 * sum in double, as ggml (in 8 lanes: one chain of n dependent adds made short rows of heads,
 * qwen3's QK-norm, cost as much as the long ones). */
void gl_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y,
                 int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i), sq = _mm256_mul_ps(v, v);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
        double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
        for (i = 0; i < n; i++) yr[i] = (xr[i] * scale) * w[i];
    }
}

/* Rotate the first rot values of one head (adjacent pairs, or halves when neox). */
static inline void rope_head(const float *x, float *o, int64_t d, int64_t rot, const float *cs,
                             const float *sn, int neox) {
    const int64_t half = rot / 2;
    if (neox) {
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            o[i] = a * cs[i] - b * sn[i];
            o[i + half] = b * cs[i] + a * sn[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            const float a = x[2 * i], b = x[2 * i + 1];
            o[2 * i] = a * cs[i] - b * sn[i];
            o[2 * i + 1] = a * sn[i] + b * cs[i];
        }
    }
    for (int64_t i = rot; i < d; i++) o[i] = x[i];
}

/* RoPE for N rows of H heads of D values (a prompt's q or k): row i at x + i * rs, its heads D
 * apart, rotated at position pos[i] (first rot values of each head), into out (N, H, D).
 * The tables have n_pos rows: -1 (nothing written) when a position is outside them. */
int gl_rope(const float *x, int64_t N, int64_t rs, int64_t H, int64_t D, const int64_t *pos,
            const float *cos_t, const float *sin_t, int64_t n_pos, int64_t rot, int neox,
            float *out, int nth) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < N; i++)
        if (pos[i] < 0 || pos[i] >= n_pos) return -1;
#pragma omp parallel for num_threads(nth) schedule(static) if (N * H * D > 65536)
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < H; h++)
            rope_head(x + i * rs + h * D, out + (i * H + h) * D, D, rot, cos_t + pos[i] * half,
                      sin_t + pos[i] * half, neox);
    return 0;
}

/* One decode step of attention for B rows, each one new token of its own sequence: RoPE on q and
 * k at the row's position, k and v written into the cache at (slot, position), then
 * softmax(scale * q.K) V over positions [max(0, pos - window + 1), pos] (window 0: all), with GQA
 * (query head h reads kv head h / G, G = H / Hkv) and an optional tanh soft-cap. q/k/v rows start
 * every q_rs/k_rs/v_rs floats, heads contiguous within a row; the cache, the RoPE tables, the
 * dimensions and the scales are a's. out: (B, H * Dv).
 *
 * The step reads the cache once: a task is one row's kv head over a range of its positions, and
 * takes all G query heads of that kv head through each tile of up to DT keys (consecutive
 * positions of one cache block, contiguous in the pool) in one pass: the tile as float32 (the
 * cache's type converted once), its G x DT scores (each key's dot products summed in 8 lanes,
 * eight keys' lanes reduced together), the online softmax's running max and sum, and the weighted
 * values added to the G outputs. Ranges: a row's positions split in chunks when the rows' kv
 * heads alone would not keep every thread busy (flash-decoding), each chunk's (max, sum, output)
 * merged at the end. Where the CPU has AVX-512 BF16 a bfloat16 cache's task runs in bfloat16
 * pairs (decode_task_bf16: half the instructions, the query and the weights rounded to bfloat16);
 * a q8_0 cache's keys meet the query in integer dots (VNNI) and its values' scales ride on the
 * weights (pv_q8); float16 and float32 caches keep float32 arithmetic throughout. */
#define DT 16 /* keys a tile (the cache's block: step/kv_cache.py BLOCK) */
#define DECODE_MIN_CHUNK 256 /* the fewest positions a split hands one task */

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The float32 rows of a tile: n rows of w cached values of type t at src (contiguous), converted
 * into dst, or src itself when it is float32 and whole (a short float32 tile is copied: the rows
 * past it may lie past the pool). */
static inline __attribute__((always_inline)) const float *tile_f32(const char *src, int64_t n,
                                                                   int64_t w, float *dst, const int t) {
    if (t == 0 && n == DT) return (const float *)src;
    const int64_t m = n * w;
    for (int64_t i = 0; i < m; i += 8) _mm256_store_ps(dst + i, kv_load8(src, i, t));
    return dst;
}

/* O (GN heads x 8 NU values, rows Dv apart) = alpha O + sum_i P[g][i] V[i] over the tile's n keys
 * (V rows Dv apart, P rows DT apart): the accumulators held in registers. */
static inline __attribute__((always_inline)) void pv_tile(float *O, const float *alpha, const float *P,
                                                          const float *V, int64_t n, int64_t Dv,
                                                          const int GN, const int NU) {
    __m256 acc[4][4];
    for (int g = 0; g < GN; g++) {
        const __m256 a = _mm256_set1_ps(alpha[g]);
        for (int u = 0; u < NU; u++) acc[g][u] = _mm256_mul_ps(a, _mm256_loadu_ps(O + g * Dv + 8 * u));
    }
    for (int64_t i = 0; i < n; i++) {
        __m256 v[4];
        for (int u = 0; u < NU; u++) v[u] = _mm256_loadu_ps(V + i * Dv + 8 * u);
        for (int g = 0; g < GN; g++) {
            const __m256 p = _mm256_broadcast_ss(P + g * DT + i);
            for (int u = 0; u < NU; u++) acc[g][u] = _mm256_fmadd_ps(p, v[u], acc[g][u]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int u = 0; u < NU; u++) _mm256_storeu_ps(O + g * Dv + 8 * u, acc[g][u]);
}

#define PV_NU(GN)                                                                      \
    switch (nu) {                                                                      \
    case 1: pv_tile(Og, al, Pg, Vc, n, Dv, GN, 1); break;                              \
    case 2: pv_tile(Og, al, Pg, Vc, n, Dv, GN, 2); break;                              \
    case 3: pv_tile(Og, al, Pg, Vc, n, Dv, GN, 3); break;                              \
    default: pv_tile(Og, al, Pg, Vc, n, Dv, GN, 4); break;                             \
    }

/* The tiles of the block after position j's toward the cache (L2), of a task ending at k1: the
 * whole block of keys where they are transposed, else its rows; the block's rows of values. The
 * blocks lie anywhere in the pool, where no hardware prefetcher follows. */
static inline __attribute__((always_inline)) void decode_ahead(const gl_kv *kv, int64_t s, int64_t hk,
                                                               int64_t j, int64_t k1, int64_t D,
                                                               int64_t Dv, const int t) {
    const int64_t BS = kv->block, jn = (j / BS + 1) * BS, nn = k1 - jn < BS ? k1 - jn : BS;
    if (jn >= k1) return;
    const char *kn = t != 3 ? kt_plane(kv, s, hk, jn, D) : kv_at(kv, kv->k, s, hk, jn, D);
    const char *vn = kv_at(kv, kv->v, s, hk, jn, Dv);
    prefetch_l2(kn, kv_bytes((t != 3 ? BS : nn) * D, t));
    prefetch_l2(vn, kv_bytes(nn * Dv, t));
}

/* tiles a step of the 512-bit task: one softmax update over DECODE_STEP DT keys (4: 0.89-0.93x
 * the time of 2 in cache, one thread; 8 no better); a q8_0 cache's step: 2 (from memory, one
 * thread, Qwen2.5-1.5B's heads: 0.88-0.93x the time of 4; in cache 1.03x) */
#define DECODE_STEP 4
#define DECODE_STEP_Q8 2
/* steps of blocks the 512-bit task prefetches (every line, toward L2) ahead of the one it reads
 * (4 blocks): 1 to 4 steps of 2 blocks measured alike; every other line, or toward L1, or none:
 * 1.5x to 2x slower at 16,384 (none: 0.94x in cache). Spread over the step's loops (pf_queue), 2
 * steps measured as 1 (0.97-1.01x, one thread, a loaded machine) */
#define DECODE_AHEAD 1

/* The lines of the next step's blocks, handed out a few at a time by pf_issue inside the step's
 * loops: a step's burst of prefetches (every line of 4 blocks at once) stalled the core on its
 * full miss buffers with no arithmetic beside it (a fifth of the task's samples sat on the burst's
 * PREFETCHT1s at 16,384 positions), where spread over the step they overlap its arithmetic. */
#define PF_RANGES (2 * DECODE_AHEAD * DECODE_STEP)
/* lines a block of q8_0 scores and a key of q8_0 values issue (4 and 2: 0.94-1.0x the time of 2
 * and 1, one thread; the other loops: one a pair of dims of f16 scores, two a key of values) */
#define PF_Q8_SCORES 4
#define PF_Q8_PV 2
typedef struct {
    const char *cur, *stop; /* the range being issued */
    const char *p[PF_RANGES], *e[PF_RANGES]; /* the ranges queued behind it */
    int i, n;
} pf_queue;

/* The next line of the queue toward L2, if any is left. */
static inline __attribute__((always_inline)) void pf_issue(pf_queue *q) {
    if (q->cur >= q->stop) {
        if (q->i == q->n) return;
        q->cur = q->p[q->i], q->stop = q->e[q->i], q->i++;
    }
    _mm_prefetch(q->cur, _MM_HINT_T1);
    q->cur += 64;
}

static inline void pf_range(pf_queue *q, const char *p, int64_t bytes) {
    q->p[q->n] = (const char *)((uintptr_t)p & ~(uintptr_t)63), q->e[q->n] = p + bytes, q->n++;
}

/* Every line still queued, then an empty queue. */
static inline __attribute__((always_inline)) void pf_flush(pf_queue *q) {
    for (; q->cur < q->stop; q->cur += 64) _mm_prefetch(q->cur, _MM_HINT_T1);
    for (; q->i < q->n; q->i++)
        for (const char *c = q->p[q->i]; c < q->e[q->i]; c += 64) _mm_prefetch(c, _MM_HINT_T1);
    q->i = q->n = 0;
}

/* The tile of keys and the rows of values of the block holding position p (of a task ending at
 * k1), queued: the whole transposed block, else its rows from p. */
static inline __attribute__((always_inline)) void pf_block(pf_queue *q, const gl_kv *kv, int64_t s, int64_t hk,
                                                           int64_t p, int64_t k1, int64_t D, int64_t Dv,
                                                           const int t) {
    const int64_t BS = kv->block, end = (p / BS + 1) * BS, n = (k1 < end ? k1 : end) - p;
    const char *kn = t != 3 ? kt_plane(kv, s, hk, p, D) : kv_at(kv, kv->k, s, hk, p, D);
    pf_range(q, kn, kv_bytes((t != 3 ? BS : n) * D, t));
    pf_range(q, kv_at(kv, kv->v, s, hk, p, Dv), kv_bytes(n * Dv, t));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(GL_NO_ZMM)
/* The 512-bit task: a tile's 16 keys are one vector of scores a head (the ymm variant and AVX2
 * CPUs take the 256-bit one below, two vectors a head). */

/* 16 cached values from value i of p as float32 (i a multiple of 16). */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *p, int64_t i, const int t) {
    if (t == 0) return _mm512_loadu_ps((const float *)p + i);
    if (t == 3) {
        const char *b = (const char *)p + (i >> 5) * 34;
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + (i & 31)));
        return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(dh)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
    if (t == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
}

/* 16 vectors of 16 transposed in place: r[i] lane j <- r[j] lane i (dwords: any 32-bit data). */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 u[16];
    for (int j = 0; j < 16; j += 2) {
        u[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
        u[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {
        r[j] = _mm512_shuffle_ps(u[j], u[j + 2], 0x44);
        r[j + 1] = _mm512_shuffle_ps(u[j], u[j + 2], 0xEE);
        r[j + 2] = _mm512_shuffle_ps(u[j + 1], u[j + 3], 0x44);
        r[j + 3] = _mm512_shuffle_ps(u[j + 1], u[j + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        u[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88);
        u[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xDD);
        u[j + 8] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88);
        u[j + 12] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xDD);
    }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(u[j], u[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(u[j], u[j + 8], 0xDD);
    }
}

/* The float32 keys of a tile transposed, Kt (D x DT): Kt[d * DT + j] = key j's value d, for the
 * tile's n keys (keys past n: key 0's values, masked out later). 16 x 16 blocks through registers. */
static inline __attribute__((always_inline)) void tile_keys_t(const char *src, int64_t n, int64_t D,
                                                              float *Kt, const int t) {
    const int64_t rb = kv_bytes(D, t); /* a row's bytes */
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t w = D - d0 < 16 ? D - d0 : 16; /* 16, or 8 at a tail */
        __m512 r[16];
        for (int j = 0; j < 16; j++) {
            const char *row = src + (j < n ? j : 0) * rb;
            r[j] = w == 16 ? kv_load16(row, d0, t) : _mm512_castps256_ps512(kv_load8(row, d0, t));
        }
        transpose16(r);
        for (int i = 0; i < w; i++) _mm512_store_ps(Kt + (d0 + i) * DT, r[i]); /* r[i]: value i */
    }
}

/* 16 values of type t from p (16-bit types: elements; float32: floats), lanes past m zero. */
static inline __attribute__((always_inline)) __m512 kt_load16(const char *p, __mmask16 m, const int t) {
    if (t == 0) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (t == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* S[g] (one vector: the tile's 16 keys) = Q[g] . K for GN heads from Q (rows D apart), K the
 * tile's keys transposed: value d of the 16 keys at K + kv_bytes(d * ld), type t, lanes past m
 * zero. Two chains a head over the even and odd values, all heads' chains interleaved. */
static inline __attribute__((always_inline)) void scores_tile(const float *Q, const char *K, int64_t ld,
                                                              __mmask16 m, int64_t D, __m512 *S,
                                                              pf_queue *pf, const int t, const int GN) {
    __m512 acc[8][2];
    for (int g = 0; g < GN; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
        pf_issue(pf);
        const __m512 k0 = kt_load16(K + kv_bytes(d * ld, t), m, t);
        const __m512 k1 = kt_load16(K + kv_bytes((d + 1) * ld, t), m, t);
        for (int g = 0; g < GN; g++) {
            acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(Q[g * D + d]), k0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(Q[g * D + d + 1]), k1, acc[g][1]);
        }
    }
    for (int g = 0; g < GN; g++) S[g] = _mm512_add_ps(acc[g][0], acc[g][1]);
}

/* The float16 scales at p + i rb of rows i < n as 16 floats (0 past n): one gather (16 scalar
 * loads through memory measured 9% slower: the 16-bit stores do not forward to the wide load). */
static inline void q8_scales16(const char *p, int64_t rb, int64_t n, float *out) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)rb));
    const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << n) - 1u), at, p, 1);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
}

#if defined(__AVX512VNNI__) && !defined(GL_NO_Q8_DOTS) /* (-DGL_NO_Q8_DOTS: tests of the rest) */
#define DECODE_Q8_DOTS 1
/* q8_0 keys against int8 queries (llama.cpp's q8_0 x q8_0 dot for a q8_0 cache): the group's
 * queries quantized per 32 values (qi, their scales qd, and 128 x each block's sum, qs, for the
 * unsigned keys), 1.25 G D bytes of the thread's Vf (the 512-bit task reads values in place). */
typedef struct {
    int8_t *qi;
    float *qd;
    int32_t *qs;
} q8_queries;

/* Round half away from zero, as roundf (the cache's kv_store and KVCache's q8_0_pack). */
static inline __m512i round_away(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
    return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
}

/* The bytes q8_quantize lays out in its room: the codes (G D, to a multiple of 64), then a scale
 * and a code sum each 32 values. */
static inline int64_t q8_queries_bytes(int64_t G, int64_t D) {
    return (G * D + 63) / 64 * 64 + 8 * G * (D / 32);
}

static inline q8_queries q8_quantize(const float *Q, int64_t G, int64_t D, void *room) {
    const int64_t nb = D / 32;
    q8_queries out = {(int8_t *)room, NULL, NULL};
    out.qd = (float *)((char *)room + (G * D + 63) / 64 * 64);
    out.qs = (int32_t *)(out.qd + G * nb);
    for (int64_t g = 0; g < G; g++)
        for (int64_t b = 0; b < nb; b++) { /* as ggml's quantize_row_q8_0: d = amax / 127 */
            const float *x = Q + g * D + b * 32;
            const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512i a = round_away(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
            const __m512i c = round_away(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(out.qi + g * D + b * 32), _mm512_cvtsepi32_epi8(a));
            _mm_storeu_si128((__m128i *)(out.qi + g * D + b * 32 + 16), _mm512_cvtsepi32_epi8(c));
            out.qd[g * nb + b] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); /* stored as float16 */
            out.qs[g * nb + b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
        }
    return out;
}

/* A tile's n q8_0 keys (rows of 34-byte blocks at rows, rb bytes apart) as unsigned bytes (+128),
 * transposed in dwords: kq[c * 16 + l] lanes = keys, dword l of 64-value chunk c (values 4 l ..
 * 4 l + 3 of block 2c, then of block 2c + 1); ks[b * 16 + i] key i's scale of block b. Keys past
 * n: key 0's (masked out later). */
static inline void q8_keys_t(const char *rows, int64_t rb, int64_t n, int64_t D, __m512i *kq, float *ks) {
    const int64_t nb = D / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; 2 * c < nb; c++) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) {
            const char *row = rows + (i < n ? i : 0) * rb + 2 * c * 34;
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(row + 2));
            const __m256i hi = 2 * c + 1 < nb ? _mm256_loadu_si256((const __m256i *)(row + 36)) : _mm256_setzero_si256();
            r[i] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
        }
        transpose16(r);
        for (int l = 0; l < 16; l++) kq[c * 16 + l] = _mm512_xor_si512(_mm512_castps_si512(r[l]), flip);
    }
    for (int64_t b = 0; b < nb; b++) q8_scales16(rows + b * 34, rb, n, ks + b * 16);
}

/* GN heads' scores of the tile from head g0 (S[gi]: lanes = keys): per block the exact int32
 * dot of the keys' codes with each query's, then times both scales; each vector of keys loaded
 * once for the GN heads, their chains of VPDPBUSD interleaved (one head at a time: 8 dependent
 * VPDPBUSDs a block, each vector of keys loaded G times). */
static inline __attribute__((always_inline)) void q8_scores(const q8_queries *qq, int64_t g0, int64_t D,
                                                            const __m512i *kq, const float *ks, __m512 *S,
                                                            pf_queue *pf, const int GN) {
    const int64_t nb = D / 32;
    __m512 acc[8];
    for (int g = 0; g < GN; g++) acc[g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[8];
        for (int g = 0; g < GN; g++) dot[g] = _mm512_set1_epi32(-qq->qs[(g0 + g) * nb + b]);
        const __m512i *kb = kq + (b / 2) * 16 + (b % 2) * 8;
        for (int l = 0; l < 8; l++) {
            if (l % (8 / PF_Q8_SCORES) == 0) pf_issue(pf);
            const __m512i k = kb[l];
            for (int g = 0; g < GN; g++) {
                const int32_t *q4 = (const int32_t *)(qq->qi + (g0 + g) * D);
                dot[g] = _mm512_dpbusd_epi32(dot[g], k, _mm512_set1_epi32(q4[b * 8 + l]));
            }
        }
        const __m512 kd = _mm512_loadu_ps(ks + b * 16);
        for (int g = 0; g < GN; g++) {
            const __m512 sc = _mm512_mul_ps(kd, _mm512_set1_ps(qq->qd[(g0 + g) * nb + b]));
            acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g]), sc, acc[g]);
        }
    }
    for (int g = 0; g < GN; g++) S[g] = acc[g];
}
#else
#define DECODE_Q8_DOTS 0
#endif

/* 2^x for 16 floats x <= 0 (finite: below -126 about 0, under FTZ 0; -inf lanes: NaN, masked by
 * the caller), to a relative 1e-7: x's integer part through VSCALEFPS, its fraction [-0.5, 0.5]
 * by a degree-6 fit (10 instructions, exp512's 18: the softmax pays G of them a key). */
static inline __m512 exp2_512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.5332502e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3394706e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6184909e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5503424e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022648e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* O (GN heads x 16 NU values from value c0, rows Dv apart; the last vector's lanes: last) =
 * alpha O + sum_i P[g][i] V[i] over the keys of a step's nts tiles (tile u: n[u] keys, its
 * values' rows at V[u], rb bytes apart, type t; its weights at P + u DT, rows pw apart), each row
 * of V read once from the cache for all GN heads, the accumulators in registers over the step. */
static inline __attribute__((always_inline)) void pv_step16(float *O, const float *alpha, const float *P,
                                                            int64_t pw, const char *const *V,
                                                            const int64_t *n, int nts, int64_t rb,
                                                            int64_t c0, int64_t Dv, __mmask16 last,
                                                            pf_queue *pf, const int t, const int GN,
                                                            const int NU) {
    __m512 acc[4][4];
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int u = 0; u < NU; u++)
            acc[g][u] = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(u == NU - 1 ? last : 0xFFFF, O + g * Dv + 16 * u));
    }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x];
        const float *Px = P + x * DT;
        for (int64_t i = 0; i < n[x]; i++) {
            pf_issue(pf);
            pf_issue(pf);
            __m512 v[4];
            for (int u = 0; u < NU; u++)
                v[u] = u == NU - 1 && last != 0xFFFF ? _mm512_zextps256_ps512(kv_load8(Vx + i * rb, c0 + 16 * u, t))
                                                     : kv_load16(Vx + i * rb, c0 + 16 * u, t);
            for (int g = 0; g < GN; g++) {
                const __m512 p = _mm512_set1_ps(Px[g * pw + i]);
                for (int u = 0; u < NU; u++) acc[g][u] = _mm512_fmadd_ps(p, v[u], acc[g][u]);
            }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int u = 0; u < NU; u++)
            _mm512_mask_storeu_ps(O + g * Dv + 16 * u, u == NU - 1 ? last : 0xFFFF, acc[g][u]);
}

#define PV16_NU(GN)                                                                    \
    switch (nu) {                                                                      \
    case 1: pv_step16(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, last, &pf, t, GN, 1); break;            \
    case 2: pv_step16(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, last, &pf, t, GN, 2); break;            \
    case 3: pv_step16(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, last, &pf, t, GN, 3); break;            \
    default: pv_step16(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, last, &pf, t, GN, 4); break;           \
    }

/* The scales of the values of a step's q8_0 tiles: vs[(x 32 + b) 16 + i] = tile x's key i's
 * scale of block b (of Dv / 32), 0 past the tile's n[x] keys (a block's scales lie 34 bytes
 * apart, a tile's rows rb apart). */
static inline void q8_value_scales(const char *const *V, const int64_t *n, int nts, int64_t rb,
                                   int64_t Dv, float *vs) {
    for (int x = 0; x < nts; x++)
        for (int64_t b = 0; b < Dv / 32; b++) q8_scales16(V[x] + 34 * b, rb, n[x], vs + (x * 32 + b) * 16);
}

/* pv_step16 for q8_0 values (c0 and Dv multiples of 32, NU even): each key's block scales folded
 * into its weights a tile at a time (p'[g][i] = p[g][i] s_i, vs: q8_value_scales'), so a value
 * is its code converted, and one broadcast weight serves a block's two vectors. */
static inline __attribute__((always_inline)) void pv_q8(float *O, const float *alpha, const float *P,
                                                        int64_t pw, const char *const *V, const int64_t *n,
                                                        int nts, int64_t rb, int64_t c0, int64_t Dv,
                                                        const float *vs, pf_queue *pf, const int GN,
                                                        const int NU) {
    __m512 acc[4][4];
    float pp[4][2][16];
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int u = 0; u < NU; u++) acc[g][u] = _mm512_mul_ps(a, _mm512_loadu_ps(O + g * Dv + 16 * u));
    }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x] + (c0 / 32) * 34 + 2;
        for (int g = 0; g < GN; g++)
            for (int b = 0; b < NU / 2; b++)
                _mm512_storeu_ps(pp[g][b], _mm512_mul_ps(_mm512_loadu_ps(P + g * pw + x * DT),
                                                         _mm512_loadu_ps(vs + (x * 32 + c0 / 32 + b) * 16)));
        for (int64_t i = 0; i < n[x]; i++) {
            for (int f = 0; f < PF_Q8_PV; f++) pf_issue(pf);
            __m512 v[4];
            for (int u = 0; u < NU; u++)
                v[u] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(Vx + i * rb + (u / 2) * 34 + (u % 2) * 16))));
            for (int g = 0; g < GN; g++)
                for (int b = 0; b < NU / 2; b++) {
                    const __m512 p = _mm512_set1_ps(pp[g][b][i]);
                    acc[g][2 * b] = _mm512_fmadd_ps(p, v[2 * b], acc[g][2 * b]);
                    acc[g][2 * b + 1] = _mm512_fmadd_ps(p, v[2 * b + 1], acc[g][2 * b + 1]);
                }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int u = 0; u < NU; u++) _mm512_storeu_ps(O + g * Dv + 16 * u, acc[g][u]);
}

#define PVQ8_NU(GN)                                                                    \
    if (nu == 2) pv_q8(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, &pf, GN, 2);          \
    else pv_q8(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, &pf, GN, 4);

/* pv_bf16's order of n values (a multiple of 32) back to theirs, in place. */
static inline void decode_bf16_order(float *O, int64_t n) {
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < n; c += 32) {
        const __m512 lo = _mm512_loadu_ps(O + c), hi = _mm512_loadu_ps(O + c + 16);
        _mm512_storeu_ps(O + c, _mm512_permutex2var_ps(lo, i0, hi));
        _mm512_storeu_ps(O + c + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
}

#if DECODE_Q8_DOTS /* (the VNNI of the keys' integer dots: a build without takes pv_q8) */
#define DECODE_Q8_PV16 1
/* The values' side of pv_q8 in 16-bit integers (VPDPWSSD: two products a lane, int32 sums), half
 * the instructions: a step's weights of head g and block b, p'[i] = p[g][i] s_i, rounded to
 * integers w = p' 32767 / c, c = pm[g] cb[b] (pm: the head's largest weight in the step, cb: the
 * block's largest scale there; c >= every p'), an error of at most c / 65534 a weight: a step's 32
 * at most 2^-11 pm max|v|, and as pm <= the step's sum of weights, an output value within 2^-11
 * of the head's largest value of the exact one (the cache's own rounding: 2^-8 of its block's
 * largest; measured: 2^-16 or less, the errors' signs mixed). Two keys' codes are interleaved by value (sign-extended to 16 bits, then unpacklo / unpackhi of words:
 * pv_bf16's order of O, which decode_bf16_order puts back at the task's end) and meet the pair of
 * their weights; a step's int32 sums times c / 32767 join O in float32. */
static inline void q8_block_max(const float *vs, int nts, int64_t Dv, float *cb) {
    for (int64_t b = 0; b < Dv / 32; b++) {
        __m512 mx = _mm512_setzero_ps();
        for (int x = 0; x < nts; x++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(vs + (x * 32 + b) * 16));
        cb[b] = _mm512_reduce_max_ps(mx);
    }
}

static inline __attribute__((always_inline)) void pv_q8w(float *O, const float *alpha, const float *P,
                                                         int64_t pw, const char *const *V, const int64_t *n,
                                                         int nts, int64_t rb, int64_t c0, int64_t Dv,
                                                         const float *vs, const float *pm, const float *cb,
                                                         pf_queue *pf, const int GN, const int NB) {
    __m512i acc[4][4];
    int16_t wq[4][2][DT + 2]; /* a tile's weights (the pair past its last key: 0) */
    float wk[4][2], dk[4][2];
    for (int g = 0; g < GN; g++)
        for (int b = 0; b < NB; b++) {
            const float c = pm[g] * cb[c0 / 32 + b];
            wk[g][b] = c > 0.0f ? 32767.0f / c : 0.0f;
            dk[g][b] = c / 32767.0f;
            acc[g][2 * b] = acc[g][2 * b + 1] = _mm512_setzero_si512();
        }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x] + (c0 / 32) * 34 + 2;
        for (int g = 0; g < GN; g++)
            for (int b = 0; b < NB; b++) {
                const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(P + g * pw + x * DT),
                                               _mm512_mul_ps(_mm512_loadu_ps(vs + (x * 32 + c0 / 32 + b) * 16), _mm512_set1_ps(wk[g][b])));
                _mm256_storeu_si256((__m256i *)wq[g][b], _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(w)));
                wq[g][b][DT] = wq[g][b][DT + 1] = 0;
            }
        for (int64_t i = 0; i < n[x]; i += 2) {
            for (int f = 0; f < 2 * PF_Q8_PV; f++) pf_issue(pf);
            const int two = i + 1 < n[x];
            __m512i lo[2], hi[2];
            for (int b = 0; b < NB; b++) {
                const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(Vx + i * rb + b * 34)));
                const __m512i c = two ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(Vx + (i + 1) * rb + b * 34)))
                                      : _mm512_setzero_si512();
                lo[b] = _mm512_unpacklo_epi16(a, c);
                hi[b] = _mm512_unpackhi_epi16(a, c);
            }
            for (int g = 0; g < GN; g++)
                for (int b = 0; b < NB; b++) {
                    uint32_t pp;
                    memcpy(&pp, &wq[g][b][i], 4);
                    const __m512i pv = _mm512_set1_epi32((int)pp);
                    acc[g][2 * b] = _mm512_dpwssd_epi32(acc[g][2 * b], lo[b], pv);
                    acc[g][2 * b + 1] = _mm512_dpwssd_epi32(acc[g][2 * b + 1], hi[b], pv);
                }
        }
    }
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int u = 0; u < 2 * NB; u++) {
            float *o = O + g * Dv + 16 * u;
            const __m512 d = _mm512_set1_ps(dk[g][u / 2]);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc[g][u]), _mm512_mul_ps(a, _mm512_loadu_ps(o))));
        }
    }
}

#define PVQ8W_NB(GN)                                                                   \
    if (nu == 2) pv_q8w(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, pmx + g0, cb, &pf, GN, 1); \
    else pv_q8w(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, pmx + g0, cb, &pf, GN, 2);
#else
#define DECODE_Q8_PV16 0
#endif

#if ATTN_BF16
/* A bfloat16 cache's task in bfloat16 pairs (VDPBF16PS: two products a lane, float32 sums), half
 * the instructions of float32 FMAs and no conversion of the cache's values: the query rounded to
 * bfloat16 once a task, the softmax's weights once a step (the sums l are the rounded weights',
 * so the output stays a convex combination of the values). -DGL_NO_BF16_ATTN (and the ymm and
 * avx2 variants) keep float32 arithmetic. Where a tile of a step starts inside its block (a
 * window's first block, a chunk's), its lanes still are the block's 16 positions, those outside
 * the tile masked. */
#define DECODE_BF16 1

#define DECODE_BF16_STEP 4 /* tiles a step of the bfloat16 task */
#define PF_BF16 4 /* lines a pair of dims of its scores and a pair of keys of its values issue */
#if DECODE_BF16_STEP > DECODE_STEP
#error "pf_queue holds the ranges of DECODE_AHEAD * DECODE_STEP blocks"
#endif

/* S[g NT + x] (the 16 keys of tile x's block: lanes) = Q[g] . K[x] for GN heads and NT blocks,
 * Qb: the heads' queries as bfloat16 pairs (dims 2i, 2i + 1 in dword i; rows D / 2 dwords
 * apart), K[x]: a block's keys transposed (value d of its 16 keys: 32 bytes at K[x] + 32 d). Two
 * rows of a block (dims d and d + 1) are one 64-byte load, interleaved into pairs by key (one
 * VPERMW); each broadcast pair of a query meets the NT blocks. */
static inline __attribute__((always_inline)) void scores_bf16(const uint32_t *Qb, const char *const *K,
                                                              int64_t D, __m512 *S, pf_queue *pf,
                                                              const int GN, const int NT) {
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t D2 = D / 2;
    __m512 acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int x = 0; x < NT; x++) acc[g][x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D2; i++) {
        for (int f = 0; f < PF_BF16; f++) pf_issue(pf);
        __m512bh k[4];
        for (int x = 0; x < NT; x++)
            k[x] = (__m512bh)_mm512_permutexvar_epi16(ilv, _mm512_loadu_si512(K[x] + 64 * i));
        for (int g = 0; g < GN; g++) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)Qb[g * D2 + i]);
            for (int x = 0; x < NT; x++) acc[g][x] = _mm512_dpbf16_ps(acc[g][x], k[x], qp);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int x = 0; x < NT; x++) S[g * NT + x] = acc[g][x];
}

/* 2^x for 16 floats x <= 0 (below -126: about 2^-126), to a relative 5e-5: enough for weights
 * rounded to bfloat16 (2^-9). */
static inline __m512 exp2_bf16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 y = _mm512_set1_ps(9.6181291e-3f); /* ln2^4 / 24, then Taylor's terms down */
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* O (GN heads x 32 NC values from value c0, rows Dv apart) = alpha O + sum_i P[g][i] V[i] over a
 * step's nts tiles (tile x: n[x] keys, its values' rows at V[x], rb bytes apart; its weights as
 * bfloat16 at Pb + x 16 + o[x], rows pw apart). Two keys' rows interleaved by value (unpacklo /
 * unpackhi of 16-bit words) meet the pair of their weights: each 32 values of O are held as two
 * vectors, the first of values 0-3, 8-11, 16-19 and 24-27, the second of the others
 * (decode_bf16_order puts them back in order at the task's end). */
static inline __attribute__((always_inline)) void pv_bf16(float *O, const float *alpha, const uint16_t *Pb,
                                                          int64_t pw, const char *const *V, const int64_t *o,
                                                          const int64_t *n, int nts, int64_t rb, int64_t c0,
                                                          int64_t Dv, pf_queue *pf, const int GN,
                                                          const int NC) {
    __m512 acc[4][4][2];
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++)
                acc[g][c][h] = _mm512_mul_ps(a, _mm512_loadu_ps(O + g * Dv + c0 + 32 * c + 16 * h));
    }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x] + 2 * c0;
        const uint16_t *px = Pb + 16 * x + o[x];
        for (int64_t i = 0; i < n[x]; i += 2) {
            for (int f = 0; f < PF_BF16; f++) pf_issue(pf);
            const int two = i + 1 < n[x];
            __m512bh lo[4], hi[4];
            for (int c = 0; c < NC; c++) {
                const __m512i a = _mm512_loadu_si512(Vx + i * rb + 64 * c);
                const __m512i b = two ? _mm512_loadu_si512(Vx + (i + 1) * rb + 64 * c) : _mm512_setzero_si512();
                lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < GN; g++) {
                uint32_t pp;
                memcpy(&pp, px + g * pw + i, 4); /* (p_i, p_i+1): p_i+1 finite, its row zero past n */
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp);
                for (int c = 0; c < NC; c++) {
                    acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], lo[c], pv);
                    acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], hi[c], pv);
                }
            }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++) _mm512_storeu_ps(O + g * Dv + c0 + 32 * c + 16 * h, acc[g][c][h]);
}

#define PVB_NC(GN)                                                                     \
    if (nc == 1) pv_bf16(Og, al, Pg, PWB, Vt, ot, nt, nts, vrb, c0, Dv, &pf, GN, 1);       \
    else pv_bf16(Og, al, Pg, PWB, Vt, ot, nt, nts, vrb, c0, Dv, &pf, GN, 2);

/* Whether a task of these dimensions takes the bfloat16 pairs: a cache's block of DT positions,
 * whole pairs of 32 values a head, its queries and weights in the thread's Kf and Vf. */
static inline int decode_bf16_fits(const gl_attn *a) {
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim;
    return a->kv.block == DT && D % 32 == 0 && Dv % 32 == 0 && G * D * 2 <= DT * D * 4 &&
           G * (DECODE_BF16_STEP * DT + 2) * 2 <= DT * Dv * 4;
}

/* decode_task (below) for a bfloat16 cache in bfloat16 pairs; Kf: the queries' pairs, Vf: the
 * weights as bfloat16. */
static void decode_task_bf16(const gl_attn *a, const float *Q, int64_t s, int64_t hk, int64_t k0,
                             int64_t k1, float *part, float *Kf, float *Vf, float *P, float *alpha) {
    const gl_kv *kv = &a->kv;
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim, BS = DT;
    const int64_t PW = DECODE_BF16_STEP * DT, PWB = PW + 2; /* P's rows, Pb's */
    const float l2e = 1.44269504088896341f; /* scores in base 2: m too, until the task's end */
    const float softcap = a->softcap;
    const __m512 cap = _mm512_set1_ps(softcap), ninf = _mm512_set1_ps(-INFINITY);
    float *m = part, *l = part + G, *O = part + 2 * G, *mnew = alpha + G, *psum = alpha + 2 * G;
    uint32_t *Qb = (uint32_t *)Kf;
    uint16_t *Pb = (uint16_t *)Vf;
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)(G * Dv));
    memset(Pb, 0, sizeof(uint16_t) * (size_t)(G * PWB)); /* the pads past a step's tiles: 0 */
    for (int64_t i = 0; i < G * D; i += 32)
        _mm512_storeu_si512(Qb + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(Q + i + 16), _mm512_loadu_ps(Q + i)));
    const int64_t vrb = 2 * Dv;
    int64_t ahead = k0;
    pf_queue pf = {NULL, NULL, {NULL}, {NULL}, 0, 0};
    for (int64_t j = k0; j < k1;) {
        int64_t jt[DECODE_BF16_STEP], nt[DECODE_BF16_STEP], ot[DECODE_BF16_STEP];
        const char *Vt[DECODE_BF16_STEP], *Kt[DECODE_BF16_STEP];
        __mmask16 vis[DECODE_BF16_STEP];
        int nts = 0;
        for (int64_t p = j; nts < DECODE_BF16_STEP && p < k1; nts++) {
            const int64_t o = p % BS, n = BS - o < k1 - p ? BS - o : k1 - p;
            jt[nts] = p, nt[nts] = n, ot[nts] = o, vis[nts] = (__mmask16)(((1u << n) - 1u) << o);
            Vt[nts] = kv_at(kv, kv->v, s, hk, p, Dv);
            Kt[nts] = kt_plane(kv, s, hk, p, D);
            p += n;
        }
        const int64_t jend = jt[nts - 1] + nt[nts - 1];
        pf_flush(&pf);
        for (; ahead < k1 && ahead < jend + DECODE_AHEAD * DECODE_BF16_STEP * BS; ahead = (ahead / BS + 1) * BS)
            if (ahead >= jend) pf_block(&pf, kv, s, hk, ahead, k1, D, Dv, 2);
        /* raw scores into P: up to 4 heads over all the step's blocks at once (a whole step), or
         * block by block */
        for (int64_t g0 = 0; g0 < G;) {
            const int64_t gn = G - g0 >= 4 ? 4 : G - g0 >= 2 ? 2 : 1;
            const uint32_t *Qg = Qb + g0 * (D / 2);
            __m512 S[16];
            if (nts == DECODE_BF16_STEP) {
                switch (gn) {
                case 4: scores_bf16(Qg, Kt, D, S, &pf, 4, DECODE_BF16_STEP); break;
                case 2: scores_bf16(Qg, Kt, D, S, &pf, 2, DECODE_BF16_STEP); break;
                default: scores_bf16(Qg, Kt, D, S, &pf, 1, DECODE_BF16_STEP); break;
                }
                for (int64_t gi = 0; gi < gn; gi++)
                    for (int x = 0; x < DECODE_BF16_STEP; x++)
                        _mm512_storeu_ps(P + (g0 + gi) * PW + x * DT, S[gi * DECODE_BF16_STEP + x]);
            } else {
                for (int x = 0; x < nts; x++) {
                    switch (gn) {
                    case 4: scores_bf16(Qg, Kt + x, D, S, &pf, 4, 1); break;
                    case 2: scores_bf16(Qg, Kt + x, D, S, &pf, 2, 1); break;
                    default: scores_bf16(Qg, Kt + x, D, S, &pf, 1, 1); break;
                    }
                    for (int64_t gi = 0; gi < gn; gi++) _mm512_storeu_ps(P + (g0 + gi) * PW + x * DT, S[gi]);
                }
            }
            g0 += gn;
        }
        /* each head's weights over the step, rounded to bfloat16: Pb, and their sum */
        for (int64_t g = 0; g < G; g++) {
            __m512 xs[DECODE_BF16_STEP], mxv = ninf;
            for (int x = 0; x < nts; x++) {
                __m512 v = _mm512_loadu_ps(P + g * PW + x * DT);
                if (softcap > 0.0f)
                    v = _mm512_mul_ps(tanh512(_mm512_div_ps(_mm512_mul_ps(v, _mm512_set1_ps(a->scale)), cap)), _mm512_set1_ps(softcap * l2e));
                else
                    v = _mm512_mul_ps(v, _mm512_set1_ps(a->scale * l2e));
                xs[x] = _mm512_mask_blend_ps(vis[x], ninf, v);
                mxv = _mm512_max_ps(mxv, xs[x]);
            }
            const float mx = _mm512_reduce_max_ps(mxv), mn = mx > m[g] ? mx : m[g];
            __m512 sum = _mm512_setzero_ps();
            for (int x = 0; x < nts; x++) {
                const __m512 e = _mm512_maskz_mov_ps(vis[x], exp2_bf16(_mm512_sub_ps(xs[x], _mm512_set1_ps(mn))));
                const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
                _mm256_storeu_si256((__m256i *)(Pb + g * PWB + x * DT), eb);
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
            }
            if (nts < DECODE_BF16_STEP) _mm256_storeu_si256((__m256i *)(Pb + g * PWB + nts * DT), _mm256_setzero_si256());
            psum[g] = _mm512_reduce_add_ps(sum);
            mnew[g] = mn;
        }
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 mk = (__mmask16)(G - g >= 16 ? 0xFFFF : (1u << (G - g)) - 1u);
            const __m512 mo = _mm512_maskz_loadu_ps(mk, m + g), mw = _mm512_maskz_loadu_ps(mk, mnew + g);
            const __mmask16 seen = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ);
            const __m512 al = _mm512_maskz_mov_ps(seen, exp512(_mm512_mul_ps(_mm512_sub_ps(mo, mw), _mm512_set1_ps(0.69314718056f))));
            _mm512_mask_storeu_ps(alpha + g, mk, al);
            _mm512_mask_storeu_ps(l + g, mk, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, l + g), al, _mm512_maskz_loadu_ps(mk, psum + g)));
            _mm512_mask_storeu_ps(m + g, mk, mw);
        }
        /* O = alpha O + P V: up to 4 heads x 64 values a pass */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            const float *al = alpha + g0;
            const uint16_t *Pg = Pb + g0 * PWB;
            for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
                const int64_t nc = Dv - c0 < 64 ? 1 : 2;
                float *Og = O + g0 * Dv;
                switch (gn) {
                case 1: PVB_NC(1) break;
                case 2: PVB_NC(2) break;
                case 3: PVB_NC(3) break;
                default: PVB_NC(4) break;
                }
            }
        }
        j = jend;
    }
    decode_bf16_order(O, G * Dv);
    for (int64_t g = 0; g < G; g++) m[g] *= 0.69314718056f; /* the merge's base: e */
}
#else
#define DECODE_BF16 0
#endif

/* One task: kv head hk of the row at slot s, its G query heads rotated in Q (G x D), over
 * positions [k0, k1): part = [m (G), l (G), O (G x Dv)], the running max, the sum of
 * exp(score - max) and the unnormalized output. A step takes up to DECODE_STEP tiles (one cache block
 * each): their scores from the keys as the cache holds them (q8_0's: integer dots with VNNI, else
 * transposed into Kf as float32) into P, one online-softmax update over all of them (alpha: the
 * heads' rescales, then their new maxima and the step's sums; the horizontal reductions and the
 * outputs' rescale paid once a step, not once a tile), and the weighted values, read once for up
 * to 4 heads. P: G x DECODE_STEP DT scores, then weights; Vf: room for a q8_0 cache's quantized queries
 * (the values are read in place). The blocks of the next DECODE_AHEAD steps are prefetched, their
 * lines handed out a few at a time inside the step's loops (pf_queue). */
static inline __attribute__((always_inline)) void decode_task(
    const gl_attn *a, const float *Q, int64_t s, int64_t hk, int64_t k0, int64_t k1, float *part,
    float *Kf, float *Vf, float *P, float *alpha, const int t) {
    const gl_kv *kv = &a->kv;
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim, BS = kv->block;
    const int64_t PW = DECODE_STEP * DT; /* P's rows */
    const float softcap = a->softcap, l2e = 1.44269504088896341f; /* scores in base 2 (m too, to the end) */
    const __m512 cap = _mm512_set1_ps(softcap), capl2 = _mm512_set1_ps(softcap * l2e), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 sc = _mm512_set1_ps(a->scale), scl2 = _mm512_set1_ps(a->scale * l2e);
#if DECODE_BF16
    if (t == 2 && decode_bf16_fits(a)) {
        decode_task_bf16(a, Q, s, hk, k0, k1, part, Kf, Vf, P, alpha);
        return;
    }
#endif
    float *m = part, *l = part + G, *O = part + 2 * G, *mnew = alpha + G, *psum = alpha + 2 * G;
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)(G * Dv));
#if DECODE_Q8_DOTS
    /* q8_0 keys: integer dots where the quantized queries fit in Vf */
    const int q8 = t == 3 && q8_queries_bytes(G, D) <= DT * Dv * 4;
    q8_queries qq = {NULL, NULL, NULL};
    if (q8) qq = q8_quantize(Q, G, D, Vf);
    __m512i kq[16 * 16]; /* a tile's keys, up to 1,024 values (MAX_HEAD_DIM) */
    float ks[32 * 16];
#else
    const int q8 = 0;
#endif
    const int kt = t != 3 ? t : 0;
    const int64_t vrb = kv_bytes(Dv, t);
    float vsc[t == 3 ? DECODE_STEP_Q8 * 32 * 16 : 1]; /* q8_0 values' scales (q8_value_scales) */
#if DECODE_Q8_PV16
    float cb[32], pmx[t == 3 ? G : 1]; /* q8_0 values: the blocks' largest scales, the heads' weights */
#endif
    int64_t ahead = k0; /* the first position whose block is not prefetched */
    pf_queue pf = {NULL, NULL, {NULL}, {NULL}, 0, 0};
    for (int64_t j = k0; j < k1;) {
        /* the step's tiles: up to DECODE_STEP, each inside one block */
        int64_t jt[DECODE_STEP], nt[DECODE_STEP];
        const char *Vt[DECODE_STEP];
        __mmask16 vis[DECODE_STEP];
        int nts = 0;
        for (int64_t p = j; nts < (t == 3 ? DECODE_STEP_Q8 : DECODE_STEP) && p < k1; nts++) {
            int64_t n = BS - p % BS < k1 - p ? BS - p % BS : k1 - p;
            if (n > DT) n = DT;
            jt[nts] = p, nt[nts] = n, vis[nts] = (__mmask16)((1u << n) - 1u);
            Vt[nts] = kv_at(kv, kv->v, s, hk, p, Dv);
            p += n;
        }
        const int64_t jend = jt[nts - 1] + nt[nts - 1];
        pf_flush(&pf); /* what the last step's loops left */
        for (; ahead < k1 && ahead < jend + DECODE_AHEAD * DECODE_STEP * BS; ahead = (ahead / BS + 1) * BS)
            if (ahead >= jend) pf_block(&pf, kv, s, hk, ahead, k1, D, Dv, t);
        /* raw scores into P: tile by tile, its keys transposed once for all the heads */
        for (int x = 0; x < nts; x++) {
            const char *K = (const char *)Kf;
            int64_t ld = DT;
            if (t != 3) {
                K = kt_plane(kv, s, hk, jt[x], D) + kv_bytes(jt[x] % BS, t);
                ld = BS;
            } else if (!q8) {
                tile_keys_t(kv_at(kv, kv->k, s, hk, jt[x], D), nt[x], D, Kf, t);
            }
#if DECODE_Q8_DOTS
            if (q8) q8_keys_t(kv_at(kv, kv->k, s, hk, jt[x], D), kv_bytes(D, 3), nt[x], D, kq, ks);
#endif
            for (int64_t g0 = 0; g0 < G;) {
                const int64_t gn = G - g0 >= 8 ? 8 : G - g0 >= 4 ? 4 : G - g0 >= 2 ? 2 : 1;
                __m512 S[8];
#if DECODE_Q8_DOTS
                if (q8) switch (gn) {
                    case 8: q8_scores(&qq, g0, D, kq, ks, S, &pf, 8); break;
                    case 4: q8_scores(&qq, g0, D, kq, ks, S, &pf, 4); break;
                    case 2: q8_scores(&qq, g0, D, kq, ks, S, &pf, 2); break;
                    default: q8_scores(&qq, g0, D, kq, ks, S, &pf, 1); break;
                    }
                else
#endif
                switch (gn) {
                case 8: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 8); break;
                case 4: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 4); break;
                case 2: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 2); break;
                default: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 1); break;
                }
                for (int64_t gi = 0; gi < gn; gi++) _mm512_storeu_ps(P + (g0 + gi) * PW + x * DT, S[gi]);
                g0 += gn;
            }
        }
        /* each head's weights over the step: P = 2^(log2(e) scale S - m_new), masked (m in base
         * 2 until the task's end) */
        for (int64_t g = 0; g < G; g++) {
            __m512 xs[DECODE_STEP], mxv = ninf;
            for (int x = 0; x < nts; x++) {
                const __m512 sv = _mm512_loadu_ps(P + g * PW + x * DT); /* scaled as llama.cpp: after the dot */
                const __m512 v = softcap > 0.0f ? _mm512_mul_ps(tanh512(_mm512_div_ps(_mm512_mul_ps(sv, sc), cap)), capl2)
                                                : _mm512_mul_ps(sv, scl2);
                xs[x] = _mm512_mask_blend_ps(vis[x], ninf, v);
                mxv = _mm512_max_ps(mxv, xs[x]);
            }
            const float mx = _mm512_reduce_max_ps(mxv), mn = mx > m[g] ? mx : m[g];
            __m512 sum = _mm512_setzero_ps();
            for (int x = 0; x < nts; x++) {
                const __m512 e = _mm512_maskz_mov_ps(vis[x], exp2_512(_mm512_sub_ps(xs[x], _mm512_set1_ps(mn))));
                _mm512_storeu_ps(P + g * PW + x * DT, e);
                sum = _mm512_add_ps(sum, e);
            }
            psum[g] = _mm512_reduce_add_ps(sum);
            mnew[g] = mn;
#if DECODE_Q8_PV16
            if (t == 3) pmx[g] = exp2f(mx - mn); /* (mx: -inf where every lane is masked) */
#endif
        }
        /* alpha = 2^(m_old - m_new) of every head at once (0 where nothing was seen yet) */
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 mk = (__mmask16)(G - g >= 16 ? 0xFFFF : (1u << (G - g)) - 1u);
            const __m512 mo = _mm512_maskz_loadu_ps(mk, m + g), mw = _mm512_maskz_loadu_ps(mk, mnew + g);
            const __mmask16 seen = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ);
            const __m512 al = _mm512_maskz_mov_ps(seen, exp2_512(_mm512_sub_ps(mo, mw)));
            _mm512_mask_storeu_ps(alpha + g, mk, al);
            _mm512_mask_storeu_ps(l + g, mk, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, l + g), al, _mm512_maskz_loadu_ps(mk, psum + g)));
            _mm512_mask_storeu_ps(m + g, mk, mw);
        }
        /* O = alpha O + P V: up to 4 heads x 64 values a pass, in registers (q8_0's: the
         * values' scales in the weights) */
        if (t == 3) {
            q8_value_scales(Vt, nt, nts, vrb, Dv, vsc);
#if DECODE_Q8_PV16
            q8_block_max(vsc, nts, Dv, cb);
#endif
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            const float *al = alpha + g0, *Pg = P + g0 * PW;
            for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
                const int64_t w = Dv - c0 < 64 ? Dv - c0 : 64, nu = (w + 15) / 16;
                const __mmask16 last = (__mmask16)(w % 16 ? (1u << (w % 16)) - 1u : 0xFFFF);
                float *Og = O + g0 * Dv + c0;
                if (t == 3) {
                    switch (gn) {
#if DECODE_Q8_PV16
                    case 1: PVQ8W_NB(1) break;
                    case 2: PVQ8W_NB(2) break;
                    case 3: PVQ8W_NB(3) break;
                    default: PVQ8W_NB(4) break;
#else
                    case 1: PVQ8_NU(1) break;
                    case 2: PVQ8_NU(2) break;
                    case 3: PVQ8_NU(3) break;
                    default: PVQ8_NU(4) break;
#endif
                    }
                    continue;
                }
                switch (gn) {
                case 1: PV16_NU(1) break;
                case 2: PV16_NU(2) break;
                case 3: PV16_NU(3) break;
                default: PV16_NU(4) break;
                }
            }
        }
        j = jend;
    }
#if DECODE_Q8_PV16
    if (t == 3) decode_bf16_order(O, G * Dv); /* pv_q8w's order of the values */
#endif
    for (int64_t g = 0; g < G; g++) m[g] *= 0.69314718056f; /* the merge's base: e */
}
#else

/* One task: kv head hk of the row at slot s, its G query heads rotated in Q (G x D), over
 * positions [k0, k1): part = [m (G), l (G), O (G x Dv)], the running max, the sum of
 * exp(score - max) and the unnormalized output. Kf: a tile's keys transposed as float32 (when
 * the cache's cannot be read in place), Vf: its values' float32 rows; P: G x DT weights. The
 * 256-bit twin of the 512-bit task above. */
static inline __attribute__((always_inline)) void decode_task(
    const gl_attn *a, const float *Q, int64_t s, int64_t hk, int64_t k0, int64_t k1, float *part,
    float *Kf, float *Vf, float *P, float *alpha, const int t) {
    const gl_kv *kv = &a->kv;
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim, BS = kv->block;
    const float softcap = a->softcap;
    const __m256 cap = _mm256_set1_ps(softcap), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float *m = part, *l = part + G, *O = part + 2 * G;
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)(G * Dv));
    for (int64_t j = k0; j < k1;) {
        int64_t n = BS - j % BS < k1 - j ? BS - j % BS : k1 - j;
        if (n > DT) n = DT;
        decode_ahead(kv, s, hk, j, k1, D, Dv, t);
        /* the tile's keys transposed (value d of its keys at K + kv_bytes(d * ld), type kt): in
         * the cache when the tile is a whole block of them, else into Kf as float32, zero past n */
        const int kt = t != 3 && n == DT ? t : 0;
        const char *K = (const char *)Kf;
        int64_t ld = DT;
        if (t != 3) {
            const char *plane = kt_plane(kv, s, hk, j, D) + kv_bytes(j % BS, t);
            if (n == DT) {
                K = plane;
                ld = BS;
            } else {
                for (int64_t d = 0; d < D; d++)
                    for (int64_t i = 0; i < DT; i++) Kf[d * DT + i] = i < n ? kv_get(plane, d * BS + i, t) : 0.0f;
            }
        } else { /* q8_0's rows, 8 values at a time */
            const char *rows = kv_at(kv, kv->k, s, hk, j, D);
            float r8[8];
            memset(Kf, 0, sizeof(float) * (size_t)(D * DT));
            for (int64_t i = 0; i < n; i++)
                for (int64_t d0 = 0; d0 < D; d0 += 8) {
                    _mm256_storeu_ps(r8, kv_load8(rows + kv_bytes(i * D, t), d0, t));
                    for (int u = 0; u < 8; u++) Kf[(d0 + u) * DT + i] = r8[u];
                }
        }
        const float *V = tile_f32(kv_at(kv, kv->v, s, hk, j, Dv), n, Dv, Vf, t);
        /* scores of G heads x 16 keys (two vectors a head): FMAs over d with each head's value
         * broadcast, up to 4 heads' chains interleaved */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            __m256 acc[4][2];
            for (int gi = 0; gi < 4; gi++) acc[gi][0] = acc[gi][1] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const char *kd = K + kv_bytes(d * ld, kt);
                const __m256 lo = kv_load8(kd, 0, kt), hi = kv_load8(kd, 8, kt);
                for (int gi = 0; gi < 4; gi++) {
                    if (gi >= gn) break;
                    const __m256 qv = _mm256_broadcast_ss(Q + (g0 + gi) * D + d);
                    acc[gi][0] = _mm256_fmadd_ps(qv, lo, acc[gi][0]);
                    acc[gi][1] = _mm256_fmadd_ps(qv, hi, acc[gi][1]);
                }
            }
            for (int64_t gi = 0; gi < gn; gi++) {
                const int64_t g = g0 + gi;
                __m256 sv[DT / 8];
                float mx = -INFINITY;
                for (int h = 0; h < DT / 8; h++) {
                    __m256 x = _mm256_mul_ps(acc[gi][h], _mm256_set1_ps(a->scale));
                    if (softcap > 0.0f) x = _mm256_mul_ps(tanh256(_mm256_div_ps(x, cap)), cap);
                    const __m256i out = _mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * h)), _mm256_set1_epi32((int)n - 1));
                    sv[h] = _mm256_blendv_ps(x, ninf, _mm256_castsi256_ps(out));
                    const float hm = hmax8(sv[h]);
                    mx = hm > mx ? hm : mx;
                }
                const float mnew = mx > m[g] ? mx : m[g];
                alpha[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - mnew);
                const __m256 mv = _mm256_set1_ps(mnew);
                __m256 sum = _mm256_setzero_ps();
                for (int h = 0; h < DT / 8; h++) {
                    const __m256 vis = _mm256_cmp_ps(sv[h], ninf, _CMP_NEQ_OQ);
                    const __m256 e = _mm256_and_ps(vis, exp256(_mm256_sub_ps(sv[h], mv)));
                    _mm256_store_ps(P + g * DT + 8 * h, e);
                    sum = _mm256_add_ps(sum, e);
                }
                l[g] = l[g] * alpha[g] + hsum8(sum);
                m[g] = mnew;
            }
        }
        /* O = alpha O + P V: up to 4 heads x 32 values a pass, in registers */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            const float *al = alpha + g0, *Pg = P + g0 * DT;
            for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
                const int64_t nu = Dv - c0 < 32 ? (Dv - c0) / 8 : 4;
                float *Og = O + g0 * Dv + c0;
                const float *Vc = V + c0;
                switch (gn) {
                case 1: PV_NU(1) break;
                case 2: PV_NU(2) break;
                case 3: PV_NU(3) break;
                default: PV_NU(4) break;
                }
            }
        }
        j += n;
    }
}
#endif

/* The positions a split hands one task of a row that sees n positions: its kv heads over the
 * threads, about four tasks a thread, never fewer than DECODE_MIN_CHUNK positions (a whole number
 * of tiles). The row's own length decides, never the batch's: a row's result is the same bits
 * whatever else the step holds (a speculative draft's rows, other sequences). */
static int64_t decode_chunk(int64_t n, int64_t Hkv, int nth) {
    int64_t c = (n * Hkv + 4 * nth - 1) / (4 * nth);
    c = (c + DT - 1) / DT * DT;
    return c < DECODE_MIN_CHUNK ? DECODE_MIN_CHUNK : c;
}

/* The first position row b sees. */
static inline int64_t decode_lo(const gl_attn *a, int64_t p) {
    return a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
}

#if defined(DECODE_BF16) && DECODE_BF16 && DECODE_BF16_STEP > DECODE_STEP
#define DECODE_PW (DECODE_BF16_STEP * DT) /* P's row: the scores of a step */
#else
#define DECODE_PW (DECODE_STEP * DT)
#endif
/* A decode thread's part of the work buffer: a tile's K and V as float32, the group's rotated
 * queries, the tile's weights, and the heads' rescales, maxima and sums (G each); 64-byte whole. */
static inline int64_t decode_thread_bytes(int64_t G, int64_t D, int64_t Dv) {
    return ((DT * (D + Dv) + G * D + G * DECODE_PW + 3 * G) * (int64_t)sizeof(float) + 63) / 64 * 64;
}

/* The work buffer of a decode step of B rows on nth threads: each thread's part, the tasks'
 * partial results (at most 4 nth + Hkv tasks a row: see decode_chunk) and the tasks' first index
 * per row. */
static int64_t attn_decode_bytes(int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t B, int nth) {
    const int64_t G = H / Hkv;
    return nth * decode_thread_bytes(G, D, Dv) + B * (4 * nth + Hkv) * G * (Dv + 2) * (int64_t)sizeof(float) +
           (B + 1) * (int64_t)sizeof(int64_t);
}

static void attn_decode_run(const gl_attn *a, const float *q, int64_t q_rs, const float *k,
                            int64_t k_rs, const float *v, int64_t v_rs, const int64_t *slots,
                            const int64_t *pos, int64_t B, float *out, void *work_, int nth) {
    const gl_kv *kv = &a->kv;
    const int t = (int)kv->type;
    char *work = work_;
    const float *cos_t = a->cos_t, *sin_t = a->sin_t;
    const int64_t H = a->n_head, Hkv = a->n_head_kv, D = a->head_dim, Dv = a->v_dim;
    const int64_t G = H / Hkv, rot = a->rot, half = rot / 2;
    const int neox = (int)a->neox;
    for (int64_t b = 0; b < B; b++) {
        const int64_t p = pos[b], s = slots[b];
        for (int64_t h = 0; h < Hkv; h++) {
            float kr[1024];
            rope_head(k + b * k_rs + h * D, kr, D, rot, cos_t + p * half, sin_t + p * half, neox);
            key_store(kv, s, h, p, kr, D);
            kv_store(kv_at(kv, kv->v, s, h, p, Dv), v + b * v_rs + h * Dv, Dv, t);
        }
    }
    const int64_t thread = decode_thread_bytes(G, D, Dv), pw = G * (Dv + 2);
    float *parts = (float *)(work + nth * thread);
    int64_t *first = (int64_t *)(parts + B * (4 * nth + Hkv) * pw); /* row b's tasks: first[b] .. */
    int64_t total = 0; /* the keys every head of every row reads */
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = pos[b] + 1 - decode_lo(a, pos[b]), chunk = decode_chunk(n, Hkv, nth);
        first[b + 1] = first[b] + Hkv * ((n + chunk - 1) / chunk);
        total += n * Hkv;
    }
    const int64_t ntask = first[B];
#pragma omp parallel num_threads(nth) if (total * (D + Dv) * G > 100000)
    {
        const unsigned csr = ftz_begin();
        char *mine = work + omp_get_thread_num() * thread;
        float *Kf = (float *)mine, *Vf = Kf + DT * D, *Q = Vf + DT * Dv, *P = Q + G * D, *al = P + G * DECODE_PW;
        int64_t b = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            while (first[b + 1] <= task) b++; /* tasks come in order to each thread */
            while (first[b] > task) b--;
            const int64_t ns = (first[b + 1] - first[b]) / Hkv, i = task - first[b];
            const int64_t hk = i / ns, c = i % ns, p = pos[b], lo = decode_lo(a, p);
            const int64_t chunk = decode_chunk(p + 1 - lo, Hkv, nth);
            const int64_t k0 = lo + c * chunk, k1 = k0 + chunk < p + 1 ? k0 + chunk : p + 1;
            for (int64_t g = 0; g < G; g++) /* the group's queries, rotated */
                rope_head(q + b * q_rs + (hk * G + g) * D, Q + g * D, D, rot, cos_t + p * half,
                          sin_t + p * half, neox);
            float *part = parts + task * pw;
            switch (t) { /* here, not around the region: OpenMP outlines the region's body before
                          * inlining, and each case must see its type as a constant */
            case 1: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 1); break;
            case 2: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 2); break;
            case 3: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 3); break;
            default: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 0); break;
            }
        }
        /* each head's output: its chunks' outputs weighted by exp(m - max), over their sum */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t rb = bh / H, h = bh % H, hk = h / G, g = h % G;
            const int64_t ns = (first[rb + 1] - first[rb]) / Hkv;
            const float *p0 = parts + (first[rb] + hk * ns) * pw;
            float mx = -INFINITY;
            for (int64_t c = 0; c < ns; c++) mx = p0[c * pw + g] > mx ? p0[c * pw + g] : mx;
            const float sink = a->sinks ? a->sinks[h] : -INFINITY; /* a logit with no value */
            mx = sink > mx ? sink : mx;
            float wsum = 0.0f;
            float *o = out + (rb * H + h) * Dv;
            for (int64_t d = 0; d < Dv; d++) o[d] = 0.0f;
            for (int64_t c = 0; c < ns; c++) {
                const float *pc = p0 + c * pw;
                const float wc = expf(pc[g] - mx);
                wsum += wc * pc[G + g];
                scale_axpy(o, 1.0f, wc, pc + 2 * G + g * Dv, Dv);
            }
            if (a->sinks) wsum += expf(sink - mx);
            const float il = 1.0f / wsum;
            for (int64_t d = 0; d < Dv; d++) o[d] *= il;
        }
        ftz_end(csr);
    }
}

/* Attention of a decode step from Python: its work buffer in one allocation. */
void gl_attn_decode(const gl_attn *a, const float *q, int64_t q_rs, const float *k, int64_t k_rs,
                    const float *v, int64_t v_rs, const int64_t *slots, const int64_t *pos,
                    int64_t B, float *out, int nth) {
    const int64_t bytes = attn_decode_bytes(a->n_head, a->n_head_kv, a->head_dim, a->v_dim, B, nth);
    gl_scratch own, *s = scratch_open(NULL, &own, bytes);
    attn_decode_run(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scratch_take(s, bytes), nth);
    scratch_close(s, &own);
}

/* A prompt step's keys (which 0) or values (1) into the paged cache: x (B, T, n_head_kv, D), row
 * (b, t) at x + (b * T + t) * rs with its heads D apart, at slot slots[b] and position
 * starts[b] + t, each row rounded as kv_store rounds it (torch's rounding: the same bits as
 * KVCache.write). Positions past the table (a padding row's, which KVCache.write clamps to its
 * last position) are not written: nothing reads them. */
void gl_kv_write(const gl_kv *kv, int64_t which, const float *x, int64_t rs, const int64_t *slots,
                 const int64_t *starts, int64_t B, int64_t T, int64_t D, int nth) {
    const int64_t H = kv->n_head_kv, end = kv->max_blocks * kv->block;
    void *base = which ? kv->v : kv->k;
#pragma omp parallel for num_threads(nth) schedule(static) if (B * T * H * D > 65536)
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t b = bt / T, p = starts[b] + bt % T;
        for (int64_t h = 0; p < end && h < H; h++) {
            if (which == 0)
                key_store(kv, slots[b], h, p, x + bt * rs + h * D, D);
            else
                kv_store(kv_at(kv, base, slots[b], h, p, D), x + bt * rs + h * D, D, kv->type);
        }
    }
}

/* ---------------------------------------------------------------- gates */

/* Rows [b0, b1) of gl_gated, on the calling thread. */
static void gated_rows(const float *gu, int64_t b0, int64_t b1, int64_t ff, int64_t act, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 c0 = _mm256_set1_ps(0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
    for (int64_t b = b0; b < b1; b++) {
        const float *g = gu + b * 2 * ff, *u = g + ff;
        float *a = out + b * ff;
        int64_t j = 0;
        for (; j + 8 <= ff; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            __m256 v;
            if (act == 0) { /* g / (1 + e^-g) */
                v = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            } else if (act == 2) { /* gpt-oss: g = min(g, 7) / (1 + e^(-1.702 g)), times clamp(u) + 1 */
                const __m256 gc = _mm256_min_ps(gv, _mm256_set1_ps(7.0f));
                const __m256 uc = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(u + j), _mm256_set1_ps(-7.0f)), _mm256_set1_ps(7.0f));
                v = _mm256_div_ps(gc, _mm256_add_ps(one, exp256(_mm256_mul_ps(_mm256_set1_ps(-1.702f), gc))));
                _mm256_storeu_ps(a + j, _mm256_mul_ps(v, _mm256_add_ps(uc, one)));
                continue;
            } else { /* g/2 (1 + tanh(z)) = g / (1 + e^-2z), z = c0 (g + c1 g^3): no cancellation */
                const __m256 z = _mm256_mul_ps(c0, _mm256_add_ps(gv, _mm256_mul_ps(c1, _mm256_mul_ps(gv, _mm256_mul_ps(gv, gv)))));
                const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), z));
                v = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            }
            _mm256_storeu_ps(a + j, _mm256_mul_ps(v, _mm256_loadu_ps(u + j)));
        }
        for (; j < ff; j++) {
            if (act == 2) {
                const float gc = g[j] < 7.0f ? g[j] : 7.0f, uc = u[j] < -7.0f ? -7.0f : u[j] > 7.0f ? 7.0f : u[j];
                a[j] = gc / (1.0f + expf(-1.702f * gc)) * (uc + 1.0f);
                continue;
            }
            const float x = g[j];
            const float v = act == 0 ? x / (1.0f + expf(-x))
                                     : x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
            a[j] = v * u[j];
        }
    }
}

/* Rows of [gate | up] (2 ff values each) -> act(gate) * up, (B, ff). act 0: SiLU, 1: GELU-tanh,
 * 2: gpt-oss's clamped SwiGLU (min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)). */
void gl_gated(const float *gu, int64_t B, int64_t ff, int64_t act, float *out, int nth) {
    if (B * ff <= 65536) {
        gated_rows(gu, 0, B, ff, act, out);
        return;
    }
#pragma omp parallel num_threads(nth)
    {
        int64_t b0, b1;
        static_chunk(B, omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        gated_rows(gu, b0, b1, ff, act, out);
    }
}
