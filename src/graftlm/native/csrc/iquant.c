/* The grid quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (kind 5), read in place: the file's
 * own super-blocks of 256 values, rows one after another, no repacking (2.06 to 3.44 bits a
 * weight, as in the file).
 *
 * Every 8 (IQ2) or 4 (IQ3) values are one entry of the type's grid of small positive magnitudes
 * (iq_grids.h, generated from gguf-py's tables) with a sign bit each, and a scale per 32 values
 * (IQ2_XS, IQ2_S: per 16) from the super-block's float16 d and a 4-bit ls:
 *   IQ2_*:   w = (d * (0.5 + ls) * 0.25) * grid * sign     IQ3_XXS: the same with 0.5
 *   IQ3_S:   w = (d * (1 + 2 ls)) * grid * sign
 * gguf.quants.dequantize's float32 operations in its order: gl_deq_iq is bit-exact with it.
 *
 * The products quantize x to int8 per 32 values (quantize_x, as for the other kinds) and take,
 * for each 32 values of a row, the integer dot of the grid's magnitudes (unsigned bytes) with x's
 * codes whose signs the weight's sign bits flip (vpsignb), as llama.cpp's CPU kernels do: VNNI's
 * u8 x s8 dots where the CPU has them, else maddubs + madd (pairs at most 2 * 62 * 127, no
 * saturation): the same int32 sums either way, so every variant gives the same bits. Each sum is
 * scaled in float by (the weight's scale * x's scale) of its 32 values (16: the half of the lanes
 * that sum them) and accumulated in 8 lanes per row of x, summed across at the end of the row.
 * A task's outputs are decoded once per tile of up to MT rows of x.
 */
#include "graftlm.h"
#include "iq_grids.h"

/* gl_weight.small: the type; IQ_BYTES its super-block's bytes */
enum { IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S };
#define IQ_BYTES(v) ((v) == IQ2_XXS ? 66 : (v) == IQ2_XS ? 74 : (v) == IQ2_S ? 82 : (v) == IQ3_XXS ? 98 : 110)
#define IQ_PER16(v) ((v) == IQ2_XS || (v) == IQ2_S) /* a scale per 16 values */

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

static inline uint32_t ksigns4(uint32_t aux) { /* four 7-bit sign indices -> 32 sign bits */
    return (uint32_t)KSIGNS[aux & 127] | (uint32_t)KSIGNS[(aux >> 7) & 127] << 8 |
           (uint32_t)KSIGNS[(aux >> 14) & 127] << 16 | (uint32_t)KSIGNS[(aux >> 21) & 127] << 24;
}

/* Values [32 ib, 32 ib + 32) of the super-block p (d its float16 d as float): their grid
 * magnitudes (byte i: value i), *sg their sign bits (bit i set: value i negative), *s0 and *s1
 * the scales of their first and last 16 values (equal but for IQ2_XS and IQ2_S). */
