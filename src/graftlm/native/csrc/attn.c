/* RMS norm, RoPE, attention through the KV cache (decode steps and prompts), and the gated
 * activation of the feed-forward block: the float32 pieces of a decoder layer. */
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

/* One decode step of attention for B rows, each one new token of its own sequence:
 * RoPE on q and k at the row's position, k and v written into the cache at (slot, position),
 * then softmax(scale * q.K) V over positions [max(0, pos - window + 1), pos] (window 0: all),
 * with GQA (query head h reads kv head h / (H / Hkv)) and an optional tanh soft-cap.
 * q/k/v rows start every q_rs/k_rs/v_rs floats, heads contiguous within a row; the cache, the
 * RoPE tables, the dimensions and the scales are a's.
 * Cache: a->kv, paged (gl_kv), values of type t.  out: (B, H * Dv).  scores: `per` floats for
 * each thread, for the rows that see more positions than the stack holds (per >= their count). */
static inline __attribute__((always_inline)) void attn_decode_t(
    const gl_attn *a, const float *q, int64_t q_rs, const float *k, int64_t k_rs, const float *v,
    int64_t v_rs, const int64_t *slots, const int64_t *pos, int64_t B, float *out, float *scores,
    int64_t per, int nth, const int t) {
    const gl_kv *kv = &a->kv;
    const float *cos_t = a->cos_t, *sin_t = a->sin_t;
    const int64_t H = a->n_head, Hkv = a->n_head_kv, D = a->head_dim, Dv = a->v_dim;
    const int64_t rot = a->rot, window = a->window, BS = kv->block;
    const int neox = (int)a->neox;
    const float scale = a->scale, softcap = a->softcap;
    const int64_t half = rot / 2;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t p = pos[b], s = slots[b];
        for (int64_t h = 0; h < Hkv; h++) {
            float kr[1024];
            rope_head(k + b * k_rs + h * D, kr, D, rot, cos_t + p * half, sin_t + p * half, neox);
            kv_store(kv_at(kv, kv->k, s, h, p, D), kr, D, t);
            kv_store(kv_at(kv, kv->v, s, h, p, Dv), v + b * v_rs + h * Dv, Dv, t);
        }
        work += (p + 1) * H;
    }
    const int64_t group = H / Hkv;
