/* graftlm's native quantized kernels (x86-64 AVX2 + FMA, OpenMP).
 *
 * Two weight formats, both repacked once at load from GGUF blocks (layouts: see gl_pack_u4):
 *   u4: Q4_0, Q4_1, Q4_K.  4-bit codes q in 0..15 with a float scale d and offset m per 32
 *       values: w = q * d + m   (bit-exact with gguf.quants.dequantize for the three types).
 *   s8: Q8_0, Q5_0 (scale per 32 values), Q6_K (scale per 16).  One int8 code per value and a
 *       float scale per block: w = q * s   (bit-exact likewise).
 * Matrix products quantize x to int8 per 32 values (xd = max|x| / 127, as llama.cpp's Q8_0 /
 * Q8_1 activations do) and accumulate the integer dot products of each block in float:
 *   y[r, n] = sum_b (d[n,b] * xd[r,b]) * sum_j q[n,b,j] * xq[r,b,j]  +  sum_b m[n,b] * xs[r,b]
 * with xs[r,b] = xd[r,b] * sum_j xq[r,b,j].  Built with -ffp-contract=off so the dequantizers
 * round exactly as numpy does.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "graftlm native kernels need AVX2 and FMA"
#endif

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

int gl_abi_version(void) { return 25; }

static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, f;
    if (exp == 0) {
        if (man == 0) {
            f = sign;
        } else {
            exp = 113;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (man << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (man << 13);
    }
    float r;
    memcpy(&r, &f, 4);
    return r;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---------------------------------------------------------------- repacking (load time) */

/* Scales are stored as float, or as float16 where every one of a weight's scales is exactly a
 * float16 (the file's own d and m of Q4_0, Q4_1, Q5_0, Q8_0): a quarter less to read per step. */
static inline void put_scale(void *dst, int64_t idx, float v, int h, int *inexact) {
    if (h) {
        const uint16_t b = (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
        if (h2f(b) != v) *inexact = 1;
        ((uint16_t *)dst)[idx] = b;
    } else {
        ((float *)dst)[idx] = v;
    }
}

static inline float get_scale(const void *src, int64_t idx, int h) {
    return h ? h2f(((const uint16_t *)src)[idx]) : ((const float *)src)[idx];
}

static inline __m256 load_scales8(const void *src, int64_t idx, int h) {
    return h ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + idx)))
             : _mm256_loadu_ps((const float *)src + idx);
}

static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One GGUF row of a u4 type -> codes (k bytes, 0..15), d and m per 32 values. */
static void row_u4(int type, const uint8_t *src, int64_t k, uint8_t *q, float *d, float *m) {
    if (type == T_Q4_0 || type == T_Q4_1) {
        const int bs = type == T_Q4_0 ? 18 : 20;
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *blk = src + b * bs, *qs = blk + bs - 16;
            d[b] = h2f(rd16(blk));
            m[b] = type == T_Q4_0 ? -8.0f * d[b] : h2f(rd16(blk + 2));
            for (int j = 0; j < 16; j++) {
                q[b * 32 + j] = qs[j] & 0xF;
                q[b * 32 + j + 16] = qs[j] >> 4;
            }
        }
        return;
    }
    for (int64_t sb = 0; sb < k / 256; sb++) { /* Q4_K: 144 bytes per 256 values */
        const uint8_t *blk = src + sb * 144;
        const float dk = h2f(rd16(blk)), dmin = h2f(rd16(blk + 2));
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(j, blk + 4, &sc, &mn);
            const int64_t b = sb * 8 + j;
            d[b] = dk * (float)sc;
            m[b] = -(dmin * (float)mn);
            const uint8_t *c = blk + 16 + (j / 2) * 32;
            for (int t = 0; t < 32; t++) q[b * 32 + t] = (j & 1) ? c[t] >> 4 : c[t] & 0xF;
        }
    }
}

/* One GGUF row of an s8 type -> codes (k int8) and scales per sblk values. */
static void row_s8(int type, const uint8_t *src, int64_t k, int8_t *o, float *s) {
    if (type == T_Q8_0) {
        for (int64_t b = 0; b < k / 32; b++) {
            s[b] = h2f(rd16(src + b * 34));
            memcpy(o + b * 32, src + b * 34 + 2, 32);
        }
    } else if (type == T_Q5_0) {
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *blk = src + b * 22, *ql = blk + 6;
            s[b] = h2f(rd16(blk));
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            for (int j = 0; j < 16; j++) {
                o[b * 32 + j] = (int8_t)(((ql[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16);
                o[b * 32 + j + 16] = (int8_t)(((ql[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16);
            }
        }
    } else { /* Q6_K: ql[128] qh[64] scales[16] d, 210 bytes per 256 values */
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *blk = src + sb * 210;
            const float dk = h2f(rd16(blk + 208));
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int j = 0; j < 16; j++) s[sb * 16 + j] = dk * (float)sc[j];
            int8_t *y = o + sb * 256;
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + h * 64, *qh = blk + 128 + h * 32;
                for (int l = 0; l < 32; l++) {
                    y[h * 128 + l] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                    y[h * 128 + l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[h * 128 + l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[h * 128 + l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
        }
    }
}

/* Layouts, rows in groups of 8 (n padded to a multiple of 8 with zero rows), g = row / 8,
 * i = row % 8, b = block of 32 values, j = 0..3:
 *   u4: qs[((g*kb + b)*4 + c)*32 + 4i + j] = q[32b + 4c + j] | q[32b + 16 + 4c + j] << 4
 *       d[(g*kb + b)*8 + i], m[(g*kb + b)*8 + i]
 *   s8: q[((g*kb + b)*8 + t)*32 + 4i + j] = q[32b + 4t + j]
 *       s[(g*ns + u)*8 + i] for scale block u of the row (ns = k / sblk)
 * so one 32-byte load holds 4 consecutive values of 8 rows: the products below yield 8 outputs
 * per vector, with their scales loaded as one vector. */
/* Returns 1 when h (float16 scales) was asked for but some scale is not a float16. */
int gl_pack_u4(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k,
               uint8_t *qs, void *d, void *m, int h, int nth) {
    const int64_t kb = k / 32, groups = (n + 7) / 8;
    int inexact = 0;
#pragma omp parallel for num_threads(nth) schedule(static) reduction(| : inexact)
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *q = calloc((size_t)(8 * k), 1);
        float *dd = calloc((size_t)(8 * kb), sizeof(float)), *mm = calloc((size_t)(8 * kb), sizeof(float));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_u4(type, raw + (g * 8 + i) * rowbytes, k, q + i * k, dd + i * kb, mm + i * kb);
        for (int64_t b = 0; b < kb; b++) {
            for (int i = 0; i < 8; i++) {
                put_scale(d, (g * kb + b) * 8 + i, dd[i * kb + b], h, &inexact);
                put_scale(m, (g * kb + b) * 8 + i, mm[i * kb + b], h, &inexact);
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++)
                        qs[((g * kb + b) * 4 + c) * 32 + 4 * i + j] =
                            (uint8_t)(q[i * k + 32 * b + 4 * c + j] | (q[i * k + 32 * b + 16 + 4 * c + j] << 4));
            }
        }
        free(q);
        free(dd);
        free(mm);
    }
    return inexact;
}

int gl_pack_s8(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, int8_t *q,
               void *s, int h, int nth) {
    const int64_t kb = k / 32, groups = (n + 7) / 8, ns = type == T_Q6_K ? k / 16 : k / 32;
    int inexact = 0;
#pragma omp parallel for num_threads(nth) schedule(static) reduction(| : inexact)
    for (int64_t g = 0; g < groups; g++) {
        int8_t *t = calloc((size_t)(8 * k), 1);
        float *ss = calloc((size_t)(8 * ns), sizeof(float));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_s8(type, raw + (g * 8 + i) * rowbytes, k, t + i * k, ss + i * ns);
        for (int i = 0; i < 8; i++) {
            for (int64_t u = 0; u < ns; u++) put_scale(s, (g * ns + u) * 8 + i, ss[i * ns + u], h, &inexact);
            for (int64_t b = 0; b < kb; b++)
                for (int c = 0; c < 8; c++)
                    memcpy(q + ((g * kb + b) * 8 + c) * 32 + 4 * i, t + i * k + 32 * b + 4 * c, 4);
        }
        free(t);
        free(ss);
    }
    return inexact;
}

/* ---------------------------------------------------------------- dequantization (exact) */

/* Rows ids[i] (or row0 + i when ids is NULL) of a u4 weight -> out (nrows, k) float.
 * offset 8 (Q4_0): w = (q - 8) * d, as gguf computes it (which keeps the sign of a zero). */
void gl_deq_u4(const uint8_t *qs, const void *d, const void *m, int h, int offset, int64_t k,
               const int64_t *ids, int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const float dd = get_scale(d, (g * kb + b) * 8 + i, h), mm = get_scale(m, (g * kb + b) * 8 + i, h);
            const uint8_t *blk = qs + (g * kb + b) * 128 + 4 * i;
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 4; j++) {
                    const int lo = blk[c * 32 + j] & 0xF, hi = blk[c * 32 + j] >> 4;
                    float *v0 = o + 32 * b + 4 * c + j, *v1 = v0 + 16;
                    if (offset) {
                        *v0 = (float)(lo - offset) * dd;
                        *v1 = (float)(hi - offset) * dd;
                    } else {
                        const float a = (float)lo * dd, e = (float)hi * dd;
                        *v0 = a + mm;
                        *v1 = e + mm;
                    }
                }
            }
        }
    }
}

void gl_deq_s8(const int8_t *q, const void *s, int h, int64_t sblk, int64_t k, const int64_t *ids,
               int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, ns = k / sblk;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        for (int64_t v = 0; v < k; v++) {
            const int64_t b = v / 32, t = (v % 32) / 4, j = v % 4;
            out[r * k + v] = (float)q[((g * kb + b) * 8 + t) * 32 + 4 * i + j] * get_scale(s, (g * ns + v / sblk) * 8 + i, h);
        }
    }
}

