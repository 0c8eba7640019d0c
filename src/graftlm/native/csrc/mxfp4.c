/* MXFP4 (gpt-oss's expert weights): per 32 values an E8M0 exponent e and 32 4-bit codes of e2m1
 * values. As ggml (and gguf.quants) compute it, with the e2m1 values doubled so that they are
 * integers (kvalues_mxfp4) and the scale halved to match:
 *   w = MX4_VALUES[code] * e8m0_half(e),  e8m0_half(e) = 2^(e - 128) (e >= 2; 2^-128, 2^-127 for
 *   e 0 and 1, float32 subnormals: ggml_e8m0_to_fp32_half's bits)
 * exactly a power of two times a small integer, so dequantization is one exact product, bit-exact
 * with gguf's.
 *
 * mx4 keeps the file's 4.25 bits a weight, regrouped by 8 rows (g = row / 8, i = row % 8, b =
 * block of 32 values; n padded to a multiple of 8 with zero rows):
 *   q[(g kb + b) MX4_BYTES + ...]: [0, 128) the codes as u4 lays them (quant.c's put_nibbles:
 *   byte 32 c + 4 i + j holds value 4 c + j of row i in its low nibble, 16 + 4 c + j in its high),
 *   then the 8 rows' exponents e, a byte each.
 *
 * Products: x quantized to int8 per 32 values (quantize_x, as every integer kernel takes it); each
 * code looked up (vpshufb) as the unsigned u = value + 12 in 0..24, so that u . xq is one unsigned
 * by signed dot (VPDPBUSD; maddubs without VNNI) with no sign trick and no x + 128 copy; the 12s
 * come off in float with the block's sum of x:
 *   y[r, n] = sum_b e8m0_half(e[n, b]) * (xd[r, b] * (u . xq)[r, n, b] - 12 xs[r, b])
 * (xs = xd * sum(xq): quantize_x's). The 256-bit groups, the 512-bit pairs and the AVX2 sums make
 * the same integer sums and the same float steps per output, so the same bits.
 */
#include "graftlm.h"

#define MX4_BYTES 136 /* a block of 32 values of 8 rows: 128 bytes of codes, 8 exponents */
#define MX4_BIAS 12   /* added to the doubled e2m1 values: 0..24, unsigned bytes */

/* The doubled e2m1 value of each code (ggml's kvalues_mxfp4), and the same plus MX4_BIAS. */
static const int8_t MX4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const uint8_t MX4_UNSIGNED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (e 0 and 1: the subnormals 2^-128, 2^-127). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The 8 rows' e8m0_half of their exponents at p. With AVX-512 (VL) 1 * 2^(e - 128) by VSCALEFPS,
 * exact down to the subnormals 2^-128 and 2^-127 (as the bits below; with flush-to-zero both are
 * 0 to the products that read them): three operations where the bits took six. */
static inline __attribute__((always_inline)) __m256 mx4_scales8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#if defined(__AVX512F__) && defined(__AVX512VL__)
    return _mm256_scalef_ps(_mm256_set1_ps(1.0f), _mm256_cvtepi32_ps(_mm256_sub_epi32(e, _mm256_set1_epi32(128))));
#else
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e); /* (e < 2 only) */
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
#endif
}

/* ---------------------------------------------------------------- repacking, dequantization */

/* n GGUF rows of k values (rowbytes apart; 17 bytes a block: e, then 16 bytes of codes, value j
 * in the low nibble of byte j and 16 + j in its high) -> q, laid out as above. 0, or -1 when k
 * is not a multiple of 32. */
int gl_pack_mx4(const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, uint8_t *q, int nth) {
    if (k % 32) return -1;
    const int64_t kb = k / 32, groups = (n + 7) / 8;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *w = q + (g * kb + b) * MX4_BYTES;
            memset(w, 0, MX4_BYTES); /* padding rows: codes 0 (value 0), e 0 */
            for (int i = 0; i < 8 && g * 8 + i < n; i++) {
                const uint8_t *blk = raw + (g * 8 + i) * rowbytes + b * 17;
                uint8_t codes[32];
                for (int j = 0; j < 16; j++) {
                    codes[j] = blk[1 + j] & 0xF;
                    codes[16 + j] = blk[1 + j] >> 4;
                }
                put_nibbles(w, i, codes);
                w[128 + i] = blk[0];
            }
        }
    }
    return 0;
}

/* Rows ids[r] (or row0 + r when ids is NULL) -> out (nrows, k): value * e8m0_half(e), gguf's one
 * float32 product. */
void gl_deq_mx4(const uint8_t *q, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
                float *out, int nth) {
    const int64_t kb = k / 32;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *w = q + (g * kb + b) * MX4_BYTES;
            const float d = e8m0_half(w[128 + i]);
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t byte = w[32 * c + 4 * i + j];
                    o[32 * b + 4 * c + j] = (float)MX4_VALUES[byte & 0xF] * d;
                    o[32 * b + 16 + 4 * c + j] = (float)MX4_VALUES[byte >> 4] * d;
                }
        }
    }
}

/* ---------------------------------------------------------------- products */

/* Chunk c of a block w as unsigned values (value + 12): lo (values 4 c ..), hi (16 + 4 c ..).
 * With AVX-512 VBMI each nibble is looked up by VPERMB in the table twice over (32 bytes: it
 * reads 5 bits of an index, so the bit above the nibble picks the same value): no mask, where
 * VPSHUFB needed each byte's upper bits cleared first. */
