/* A prototype, not part of graftlm: the Q4_K product of many rows of x with x quantized per 256
 * values (one float scale a super-block, and the sums of its codes per 32 for the mins, as
 * llama.cpp's Q8_K) instead of per 32 as the library does (graftlm.h's xbuf). It reads the
 * library's packed Q4_K weights (kquant.c's k4 layout: groups of 8 rows, per block of 32 the u4
 * codes, then the 8 rows' sc and mn; per super-block the 8 rows' d and dmin) and runs the same
 * tiles as kquant_k4.c's pairs (two groups, 16 outputs, a zmm lane each; KT rows of x a tile; GT
 * groups a task), so that only the epilogue differs. Built and run by bench/xq256.py:
 *
 *     cc -O3 -march=native -ffp-contract=off -shared -fPIC bench/xq256.c -o xq256.so
 *
 * Semantics, for output lane o (weight row), x row r and super-block s of 8 sub-blocks j:
 *     s32[j] = sum over the sub-block's 32 values of q[o] * xq[r]       (q 0..15, xq -127..127)
 *     S = sum_j sc[o, j] * s32[j]        M = sum_j mn[o, j] * bsum[r, s, j]     (int32, exact)
 *     t = float(S) * d[o] - float(M) * dmin[o]     (each product and the difference rounded)
 *     y[r, o] += t * xd[r, s]                      (the product, then the sum, rounded)
 * Slots a super-block and row of x (docs/design-notes.md's table): 64 VPDPBUSD, 8 VPMULLD (a
 * sub-block's scale), 4 VPDPWSSD (the mins), 3 VMULPS; the VPADDDs, VCVTDQ2PS, VSUBPS, VADDPS
 * and the loads take none: 79 for 64, a ceiling of 64 / 79 of the peak (per 32: 64 / 88); a loop
 * of each whole mix (bench/epilogue_probe.c) runs at 188 GMAC/s, per 32's at 164. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KT 8 /* rows of x a tile (kquant_k4.c's; 12: 0.91-0.99x, 6: 0.91-1.03x) */
#define GT 4      /* groups of 8 outputs a task (graftlm.h's) */
#define BS 144    /* bytes a packed Q4_K block of a group: 128 of codes, 8 sc, 8 mn */
#define AHEAD 4096
#define RC 48

/* x (M, k) quantized per 256 into the tiled layout the kernel reads: rows in tiles of KT (the
 * last tile R = M % KT rows), and in a tile of R rows, per super-block s: the R rows' 256 codes
 * (xq), their bsums (8 int16 a row: the sums of the codes per 32) and their scales (xd). Row r
 * of tile t, super-block s:
 *     xq[t KT k + s R 256 + (r % KT) 256 + v],  bs[(t KT ks + s R + r % KT) 8 + j],
 *     xd[t KT ks + s R + r % KT]
 * Per 256 values: amax = max |x|, d = amax / 127, id = 127 / amax (0 when amax is 0),
 * q = round-to-nearest-even(x id), float32 throughout (quant.c's quantize_blocks per 256). */
void xq256_quantize(const float *x, int64_t M, int64_t k, int8_t *xq, int16_t *bs, float *xd) {
    const int64_t ks = k / 256;
    for (int64_t r = 0; r < M; r++) {
        const int64_t t = r / KT, R = M - t * KT < KT ? M - t * KT : KT, i = r % KT;
        for (int64_t s = 0; s < ks; s++) {
            const float *p = x + r * k + s * 256;
            __m512 v[16], a = _mm512_setzero_ps();
            for (int c = 0; c < 16; c++) {
                v[c] = _mm512_loadu_ps(p + 16 * c);
                a = _mm512_max_ps(a, _mm512_abs_ps(v[c]));
            }
            const float amax = _mm512_reduce_max_ps(a);
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512 mul = _mm512_set1_ps(id);
            const int64_t at = t * KT * ks + s * R + i;
            int8_t *q = xq + t * KT * k + (s * R + i) * 256;
            for (int c = 0; c < 16; c += 2) {
                const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], mul));
                const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[c + 1], mul));
                _mm_storeu_si128((__m128i *)(q + 16 * c), _mm512_cvtsepi32_epi8(i0));
                _mm_storeu_si128((__m128i *)(q + 16 * c + 16), _mm512_cvtsepi32_epi8(i1));
                bs[at * 8 + c / 2] = (int16_t)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            }
            xd[at] = d;
        }
    }
}