static inline __attribute__((always_inline)) __m256i iq_sub(const uint8_t *p, const int v, int ib,
                                                            float d, uint32_t *sg, float *s0, float *s1) {
    if (v == IQ2_XXS) {
        const uint8_t *q = p + 2 + 8 * ib;
        const uint32_t aux = rd32(q + 4);
        *sg = ksigns4(aux);
        *s0 = *s1 = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        return _mm256_setr_epi64x((long long)IQ2XXS_GRID[q[0]], (long long)IQ2XXS_GRID[q[1]],
                                  (long long)IQ2XXS_GRID[q[2]], (long long)IQ2XXS_GRID[q[3]]);
    }
    if (v == IQ2_XS) {
        uint16_t q[4];
        memcpy(q, p + 2 + 8 * ib, 8);
        const uint8_t ls = p[66 + ib];
        *sg = (uint32_t)KSIGNS[q[0] >> 9] | (uint32_t)KSIGNS[q[1] >> 9] << 8 |
              (uint32_t)KSIGNS[q[2] >> 9] << 16 | (uint32_t)KSIGNS[q[3] >> 9] << 24;
        *s0 = d * (0.5f + (float)(ls & 15)) * 0.25f;
        *s1 = d * (0.5f + (float)(ls >> 4)) * 0.25f;
        return _mm256_setr_epi64x((long long)IQ2XS_GRID[q[0] & 511], (long long)IQ2XS_GRID[q[1] & 511],
                                  (long long)IQ2XS_GRID[q[2] & 511], (long long)IQ2XS_GRID[q[3] & 511]);
    }
    if (v == IQ2_S) {
        const uint8_t *q = p + 2 + 4 * ib, h = p[66 + ib], ls = p[74 + ib];
        *sg = rd32(p + 34 + 4 * ib);
        *s0 = d * (0.5f + (float)(ls & 15)) * 0.25f;
        *s1 = d * (0.5f + (float)(ls >> 4)) * 0.25f;
        return _mm256_setr_epi64x((long long)IQ2S_GRID[q[0] | (h & 3) << 8],
                                  (long long)IQ2S_GRID[q[1] | (h >> 2 & 3) << 8],
                                  (long long)IQ2S_GRID[q[2] | (h >> 4 & 3) << 8],
                                  (long long)IQ2S_GRID[q[3] | (h >> 6 & 3) << 8]);
    }
    if (v == IQ3_XXS) {
        const uint8_t *q = p + 2 + 8 * ib;
        const uint32_t aux = rd32(p + 66 + 4 * ib);
        *sg = ksigns4(aux);
        *s0 = *s1 = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        return _mm256_setr_epi32((int)IQ3XXS_GRID[q[0]], (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[2]],
                                 (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[5]],
                                 (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[7]]);
    }
    /* IQ3_S */
    const uint8_t *q = p + 2 + 8 * ib;
    const unsigned h = p[66 + ib];
    *sg = rd32(p + 74 + 4 * ib);
    const unsigned ls = (p[106 + ib / 2] >> (4 * (ib & 1))) & 15;
    *s0 = *s1 = d * (float)(1 + 2 * ls);
    return _mm256_setr_epi32((int)IQ3S_GRID[q[0] | (h << 8 & 256)], (int)IQ3S_GRID[q[1] | (h << 7 & 256)],
                             (int)IQ3S_GRID[q[2] | (h << 6 & 256)], (int)IQ3S_GRID[q[3] | (h << 5 & 256)],
                             (int)IQ3S_GRID[q[4] | (h << 4 & 256)], (int)IQ3S_GRID[q[5] | (h << 3 & 256)],
                             (int)IQ3S_GRID[q[6] | (h << 2 & 256)], (int)IQ3S_GRID[q[7] | (h << 1 & 256)]);
}

/* 32 sign bits -> a byte per value: -1 where its bit is set, else 1 (vpsignb's second operand). */
static inline __m256i iq_signs(uint32_t sg) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                          2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201ll);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)sg), pick), bits);
    return _mm256_or_si256(_mm256_cmpeq_epi8(b, bits), _mm256_set1_epi8(1));
}

/* The 8 int32 sums (lane i: bytes 4i .. 4i + 3) of g (unsigned) times xs (signed). */
static inline __attribute__((always_inline)) __m256i iq_dot(__m256i g, __m256i xs) {
#if GL_VNNI
    return DPBUSD(_mm256_setzero_si256(), g, xs);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, xs), _mm256_set1_epi16(1));
#endif
}

/* y[r * ldy] = the dot of one weight row wr (nsb super-blocks of type v) with R rows of x
 * (xq, xd: rows k and k / 32 apart). */
static inline __attribute__((always_inline)) void iq_row(const uint8_t *wr, const int v, int64_t nsb,
                                                         const int8_t *xq, const float *xd, int64_t k,
                                                         const int R, float *y, int64_t ldy) {
    const int64_t bytes = IQ_BYTES(v), kb = k / 32;
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = wr + sb * bytes;
        prefetch_block(p, bytes);
        const float d = _cvtsh_ss(rd16(p));
        for (int ib = 0; ib < 8; ib++) {
            uint32_t sg;
            float s0, s1;
            const __m256i g = iq_sub(p, v, ib, d, &sg, &s0, &s1);
            const __m256i sv = iq_signs(sg);
            const __m256 sc = IQ_PER16(v) ? _mm256_insertf128_ps(_mm256_set1_ps(s0), _mm_set1_ps(s1), 1)
                                          : _mm256_set1_ps(s0);
            const int64_t b = sb * 8 + ib;
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * 32));
                const __m256i dot = iq_dot(g, _mm256_sign_epi8(x, sv));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(xd[r * kb + b])),
                                         acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = hsum8(acc[r]);
}

