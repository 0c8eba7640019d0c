/* Float weights as the file stores them (kind 4): n rows of k values, float16 (half 0),
 * bfloat16 (1) or float32 (2), read in place (the file's mapped bytes, no repacking).
 *
 * The products take x as float32 (xbuf.xf), not quantized: each weight value is converted to
 * float32 (F16C's vcvtph2ps, bfloat16 by a 16-bit shift) and multiplied into float32 sums, 16
 * values a lane group with AVX-512, 8 without. A decode step reads 2 bytes a weight (4 for
 * float32) once; the conversion and one FMA a weight and row of x cost far less than the read.
 * The sums run in another order than a float32 GEMM's: ~1e-6 relative, where the quantized
 * kinds round x to int8 (~5e-3).
 */
#include "graftlm.h"

#if defined(__AVX512F__) && !defined(GL_NO_ZMM)
#define FW 16 /* values a vector */
#define FO 4  /* output rows a tile: FO x FR sums in registers */
typedef __m512 fvec;
static inline __attribute__((always_inline)) fvec fw_load(const void *w, int64_t i, int h) {
    if (h == 2) return _mm512_loadu_ps((const float *)w + i);
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (h == 0) return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#define fx_load(p) _mm512_loadu_ps(p)
#define fv_fmadd _mm512_fmadd_ps
#define fv_zero _mm512_setzero_ps
#define fv_sum _mm512_reduce_add_ps
#else
#define FW 8
#define FO 2
typedef __m256 fvec;
static inline __attribute__((always_inline)) fvec fw_load(const void *w, int64_t i, int h) {
    if (h == 2) return _mm256_loadu_ps((const float *)w + i);
    const __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (h == 0) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#define fx_load(p) _mm256_loadu_ps(p)
#define fv_fmadd _mm256_fmadd_ps
#define fv_zero _mm256_setzero_ps
#define fv_sum hsum8
#endif
#define FR 4 /* rows of x a tile */

/* y[r, o] for the R rows of x at x (ldx apart) and the outputs [o0, o0 + no) of W (no <= FO),
 * each over all k values (a multiple of 32, as every native product's: NativeKernel.accepts). */
static inline __attribute__((always_inline)) void f_tile(const char *w, int64_t rowbytes, int64_t k, int h,
                                                         const float *x, int64_t ldx, int R, int64_t no,
                                                         float *y, int64_t ldy, const char *pf) {
    fvec acc[FO][FR];
    for (int o = 0; o < FO; o++)
        for (int r = 0; r < FR; r++) acc[o][r] = fv_zero();
    const int64_t step = FO * FW * (h == 2 ? 4 : 2); /* bytes a trip reads */
    for (int64_t i = 0; i < k; i += FW) {
        if (pf) prefetch_l2(pf + (i / FW) * step, step); /* the next tile, a trip's share: all by the end */
        fvec xv[FR];
        for (int r = 0; r < R; r++) xv[r] = fx_load(x + r * ldx + i);
        for (int o = 0; o < FO; o++) {
            if (o >= no) break;
            const fvec wv = fw_load(w + o * rowbytes, i, h);
            for (int r = 0; r < R; r++) acc[o][r] = fv_fmadd(wv, xv[r], acc[o][r]);
        }
    }
    for (int o = 0; o < no; o++)
        for (int r = 0; r < R; r++) y[r * ldy + o] = fv_sum(acc[o][r]);
}

/* mm_task for a float weight (kind 4): the outputs [8 GT t, 8 GT (t + 1)) of rows [ra, rb) of x
 * (xb->xf, rows of k floats). */
static void f_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                   float *y) {
    (void)M;
    const int64_t n = w->n, k = w->k, o1 = (t + 1) * GT * 8 < n ? (t + 1) * GT * 8 : n;
    const int h = (int)w->half;
    const int64_t rowbytes = k * (h == 2 ? 4 : 2);
    for (int64_t r0 = ra; r0 < rb; r0 += FR) {
        const int R = rb - r0 < FR ? (int)(rb - r0) : FR;
        const float *x = xb->xf + r0 * k;
        for (int64_t o = t * GT * 8; o < o1; o += FO) {
            const char *wo = (const char *)w->q + o * rowbytes;
            const int64_t no = o1 - o < FO ? o1 - o : FO;
            /* the next tile's rows follow this one's (a thread's tasks are one run of rows) */
            const char *pf = r0 == ra ? wo + FO * rowbytes : NULL;
            float *yo = y + r0 * n + o;
#define FT(HH, RR) f_tile(wo, rowbytes, k, HH, x, k, RR, no, yo, n, pf)
#define F_ROWS(HH)                                                                                 \
    switch (R) {                                                                                   \
    case 4: FT(HH, 4); break;                                                                      \
    case 3: FT(HH, 3); break;                                                                      \
    case 2: FT(HH, 2); break;                                                                      \
    default: FT(HH, 1); break;                                                                     \
    }
            if (h == 0) {
                F_ROWS(0)
            } else if (h == 1) {
                F_ROWS(1)
            } else {
                F_ROWS(2)
            }
#undef F_ROWS
#undef FT
        }
    }
}

/* y (M, n) = x (M, k) @ W.T for a float weight w (n rows of k values, half: 0 float16,
 * 1 bfloat16, 2 float32). */
void gl_mm_f(const float *x, int64_t M, int64_t k, const void *w, int h, int64_t n, float *y, int nth) {
    const gl_weight wt = {4, h, 32, 0, n, k, w, NULL, NULL};
    proj_alone(&wt, x, M, 1, NULL, y, nth);
}
