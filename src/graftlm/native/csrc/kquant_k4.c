/* The products of the k4 / k5 weights (Q4_K, Q5_K; kquant.c's layout), and the helpers the
 * k16 products (kquant_k16.c) share with them. */
#include "graftlm.h"

/* A few rows (a batched decode step) take a task's weights from memory in their first tile and
 * from cache in the rest, the prompt's every 8 or 6 rows: at 16 rows the first tile waited on
 * memory (Llama-1B's attn_output at 16 rows streamed: 0.82x its speed on weights in cache).
 * The last of two or more tiles asks instead for the next task's blocks (nx bytes on: the same
 * groups' of the next task, which the thread takes next) toward L2, one line a line of its
 * own, so the next task's first tile finds them there. */
static inline int64_t next_task_at(int64_t ra, int64_t rb, int64_t r0, int64_t tile, int64_t task_bytes) {
    return rb - ra > tile && rb - ra <= RC && r0 + tile >= rb ? task_bytes : 0;
}

#if GL_VNNI512
static inline __attribute__((always_inline)) void pair_prefetch(const uint8_t *wa, const uint8_t *wb,
                                                                int64_t bs, int64_t nx) {
    if (nx) {
        prefetch_l2(wa + nx, bs);
        prefetch_l2(wb + nx, bs);
    } else {
        prefetch_block(wa, bs);
        prefetch_block(wb, bs);
    }
}
#endif

#if GL_VNNI512
/* Rows of x a tile of the k4 / k5 pair kernels: their accumulators and sums take 2 KT of the 32
 * vector registers. A decode step's 16 rows are two tiles of 8 (with MT: 6, 6 and 4, the
 * codes unpacked a third time for 4 rows). Q6_K's pairs take them too from 9 rows (3 KT
 * registers: a few spill, but its codes and high bits unpacked twice a block at 16 rows, not
 * three times: the 128,256-wide output head at 16 rows, 1.03-1.045x; 8 rows stay one tile of 6
 * and one of 2, whose last asks for the next task's weights). */
#define KT 8
#define WITH_ROWS_KT(R, F)                                                                         \
    switch (R) {                                                                                   \
    case 8: F(8); break;                                                                           \
    case 7: F(7); break;                                                                           \
    default: WITH_ROWS(R, F)                                                                       \
    }
#endif

/* 8 bytes -> 8 floats */
static inline __m256 u8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* y[r, 8g .. 8g+7] for R rows of x, one group g of a k4 / k5 weight: the u4 layout's codes
 * (quant.c's nibble_dots, nibble_sums) with a scale and min per 32 values. */
static inline __attribute__((always_inline)) void k4_group(
    const uint8_t *qg, const uint16_t *dg, int h5, int64_t kb, const int8_t *xq, const float *xd,
    const float *xs, int R, float *y, int64_t ldy, int64_t nvalid) {
    const int64_t bs = K4_BYTES(h5);
    __m256 acc[MT], dsv = _mm256_setzero_ps(), msv = dsv;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *w = qg + b * bs, *sm = w + 128 + 32 * h5;
        prefetch_block(w, bs);
        if ((b & 7) == 0) {
            dsv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + (b >> 3) * 16)));
            msv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + (b >> 3) * 16 + 8)));
        }
        const __m256 dv = _mm256_mul_ps(dsv, u8x8_ps(sm)), mv = _mm256_mul_ps(msv, u8x8_ps(sm + 8));
#if GL_VNNI
        __m256i s32[MT];
        nibble_dots(w, h5, xq + b * 32, kb * 32, R, s32);
#else
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) nibble_chunk(w, h5, c, &lo[c], &hi[c]);
#endif
        for (int r = 0; r < R; r++) {
#if GL_VNNI
            const __m256i s32r = s32[r];
#else
            const __m256i s32r = nibble_sums(lo, hi, h5, xq + (r * kb + b) * 32);
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32r), _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm256_fnmadd_ps(mv, _mm256_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* k4_group for two whole groups at once (qa, da, ya: group g; qb, db, yb: g + 1), in 512-bit
 * vectors: the same sums and float steps per output as k4_group, so the same bits. nx: 0, or
 * how far on the next task's blocks lie (pair_prefetch). */
static inline __attribute__((always_inline)) void k4_pair(
    const uint8_t *qa, const uint8_t *qb, const uint16_t *da, const uint16_t *db, int h5,
    int64_t kb, const int8_t *xq, const float *xd, const float *xs, int R, float *ya, float *yb,
    int64_t ldy, int64_t nx) {
    const int64_t bs = K4_BYTES(h5);
    __m512 acc[KT], dsv = _mm512_setzero_ps(), msv = dsv;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *wa = qa + b * bs, *wb = qb + b * bs;
        const uint8_t *sa = wa + 128 + 32 * h5, *sb = wb + 128 + 32 * h5;
        pair_prefetch(wa, wb, bs, nx);
        if ((b & 7) == 0) {
            const int64_t o = (b >> 3) * 16;
            dsv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + o))),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + o))));
            msv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + o + 8))),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + o + 8))));
        }
        const __m512 dv = _mm512_mul_ps(dsv, cat_ps(u8x8_ps(sa), u8x8_ps(sb)));
        const __m512 mv = _mm512_mul_ps(msv, cat_ps(u8x8_ps(sa + 8), u8x8_ps(sb + 8)));
        __m512i s32[KT];
        nibble_dots2(wa, wb, h5, xq, kb, b, R, s32);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]), _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_pair(acc, R, ya, yb, ldy);
}