#pragma omp parallel num_threads(nth) if (work * (D + Dv) > 200000)
    {
    const unsigned csr = ftz_begin();
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, hk = h / group, p = pos[b], s = slots[b];
        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p + 1 - lo;
        float qr[1024], sbuf_stack[GL_STACK_SCORES];
        float *sc = n <= GL_STACK_SCORES ? sbuf_stack : scores + omp_get_thread_num() * per;
        rope_head(q + b * q_rs + h * D, qr, D, rot, cos_t + p * half, sin_t + p * half, neox);
        /* scores, their max, exp(score - max) in place, their sum; the keys a block at a time */
        float m = -INFINITY;
        for (int64_t j = lo; j <= p;) {
            const int64_t run = BS - j % BS < p + 1 - j ? BS - j % BS : p + 1 - j;
            const char *kb = kv_at(kv, kv->k, s, hk, j, D);
            for (int64_t i = 0; i < run; i++) {
                float x = dot_kv(qr, kb + kv_bytes(i * D, t), D, t) * scale;
                if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                sc[j - lo + i] = x;
                m = x > m ? x : m;
            }
            j += run;
        }
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lsum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
            _mm256_storeu_ps(sc + j, e);
            lsum = _mm256_add_ps(lsum, e);
        }
        float l = hsum8(lsum);
        for (; j < n; j++) {
            sc[j] = expf(sc[j] - m);
            l += sc[j];
        }
        const float il = 1.0f / l;
        /* out = sum_j e_j V_j / l, 64 outputs at a time held in registers */
        float *o = out + (b * H + h) * Dv;
        for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
            const int64_t w = Dv - c0 < 64 ? Dv - c0 : 64;
            if (w == 64) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int64_t jj = lo; jj <= p;) {
                    const int64_t run = BS - jj % BS < p + 1 - jj ? BS - jj % BS : p + 1 - jj;
                    const char *vb = kv_at(kv, kv->v, s, hk, jj, Dv);
                    const float *e_run = sc + (jj - lo);
                    for (int64_t i = 0; i < run; i++) {
                        const __m256 e = _mm256_set1_ps(e_run[i]);
                        const void *vr = vb + kv_bytes(i * Dv + c0, t);
                        a0 = _mm256_fmadd_ps(e, kv_load8(vr, 0, t), a0);
                        a1 = _mm256_fmadd_ps(e, kv_load8(vr, 8, t), a1);
                        a2 = _mm256_fmadd_ps(e, kv_load8(vr, 16, t), a2);
                        a3 = _mm256_fmadd_ps(e, kv_load8(vr, 24, t), a3);
                        a4 = _mm256_fmadd_ps(e, kv_load8(vr, 32, t), a4);
                        a5 = _mm256_fmadd_ps(e, kv_load8(vr, 40, t), a5);
                        a6 = _mm256_fmadd_ps(e, kv_load8(vr, 48, t), a6);
                        a7 = _mm256_fmadd_ps(e, kv_load8(vr, 56, t), a7);
                    }
                    jj += run;
                }
                const __m256 iv = _mm256_set1_ps(il);
                _mm256_storeu_ps(o + c0, _mm256_mul_ps(a0, iv));
                _mm256_storeu_ps(o + c0 + 8, _mm256_mul_ps(a1, iv));
                _mm256_storeu_ps(o + c0 + 16, _mm256_mul_ps(a2, iv));
                _mm256_storeu_ps(o + c0 + 24, _mm256_mul_ps(a3, iv));
                _mm256_storeu_ps(o + c0 + 32, _mm256_mul_ps(a4, iv));
                _mm256_storeu_ps(o + c0 + 40, _mm256_mul_ps(a5, iv));
                _mm256_storeu_ps(o + c0 + 48, _mm256_mul_ps(a6, iv));
                _mm256_storeu_ps(o + c0 + 56, _mm256_mul_ps(a7, iv));
            } else {
                float acc[64] = {0};
                for (int64_t jj = lo; jj <= p; jj++) {
                    const char *vr = kv_at(kv, kv->v, s, hk, jj, Dv) + kv_bytes(c0, t);
                    const float e = sc[jj - lo];
                    for (int64_t i = 0; i < w; i++) acc[i] += e * kv_get(vr, i, t);
                }
                for (int64_t i = 0; i < w; i++) o[c0 + i] = acc[i] * il;
            }
        }
    }
    ftz_end(csr);
    }
}

static void attn_decode_run(const gl_attn *a, const float *q, int64_t q_rs, const float *k,
                            int64_t k_rs, const float *v, int64_t v_rs, const int64_t *slots,
                            const int64_t *pos, int64_t B, float *out, float *scores,
                            int64_t per, int nth) {
    switch (a->kv.type) { /* one specialization a cache type: the loads are its inner loop */
    case 1: attn_decode_t(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scores, per, nth, 1); break;
    case 2: attn_decode_t(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scores, per, nth, 2); break;
    case 3: attn_decode_t(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scores, per, nth, 3); break;
    default: attn_decode_t(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scores, per, nth, 0); break;
    }
}

/* Attention of a decode step from Python: the scores of the longest rows in one allocation. */
void gl_attn_decode(const gl_attn *a, const float *q, int64_t q_rs, const float *k, int64_t k_rs,
                    const float *v, int64_t v_rs, const int64_t *slots, const int64_t *pos,
                    int64_t B, float *out, int nth) {
    int64_t per = 0; /* the most positions a row sees, past what the stack holds */
    for (int64_t b = 0; b < B; b++) {
        const int64_t lo = a->window > 0 && pos[b] - a->window + 1 > 0 ? pos[b] - a->window + 1 : 0;
        if (pos[b] + 1 - lo > GL_STACK_SCORES && pos[b] + 1 - lo > per) per = pos[b] + 1 - lo;
    }
    const int64_t bytes = (int64_t)sizeof(float) * nth * per;
    gl_scratch own, *s = scratch_open(NULL, &own, bytes);
    attn_decode_run(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scratch_take(s, bytes), per,
                    nth);
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
        for (int64_t h = 0; p < end && h < H; h++)
            kv_store(kv_at(kv, base, slots[b], h, p, D), x + bt * rs + h * D, D, kv->type);
    }
}