static inline __m512 cat_ps(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

static inline __attribute__((always_inline)) void prefetch_lines(const uint8_t *p, int hint_l2) {
    for (int o = 0; o < BS; o += 64) _mm_prefetch((const char *)p + o, hint_l2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

/* 16 bytes: 8 of group a's (the low 8 lanes), 8 of group b's -> 16 int32 lanes */
static inline __m512i bytes16_epi32(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                                   _mm_loadl_epi64((const __m128i *)b)));
}

/* y for R rows of x (a tile: xt its codes, bt its bsums, dt its scales, ks super-blocks) and
 * two groups' 16 outputs (qa, da: ya's 8; qb, db: yb's 8), the Semantics above. nx: 0, or how
 * far on the next task's blocks lie (kquant_k4.c's next_task_at: asked for toward L2 instead
 * of this task's 4 KiB ahead). */
static inline __attribute__((always_inline)) void q8k_pair(
    const uint8_t *qa, const uint8_t *qb, const uint16_t *da, const uint16_t *db, int64_t ks,
    const int8_t *xt, const int16_t *bt, const float *dt, int R, float *ya, float *yb,
    int64_t ldy, int64_t nx) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[KT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ks; s++) {
        const int8_t *xs = xt + s * R * 256;
        __m512i S[KT];
        for (int j = 0; j < 8; j++) {
            const uint8_t *wa = qa + (s * 8 + j) * BS, *wb = qb + (s * 8 + j) * BS;
            if (nx) {
                prefetch_lines(wa + nx, 1);
                prefetch_lines(wb + nx, 1);
            } else {
                prefetch_lines(wa + AHEAD, 0);
                prefetch_lines(wb + AHEAD, 0);
            }
            __m512i s32[KT];
            for (int r = 0; r < R; r++) s32[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wa + 32 * c))),
                    _mm256_loadu_si256((const __m256i *)(wb + 32 * c)), 1);
                const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                for (int r = 0; r < R; r++) {
                    const int8_t *xb = xs + r * 256 + j * 32;
                    int32_t x0, x1;
                    memcpy(&x0, xb + 4 * c, 4);
                    memcpy(&x1, xb + 16 + 4 * c, 4);
                    s32[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s32[r], lo, _mm512_set1_epi32(x0)), hi,
                                                 _mm512_set1_epi32(x1));
                }
            }
            const __m512i sc = bytes16_epi32(wa + 128, wb + 128);
            for (int r = 0; r < R; r++) {
                const __m512i p = _mm512_mullo_epi32(s32[r], sc);
                S[r] = j ? _mm512_add_epi32(S[r], p) : p;
            }
        }
        /* the mins: lane o of pair p holds (mn[o, 2p], mn[o, 2p + 1]) as int16 */
        const uint8_t *wa = qa + s * 8 * BS + 136, *wb = qb + s * 8 * BS + 136;
        __m512i mp[4];
        for (int p = 0; p < 4; p++) {
            const __m128i e = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(wa + 2 * p * BS)),
                                                 _mm_loadl_epi64((const __m128i *)(wb + 2 * p * BS)));
            const __m128i o = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(wa + (2 * p + 1) * BS)),
                                                 _mm_loadl_epi64((const __m128i *)(wb + (2 * p + 1) * BS)));
            mp[p] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(e, o), _mm_unpacklo_epi8(e, o)));
        }
        const __m512 dv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + s * 16))),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + s * 16))));
        const __m512 mv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + s * 16 + 8))),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + s * 16 + 8))));
        const int16_t *bsr = bt + s * R * 8;
        for (int r = 0; r < R; r++) {
            __m512i m = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                int32_t pair;
                memcpy(&pair, bsr + r * 8 + 2 * p, 4);
                m = _mm512_dpwssd_epi32(m, mp[p], _mm512_set1_epi32(pair));
            }
            const __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[r]), dv),
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(m), mv));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(t, _mm512_set1_ps(dt[s * R + r])));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(ya + r * ldy, _mm512_castps512_ps256(acc[r]));
        if (yb) _mm256_storeu_ps(yb + r * ldy, _mm512_extractf32x8_ps(acc[r], 1));
    }
}

