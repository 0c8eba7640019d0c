/* Prompt attention through the paged KV cache (gl_attn_prefill): float32 FMAs, and where the CPU
 * has AVX-512 BF16 the bfloat16 tiles of fast steps (VDPBF16PS). Included after attn.c (its
 * exp2_bf16, tanh512). */
#include "graftlm.h"

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
        } else { /* as kt_gather (q8_0: m a multiple of 32, no tail) */
            int64_t i = 0;
            for (; i + 8 <= m; i += 8) _mm256_storeu_ps(o + i, kv_load8(src, i, (int)t));
            for (; i < m; i++) o[i] = kv_get(src, i, (int)t);
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
 * work of a masked full product. Fast steps (exact 0, 2 or 3) where the CPU has AVX-512 BF16 take
 * the same tasks in bfloat16 tiles (prompt_bf16, attn_prompt_bf16.c), their scores in bfloat16
 * pairs (2) or, where it has AVX-512 VNNI too, from int8 codes: of the keys less their mean (0,
 * attn_prompt_i8.c) or a q8_0 cache's own (3, attn_prompt_q8.c); exact steps (exact 1), other
 * CPUs and a -DGL_NO_BF16_ATTN build these float32 FMAs. */
#define PQ 16 /* the fewest queries a task */
#define PR 64 /* the score rows a task aims at */
#define PK 64
#define AR 6 /* score / output rows per register tile */

#if ATTN_BF16
/* 16 pairs (lo[i], hi[i]) of bfloat16, lo in the low half of each 32-bit lane */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
/* n float32 values as bfloat16 in order (n even; pairs of them are 32-bit lanes) */
static inline void bf16_row(const float *x, int64_t n, uint16_t *o) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(o + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    for (; i < n; i++) o[i] = bf16_of(x[i]);
}
#endif

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

/* The keys of (slot s, kv head h) at positions k0 .. k0 + nk - 1 from a cache whose key blocks
 * are transposed, as float32 into Kt (D, PK): the same tile key_block_t makes from rows, zero
 * past nk. */
static void kt_gather(const gl_kv *kv, int64_t s, int64_t h, int64_t k0, int64_t nk, int64_t D,
                      float *Kt) {
    const int64_t BS = kv->block, t = kv->type;
    for (int64_t j = k0; j < k0 + nk;) {
        const int64_t o = j % BS, run = BS - o < k0 + nk - j ? BS - o : k0 + nk - j;
        const char *plane = kt_plane(kv, s, h, j, D);
        for (int64_t d = 0; d < D; d++) {
            const char *src = plane + kv_bytes(d * BS + o, t);
            float *dst = Kt + d * PK + (j - k0);
            int64_t i = 0;
            for (; i + 8 <= run; i += 8) _mm256_storeu_ps(dst + i, kv_load8(src, i, (int)t));
            for (; i < run; i++) dst[i] = kv_get(src, i, (int)t);
        }
        j += run;
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = nk; j < PK; j++) Kt[d * PK + j] = 0.0f;
}

#include "attn_prompt_bf16.c" /* the bfloat16 tiles: prompt_bf16 */

void gl_attn_prefill(const gl_attn *a, const float *q, const int64_t *slots,
                     const int64_t *starts, int64_t B, int64_t T, float *out, int64_t exact,
                     int nth) {
#if ATTN_BF16
    if (exact != 1 && prompt_bf16_fits(a)) { /* fast steps: bfloat16 tiles */
        /* int8 scores where the CPU has VNNI: 0 the keys' codes less their mean, 3 a q8_0 cache's
         * own (its rows whole blocks: else the keys' codes) */
        const int q8 = exact == 3 && a->kv.type == 3 && a->head_dim % 32 == 0;
        const int scores = !ATTN_I8 ? SCORES_BF16 : q8 ? SCORES_Q8 : exact == 0 || exact == 3 ? SCORES_I8 : SCORES_BF16;
        prompt_bf16(a, q, slots, starts, B, T, out, scores, nth);
        return;
    }
#endif
    (void)exact;
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
                kv_gather(kv, kv->v, s, g, k0, nk, D, Vf);
                if (kv_keys_t(kv)) {
                    kt_gather(kv, s, g, k0, nk, D, Kt);
                } else {
                    kv_gather(kv, kv->k, s, g, k0, nk, D, Kf);
                    key_block_t(Kf, nk, D, Kt);
                }
                /* S = scale * Q Kt: AR rows x 16 keys a tile (AVX-512: x 32, a pair of vectors;
                 * each score is the same FMA chain over d in either width, so the same bits) */
                {
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
                }
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
                {
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
                }
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
                float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                if (a->sinks) { /* the sink's logit joins the sum, no value: both at max(m, sink) */
                    const float sk = a->sinks[h], mm = m[r] > sk ? m[r] : sk;
                    const float c = m[r] == -INFINITY ? 0.0f : expf(m[r] - mm), den = l[r] * c + expf(sk - mm);
                    inv = den > 0.0f ? c / den : 0.0f;
                }
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