/* mm_task for a grid-quant weight (kind 5, small = the type): the outputs [8 GT t, 8 GT (t + 1))
 * of rows [ra, rb) of x. */
static void iq_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    (void)M;
    const int v = (int)w->small;
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, rowbytes = nsb * IQ_BYTES(v);
    const int64_t o0 = t * GT * 8, o1 = o0 + GT * 8 < n ? o0 + GT * 8 : n;
    for (int64_t r0 = ra; r0 < rb; r0 += MT) {
        const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
        const int8_t *xt = xb->xq + r0 * k;
        const float *dt = xb->xd + r0 * kb;
        for (int64_t o = o0; o < o1; o++) {
            const uint8_t *wr = (const uint8_t *)w->q + o * rowbytes;
            float *yo = y + r0 * n + o;
#define IQ_ROW(VV, RR) iq_row(wr, VV, nsb, xt, dt, k, RR, yo, n)
#define IQ_ROWS(VV)                                                                                \
    switch (R) {                                                                                   \
    case 6: IQ_ROW(VV, 6); break;                                                                  \
    case 5: IQ_ROW(VV, 5); break;                                                                  \
    case 4: IQ_ROW(VV, 4); break;                                                                  \
    case 3: IQ_ROW(VV, 3); break;                                                                  \
    case 2: IQ_ROW(VV, 2); break;                                                                  \
    default: IQ_ROW(VV, 1); break;                                                                 \
    }
            switch (v) {
            case IQ2_XXS: IQ_ROWS(IQ2_XXS) break;
            case IQ2_XS: IQ_ROWS(IQ2_XS) break;
            case IQ2_S: IQ_ROWS(IQ2_S) break;
            case IQ3_XXS: IQ_ROWS(IQ3_XXS) break;
            default: IQ_ROWS(IQ3_S) break;
            }
#undef IQ_ROWS
#undef IQ_ROW
        }
    }
}

/* One row of k values of type v, dequantized: gguf's (scale * grid) * sign, in float32. */
static void iq_deq_row(const uint8_t *wr, int v, int64_t k, float *out) {
    const int64_t bytes = IQ_BYTES(v);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *p = wr + sb * bytes;
        const float d = _cvtsh_ss(rd16(p));
        for (int ib = 0; ib < 8; ib++) {
            uint32_t sg;
            float s0, s1;
            const __m256i g = iq_sub(p, v, ib, d, &sg, &s0, &s1);
            uint8_t mag[32];
            _mm256_storeu_si256((__m256i *)mag, g);
            float *o = out + sb * 256 + ib * 32;
            for (int j = 0; j < 4; j++) { /* 8 values: their sign bits -> -1.0 / 1.0 */
                const __m256i bit = _mm256_and_si256(_mm256_set1_epi32((int)(sg >> (8 * j))),
                                                     _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128));
                const __m256 neg = _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cmpeq_epi32(bit, _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)), 31));
                const __m256 gv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mag + 8 * j))));
                const __m256 wv = _mm256_mul_ps(_mm256_set1_ps(j < 2 ? s0 : s1), gv);
                _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(wv, _mm256_or_ps(one, neg)));
            }
        }
    }
}

/* out (nrows, k) = rows ids[i] (ids NULL: row0 + i) of the type-v weight q, dequantized. */
void gl_deq_iq(const uint8_t *q, int v, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
               float *out, int nth) {
    const int64_t rowbytes = k / 256 * IQ_BYTES(v);
#pragma omp parallel for num_threads(nth) schedule(static) if (nrows * k >= 65536)
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t r = ids ? ids[i] : row0 + i;
        iq_deq_row(q + r * rowbytes, v, k, out + i * k);
    }
}

/* y (M, n) = x (M, k) @ W.T for a grid-quant weight q of type v (the file's rows of n rows). */
void gl_mm_iq(const float *x, int64_t M, int64_t k, const uint8_t *q, int v, int64_t n, float *y,
              int nth) {
    const gl_weight w = {5, 0, 256, v, n, k, q, NULL, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
