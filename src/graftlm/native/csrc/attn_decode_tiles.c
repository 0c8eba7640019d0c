/* Decode attention's pieces (attn_decode.c runs them): the tile of keys and values, the
 * prefetch queue, and the 512-bit float32 helpers of the scores and the weighted values. */
#include "graftlm.h"

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
#define DECODE_ZMM 1
#else
#define DECODE_ZMM 0
#endif

#if DECODE_ZMM
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
#endif