/* ---------------------------------------------------------------- activations -> int8 */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x (M, k) -> xq (M, k) int8, xd / xs (M, k/32), xs16 (M, k/16): per 32 values
 * xd = max|x| / 127, xq = round(x / xd), xs = xd * sum(xq); xs16 the same sum per 16 values. */
static void quantize_x(const float *x, int64_t M, int64_t k, int8_t *xq, float *xd, float *xs,
                       float *xs16, int nth) {
    const int64_t kb = k / 32;
    const __m256 signbit = _mm256_set1_ps(-0.0f);
#pragma omp parallel for num_threads(nth) schedule(static) if (M * k > 65536)
    for (int64_t i = 0; i < M * kb; i++) {
        const float *p = x + i * 32;
        __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signbit, v0), _mm256_andnot_ps(signbit, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(signbit, v2), _mm256_andnot_ps(signbit, v3)));
        __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
        a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
        const float amax = _mm_cvtss_f32(a4);
        const float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), rnd));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), rnd));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), rnd));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), rnd));
        const __m256i sa = _mm256_add_epi32(i0, i1), sb = _mm256_add_epi32(i2, i3);
        __m128i s4 = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(sa), _mm256_extracti128_si256(sa, 1)),
                                    _mm_add_epi32(_mm256_castsi256_si128(sb), _mm256_extracti128_si256(sb, 1)));
        s4 = _mm_hadd_epi32(s4, s4); /* [sum of the first 16, of the last 16, ...] */
        const int32_t sum0 = _mm_cvtsi128_si32(s4), sum1 = _mm_extract_epi32(s4, 1);
        /* pack 32 x int32 -> 32 x int8 in order */
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i pk = _mm256_packs_epi16(p01, p23);
        pk = _mm256_permutevar8x32_epi32(pk, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * 32), pk);
        xd[i] = dd;
        xs[i] = dd * (float)(sum0 + sum1);
        xs16[2 * i] = dd * (float)sum0;
        xs16[2 * i + 1] = dd * (float)sum1;
    }
}

/* ---------------------------------------------------------------- matrix products */

#define MT 6  /* rows of x per tile: their accumulators live in registers */
#define MTU 4 /* the same for the unsigned small-code kernels (s5, k6), which hold 4 weight vectors */
#define GT 4 /* groups of 8 output rows per task: their weights stay in L1 across the x tiles */

/* The 8 outputs of a row group for R rows of x: nvalid < 8 in the last, padded group. */
static inline __attribute__((always_inline)) void store_group(const __m256 *acc, int R, float *y,
                                                              int64_t ldy, int64_t nvalid) {
    for (int r = 0; r < R; r++) {
        if (nvalid == 8) {
            _mm256_storeu_ps(y + r * ldy, acc[r]);
        } else {
            float t[8];
            _mm256_storeu_ps(t, acc[r]);
            memcpy(y + r * ldy, t, sizeof(float) * (size_t)nvalid);
        }
    }
}

/* F(rows) with rows a compile-time constant 1..MT (WITH_ROWS) or 1..MTU (WITH_ROWS_U): the group
 * kernels keep R accumulators in registers only when R is known when they are inlined. */
#define WITH_ROWS_U(R, F)                                                                           \
    switch (R) {                                                                                   \
    case 4: F(4); break;                                                                           \
    case 3: F(3); break;                                                                           \
    case 2: F(2); break;                                                                           \
    default: F(1); break;                                                                          \
    }

#define WITH_ROWS(R, F)                                                                            \
    switch (R) {                                                                                   \
    case 6: F(6); break;                                                                           \
    case 5: F(5); break;                                                                           \
    case 4: F(4); break;                                                                           \
    case 3: F(3); break;                                                                           \
    case 2: F(2); break;                                                                           \
    default: F(1); break;                                                                          \
    }

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* y[r, 8g .. 8g+7] for R rows of x, one group g of a u4 weight. */
static inline __attribute__((always_inline)) void u4_group(
    const uint8_t *qs, const void *d, const void *m, int h, int64_t kb, const int8_t *xq,
    const float *xd, const float *xs, int R, float *y, int64_t ldy, int64_t nvalid) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *w = qs + b * 128;
        __m256i s16[MT];
        for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + (r * kb + b) * 32;
                /* |pair| <= 2 * 15 * 127: eight of them still fit in int16 */
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, bcast4(xb + 4 * c)));
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, bcast4(xb + 16 + 4 * c)));
            }
        }
        const __m256 dv = load_scales8(d, b * 8, h), mv = load_scales8(m, b * 8, h);
        for (int r = 0; r < R; r++) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