/* F(rows) with rows a compile-time constant 1..KT */
#define WITH_ROWS_KT(R, F)                                                                         \
    switch (R) {                                                                                   \
    case 8: F(8); break;                                                                           \
    case 7: F(7); break;                                                                           \
    case 6: F(6); break;                                                                           \
    case 5: F(5); break;                                                                           \
    case 4: F(4); break;                                                                           \
    case 3: F(3); break;                                                                           \
    case 2: F(2); break;                                                                           \
    default: F(1); break;                                                                          \
    }

static __attribute__((noinline)) void q8k_pair_next(const uint8_t *qa, const uint8_t *qb, const uint16_t *da,
                                                    const uint16_t *db, int64_t ks, const int8_t *xt,
                                                    const int16_t *bt, const float *dt, float *ya, float *yb,
                                                    int64_t ldy, int64_t nx) {
    q8k_pair(qa, qb, da, db, ks, xt, bt, dt, KT, ya, yb, ldy, nx);
}

/* The groups [g0, g1) of a task for the rows [0, M): kquant_k4.c's k4_task (tiles of KT rows,
 * each over the task's groups two at a time; an odd last group by itself, its pair its own
 * codes again with the upper 8 lanes not stored). */
static void q8k_task(const uint8_t *q, const uint16_t *d, int64_t M, int64_t k, int64_t n, int64_t t,
                     const int8_t *xq, const int16_t *bs, const float *xd, float *y) {
    const int64_t ks = k / 256, kb = k / 32, groups = (n + 7) / 8;
    const int64_t g0 = t * GT, g1 = g0 + GT < groups ? g0 + GT : groups;
    for (int64_t r0 = 0; r0 < M; r0 += KT) {
        const int R = M - r0 < KT ? (int)(M - r0) : KT;
        const int8_t *xt = xq + r0 * k;
        const int16_t *bt = bs + r0 * ks * 8;
        const float *dt = xd + r0 * ks;
        const int64_t nx = M > KT && M <= RC && r0 + KT >= M ? GT * kb * BS : 0;
        for (int64_t g = g0; g < g1; g += 2) {
            const int two = g + 1 < g1;
            const uint8_t *qa = q + g * kb * BS, *qb = two ? qa + kb * BS : qa;
            const uint16_t *da = d + g * ks * 16, *db = two ? da + ks * 16 : da;
            float *ya = y + r0 * n + g * 8, *yb = two ? ya + 8 : NULL;
            if (nx && R == KT) {
                q8k_pair_next(qa, qb, da, db, ks, xt, bt, dt, ya, yb, n, nx);
                continue;
            }
#define P(RR) q8k_pair(qa, qb, da, db, ks, xt, bt, dt, RR, ya, yb, n, 0)
            WITH_ROWS_KT(R, P)
#undef P
        }
    }
}

/* y (M, n) = x (M, k) @ W.T for the library's packed Q4_K weight (q, d) of n rows (a multiple of
 * 8), one thread: x quantized per 256 (xq256_quantize), then the tasks in turn. */
void xq256_mm(const float *x, int64_t M, int64_t k, const uint8_t *q, const uint16_t *d, int64_t n,
              float *y) {
    const int64_t ks = k / 256;
    int8_t *xq = aligned_alloc(64, (size_t)((M * k + 63) / 64 * 64));
    int16_t *bs = malloc((size_t)(M * ks * 8) * sizeof(int16_t));
    float *xd = malloc((size_t)(M * ks) * sizeof(float));
    if (!xq || !bs || !xd) abort();
    xq256_quantize(x, M, k, xq, bs, xd);
    const int64_t tasks = ((n + 7) / 8 + GT - 1) / GT;
    for (int64_t t = 0; t < tasks; t++) q8k_task(q, d, M, k, n, t, xq, bs, xd, y);
    free(xq);
    free(bs);
    free(xd);
}

int xq256_rows_a_tile(void) { return KT; }

/* The same product from x already quantized (xq256_quantize's buffers): for the check. */
void xq256_mm_quantized(const int8_t *xq, const int16_t *bs, const float *xd, int64_t M, int64_t k,
                        const uint8_t *q, const uint16_t *d, int64_t n, float *y) {
    const int64_t tasks = ((n + 7) / 8 + GT - 1) / GT;
    for (int64_t t = 0; t < tasks; t++) q8k_task(q, d, M, k, n, t, xq, bs, xd, y);
}