/* k4_pair for a whole tile asking for the next task's blocks (next_task_at), out of line: with
 * its copies inlined beside the others, or nx a test in the loop, the prompt's tiles ran
 * 3-5% slower. */
static __attribute__((noinline)) void k4_pair_next(const uint8_t *qa, const uint8_t *qb, const uint16_t *da,
                                                   const uint16_t *db, int h5, int64_t kb, const int8_t *xq,
                                                   const float *xd, const float *xs, float *y, int64_t ldy,
                                                   int64_t nx) {
    if (h5)
        k4_pair(qa, qb, da, db, 1, kb, xq, xd, xs, KT, y, y + 8, ldy, nx);
    else
        k4_pair(qa, qb, da, db, 0, kb, xq, xd, xs, KT, y, y + 8, ldy, nx);
}
#endif

/* k4_group for rows [r0, r1) of x, in tiles of MT rows. */
static void k4_group_rows(const gl_weight *w, const xbuf *xb, int64_t r0, int64_t r1, int64_t g, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, ks = k / 256;
    const int h5 = (int)w->small;
    const uint8_t *qg = (const uint8_t *)w->q + g * kb * K4_BYTES(h5);
    const uint16_t *dg = (const uint16_t *)w->d + g * ks * 16;
    const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
    for (int64_t i = r0; i < r1; i += MT) {
        const int R = r1 - i < MT ? (int)(r1 - i) : MT;
        const int8_t *xt = xb->xq + i * k;
        const float *dt = xb->xd + i * kb, *st = xb->xs + i * kb;
        float *yo = y + i * n + g * 8;
#define K4(RR) k4_group(qg, dg, 0, kb, xt, dt, st, RR, yo, n, nv)
#define K5(RR) k4_group(qg, dg, 1, kb, xt, dt, st, RR, yo, n, nv)
        if (h5) {
            WITH_ROWS(R, K5)
        } else {
            WITH_ROWS(R, K4)
        }
#undef K4
#undef K5
    }
}

/* mm_task for a k4 / k5 weight (kind 2; small: Q5_K's fifth bits): tiles of rows (with the pair
 * kernels, of KT), each over the task's groups, two whole ones at a time in the pair kernels. */
static void k4_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    const int64_t n = w->n, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
#if GL_VNNI512
    const int64_t k = w->k, kb = k / 32, ks = k / 256;
    const int h5 = (int)w->small;
    const int64_t bs = K4_BYTES(h5);
    for (int64_t r0 = ra; r0 < rb; r0 += KT) {
        const int R = rb - r0 < KT ? (int)(rb - r0) : KT;
        const int8_t *xt = xb->xq + r0 * k;
        const float *dt = xb->xd + r0 * kb, *st = xb->xs + r0 * kb;
        const int64_t nx = next_task_at(ra, rb, r0, KT, GT * kb * bs);
        for (int64_t g = t * GT; g < g1; g++) {
            if (!pair_at(M, g, g1, n)) {
                k4_group_rows(w, xb, r0, r0 + R, g, y);
                continue;
            }
            const uint8_t *qg = (const uint8_t *)w->q + g * kb * bs, *qh = qg + kb * bs;
            const uint16_t *dg = (const uint16_t *)w->d + g * ks * 16, *dh = dg + ks * 16;
            float *yo = y + r0 * n + g * 8;
#define K4P(RR) k4_pair(qg, qh, dg, dh, 0, kb, xt, dt, st, RR, yo, yo + 8, n, 0)
#define K5P(RR) k4_pair(qg, qh, dg, dh, 1, kb, xt, dt, st, RR, yo, yo + 8, n, 0)
            if (nx && R == KT) {
                k4_pair_next(qg, qh, dg, dh, h5, kb, xt, dt, st, yo, n, nx);
            } else if (h5) {
                WITH_ROWS_KT(R, K5P)
            } else {
                WITH_ROWS_KT(R, K4P)
            }
#undef K4P
#undef K5P
            g++;
        }
    }
#else
    (void)M;
    for (int64_t r0 = ra; r0 < rb; r0 += MT) {
        const int64_t r1 = rb - r0 < MT ? rb : r0 + MT;
        for (int64_t g = t * GT; g < g1; g++) k4_group_rows(w, xb, r0, r1, g, y);
    }
#endif
}

/* y (M, n) = x (M, k) @ W.T for a k4 (h5 0: Q4_K) or k5 (h5 1: Q5_K) weight of n rows. */
void gl_mm_k4(const float *x, int64_t M, int64_t k, const uint8_t *q, const uint16_t *d, int h5,
              int64_t n, float *y, int nth) {
    const gl_weight w = {2, 1, 32, h5, n, k, q, d, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