/* n rows of D cached values of (slot s, kv head h) from position p0 on, as float32 into dst
 * (n, D): a block's rows at a time (contiguous in the pool). */
static void kv_gather(const gl_kv *kv, void *base, int64_t s, int64_t h, int64_t p0, int64_t n,
                      int64_t D, float *dst) {
    const int64_t BS = kv->block, t = kv->type;
    for (int64_t j = p0; j < p0 + n;) {
        const int64_t run = BS - j % BS < p0 + n - j ? BS - j % BS : p0 + n - j;
        const char *src = kv_at(kv, base, s, h, j, D);
        float *o = dst + (j - p0) * D;
        const int64_t m = run * D;
        if (t == 0) {
            memcpy(o, src, sizeof(float) * (size_t)m);
        } else if (t == 1) {
            int64_t i = 0;
            for (; i + 8 <= m; i += 8) _mm256_storeu_ps(o + i, kv_load8(src, i, 1));
            for (; i < m; i++) o[i] = kv_get(src, i, 1);
        } else if (t == 2) {
            int64_t i = 0;
            for (; i + 8 <= m; i += 8) _mm256_storeu_ps(o + i, kv_load8(src, i, 2));
            for (; i < m; i++) o[i] = kv_get(src, i, 2);
        } else { /* q8_0: m a multiple of 32 */
            for (int64_t i = 0; i < m; i += 8) _mm256_storeu_ps(o + i, kv_load8(src, i, 3));
        }
        j += run;
    }
}

/* Prompt attention: B rows of T queries each, rows of one sequence each (slot[b]) whose keys and
 * values for positions 0 .. start[b] + T - 1 are in the cache (this chunk's already written,
 * rotated; a: the cache and the dimensions, no RoPE tables). Each block of PK keys and their
 * values is read from the pool as float32 into the task's own tiles (Kf, Vf) once. q (B, T, H, D) rotated;
 * out (B, T, H * D) (Dv == D). Query t of row b sits at
 * position p = start[b] + t and sees keys j <= p (and p - j < window when window > 0). Scores are
 * scale * q.k, soft-capped to cap * tanh(score / cap) when a->softcap > 0 (gemma-2).
 *
 * One task: a kv head g of a row and pq queries, whose H / Hkv heads share g's keys: rows =
 * pq * group score rows, about PR (pq: PR / group, at least PQ), since every task gathers and
 * transposes its keys (qwen3's group of 2 at 16 queries a task: 1.05x a whole pp512 at 32). Keys
 * go by blocks of PK, transposed once per block into Kt (D, PK), so the score tile is AR rows x
 * 16 keys (AVX-512: 32) of FMAs with every operand a load or a broadcast; softmax
 * is online (flash attention): running max m and sum l per row, O rescaled when m grows. Blocks
 * past a task's last query or before its window are never touched: causal prompts do half the
 * work of a masked full product. */
#define PQ 16 /* the fewest queries a task */
#define PR 64 /* the score rows a task aims at */
#define PK 64
#define AR 6 /* score / output rows per register tile */