#if defined(__AVX512VBMI__) && defined(__AVX512VL__)
#define MX4_VPERMB 1
#else
#define MX4_VPERMB 0
#endif
static inline __attribute__((always_inline)) void mx4_chunk(const uint8_t *w, int c, __m256i *lo, __m256i *hi) {
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX4_UNSIGNED));
#if MX4_VPERMB
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
    *lo = _mm256_permutexvar_epi8(raw, tbl);
    *hi = _mm256_permutexvar_epi8(_mm256_srli_epi16(raw, 4), tbl);
#else
    nibble_chunk(w, 0, c, lo, hi);
    *lo = _mm256_shuffle_epi8(tbl, *lo);
    *hi = _mm256_shuffle_epi8(tbl, *hi);
#endif
}

/* y[r, 8g .. 8g+7] for R rows of x, one group g (q: its blocks). The block's 8 value vectors are
 * looked up once for the R rows. Without VNNI each row's 8 maddubs are summed in int16 two chunks
 * at a time (|pair| <= 2 * 24 * 127: four pairs fit), then widened (quant.c's widen_sums). */
static inline __attribute__((always_inline)) void mx4_group(const uint8_t *q, int64_t kb, const int8_t *xq,
                                                            const float *xd, const float *xs, int R,
                                                            float *y, int64_t ldy, int64_t nvalid) {
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *w = q + b * MX4_BYTES;
        prefetch_block(w, MX4_BYTES);
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) mx4_chunk(w, c, &lo[c], &hi[c]);
        const __m256 sv = mx4_scales8(w + 128);
        for (int r = 0; r < R; r++) {
            const int8_t *xb = xq + (r * kb + b) * 32;
#if GL_VNNI
            /* four chains of two dots, summed after: the same int32 sum as one chain of eight
             * (so the same bits), where one decode row's block waited on eight VPDPBUSD
             * latencies (one row, one Zen 4 thread, 2048 x 2880 from cache: 24.1 -> 27.1 GB/s
             * of weights; with VPERMB and VSCALEFPS below 29.8) */
            __m256i s[4];
            for (int c = 0; c < 4; c++)
                s[c] = DPBUSD(DPBUSD(_mm256_setzero_si256(), lo[c], bcast4(xb + 4 * c)), hi[c],
                              bcast4(xb + 16 + 4 * c));
            const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
#else
            const __m256i s32 = nibble_sums(lo, hi, 1, xb);
#endif
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(xd[r * kb + b]),
                                             _mm256_set1_ps(-(float)MX4_BIAS * xs[r * kb + b]));
            acc[r] = _mm256_fmadd_ps(t, sv, acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* mx4_group for two whole groups at once (qa, ya: group g; qb, yb: g + 1), in 512-bit vectors:
 * the same sums and float steps per output, so the same bits. */
static inline __attribute__((always_inline)) void mx4_pair(const uint8_t *qa, const uint8_t *qb, int64_t kb,
                                                           const int8_t *xq, const float *xd,
                                                           const float *xs, int R, float *ya, float *yb,
                                                           int64_t ldy) {
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX4_UNSIGNED));
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *wa = qa + b * MX4_BYTES, *wb = qb + b * MX4_BYTES;
        prefetch_block(wa, MX4_BYTES);
        prefetch_block(wb, MX4_BYTES);
        __m512i s32[MT];
        nibble_dots2_lut(wa, wb, 0, &tbl, xq, kb, b, R, s32);
        const __m512 sv = cat_ps(mx4_scales8(wa + 128), mx4_scales8(wb + 128));
        for (int r = 0; r < R; r++) {
            const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]), _mm512_set1_ps(xd[r * kb + b]),
                                             _mm512_set1_ps(-(float)MX4_BIAS * xs[r * kb + b]));
            acc[r] = _mm512_fmadd_ps(t, sv, acc[r]);
        }
    }
    store_pair(acc, R, ya, yb, ldy);
}
#endif

/* mm_task for an mx4 weight (kind 5): the outputs [8 GT t, 8 GT (t + 1)) of rows [ra, rb) of x. */
static void mx4_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                     float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
    (void)M; /* (the pairs' threshold) */
    for (int64_t r0 = ra; r0 < rb; r0 += MT) {
        const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
        const int8_t *xt = xb->xq + r0 * k;
        const float *dt = xb->xd + r0 * kb, *st = xb->xs + r0 * kb;
        for (int64_t g = t * GT; g < g1; g++) {
            const uint8_t *qg = (const uint8_t *)w->q + g * kb * MX4_BYTES;
            float *yo = y + r0 * n + g * 8;
            const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#if GL_VNNI512
            if (pair_at(M, g, g1, n)) { /* two whole groups: 512 bits */
#define MXP(RR) mx4_pair(qg, qg + kb * MX4_BYTES, kb, xt, dt, st, RR, yo, yo + 8, n)
                WITH_ROWS(R, MXP)
#undef MXP
                g++;
                continue;
            }
#endif
#define MXG(RR) mx4_group(qg, kb, xt, dt, st, RR, yo, n, nv)
            WITH_ROWS(R, MXG)
#undef MXG
        }
    }
}

/* y (M, n) = x (M, k) @ W.T for an mx4 weight q of n rows. */
void gl_mm_mx4(const float *x, int64_t M, int64_t k, const uint8_t *q, int64_t n, float *y, int nth) {
    const gl_weight w = {5, 0, 32, 0, n, k, q, NULL, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