/* The same for an s8 weight: sblk 32 (one scale per block) or 16 (two). */
static inline __attribute__((always_inline)) void s8_group(
    const int8_t *q, const void *s, int h, int sblk, int64_t kb, const int8_t *xq, const float *xd,
    int R, float *y, int64_t ldy, int64_t nvalid) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *w = q + b * 256;
        __m256i i0[MT], i1[MT];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; r++) {
                const __m256i xv = bcast4(xq + (r * kb + b) * 32 + 4 * c);
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
                if (sblk == 32 || c < 4)
                    i0[r] = _mm256_add_epi32(i0[r], p);
                else
                    i1[r] = _mm256_add_epi32(i1[r], p);
            }
        }
        if (sblk == 32) {
            const __m256 sv = load_scales8(s, b * 8, h);
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[r]),
                                         _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
        } else {
            const __m256 s0 = load_scales8(s, b * 16, h), s1 = load_scales8(s, b * 16 + 8, h);
            for (int r = 0; r < R; r++) {
                const __m256 xdv = _mm256_set1_ps(xd[r * kb + b]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[r]), _mm256_mul_ps(s0, xdv), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[r]), _mm256_mul_ps(s1, xdv), acc[r]);
            }
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

/* The 4 weight vectors of half a block (16 values of 8 rows), with `off` added to every code. */
static inline __attribute__((always_inline)) void load_half(const int8_t *w, __m256i off, __m256i *v) {
    for (int c = 0; c < 4; c++) v[c] = _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(w + 32 * c)), off);
}

/* maddubs(v[0], x[0 .. 3]) + maddubs(v[1], x[4 .. 7]) in int16: 8 values of x. */
static inline __attribute__((always_inline)) __m256i dot_pair(const __m256i *v, const int8_t *xb) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast4(xb)), _mm256_maddubs_epi16(v[1], bcast4(xb + 4)));
}

/* The same for an s8 weight whose codes are small (Q5_0: q in [-16, 15]): q + 16 is a byte in
 * [0, 31], so maddubs takes it as the unsigned side directly (|pair| <= 2 * 31 * 127, four of
 * them fit in int16) and -16 * d * sum(x) corrects the offset: 3 ops per 32 products instead of
 * the 5 of the signed path. Scales per 32 values. Each half block's 4 weight vectors stay in
 * registers across the rows, and the block's sums go to float once: MTU rows per tile (with MT,
 * the accumulators spilled and this ran 25% slower). */
static inline __attribute__((always_inline)) void s5_group(
    const int8_t *q, const void *s, int h, int64_t kb, const int8_t *xq, const float *xd,
    const float *xs, int R, float *y, int64_t ldy, int64_t nvalid) {
    const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi8(16);
    __m256 acc[MTU];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *w = q + b * 256;
        __m256i s32[MTU];
        for (int half = 0; half < 2; half++) {
            __m256i v[4];
            load_half(w + 128 * half, off, v);
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + (r * kb + b) * 32 + 16 * half;
                const __m256i t = _mm256_madd_epi16(_mm256_add_epi16(dot_pair(v, xb), dot_pair(v + 2, xb + 8)), ones);
                s32[r] = half ? _mm256_add_epi32(s32[r], t) : t;
            }
        }
        const __m256 sv = load_scales8(s, b * 8, h), mv = _mm256_mul_ps(sv, _mm256_set1_ps(-16.0f));
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

/* The same for Q6_K's codes (q in [-32, 31], a scale per 16 values): q + 32 is a byte in [0, 63]
 * (|pair| <= 2 * 63 * 127, two of them fit in int16) and -32 * s * sum(x) per 16 values corrects
 * the offset. */
static inline __attribute__((always_inline)) void k6_group(
    const int8_t *q, const void *s, int64_t kb, const int8_t *xq, const float *xd,
    const float *xs16, int R, float *y, int64_t ldy, int64_t nvalid) {
    const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi8(32);
    __m256 acc[MTU];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *w = q + b * 256;
        for (int half = 0; half < 2; half++) {
            __m256i v[4];
            load_half(w + 128 * half, off, v);
            const __m256 sv = load_scales8(s, b * 16 + 8 * half, 0), mv = _mm256_mul_ps(sv, _mm256_set1_ps(-32.0f));
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + (r * kb + b) * 32 + 16 * half;
                /* each pair widened alone: |2 maddubs| <= 4 * 63 * 127 fits in int16, 4 would not */
                const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(dot_pair(v, xb), ones),
                                                     _mm256_madd_epi16(dot_pair(v + 2, xb + 8), ones));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
                acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs16[(r * kb + b) * 2 + half]), acc[r]);
            }
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

typedef struct {
    int8_t *xq;
    float *xd, *xs, *xs16;
} xbuf;

static xbuf xbuf_make(const float *x, int64_t M, int64_t k, int nth) {
    xbuf b;
    b.xq = aligned_alloc(64, (size_t)((M * k + 63) / 64 * 64));
    b.xd = malloc(sizeof(float) * (size_t)(M * (k / 32)));
    b.xs = malloc(sizeof(float) * (size_t)(M * (k / 32)));
    b.xs16 = malloc(sizeof(float) * (size_t)(M * (k / 16)));
    quantize_x(x, M, k, b.xq, b.xd, b.xs, b.xs16, nth);
    return b;
}

static void xbuf_free(xbuf b) {
    free(b.xq);
    free(b.xd);
    free(b.xs);
    free(b.xs16);
}

/* A quantized weight of n rows of k values, as the packers lay it out. */
typedef struct {
    int64_t kind; /* 0: u4 (q = qs, d, m), 1: s8 (q, d = scales) */
    int64_t half, sblk, small, n, k;
    const void *q, *d, *m;
} gl_weight;

/* One task of y (M, n) = x (M, k) @ W.T: the outputs [8 GT t, 8 GT (t + 1)) of every row of x.
 * The tasks split the output rows, so the task's weights stay in L1 across the tiles of x. */