/* Kt (D, PK) = the nk <= PK keys k (nk, D) transposed, zero past nk: 8 x 8 tiles in registers. */
static void key_block_t(const float *k, int64_t nk, int64_t D, float *Kt) {
    int64_t j0 = 0;
    for (; j0 + 8 <= nk; j0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(k + (j0 + i) * D + d0);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            for (int i = 0; i < 4; i++) {
                _mm256_store_ps(Kt + (d0 + i) * PK + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                _mm256_store_ps(Kt + (d0 + i + 4) * PK + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
            }
        }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = j0; j < PK; j++) Kt[d * PK + j] = j < nk ? k[j * D + d] : 0.0f;
}

void gl_attn_prefill(const gl_attn *a, const float *q, const int64_t *slots,
                     const int64_t *starts, int64_t B, int64_t T, float *out, int nth) {
    const gl_kv *kv = &a->kv;
    const int64_t H = a->n_head, Hkv = a->n_head_kv, D = a->head_dim;
    const int64_t window = a->window;
    const float scale = a->scale, softcap = a->softcap;
    const __m256 cap = _mm256_set1_ps(softcap);
    const int64_t group = H / Hkv, pq = PR / group > PQ ? PR / group : PQ;
    const int64_t qblocks = (T + pq - 1) / pq, rows_max = pq * group;
    const int64_t ntask = B * Hkv * qblocks;
#pragma omp parallel num_threads(nth)
    {
        const unsigned csr = ftz_begin();
        float *Kt = aligned_alloc(64, sizeof(float) * (size_t)(D * PK));
        float *Kf = aligned_alloc(64, sizeof(float) * (size_t)(D * PK));
        float *Vf = aligned_alloc(64, sizeof(float) * (size_t)(D * PK));
        float *S = aligned_alloc(64, sizeof(float) * (size_t)(rows_max * PK));
        float *O = aligned_alloc(64, sizeof(float) * (size_t)(rows_max * D));
        float *m = malloc(sizeof(float) * (size_t)rows_max), *l = malloc(sizeof(float) * (size_t)rows_max);
        float *alpha = malloc(sizeof(float) * (size_t)rows_max);
        const float **qr = malloc(sizeof(float *) * (size_t)rows_max);
        int64_t *pr = malloc(sizeof(int64_t) * (size_t)rows_max);
        /* later query blocks have more keys: hand them out first, one at a time */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            const int64_t qb = qblocks - 1 - task % qblocks, bg = task / qblocks;
            const int64_t b = bg / Hkv, g = bg % Hkv, s = slots[b], p0 = starts[b];
            const int64_t t0 = qb * pq, nq = T - t0 < pq ? T - t0 : pq, rows = nq * group;
            /* row r: query t0 + r / group of head g * group + r % group */
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r / group, h = g * group + r % group;
                qr[r] = q + ((b * T + t) * H + h) * D;
                pr[r] = p0 + t;
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(O, 0, sizeof(float) * (size_t)(rows * D));
            const int64_t pmin = p0 + t0, pmax = p0 + t0 + nq - 1;
            const int64_t klo = window > 0 && pmin - window + 1 > 0 ? pmin - window + 1 : 0;
            for (int64_t k0 = klo; k0 <= pmax; k0 += PK) {
                const int64_t nk = pmax + 1 - k0 < PK ? pmax + 1 - k0 : PK;
                kv_gather(kv, kv->k, s, g, k0, nk, D, Kf);
                kv_gather(kv, kv->v, s, g, k0, nk, D, Vf);
                key_block_t(Kf, nk, D, Kt);
                /* S = scale * Q Kt: AR rows x 16 keys a tile (AVX-512: x 32, a pair of vectors;
                 * each score is the same FMA chain over d in either width, so the same bits) */
#if defined(__AVX512F__)
                for (int64_t j0 = 0; j0 < nk; j0 += 32) { /* Kt's columns past nk are 0 */
                    for (int64_t r0 = 0; r0 < rows; r0 += AR) {
                        int64_t rr[AR];
                        for (int r = 0; r < AR; r++) rr[r] = r0 + r < rows ? r0 + r : r0;
                        __m512 acc[AR][2];
                        for (int r = 0; r < AR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
                        for (int64_t d = 0; d < D; d++) {
                            const __m512 k0v = _mm512_load_ps(Kt + d * PK + j0), k1v = _mm512_load_ps(Kt + d * PK + j0 + 16);
                            for (int r = 0; r < AR; r++) {
                                const __m512 x = _mm512_set1_ps(qr[rr[r]][d]);
                                acc[r][0] = _mm512_fmadd_ps(x, k0v, acc[r][0]);
                                acc[r][1] = _mm512_fmadd_ps(x, k1v, acc[r][1]);
                            }
                        }
                        const __m512 sc = _mm512_set1_ps(scale);
                        for (int r = AR - 1; r >= 0; r--) {
                            _mm512_store_ps(S + rr[r] * PK + j0, _mm512_mul_ps(acc[r][0], sc));
                            _mm512_store_ps(S + rr[r] * PK + j0 + 16, _mm512_mul_ps(acc[r][1], sc));
                        }
                    }
                }
#else
                for (int64_t j0 = 0; j0 < nk; j0 += 16) { /* Kt[:, j0 .. j0 + 16] stays in L1 */
                    for (int64_t r0 = 0; r0 < rows; r0 += AR) {
                        int64_t rr[AR]; /* a tail tile repeats row r0: same values, same place */
                        for (int r = 0; r < AR; r++) rr[r] = r0 + r < rows ? r0 + r : r0;
                        __m256 acc[AR][2];
                        for (int r = 0; r < AR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
                        for (int64_t d = 0; d < D; d++) {
                            const __m256 k0v = _mm256_load_ps(Kt + d * PK + j0), k1v = _mm256_load_ps(Kt + d * PK + j0 + 8);
                            for (int r = 0; r < AR; r++) {
                                const __m256 x = _mm256_broadcast_ss(qr[rr[r]] + d);
                                acc[r][0] = _mm256_fmadd_ps(x, k0v, acc[r][0]);
                                acc[r][1] = _mm256_fmadd_ps(x, k1v, acc[r][1]);
                            }
                        }
                        const __m256 sc = _mm256_set1_ps(scale);
                        for (int r = AR - 1; r >= 0; r--) {
                            _mm256_store_ps(S + rr[r] * PK + j0, _mm256_mul_ps(acc[r][0], sc));
                            _mm256_store_ps(S + rr[r] * PK + j0 + 8, _mm256_mul_ps(acc[r][1], sc));
                        }
                    }
                }
#endif
                /* soft-cap, mask, online softmax: P = exp(S - m_new) in S, alpha = exp(m_old - m_new) */
                const int64_t nk16 = (nk + 15) / 16 * 16;
                for (int64_t r = 0; r < rows; r++) {
                    float *sr = S + r * PK;
                    const int64_t p = pr[r], lo = window > 0 ? p - window + 1 : 0;
                    /* keys [jlo, jhi) of the block are visible to the row, the rest -inf; jlo < pq
                     * (the task's first query's window starts the first block) and jhi > -pq */
                    const int64_t jlo = lo - k0, jhi = p + 1 - k0 < nk ? p + 1 - k0 : nk;
                    const __m256i vlo = _mm256_set1_epi32((int)jlo), vhi = _mm256_set1_epi32((int)jhi);
                    const __m256 ninf = _mm256_set1_ps(-INFINITY);
                    __m256 mxv = _mm256_set1_ps(m[r]);
                    for (int64_t j = 0; j < nk16; j += 8) {
                        const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                        const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(vlo, idx), _mm256_cmpgt_epi32(_mm256_add_epi32(idx, _mm256_set1_epi32(1)), vhi));
                        __m256 sv = _mm256_load_ps(sr + j);
                        if (softcap > 0.0f) sv = _mm256_mul_ps(tanh256(_mm256_div_ps(sv, cap)), cap);
                        sv = _mm256_blendv_ps(sv, ninf, _mm256_castsi256_ps(out));
                        _mm256_store_ps(sr + j, sv);
                        mxv = _mm256_max_ps(mxv, sv);
                    }
                    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mxv), _mm256_extractf128_ps(mxv, 1));
                    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                    const float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
                    if (mx == -INFINITY) { /* nothing visible yet: P = 0, O and l stay 0 */
                        memset(sr, 0, sizeof(float) * (size_t)nk16);
                        alpha[r] = 1.0f;
                        continue;
                    }
                    const __m256 mv = _mm256_set1_ps(mx);
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t j = 0; j < nk16; j += 8) {
                        const __m256 sv = _mm256_load_ps(sr + j);
                        const __m256 vis = _mm256_cmp_ps(sv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                        const __m256 e = _mm256_and_ps(vis, exp256(_mm256_sub_ps(sv, mv)));
                        _mm256_store_ps(sr + j, e);
                        sum = _mm256_add_ps(sum, e);
                    }
                    alpha[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                    l[r] = l[r] * alpha[r] + hsum8(sum);
                    m[r] = mx;
                }
                /* O = alpha O + P V: AR rows x 16 dims a tile (AVX-512: x 32 while 32 remain) */
                int64_t dz = 0;
#if defined(__AVX512F__)
                for (; dz + 32 <= D; dz += 32) {
                    for (int64_t r0 = 0; r0 < rows; r0 += AR) {
                        int64_t rr[AR];
                        for (int r = 0; r < AR; r++) rr[r] = r0 + r < rows ? r0 + r : r0;
                        __m512 c[AR][2];
                        for (int r = 0; r < AR; r++) {
                            const __m512 a = _mm512_set1_ps(alpha[rr[r]]);
                            c[r][0] = _mm512_mul_ps(a, _mm512_loadu_ps(O + rr[r] * D + dz));
                            c[r][1] = _mm512_mul_ps(a, _mm512_loadu_ps(O + rr[r] * D + dz + 16));
                        }
                        for (int64_t j = 0; j < nk; j++) {
                            const float *vr = Vf + j * D + dz;
                            const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                            for (int r = 0; r < AR; r++) {
                                const __m512 x = _mm512_set1_ps(S[rr[r] * PK + j]);
                                c[r][0] = _mm512_fmadd_ps(x, v0, c[r][0]);
                                c[r][1] = _mm512_fmadd_ps(x, v1, c[r][1]);
                            }
                        }
                        for (int r = AR - 1; r >= 0; r--) {
                            _mm512_storeu_ps(O + rr[r] * D + dz, c[r][0]);
                            _mm512_storeu_ps(O + rr[r] * D + dz + 16, c[r][1]);
                        }
                    }
                }
#endif
                for (int64_t d0 = dz; d0 < D; d0 += 16) { /* V[:, d0 .. d0 + 16] stays in L1 */
                    for (int64_t r0 = 0; r0 < rows; r0 += AR) {
                        int64_t rr[AR];
                        for (int r = 0; r < AR; r++) rr[r] = r0 + r < rows ? r0 + r : r0;
                        __m256 c[AR][2];
                        for (int r = 0; r < AR; r++) {
                            const __m256 a = _mm256_set1_ps(alpha[rr[r]]);
                            c[r][0] = _mm256_mul_ps(a, _mm256_loadu_ps(O + rr[r] * D + d0));
                            c[r][1] = _mm256_mul_ps(a, _mm256_loadu_ps(O + rr[r] * D + d0 + 8));
                        }
                        for (int64_t j = 0; j < nk; j++) {
                            const float *vr = Vf + j * D + d0;
                            const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
                            for (int r = 0; r < AR; r++) {
                                const __m256 x = _mm256_broadcast_ss(S + rr[r] * PK + j);
                                c[r][0] = _mm256_fmadd_ps(x, v0, c[r][0]);
                                c[r][1] = _mm256_fmadd_ps(x, v1, c[r][1]);
                            }
                        }
                        for (int r = AR - 1; r >= 0; r--) {
                            _mm256_storeu_ps(O + rr[r] * D + d0, c[r][0]);
                            _mm256_storeu_ps(O + rr[r] * D + d0 + 8, c[r][1]);
                        }
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r / group, h = g * group + r % group;
                float *dst = out + ((b * T + t) * H + h) * D;
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                for (int64_t d = 0; d < D; d++) dst[d] = O[r * D + d] * inv;
            }
        }
        free(Kt);
        free(Kf);
        free(Vf);
        free(S);
        free(O);
        free(m);
        free(l);
        free(alpha);
        free(qr);
        free(pr);
        ftz_end(csr);
    }
}

/* ---------------------------------------------------------------- gates */

/* Rows of [gate | up] (2 ff values each) -> act(gate) * up, (B, ff). act 0: SiLU, 1: GELU-tanh. */
void gl_gated(const float *gu, int64_t B, int64_t ff, int64_t act, float *out, int nth) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 c0 = _mm256_set1_ps(0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
#pragma omp parallel for num_threads(nth) schedule(static) if (B * ff > 65536)
    for (int64_t b = 0; b < B; b++) {
        const float *g = gu + b * 2 * ff, *u = g + ff;
        float *a = out + b * ff;
        int64_t j = 0;
        for (; j + 8 <= ff; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            __m256 v;
            if (act == 0) { /* g / (1 + e^-g) */
                v = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            } else { /* g/2 (1 + tanh(z)) = g / (1 + e^-2z), z = c0 (g + c1 g^3): no cancellation */
                const __m256 z = _mm256_mul_ps(c0, _mm256_add_ps(gv, _mm256_mul_ps(c1, _mm256_mul_ps(gv, _mm256_mul_ps(gv, gv)))));
                const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), z));
                v = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            }
            _mm256_storeu_ps(a + j, _mm256_mul_ps(v, _mm256_loadu_ps(u + j)));
        }
        for (; j < ff; j++) {
            const float x = g[j];
            const float v = act == 0 ? x / (1.0f + expf(-x))
                                     : x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
            a[j] = v * u[j];
        }
    }
}
