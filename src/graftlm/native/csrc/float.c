/* Float weights as the file stores them (kind 4): n rows of k values, float16 (half 0),
 * bfloat16 (1) or float32 (2), read in place (the file's mapped bytes, no repacking).
 *
 * The products take x as float32 (xbuf.xf), not quantized: each weight value is converted to
 * float32 (F16C's vcvtph2ps, bfloat16 by a 16-bit shift) and multiplied into float32 sums, 16
 * values a lane group with AVX-512, 8 without. A decode step reads 2 bytes a weight (4 for
 * float32) once; the conversion and one FMA a weight and row of x cost far less than the read.
 * The sums run in another order than a float32 GEMM's: ~1e-6 relative, where the quantized
 * kinds round x to int8 (~5e-3). The exception: bfloat16 weights from a tile of rows of x on,
 * where the CPU has AVX512-BF16 (fb_task below), round x to bfloat16 for VDPBF16PS's products.
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

#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(GL_NO_ZMM)
/* bfloat16 weights with FB_ROWS rows of x or more: x rounded to bfloat16 and the products summed
 * by VDPBF16PS, 32 products an instruction into 16 float32 sums (FMA's 16), so prompts run at
 * twice the multiply rate. Each product of two bfloat16 values is exact in float32: the result
 * is float32 math on bf16(x) and W, up to the order of the sums (x's rounding, ~2e-3 relative
 * per value, is the one difference from the float32 path). Fewer rows (decode) keep that path.
 * One thread of a Zen 4 core: 85-90 GMAC/s at Llama-1B's shapes and 128 rows (52 by FMA; the
 * instruction's peak, 32 MACs a cycle, is 117). */
#define FB 1
/* rows of x from which a product takes them, a whole tile: with fewer the time is the weights'
 * read, and the FMA path's reading whole rows ahead (not FB_KC values of 4 rows) was faster
 * (one thread, 2048x8192: 0.75x at 1-3 rows, 0.83x at 4; 1.2x at 6, 1.4-1.5x from 16) */
#define FB_ROWS MT
#define FB_OT 4    /* outputs a tile (FB_OT x MT sums in registers, MT rows of x) */
#define FB_KC 1024 /* values of k a pass over a task's outputs: MT rows of them in bfloat16 (12 KiB) */
/* their rows' distance: a line more than FB_KC values, so that they fall in different sets of L1
 * (a multiple of 4 KiB apart, with a tile's 4 rows of weights at k = 2048, they shared a set) */
#define FB_XS (FB_KC + 32)

/* R rows of kc values of x (ldx apart) rounded to bfloat16 (FB_XS apart): round to nearest even,
 * as ggml's GGML_FP32_TO_BF16; VCVTNE2PS2BF16 flushes subnormals to zero, as VDPBF16PS would
 * read them anyway. */
static inline void fb_round(const float *x, int64_t ldx, int R, int64_t kc, uint16_t *xh) {
    for (int r = 0; r < R; r++)
        for (int64_t i = 0; i < kc; i += 32) {
            const float *xr = x + r * ldx + i;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr));
            _mm512_storeu_si512(xh + r * FB_XS + i, (__m512i)v);
        }
}

/* The four sums of a, b, c and d's lanes, in that order. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3), the same of c and d */
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: (a, b, c, d) */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* y[r, o] (add: +=) for R rows of x in bfloat16 at xh (kc values, FB_XS apart) and the outputs
 * [0, no) of the rows of W at w (k apart), no <= FB_OT: the R x FB_OT sums in registers, each
 * weight vector read once for the R rows. pf: FB_OT rows (k apart) of kc weights toward L2, a
 * line of each a trip. */