static void mm_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t t, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
    const int h = (int)w->half;
    const int64_t ss = h ? 2 : 4; /* bytes per stored scale */
    if (w->kind == 0) {
        const uint8_t *qs = (const uint8_t *)w->q;
        for (int64_t r0 = 0; r0 < M; r0 += MT) {
            const int R = M - r0 < MT ? (int)(M - r0) : MT;
            const int8_t *xt = xb->xq + r0 * k;
            const float *dt = xb->xd + r0 * kb, *st = xb->xs + r0 * kb;
            for (int64_t g = t * GT; g < g1; g++) {
                const uint8_t *qg = qs + g * kb * 128;
                const void *dg = (const char *)w->d + g * kb * 8 * ss, *mg = (const char *)w->m + g * kb * 8 * ss;
                float *yo = y + r0 * n + g * 8;
                const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#define U4H(RR) u4_group(qg, dg, mg, 1, kb, xt, dt, st, RR, yo, n, nv)
#define U4F(RR) u4_group(qg, dg, mg, 0, kb, xt, dt, st, RR, yo, n, nv)
                if (h) {
                    WITH_ROWS(R, U4H)
                } else {
                    WITH_ROWS(R, U4F)
                }
#undef U4H
#undef U4F
            }
        }
        return;
    }
    /* s8; small: the codes are Q5_0's (|q| <= 16), the unsigned path of s5_group */
    const int8_t *q = (const int8_t *)w->q;
    const int64_t sblk = w->sblk, ns = k / sblk;
    const int small = (int)w->small, mt = small || sblk == 16 ? MTU : MT;
    for (int64_t r0 = 0; r0 < M; r0 += mt) {
        const int R = M - r0 < mt ? (int)(M - r0) : mt;
        const int8_t *xt = xb->xq + r0 * k;
        const float *dt = xb->xd + r0 * kb;
        for (int64_t g = t * GT; g < g1; g++) {
            const int8_t *qg = q + g * kb * 256;
            const void *sg = (const char *)w->d + g * ns * 8 * ss;
            float *yo = y + r0 * n + g * 8;
            const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#define S5H(RR) s5_group(qg, sg, 1, kb, xt, dt, xb->xs + r0 * kb, RR, yo, n, nv)
#define S5F(RR) s5_group(qg, sg, 0, kb, xt, dt, xb->xs + r0 * kb, RR, yo, n, nv)
#define S8H(RR) s8_group(qg, sg, 1, 32, kb, xt, dt, RR, yo, n, nv)
#define S8F(RR) s8_group(qg, sg, 0, 32, kb, xt, dt, RR, yo, n, nv)
#define S8K(RR) k6_group(qg, sg, kb, xt, dt, xb->xs16 + r0 * kb * 2, RR, yo, n, nv)
            if (small && h) {
                WITH_ROWS_U(R, S5H)
            } else if (small) {
                WITH_ROWS_U(R, S5F)
            } else if (sblk == 32 && h) {
                WITH_ROWS(R, S8H)
            } else if (sblk == 32) {
                WITH_ROWS(R, S8F)
            } else {
                WITH_ROWS_U(R, S8K)
            }
#undef S5H
#undef S5F
#undef S8H
#undef S8F
#undef S8K
        }
    }
}

/* ---------------------------------------------------------------- norms, attention, gates */

/* e^x for 8 floats (Cephes' expf polynomial; ~2 ulp), x clamped to [-87.3, 88.3]. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float t = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* o = o * c + p * v */
static inline void scale_axpy(float *o, float c, float p, const float *v, int64_t n) {
    const __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_mul_ps(cv, _mm256_loadu_ps(o + i))));
    for (; i < n; i++) o[i] = o[i] * c + p * v[i];
}

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w over rows of n values (the sum in double, as ggml). */
void gl_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y,
                 int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] * scale) * w[i];
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
 * q/k/v rows start every q_rs/k_rs/v_rs floats, heads contiguous within a row.
 * Cache layout: (slot, kv head, position, dim).  out: (B, H * Dv). */
void gl_attn_decode(const float *q, int64_t q_rs, const float *k, int64_t k_rs, const float *v,
                    int64_t v_rs, float *kc, float *vc, const int64_t *slots, const int64_t *pos,
                    int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t n_ctx,
                    const float *cos_t, const float *sin_t, int64_t rot, int neox, float scale,
                    int64_t window, float softcap, float *out, int nth) {
    const int64_t half = rot / 2;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t p = pos[b], s = slots[b];
        for (int64_t h = 0; h < Hkv; h++) {
            float *kd = kc + ((s * Hkv + h) * n_ctx + p) * D;
            rope_head(k + b * k_rs + h * D, kd, D, rot, cos_t + p * half, sin_t + p * half, neox);
            memcpy(vc + ((s * Hkv + h) * n_ctx + p) * Dv, v + b * v_rs + h * Dv, sizeof(float) * (size_t)Dv);
        }
        work += (p + 1) * H;
    }
    const int64_t group = H / Hkv;
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1) if (work * (D + Dv) > 200000)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, hk = h / group, p = pos[b], s = slots[b];
        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p + 1 - lo;
        float qr[1024], sbuf_stack[2048];
        float *sc = n <= 2048 ? sbuf_stack : malloc(sizeof(float) * (size_t)n);
        rope_head(q + b * q_rs + h * D, qr, D, rot, cos_t + p * half, sin_t + p * half, neox);
        const float *kb = kc + ((s * Hkv + hk) * n_ctx + lo) * D;
        const float *vb = vc + ((s * Hkv + hk) * n_ctx + lo) * Dv;
        /* scores, their max, exp(score - max) in place, their sum */
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float v = dot_f32(qr, kb + j * D, D) * scale;
            if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
            sc[j] = v;
            m = v > m ? v : m;
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
                for (int64_t t = 0; t < n; t++) {
                    const __m256 e = _mm256_set1_ps(sc[t]);
                    const float *vr = vb + t * Dv + c0;
                    a0 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr), a0);
                    a1 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 8), a1);
                    a2 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 16), a2);
                    a3 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 24), a3);
                    a4 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 32), a4);
                    a5 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 40), a5);
                    a6 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 48), a6);
                    a7 = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 56), a7);
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
                for (int64_t t = 0; t < n; t++)
                    scale_axpy(acc, 1.0f, sc[t], vb + t * Dv + c0, w);
                for (int64_t i = 0; i < w; i++) o[c0 + i] = acc[i] * il;
            }
        }
        if (sc != sbuf_stack) free(sc);
    }
}

/* Prompt attention: B rows of T queries each, rows of one sequence each (slot[b]) whose keys and
 * values for positions 0 .. start[b] + T - 1 are in the cache (this chunk's already written,
 * rotated). q (B, T, H, D) rotated; out (B, T, H * D) (Dv == D). Query t of row b sits at
 * position p = start[b] + t and sees keys j <= p (and p - j < window when window > 0).
 *
 * One task: a kv head g of a row and PQ queries, whose H / Hkv heads share g's keys: rows =
 * PQ * group score rows. Keys go by blocks of PK, transposed once per block into Kt (D, PK), so
 * the score tile is 4 rows x 16 keys of FMAs with every operand a load or a broadcast; softmax
 * is online (flash attention): running max m and sum l per row, O rescaled when m grows. Blocks
 * past a task's last query or before its window are never touched: causal prompts do half the
 * work of a masked full product. */
#define PQ 16
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

void gl_attn_prefill(const float *q, float *out, const float *kc, const float *vc,
                     const int64_t *slots, const int64_t *starts, int64_t B, int64_t T, int64_t H,
                     int64_t Hkv, int64_t D, int64_t n_ctx, float scale, int64_t window, int nth) {
    const int64_t group = H / Hkv, qblocks = (T + PQ - 1) / PQ, rows_max = PQ * group;
    const int64_t ntask = B * Hkv * qblocks;
#pragma omp parallel num_threads(nth)
    {
        float *Kt = aligned_alloc(64, sizeof(float) * (size_t)(D * PK));
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
            const int64_t t0 = qb * PQ, nq = T - t0 < PQ ? T - t0 : PQ, rows = nq * group;
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
            const float *kg = kc + (s * Hkv + g) * n_ctx * D, *vg = vc + (s * Hkv + g) * n_ctx * D;
            for (int64_t k0 = klo; k0 <= pmax; k0 += PK) {
                const int64_t nk = pmax + 1 - k0 < PK ? pmax + 1 - k0 : PK;
                key_block_t(kg + k0 * D, nk, D, Kt);
                /* S = scale * Q Kt: AR rows x 16 keys a tile */
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
                /* mask, online softmax: P = exp(S - m_new) in S, alpha = exp(m_old - m_new) */
                const int64_t nk16 = (nk + 15) / 16 * 16;
                for (int64_t r = 0; r < rows; r++) {
                    float *sr = S + r * PK;
                    const int64_t p = pr[r], lo = window > 0 ? p - window + 1 : 0;
                    for (int64_t j = 0; j < nk16; j++) {
                        const int64_t key = k0 + j;
                        if (j >= nk || key > p || key < lo) sr[j] = -INFINITY;
                    }
                    float mx = m[r];
                    for (int64_t j = 0; j < nk16; j++) mx = sr[j] > mx ? sr[j] : mx;
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
                /* O = alpha O + P V: AR rows x 16 dims a tile */
                for (int64_t d0 = 0; d0 < D; d0 += 16) { /* V[:, d0 .. d0 + 16] stays in L1 */
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
                            const float *vr = vg + (k0 + j) * D + d0;
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
        free(S);
        free(O);
        free(m);
        free(l);
        free(alpha);
        free(qr);
        free(pr);
    }
}

/* ---------------------------------------------------------------- LoRA delta */

/* The LoRA delta of one projection for M rows of x (rows r*T .. r*T+T-1 share scale row r):
 *   y[i] += sum_c (s[i / T, c] * dot(A[c], x[i])) * B[:, c]
 * A (R, n_in) and B as float32, or as bfloat16 when bf (float32 arithmetic either way); B is
 * stored by column, padded to whole blocks of 32 outputs: Bb[c * nb * 32 + o] = B[o, c] (zero
 * past n_out, nb = ceil(n_out / 32)), so the blocks of a column that one thread adds are one
 * contiguous range (see lora_ranges); in bfloat16 each 16 outputs o .. o + 15 are stored as the
 * pairs (o + u, o + 8 + u), u = 0 .. 7 (ops.lora_block); s (M / T, R) the per-row scale of each rank
 * column (a column at scale 0 costs that row nothing); span (R, 2): outputs [lo, hi) outside which
 * column c is zero (its part of a stacked projection). y rows are ldy floats apart. */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float dot_bf16(const uint16_t *a, const float *x, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(bf16x8(a + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(bf16x8(a + i + 8), _mm256_loadu_ps(x + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(bf16x8(a + i), _mm256_loadu_ps(x + i), s0);
    float t = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) {
        const uint32_t bits = (uint32_t)a[i] << 16;
        float v;
        memcpy(&v, &bits, 4);
        t += v * x[i];
    }
    return t;
}

/* Each scale row's columns with a nonzero scale (s (S, R)): rows on different adapters walk only
 * their own. */
static void lora_columns(const float *s, int64_t S, int64_t R, int64_t *cols, int64_t *cnt) {
    for (int64_t i = 0; i < S; i++) {
        int64_t k = 0;
        for (int64_t c = 0; c < R; c++)
            if (s[i * R + c] != 0.0f) cols[i * R + k++] = c;
        cnt[i] = k;
    }
}

/* xa = s * (A[c] . x), 0 without computing where the scale is 0. */
static inline float lora_dot(const float *x, int64_t n_in, const void *A, int bf, float sc, int64_t c) {
    if (sc == 0.0f) return 0.0f;
    return sc * (bf ? dot_bf16((const uint16_t *)A + c * n_in, x, n_in) : dot_f32((const float *)A + c * n_in, x, n_in));
}

/* w[0..3] = the 32 outputs of one column's block of B at b, as float32 (bf16: see lora_block's
 * pairs, 16 outputs a load widened with a shift and a mask). */
static inline __attribute__((always_inline)) void b_widen(const char *b, int bf, __m256 w[4]) {
    if (bf) {
        const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)b), v1 = _mm256_loadu_si256((const __m256i *)(b + 32));
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(v0, hi16));
        w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        w[3] = _mm256_castsi256_ps(_mm256_and_si256(v1, hi16));
    } else {
        for (int u = 0; u < 4; u++) w[u] = _mm256_loadu_ps((const float *)b + 8 * u);
    }
}

/* y[jb * 32 ..][:32] += sum over the listed columns c of xa[c] * B[block jb, c], 32 outputs held in
 * registers; columns whose B is zero on this block (span) are skipped. */
static void lora_b_block(float *yi, const float *xa, const int64_t *cols, int64_t cnt, const void *Bb,
                         int bf, const int64_t *span, int64_t jb, int64_t n_out) {
    const int64_t j = jb * 32, nb = (n_out + 31) / 32;
    float tail[32];
    float *yo = j + 32 <= n_out ? yi + j : tail;
    if (yo == tail) {
        memset(tail, 0, sizeof(tail));
        memcpy(tail, yi + j, sizeof(float) * (size_t)(n_out - j));
    }
    __m256 y0 = _mm256_loadu_ps(yo), y1 = _mm256_loadu_ps(yo + 8);
    __m256 y2 = _mm256_loadu_ps(yo + 16), y3 = _mm256_loadu_ps(yo + 24);
    for (int64_t t = 0; t < cnt; t++) {
        const int64_t c = cols[t];
        if (j >= span[2 * c + 1] || j + 32 <= span[2 * c]) continue;
        const __m256 av8 = _mm256_set1_ps(xa[c]);
        __m256 w[4];
        b_widen((const char *)Bb + (c * nb + jb) * 32 * (bf ? 2 : 4), bf, w);
        y0 = _mm256_fmadd_ps(av8, w[0], y0);
        y1 = _mm256_fmadd_ps(av8, w[1], y1);
        y2 = _mm256_fmadd_ps(av8, w[2], y2);
        y3 = _mm256_fmadd_ps(av8, w[3], y3);
    }
    _mm256_storeu_ps(yo, y0);
    _mm256_storeu_ps(yo + 8, y1);
    _mm256_storeu_ps(yo + 16, y2);
    _mm256_storeu_ps(yo + 24, y3);
    if (yo == tail) memcpy(yi + j, tail, sizeof(float) * (size_t)(n_out - j));
}

/* Two rows whose scale rows list the same columns (ya, yb: their outputs; xa, xb: their s * A . x):
 * the delta of block jb to both, each block of B widened once for the two rows. A whole block. */
static void lora_b_two(float *ya, float *yb, const float *xa, const float *xb, const int64_t *cols,
                       int64_t cnt, const void *Bb, int bf, const int64_t *span, int64_t jb, int64_t n_out) {
    const int64_t j = jb * 32, nb = (n_out + 31) / 32, es = bf ? 2 : 4, cs = nb * 32 * es;
    const char *b0 = (const char *)Bb + jb * 32 * es;
    ya += j, yb += j;
    __m256 a0 = _mm256_loadu_ps(ya), a1 = _mm256_loadu_ps(ya + 8), a2 = _mm256_loadu_ps(ya + 16), a3 = _mm256_loadu_ps(ya + 24);
    __m256 c0 = _mm256_loadu_ps(yb), c1 = _mm256_loadu_ps(yb + 8), c2 = _mm256_loadu_ps(yb + 16), c3 = _mm256_loadu_ps(yb + 24);
    for (int64_t t = 0; t < cnt; t++) {
        const int64_t c = cols[t];
        if (j >= span[2 * c + 1] || j + 32 <= span[2 * c]) continue;
        __m256 w[4];
        b_widen(b0 + c * cs, bf, w);
        const __m256 ka = _mm256_set1_ps(xa[c]), kb = _mm256_set1_ps(xb[c]);
        a0 = _mm256_fmadd_ps(ka, w[0], a0), c0 = _mm256_fmadd_ps(kb, w[0], c0);
        a1 = _mm256_fmadd_ps(ka, w[1], a1), c1 = _mm256_fmadd_ps(kb, w[1], c1);
        a2 = _mm256_fmadd_ps(ka, w[2], a2), c2 = _mm256_fmadd_ps(kb, w[2], c2);
        a3 = _mm256_fmadd_ps(ka, w[3], a3), c3 = _mm256_fmadd_ps(kb, w[3], c3);
    }
    _mm256_storeu_ps(ya, a0), _mm256_storeu_ps(ya + 8, a1), _mm256_storeu_ps(ya + 16, a2), _mm256_storeu_ps(ya + 24, a3);
    _mm256_storeu_ps(yb, c0), _mm256_storeu_ps(yb + 8, c1), _mm256_storeu_ps(yb + 16, c2), _mm256_storeu_ps(yb + 24, c3);
}

/* Whether rows i and i + 1 (T tokens a scale row) list the same columns: lora_b_two can take them. */
static int lora_same_cols(const int64_t *cols, const int64_t *cnt, int64_t R, int64_t T, int64_t i) {
    const int64_t s = i / T, u = (i + 1) / T;
    return s == u || (cnt[s] == cnt[u] && memcmp(cols + s * R, cols + u * R, sizeof(int64_t) * (size_t)cnt[s]) == 0);
}

/* ---------------------------------------------------------------- one projection */

/* [start, end) of n iterations for thread tid of nt under schedule(static), as libgomp splits them. */
static inline void static_chunk(int64_t n, int tid, int nt, int64_t *start, int64_t *end) {
    const int64_t q = n / nt, r = n % nt;
    *start = tid * q + (tid < r ? tid : r);
    *end = *start + q + (tid < r);
}

typedef struct {
    const void *a, *bb; /* NULL a: no adapter on this projection in this step */
    const float *scales;
    const int64_t *span;
    int64_t r, bf;
    /* A again as an s8 weight of r rows (Q8_0 codes and scales, laid out as gl_pack_s8 lays
     * them), or NULL: the decode products take A . x from the quantized x the base product
     * already made, with the base kernel's integer dots (a quarter of the instructions and half
     * the bytes of the bfloat16 dots) */
    const void *aq, *as;
    int64_t ah;
} gl_lora_site;

/* xa[i * r + 8 g + u] = A[8 g + u] . x[i] for rows [r0, r1) of x and group g (8 columns) of l's
 * int8 A. */
static void lora_dots_s8(const gl_lora_site *l, const xbuf *xb, int64_t k, int64_t r0, int64_t r1,
                         int64_t g, float *xa) {
    const int64_t kb = k / 32, R = l->r, nv = R - g * 8 < 8 ? R - g * 8 : 8;
    const int8_t *qg = (const int8_t *)l->aq + g * kb * 256;
    const void *sg = (const char *)l->as + g * kb * 8 * (l->ah ? 2 : 4);
    for (int64_t i = r0; i < r1; i += MT) {
        const int rows = r1 - i < MT ? (int)(r1 - i) : MT;
        const int8_t *xt = xb->xq + i * k;
        const float *dt = xb->xd + i * kb;
        float *yo = xa + i * R + g * 8;
#define S8H(RR) s8_group(qg, sg, 1, 32, kb, xt, dt, RR, yo, R, nv)
#define S8F(RR) s8_group(qg, sg, 0, 32, kb, xt, dt, RR, yo, R, nv)
        if (l->ah) {
            WITH_ROWS(rows, S8H)
        } else {
            WITH_ROWS(rows, S8F)
        }
#undef S8H
#undef S8F
    }
}

/* av (M, R) = s * (A . x) for the rows of x (rows r*T .. r*T+T-1 share scale row r), the
 * threads of the enclosing parallel region splitting the rows; ends at a barrier. With l->aq,
 * the integer dots of the decode layer's products (proj_run) on xb, x quantized. */
static void lora_xa_rows(const gl_lora_site *l, const xbuf *xb, const float *x, int64_t M,
                         int64_t T, int64_t n_in, float *av) {
    const int64_t R = l->r;
    if (l->aq) {
        int64_t i0, i1;
        static_chunk(M, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
        for (int64_t g = 0; g < (R + 7) / 8; g++) lora_dots_s8(l, xb, n_in, i0, i1, g, av);
        for (int64_t ic = i0 * R; ic < i1 * R; ic++) av[ic] *= l->scales[(ic / R / T) * R + ic % R];
#pragma omp barrier
    } else { /* each read of A serves one (row, column) */
#pragma omp for schedule(static)
        for (int64_t ic = 0; ic < M * R; ic++) {
            const int64_t i = ic / R, c = ic % R;
            av[ic] = lora_dot(x + i * n_in, n_in, l->a, (int)l->bf, l->scales[(i / T) * R + c], c);
        }
    }
}

/* At one token a row, the columns thread tid of nt needs: those with a nonzero scale whose B
 * reaches its static share [b0, b1) of the 32-output blocks. */
static int lora_needed(const gl_lora_site *l, int64_t b0, int64_t b1, int64_t *cols) {
    int k = 0;
    for (int64_t c = 0; c < l->r; c++)
        if (l->scales[c] != 0.0f && b0 * 32 < l->span[2 * c + 1] && b1 * 32 > l->span[2 * c]) cols[k++] = c;
    return k;
}

/* The memory those columns' factors occupy, as at most 3 nc contiguous ranges (start, bytes):
 * their rows of A (or their groups of the int8 A), and for each its blocks of B in [b0, b1) that
 * its span reaches. */
static int lora_ranges(const gl_lora_site *l, int64_t n_in, int64_t n_out, const int64_t *cols,
                       int nc, int64_t b0, int64_t b1, const char **at, int64_t *len) {
    const int64_t es = l->bf ? 2 : 4, nb = (n_out + 31) / 32, row = n_in * es;
    int nr = 0;
    if (l->aq) { /* the groups of 8 rows of the int8 A holding them, codes and scales */
        const int64_t kb = n_in / 32, ss = l->ah ? 2 : 4;
        for (int i = 0; i < nc; i++) {
            const int64_t g = cols[i] / 8;
            if (i > 0 && cols[i - 1] / 8 == g) continue;
            at[nr] = (const char *)l->aq + g * kb * 256, len[nr++] = kb * 256;
            at[nr] = (const char *)l->as + g * kb * 8 * ss, len[nr++] = kb * 8 * ss;
        }
    }
    for (int i = 0; i < nc && !l->aq; i++) { /* rows of A, merged where the columns are consecutive */
        if (nr > 0 && at[nr - 1] + len[nr - 1] == (const char *)l->a + cols[i] * row) {
            len[nr - 1] += row;
        } else {
            at[nr] = (const char *)l->a + cols[i] * row;
            len[nr++] = row;
        }
    }
    for (int i = 0; i < nc; i++) {
        const int64_t c = cols[i], lo = l->span[2 * c] / 32, hi = (l->span[2 * c + 1] + 31) / 32;
        const int64_t j0 = b0 > lo ? b0 : lo, j1 = b1 < hi ? b1 : hi;
        if (j0 < j1) {
            at[nr] = (const char *)l->bb + (c * nb + j0) * 32 * es;
            len[nr++] = (j1 - j0) * 32 * es;
        }
    }
    return nr;
}

/* Walks ranges of memory one cache line at a time, asking for `upto` lines in all. */
typedef struct {
    const char *const *at;
    const int64_t *len;
    int nr, r;
    int64_t off, done;
} line_walk;

static inline void prefetch_upto(line_walk *w, int64_t upto) {
    for (; w->done < upto && w->r < w->nr; w->done++) {
        _mm_prefetch(w->at[w->r] + w->off, _MM_HINT_T0);
        w->off += 64;
        if (w->off >= w->len[w->r]) w->r++, w->off = 0;
    }
}

/* y (M, n) = x (M, k) @ W.T, plus the delta of l's adapters (T tokens a scale row:
 * l->scales (M / T, R)) unless l is NULL or l->a is: one parallel region.
 *  1. Each thread computes its static share of the base outputs (tasks of 32 outputs, one block
 *     of B each). At one token a row it asks for the adapter lines it will read, spread over
 *     those tasks: the factors are small scattered reads that miss every cache after a layer of
 *     base weights has streamed through (in one burst, the prefetches were dropped; ahead of
 *     the base product, evicted by it).
 *  2. One row: after its tasks, each thread computes the dots of the columns its own blocks
 *     need (some twice, across the two threads, but no barrier) and adds B's delta to its
 *     outputs, still in cache. More rows: first the threads split all the rows' dots and meet at
 *     a barrier; then each adds B's delta to every task's outputs right after computing them
 *     (at 512 rows a task's outputs are 64 KB: added later, they came back from memory).
 * Apart, the base product and the delta took three more barriers and one more fork. */
static void proj_run(const gl_weight *w, const float *x, int64_t M, int64_t T, const gl_lora_site *l,
                     float *y, int nth) {
    _Static_assert(GT * 8 == 32, "a product task covers one 32-output block of B");
    const int64_t n = w->n, k = w->k, tasks = ((n + 7) / 8 + GT - 1) / GT;
    const int has = l != NULL && l->a != NULL;
    const int64_t R = has ? l->r : 0;
    /* one row: per-thread columns, no barrier (R bounds the stack arrays below) */
    const int one = has && M == 1 && R <= 1024;
    const int many = has && !one;
    const int64_t S = M / T; /* scale rows: T tokens each */
    if (one) { /* the spans and scales lora_needed reads first: cold after the last product */
        for (int64_t off = 0; off < R * 16; off += 64) _mm_prefetch((const char *)l->span + off, _MM_HINT_T0);
        for (int64_t off = 0; off < R * 4; off += 64) _mm_prefetch((const char *)l->scales + off, _MM_HINT_T0);
    }
    const int base = w->q != NULL; /* no weight: the delta alone, added to y (gl_lora) */
    const xbuf xb = base || (has && l->aq) ? xbuf_make(x, M, k, nth) : (xbuf){0};
    float *av = many ? malloc(sizeof(float) * (size_t)(M * R)) : NULL;
    int64_t *cols = many ? malloc(sizeof(int64_t) * (size_t)(S * R)) : NULL;
    int64_t *cnt = many ? malloc(sizeof(int64_t) * (size_t)S) : NULL;
    char *two = many ? malloc((size_t)M) : NULL; /* two[i]: rows i and i + 1 pair up (lora_b_two) */
    if (many) {
        lora_columns(l->scales, S, R, cols, cnt);
        for (int64_t i = 0; i < M; i++) two[i] = i + 1 < M && lora_same_cols(cols, cnt, R, T, i);
    }
#pragma omp parallel num_threads(nth)
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t t0, t1;
        static_chunk(tasks, me, nt, &t0, &t1);
        int64_t mine[one ? R : 1], len[one ? 3 * R : 1];
        float xa[one ? R : 1];
        const char *at[one ? 3 * R : 1];
        const int nc = one ? lora_needed(l, t0, t1, mine) : 0;
        line_walk walk = {at, len, one ? lora_ranges(l, k, n, mine, nc, t0, t1, at, len) : 0, 0, 0, 0};
        int64_t lines = 0;
        for (int i = 0; i < walk.nr; i++) lines += (len[i] + 63) / 64;
        if (many) lora_xa_rows(l, &xb, x, M, T, k, av); /* the threads split the rows' dots */
        for (int64_t t = t0; t < t1; t++) {
            prefetch_upto(&walk, lines * (t - t0 + 1) / (t1 - t0));
            if (base) mm_task(w, &xb, M, t, y);
            for (int64_t i = 0; many && i < M; i++) { /* the task's outputs, while still in cache */
                const int64_t *ci = cols + (i / T) * R;
                if (two[i] && t * 32 + 32 <= n) { /* rows on the same adapters: a pair */
                    lora_b_two(y + i * n, y + (i + 1) * n, av + i * R, av + (i + 1) * R, ci, cnt[i / T], l->bb, (int)l->bf, l->span, t, n);
                    i++;
                } else {
                    lora_b_block(y + i * n, av + i * R, ci, cnt[i / T], l->bb, (int)l->bf, l->span, t, n);
                }
            }
        }
        if (one) {
            if (l->aq) { /* each group of 8 columns holding one of them, then the scales */
                for (int i = 0; i < nc; i++)
                    if (i == 0 || mine[i - 1] / 8 != mine[i] / 8) lora_dots_s8(l, &xb, k, 0, 1, mine[i] / 8, xa);
                for (int i = 0; i < nc; i++) xa[mine[i]] *= l->scales[mine[i]];
            } else {
                for (int i = 0; i < nc; i++) xa[mine[i]] = lora_dot(x, k, l->a, (int)l->bf, l->scales[mine[i]], mine[i]);
            }
            for (int64_t t = t0; t < t1; t++)
                lora_b_block(y, xa, mine, nc, l->bb, (int)l->bf, l->span, t, n);
        }
    }
    xbuf_free(xb);
    free(av);
    free(cols);
    free(cnt);
    free(two);
}

/* y (M, n) = x (M, k) @ W.T for a u4 weight (qs, d, m) of n rows. */
void gl_mm_u4(const float *x, int64_t M, int64_t k, const uint8_t *qs, const void *d,
              const void *m, int h, int64_t n, float *y, int nth) {
    const gl_weight w = {0, h, 32, 0, n, k, qs, d, m};
    proj_run(&w, x, M, 1, NULL, y, nth);
}

/* y (M, n) = x (M, k) @ W.T for an s8 weight (q, s) of n rows, s per sblk (16 or 32) values;
 * small: the codes are Q5_0's. */
void gl_mm_s8(const float *x, int64_t M, int64_t k, const int8_t *q, const void *s, int h,
              int sblk, int small, int64_t n, float *y, int nth) {
    const gl_weight w = {1, h, sblk, small, n, k, q, s, NULL};
    proj_run(&w, x, M, 1, NULL, y, nth);
}

/* y (M, n) = x (M, k) @ W.T plus the LoRA delta of l (scales (M / T, R): T tokens a scale row),
 * in one pass: the PyTorch blocks' projections (prompts, batched rows) as the decode layer
 * runs its own. */
void gl_proj(const gl_weight *w, const gl_lora_site *l, const float *x, int64_t M, int64_t T,
             float *y, int nth) {
    proj_run(w, x, M, T, l, y, nth);
}

/* y (M, n_out) += the LoRA delta alone (see the LoRA delta's section), for a product that ran
 * elsewhere: proj_run with no base weight. A . x takes the integer dots when aq is given. */
void gl_lora(const float *x, int64_t M, int64_t T, int64_t n_in, const void *A, int bf,
             const void *aq, const void *as, int ah, const float *s, int64_t R, const void *Bb,
             const int64_t *span, int64_t n_out, float *y, int nth) {
    const gl_lora_site l = {A, Bb, s, span, R, bf, aq, as, ah};
    const gl_weight none = {-1, 0, 32, 0, n_out, n_in, NULL, NULL, NULL};
    proj_run(&none, x, M, T, &l, y, nth);
}

/* ---------------------------------------------------------------- one llama decoder layer */

typedef struct {
    gl_weight qkv[3], o, gate_up, down; /* qkv: one stacked weight (n_qkv 1) or Q, K, V (3) */
    gl_lora_site l_qkv[3], l_o, l_gate_up, l_down;
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffw_norm; /* NULL: none */
    float *kc, *vc;
    const float *cos_t, *sin_t;
    int64_t n_qkv, n_embd, n_head, n_head_kv, head_dim, n_ff, n_ctx, rot, neox, window;
    int64_t act; /* 0: SiLU, 1: GELU (tanh approximation) */
    float eps, scale;
} gl_layer;

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

/* x (B, n_embd), the residual stream of B rows each decoding one token, updated in place:
 *   x += [post-norm] O(attention(RoPE([QK-norm] QKV(norm(x)))))
 *   x += [post-norm] down(act(gate) * up)(norm(x))
 * with every projection's LoRA delta, exactly as the PyTorch blocks compose the same kernels. */
void gl_layer_decode(const gl_layer *L, float *x, int64_t B, const int64_t *slots,
                     const int64_t *pos, int nth) {
    const int64_t d = L->n_embd, D = L->head_dim, H = L->n_head, Hkv = L->n_head_kv;
    const int64_t nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv, ff = L->n_ff;
    float *h = malloc(sizeof(float) * (size_t)(B * (ff > d ? ff : d)));
    float *big = malloc(sizeof(float) * (size_t)(B * (2 * ff > nqkv ? 2 * ff : nqkv)));
    float *att = malloc(sizeof(float) * (size_t)(B * (nq > d ? nq : d)));
    float *o = malloc(sizeof(float) * (size_t)(B * d));
    float *qb, *kb, *vb;
    int64_t qs, ks, vs;
    gl_rms_norm(x, B, d, L->attn_norm, L->eps, h, nth);
    if (L->n_qkv == 1) {
        proj_run(&L->qkv[0], h, B, 1, &L->l_qkv[0], big, nth);
        qb = big, kb = big + nq, vb = big + nq + nkv, qs = ks = vs = nqkv;
    } else {
        qb = big, kb = big + B * nq, vb = kb + B * nkv, qs = nq, ks = vs = nkv;
        float *outs[3] = {qb, kb, vb};
        for (int p = 0; p < 3; p++) proj_run(&L->qkv[p], h, B, 1, &L->l_qkv[p], outs[p], nth);
    }
    for (int64_t b = 0; b < B; b++) {
        if (L->q_norm) gl_rms_norm(qb + b * qs, H, D, L->q_norm, L->eps, qb + b * qs, nth);
        if (L->k_norm) gl_rms_norm(kb + b * ks, Hkv, D, L->k_norm, L->eps, kb + b * ks, nth);
    }
    gl_attn_decode(qb, qs, kb, ks, vb, vs, L->kc, L->vc, slots, pos, B, H, Hkv, D, D, L->n_ctx,
                   L->cos_t, L->sin_t, L->rot, (int)L->neox, L->scale, L->window, 0.0f, att, nth);
    proj_run(&L->o, att, B, 1, &L->l_o, o, nth);
    if (L->post_attn_norm) gl_rms_norm(o, B, d, L->post_attn_norm, L->eps, o, nth);
    for (int64_t i = 0; i < B * d; i++) x[i] += o[i];
    gl_rms_norm(x, B, d, L->ffn_norm, L->eps, h, nth);
    proj_run(&L->gate_up, h, B, 1, &L->l_gate_up, big, nth);
    gl_gated(big, B, ff, L->act, h, nth);
    proj_run(&L->down, h, B, 1, &L->l_down, o, nth);
    if (L->post_ffw_norm) gl_rms_norm(o, B, d, L->post_ffw_norm, L->eps, o, nth);
    for (int64_t i = 0; i < B * d; i++) x[i] += o[i];
    free(h);
    free(big);
    free(att);
    free(o);
}

/* n layers one after another: a model's whole decode step between the embedding and the final
 * norm in one call. */
void gl_layers_decode(const gl_layer *const *layers, int64_t n, float *x, int64_t B,
                      const int64_t *slots, const int64_t *pos, int nth) {
    for (int64_t i = 0; i < n; i++) gl_layer_decode(layers[i], x, B, slots, pos, nth);
}