static inline __attribute__((always_inline)) void fb_tile(const uint16_t *w, int64_t k,
                                                          const uint16_t *xh, int64_t kc, int R,
                                                          int64_t no, float *y, int64_t ldy,
                                                          int add, const char *pf) {
    __m512 acc[FB_OT][MT];
    for (int o = 0; o < FB_OT; o++)
        for (int r = 0; r < MT; r++) acc[o][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kc; i += 32) {
        if (pf)
            for (int o = 0; o < FB_OT; o++) _mm_prefetch(pf + (o * k + i) * 2, _MM_HINT_T1);
        __m512bh wv[FB_OT];
        for (int o = 0; o < FB_OT; o++)
            wv[o] = (__m512bh)(o < no ? _mm512_loadu_si512(w + o * k + i) : _mm512_setzero_si512());
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + r * FB_XS + i);
            for (int o = 0; o < FB_OT; o++) acc[o][r] = _mm512_dpbf16_ps(acc[o][r], wv[o], xv);
        }
    }
    const __mmask8 m = (__mmask8)((1u << no) - 1);
    for (int r = 0; r < R; r++) {
        __m128 s = sum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]);
        if (add) s = _mm_add_ps(s, _mm_maskz_loadu_ps(m, y + r * ldy));
        _mm_mask_storeu_ps(y + r * ldy, m, s);
    }
}

/* Whether the products above serve (unless GRAFTLM_BF16_DOTS=0, read once): x's rounding to
 * bfloat16 is llama.cpp's own for these weights and moves a BF16 model's prompt logits ~6e-3 to
 * 9e-3 from float32's (tests/models/test_quant_types.py), less than the int8 x of the quantized
 * kinds; exact steps (Batch.exact: scoring) dequantize to float32 and never come here. */
static int fb_on(void) {
    static int on = -1;
    int v = __atomic_load_n(&on, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *e = getenv("GRAFTLM_BF16_DOTS");
        v = e == NULL || e[0] != '0';
        __atomic_store_n(&on, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* f_task for a bfloat16 weight, in passes over FB_KC values of k: per MT rows of x, their
 * values of the pass rounded once for all of the task's outputs (x is read as float32 once a
 * task, as by the FMA path). A pass's weights (32 rows of FB_KC values: 64 KiB) stay in L2 while
 * x's rows stream by (at k = 8192 a task's 512 KiB did not: 79 GMAC/s in one pass, 83 in 8). */
static void fb_task(const gl_weight *w, const float *x, int64_t ra, int64_t rb, int64_t t, float *y) {
    const int64_t n = w->n, k = w->k, o0 = t * GT * 8, o1 = o0 + GT * 8 < n ? o0 + GT * 8 : n;
    const uint16_t *wq = (const uint16_t *)w->q;
    uint16_t xh[MT * FB_XS] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < k; k0 += FB_KC) {
        const int64_t kc = k - k0 < FB_KC ? k - k0 : FB_KC;
        for (int64_t r0 = ra; r0 < rb; r0 += MT) {
            const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
            fb_round(x + r0 * k + k0, k, R, kc, xh);
            for (int64_t o = o0; o < o1; o += FB_OT) {
                const int64_t no = o1 - o < FB_OT ? o1 - o : FB_OT;
                /* toward L2 with the pass's first rows: the next tile's weights, those of the
                 * task's next pass after its last tile's, the next task's after its last pass
                 * (a thread's tasks are one run of outputs) */
                const uint16_t *next = o + FB_OT < o1 ? wq + (o + FB_OT) * k + k0
                                       : k0 + kc < k ? wq + o0 * k + k0 + kc
                                                     : wq + o1 * k;
                const char *pf = r0 == ra ? (const char *)next : NULL;
                float *yo = y + r0 * n + o;
#define FBT(RR) fb_tile(wq + o * k + k0, k, xh, kc, RR, no, yo, n, k0 > 0, pf)
                WITH_ROWS(R, FBT)
#undef FBT
            }
        }
    }
}
#else
#define FB 0
#endif

/* mm_task for a float weight (kind 4): the outputs [8 GT t, 8 GT (t + 1)) of rows [ra, rb) of x
 * (xb->xf, rows of k floats). */
static void f_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                   float *y) {
    const int64_t n = w->n, k = w->k, o1 = (t + 1) * GT * 8 < n ? (t + 1) * GT * 8 : n;
    const int h = (int)w->half;
#if FB
    if (h == 1 && M >= FB_ROWS && fb_on()) {
        fb_task(w, xb->xf, ra, rb, t, y);
        return;
    }
#else
    (void)M;
#endif
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
