/* The K-quant super-block formats: k4 (Q4_K), k5 (Q5_K) and k6 (Q6_K) at the file's size, and
 * k3 (Q3_K), k2 (Q2_K) with their codes in 4 bits (4.625 and 5.125 bits a weight; the files' 3.44
 * and 2.63).
 *
 * A Q4_K / Q5_K super-block of 256 values has float16 d and dmin, and per 32 values a 6-bit scale
 * sc and min mn: w = q * (d * sc) - dmin * mn, q in 0..15 (Q4_K) or 0..31 (Q5_K). Repacked at
 * load, in groups of 8 rows (g = row / 8, i = row % 8, b = block of 32 values, L = 4 i + j):
 *   q: per (g, b), K4_BYTES(h5) bytes:
 *      [0, 128)    the low 4 bits, as u4 lays them (quant.c, gl_pack_u4): byte 32 c + L holds
 *                  value 4 c + j of row i (low nibble) and value 16 + 4 c + j (high nibble)
 *      [128, 160)  Q5_K only: the fifth bits, a byte a lane: bit 2 c of byte 128 + L is the low
 *                  nibble's of lane L in chunk c, bit 2 c + 1 the high nibble's (fifth_at)
 *      then 16     sc of the 8 rows, mn of the 8 rows (bytes)
 *   d: per (g, super-block), 16 float16: the 8 rows' d, then their dmin (the file's own values)
 * 4.625 bits a weight for Q4_K (the file: 4.5), 5.625 for Q5_K (5.5): what a decode step reads.
 * The scales d * sc and dmin * mn are made per block in the product (one multiply for 8 rows);
 * dequantization computes them as gguf does, so it is bit-exact.
 *
 * Q6_K: w = (d * sc) * (q - 32), q in 0..63, d float16 per 256 values, sc int8 per 16. k6 keeps
 *   q: per (g, b), 208 bytes: the low 4 bits as above; at 128 + 16 c, the fifth and sixth bits of
 *      chunk c's 32 bytes of codes (graftlm.h's q6_high: byte i holds two bits each of low-nibble
 *      lanes i and i + 16, then of high-nibble lanes i and i + 16); then sc of the 8 rows for
 *      values 0..15 of the block (the low nibbles) and for 16..31 (the high nibbles), int8
 *   d: per (g, super-block), the 8 rows' d (float16)
 * 6.5625 bits a weight, the file's own size. Q3_K and Q2_K keep the same layout with no planes
 * (and Q2_K its mins after its scales, its dmin after its d): see the k16 section.
 */
#include "graftlm.h"

#define K4_BYTES(h5) (144 + 32 * (h5))

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

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a super-block's 12 bytes. */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One GGUF row of Q4_K / Q5_K -> codes (k bytes, 0..31), sc and mn per 32 values, and the raw
 * float16 d, dmin per 256 (dd[2 sb], dd[2 sb + 1]). */
static void row_k4(int type, const uint8_t *src, int64_t k, uint8_t *q, uint8_t *sc, uint8_t *mn,
                   uint16_t *dd) {
    const int five = type == T_Q5_K, bs = five ? 176 : 144;
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = src + sb * bs, *qh = blk + 16, *ql = blk + (five ? 48 : 16);
        dd[2 * sb] = rd16(blk);
        dd[2 * sb + 1] = rd16(blk + 2);
        for (int j = 0; j < 8; j++) {
            int s, m;
            scale_min_k4(j, blk + 4, &s, &m);
            const int64_t b = sb * 8 + j;
            sc[b] = (uint8_t)s;
            mn[b] = (uint8_t)m;
            const uint8_t *c = ql + (j / 2) * 32;
            for (int t = 0; t < 32; t++) {
                const int lo = (j & 1) ? c[t] >> 4 : c[t] & 0xF;
                q[b * 32 + t] = (uint8_t)(lo | (five ? ((qh[t] >> j) & 1) << 4 : 0));
            }
        }
    }
}

int gl_pack_k4(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, uint8_t *q,
               uint16_t *d, int nth) {
    if (type != T_Q4_K && type != T_Q5_K) return 1;
    const int h5 = type == T_Q5_K;
    const int64_t kb = k / 32, ks = k / 256, groups = (n + 7) / 8, bs = K4_BYTES(h5);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *codes = calloc((size_t)(8 * k), 1), *sc = calloc((size_t)(8 * kb), 1);
        uint8_t *mn = calloc((size_t)(8 * kb), 1);
        uint16_t *dd = calloc((size_t)(16 * ks), sizeof(uint16_t));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_k4(type, raw + (g * 8 + i) * rowbytes, k, codes + i * k, sc + i * kb, mn + i * kb,
                   dd + i * 2 * ks);
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *w = q + (g * kb + b) * bs, *sm = w + 128 + 32 * h5;
            memset(w, 0, (size_t)bs);
            for (int i = 0; i < 8; i++) {
                sm[i] = sc[i * kb + b];
                sm[8 + i] = mn[i * kb + b];
                put_nibbles(w, i, codes + i * k + 32 * b);
                if (h5) put_fifth_bits(w, i, codes + i * k + 32 * b);
            }
        }
        for (int64_t sb = 0; sb < ks; sb++)
            for (int i = 0; i < 8; i++) {
                d[(g * ks + sb) * 16 + i] = dd[i * 2 * ks + 2 * sb];
                d[(g * ks + sb) * 16 + 8 + i] = dd[i * 2 * ks + 2 * sb + 1];
            }
        free(codes);
        free(sc);
        free(mn);
        free(dd);
    }
    return 0;
}

/* Rows ids[i] (or row0 + i) -> out (nrows, k): w = q * (d * sc) + -(dmin * mn), gguf's rounding. */
void gl_deq_k4(const uint8_t *q, const uint16_t *d, int h5, int64_t k, const int64_t *ids,
               int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, ks = k / 256, bs = K4_BYTES(h5);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *w = q + (g * kb + b) * bs, *sm = w + 128 + 32 * h5;
            const uint16_t *ds = d + (g * ks + b / 8) * 16;
            const float dd = h2f(ds[i]) * (float)sm[i], mm = -(h2f(ds[8 + i]) * (float)sm[8 + i]);
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 4; j++) {
                    const int L = 4 * (int)i + j;
                    int lo = w[32 * c + L] & 0xF, hi = w[32 * c + L] >> 4;
                    if (h5) {
                        lo |= fifth_bit(w, c, L, 0);
                        hi |= fifth_bit(w, c, L, 1);
                    }
                    const float a = (float)lo * dd, e = (float)hi * dd;
                    o[32 * b + 4 * c + j] = a + mm;
                    o[32 * b + 16 + 4 * c + j] = e + mm;
                }
            }
        }
    }
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

/* ---------------------------------------------------------------- k6, k3, k2: a scale per 16 */

/* Q6_K (v 0), Q3_K (v 1) and Q2_K (v 2): a scale per 16 values. Codes in 4 bits (Q6_K: and its
 * fifth and sixth bits, 16 bytes a chunk), the scales per 16 (Q2_K: and its mins per 16) as bytes, d (and dmin) per 256
 * as the file's float16: q (0..63, 0..7, 0..3), O the offset (32, 4, 0):
 *   w = (q - O) * (d * sc) [ - dmin * mn ]
 * Q3_K's scale is stored as its sc - 32 (int8); Q2_K's sc and mn as unsigned bytes. */
enum { V_Q6, V_Q3, V_Q2 };
#define K16_BYTES(v) (128 + ((v) == V_Q6 ? 64 : 0) + 16 + ((v) == V_Q2 ? 16 : 0))
#define K16_D(v) ((v) == V_Q2 ? 16 : 8) /* float16 per (group, super-block) */
#define K16_OFF(v) ((v) == V_Q6 ? 32 : (v) == V_Q3 ? 4 : 0)

/* One GGUF row -> codes (k bytes), scales (and mins) per 16 values, the raw float16 d (and
 * dmin) per 256. */
static void row_k16(int v, const uint8_t *src, int64_t k, uint8_t *q, int8_t *sc, uint8_t *mn,
                    uint16_t *dd) {
    for (int64_t sb = 0; sb < k / 256; sb++) {
        uint8_t *y = q + sb * 256;
        if (v == V_Q6) { /* ql[128] qh[64] scales[16] d */
            const uint8_t *blk = src + sb * 210;
            dd[sb] = rd16(blk + 208);
            memcpy(sc + sb * 16, blk + 192, 16);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + h * 64, *qh = blk + 128 + h * 32;
                for (int l = 0; l < 32; l++) {
                    y[h * 128 + l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                    y[h * 128 + l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                    y[h * 128 + l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    y[h * 128 + l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        } else if (v == V_Q3) { /* hmask[32] qs[64] scales[12] d: ggml's dequantize_row_q3_K */
            const uint8_t *blk = src + sb * 110, *hm = blk, *qs = blk + 32;
            dd[sb] = rd16(blk + 108);
            uint32_t aux[4];
            memcpy(aux, blk + 96, 12);
            const uint32_t tmp = aux[2], m1 = 0x03030303u, m2 = 0x0f0f0f0fu;
            aux[2] = ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
            aux[3] = ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
            aux[0] = (aux[0] & m2) | (((tmp >> 0) & m1) << 4);
            aux[1] = (aux[1] & m2) | (((tmp >> 2) & m1) << 4);
            const uint8_t *s6 = (const uint8_t *)aux;
            for (int j = 0; j < 16; j++) sc[sb * 16 + j] = (int8_t)(s6[j] - 32);
            for (int half = 0; half < 2; half++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        const int bit = half * 4 + j;
                        const int lo = (qs[half * 32 + l] >> (2 * j)) & 3, h = (hm[l] >> bit) & 1;
                        y[half * 128 + j * 32 + l] = (uint8_t)(lo + 4 * h); /* (lo - 4 (1 - h)) + 4 */
                    }
        } else { /* Q2_K: scales[16] qs[64] d dmin */
            const uint8_t *blk = src + sb * 84, *qs = blk + 16;
            dd[2 * sb] = rd16(blk + 80);
            dd[2 * sb + 1] = rd16(blk + 82);
            for (int j = 0; j < 16; j++) {
                sc[sb * 16 + j] = (int8_t)(blk[j] & 0xF);
                mn[sb * 16 + j] = blk[j] >> 4;
            }
            for (int half = 0; half < 2; half++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++)
                        y[half * 128 + j * 32 + l] = (uint8_t)((qs[half * 32 + l] >> (2 * j)) & 3);
        }
    }
}

static int k16_variant(int type) {
    return type == T_Q6_K ? V_Q6 : type == T_Q3_K ? V_Q3 : type == T_Q2_K ? V_Q2 : -1;
}

int gl_pack_k6(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, uint8_t *q,
               uint16_t *d, int nth) {
    const int v = k16_variant(type);
    if (v < 0) return 1;
    const int64_t kb = k / 32, ks = k / 256, groups = (n + 7) / 8, bs = K16_BYTES(v), nd = K16_D(v);
    const int64_t at_sc = v == V_Q6 ? 192 : 128;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *codes = calloc((size_t)(8 * k), 1), *mn = calloc((size_t)(8 * kb * 2), 1);
        int8_t *sc = calloc((size_t)(8 * kb * 2), 1);
        uint16_t *dd = calloc((size_t)(8 * ks * 2), sizeof(uint16_t));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_k16(v, raw + (g * 8 + i) * rowbytes, k, codes + i * k, sc + i * kb * 2,
                    mn + i * kb * 2, dd + i * ks * 2);
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *w = q + (g * kb + b) * bs;
            memset(w, 0, (size_t)bs);
            for (int i = 0; i < 8; i++) {
                w[at_sc + i] = (uint8_t)sc[i * kb * 2 + 2 * b];
                w[at_sc + 8 + i] = (uint8_t)sc[i * kb * 2 + 2 * b + 1];
                if (v == V_Q2) {
                    w[at_sc + 16 + i] = mn[i * kb * 2 + 2 * b];
                    w[at_sc + 24 + i] = mn[i * kb * 2 + 2 * b + 1];
                }
                put_nibbles(w, i, codes + i * k + 32 * b);
                for (int c = 0; c < 4 && v == V_Q6; c++) /* the fifth and sixth bits: q6_high's byte L % 16 */
                    for (int j = 0; j < 4; j++) {
                        const int L = 4 * i + j, sh = L < 16 ? 0 : 2;
                        const uint8_t lo = codes[i * k + 32 * b + 4 * c + j], hi = codes[i * k + 32 * b + 16 + 4 * c + j];
                        w[128 + 16 * c + L % 16] |= (uint8_t)(((lo >> 4) & 3) << sh | ((hi >> 4) & 3) << (4 + sh));
                    }
            }
        }
        for (int64_t sb = 0; sb < ks; sb++)
            for (int i = 0; i < 8; i++) {
                if (v == V_Q2) {
                    d[(g * ks + sb) * nd + i] = dd[i * ks * 2 + 2 * sb];
                    d[(g * ks + sb) * nd + 8 + i] = dd[i * ks * 2 + 2 * sb + 1];
                } else {
                    d[(g * ks + sb) * nd + i] = dd[i * ks * 2 + sb];
                }
            }
        free(codes);
        free(sc);
        free(mn);
        free(dd);
    }
    return 0;
}

/* The scale of 8 rows' bytes: signed (Q6_K, Q3_K) or unsigned (Q2_K). */
static inline float k16_scale(int v, const uint8_t *p) { return v == V_Q2 ? (float)p[0] : (float)(int8_t)p[0]; }

/* Rows ids[i] (or row0 + i) -> out (nrows, k): gguf's rounding, (q - O) * (d * sc) [+ -(dmin * mn)]. */
void gl_deq_k6(const uint8_t *q, const uint16_t *d, int v, int64_t k, const int64_t *ids,
               int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, ks = k / 256, bs = K16_BYTES(v), nd = K16_D(v);
    const int off = K16_OFF(v), at_sc = v == V_Q6 ? 192 : 128;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *w = q + (g * kb + b) * bs, *sm = w + at_sc;
            const uint16_t *ds = d + (g * ks + b / 8) * nd;
            const float dk = h2f(ds[i]);
            const float s0 = dk * k16_scale(v, sm + i), s1 = dk * k16_scale(v, sm + 8 + i);
            float m0 = 0.0f, m1 = 0.0f;
            if (v == V_Q2) {
                const float dm = h2f(ds[8 + i]);
                m0 = -(dm * (float)sm[16 + i]);
                m1 = -(dm * (float)sm[24 + i]);
            }
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 4; j++) {
                    const int L = 4 * (int)i + j;
                    int lo = w[32 * c + L] & 0xF, hi = w[32 * c + L] >> 4;
                    if (v == V_Q6) {
                        const int bits = w[128 + 16 * c + L % 16] >> (L < 16 ? 0 : 2);
                        lo |= (bits & 3) << 4;
                        hi |= ((bits >> 4) & 3) << 4;
                    }
                    float *v0 = o + 32 * b + 4 * c + j, *v1 = v0 + 16;
                    if (v == V_Q2) {
                        const float a = (float)lo * s0, e = (float)hi * s1;
                        *v0 = a + m0;
                        *v1 = e + m1;
                    } else {
                        *v0 = (float)(lo - off) * s0;
                        *v1 = (float)(hi - off) * s1;
                    }
                }
            }
        }
    }
}

/* 8 bytes -> 8 floats, signed or not */
static inline __m256 s8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The codes of chunk c of a k16 block w: lo (values 4 c .. of every row) and hi (16 + 4 c ..). */
static inline __attribute__((always_inline)) void k16_codes(int v, const uint8_t *w, int c, __m256i *lo,
                                                            __m256i *hi) {
    nibble_chunk(w, 0, c, lo, hi);
    if (v == V_Q6) {
        __m256i lh, hh;
        q6_high(w + 128 + 16 * c, &lh, &hh);
        *lo = _mm256_or_si256(*lo, lh);
        *hi = _mm256_or_si256(*hi, hh);
    }
}

/* y[r, 8g .. 8g+7] for R rows of x, one group g of a k6 / k3 / k2 weight. The unsigned codes go
 * into the dots as they are; -O s sum(x) per 16 values corrects the offset, and Q2_K's mins
 * subtract dmin mn sum(x). Without VNNI a row's maddubs sums are taken from the block's 8 code
 * vectors, unpacked once for the R rows (widen_sums: Q6_K's |pair| <= 2 * 63 * 127, so two
 * of them fit int16; Q3_K's and Q2_K's all four). */
static inline __attribute__((always_inline)) void k16_group(
    int v, const uint8_t *qg, const uint16_t *dg, int64_t kb, const int8_t *xq, const float *xd,
    const float *xs16, int R, float *y, int64_t ldy, int64_t nvalid) {
    const int64_t bs = K16_BYTES(v), nd = K16_D(v), at_sc = v == V_Q6 ? 192 : 128;
    __m256 acc[MT], dsv = _mm256_setzero_ps(), dmv = dsv;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *w = qg + b * bs, *sm = w + at_sc;
        prefetch_block(w, bs);
        if ((b & 7) == 0) {
            dsv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + (b >> 3) * nd)));
            if (v == V_Q2) dmv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + (b >> 3) * nd + 8)));
        }
        const __m256 s0 = _mm256_mul_ps(dsv, v == V_Q2 ? u8x8_ps(sm) : s8x8_ps(sm));
        const __m256 s1 = _mm256_mul_ps(dsv, v == V_Q2 ? u8x8_ps(sm + 8) : s8x8_ps(sm + 8));
        __m256 m0, m1; /* per 16 values: what sum(x) is multiplied by and subtracted */
        if (v == V_Q2) {
            m0 = _mm256_mul_ps(dmv, u8x8_ps(sm + 16));
            m1 = _mm256_mul_ps(dmv, u8x8_ps(sm + 24));
        } else {
            const __m256 off = _mm256_set1_ps((float)K16_OFF(v));
            m0 = _mm256_mul_ps(s0, off);
            m1 = _mm256_mul_ps(s1, off);
        }
#if GL_VNNI
        __m256i lo32[MT], hi32[MT];
        for (int r = 0; r < R; r++) lo32[r] = hi32[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            k16_codes(v, w, c, &lo, &hi);
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + (r * kb + b) * 32;
                lo32[r] = DPBUSD(lo32[r], lo, bcast4(xb + 4 * c));
                hi32[r] = DPBUSD(hi32[r], hi, bcast4(xb + 16 + 4 * c));
            }
        }
#else
        /* the block's 8 code vectors first, then each row's sums from them */
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) k16_codes(v, w, c, &lo[c], &hi[c]);
#endif
        for (int r = 0; r < R; r++) {
#if GL_VNNI
            const __m256i l32 = lo32[r], h32 = hi32[r];
#else
            const int8_t *xb = xq + (r * kb + b) * 32;
            __m256i pl[4], ph[4];
            for (int c = 0; c < 4; c++) {
                pl[c] = _mm256_maddubs_epi16(lo[c], bcast4(xb + 4 * c));
                ph[c] = _mm256_maddubs_epi16(hi[c], bcast4(xb + 16 + 4 * c));
            }
            const __m256i l32 = widen_sums(pl, v == V_Q6), h32 = widen_sums(ph, v == V_Q6);
#endif
            const __m256 xdv = _mm256_set1_ps(xd[r * kb + b]);
            const float *x16 = xs16 + (r * kb + b) * 2;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l32), _mm256_mul_ps(s0, xdv), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h32), _mm256_mul_ps(s1, xdv), acc[r]);
            acc[r] = _mm256_fnmadd_ps(m0, _mm256_set1_ps(x16[0]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(m1, _mm256_set1_ps(x16[1]), acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* The codes of chunk c of two k16 groups' blocks wa, wb as the dots take them (Q6_K: with their
 * fifth and sixth bits). */
static inline __attribute__((always_inline)) void k16_codes2(int v, const uint8_t *wa, const uint8_t *wb,
                                                             int c, __m512i *lo, __m512i *hi) {
    nibbles2(wa, wb, c, 0, lo, hi);
    if (v == V_Q6) {
        __m512i lh, hh;
        q6_high2(wa + 128 + 16 * c, wb + 128 + 16 * c, &lh, &hh);
        *lo = _mm512_or_si512(*lo, lh);
        *hi = _mm512_or_si512(*hi, hh);
    }
}

/* Two k16 groups' block scales (sa, sb: their scale bytes; dsv, dmv: the super-block's d and
 * dmin): s per 16 values, and m, what sum(x) of those 16 is multiplied by and subtracted. */
static inline __attribute__((always_inline)) void k16_scales2(int v, __m512 dsv, __m512 dmv, const uint8_t *sa,
                                                              const uint8_t *sb, __m512 *s, __m512 *m) {
    /* 16 scale bytes of each group: the low 8 of both in one 128-bit lane, then the high 8 */
    const __m128i ra = _mm_loadu_si128((const __m128i *)sa), rb = _mm_loadu_si128((const __m128i *)sb);
    const __m128i lo = _mm_unpacklo_epi64(ra, rb), hi = _mm_unpackhi_epi64(ra, rb);
    s[0] = _mm512_mul_ps(dsv, _mm512_cvtepi32_ps(v == V_Q2 ? _mm512_cvtepu8_epi32(lo) : _mm512_cvtepi8_epi32(lo)));
    s[1] = _mm512_mul_ps(dsv, _mm512_cvtepi32_ps(v == V_Q2 ? _mm512_cvtepu8_epi32(hi) : _mm512_cvtepi8_epi32(hi)));
    if (v == V_Q2) {
        const __m128i ma = _mm_loadu_si128((const __m128i *)(sa + 16)), mb = _mm_loadu_si128((const __m128i *)(sb + 16));
        m[0] = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ma, mb))));
        m[1] = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(ma, mb))));
    } else {
        const __m512 off = _mm512_set1_ps((float)K16_OFF(v));
        m[0] = _mm512_mul_ps(s[0], off);
        m[1] = _mm512_mul_ps(s[1], off);
    }
}

/* lo32[r], hi32[r] += the dots of chunk c's codes lo, hi with row r's block b of x. */
static inline __attribute__((always_inline)) void k16_dots2(__m512i lo, __m512i hi, const int8_t *xq, int64_t kb,
                                                            int64_t b, int c, int R, __m512i *lo32, __m512i *hi32) {
    for (int r = 0; r < R; r++) {
        const int8_t *xb = xq + (r * kb + b) * 32;
        int32_t x0, x1;
        memcpy(&x0, xb + 4 * c, 4);
        memcpy(&x1, xb + 16 + 4 * c, 4);
        lo32[r] = DPBUSD512(lo32[r], lo, _mm512_set1_epi32(x0));
        hi32[r] = DPBUSD512(hi32[r], hi, _mm512_set1_epi32(x1));
    }
}

/* acc[r] += block b's sums of row r, scaled (s0, s1) and offset (m0, m1) per 16 values. */
static inline __attribute__((always_inline)) void k16_fold2(__m512 s0, __m512 s1, __m512 m0, __m512 m1,
                                                            const float *xd, const float *xs16, int64_t kb,
                                                            int64_t b, int R, const __m512i *lo32,
                                                            const __m512i *hi32, __m512 *acc) {
    for (int r = 0; r < R; r++) {
        const __m512 xdv = _mm512_set1_ps(xd[r * kb + b]);
        const float *x16 = xs16 + (r * kb + b) * 2;
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo32[r]), _mm512_mul_ps(s0, xdv), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi32[r]), _mm512_mul_ps(s1, xdv), acc[r]);
        acc[r] = _mm512_fnmadd_ps(m0, _mm512_set1_ps(x16[0]), acc[r]);
        acc[r] = _mm512_fnmadd_ps(m1, _mm512_set1_ps(x16[1]), acc[r]);
    }
}

/* k16_group for two whole groups at once (qa, da, ya: group g; qb, db, yb: g + 1), in 512-bit
 * vectors: the same sums and float steps per output as k16_group, so the same bits. nx: as
 * k4_pair's. */
static inline __attribute__((always_inline)) void k16_pair(
    int v, const uint8_t *qa, const uint8_t *qb, const uint16_t *da, const uint16_t *db, int64_t kb,
    const int8_t *xq, const float *xd, const float *xs16, int R, float *ya, float *yb, int64_t ldy,
    int64_t nx) {
    const int64_t bs = K16_BYTES(v), nd = K16_D(v), at_sc = v == V_Q6 ? 192 : 128;
    __m512 acc[KT], dsv = _mm512_setzero_ps(), dmv = dsv;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *wa = qa + b * bs, *wb = qb + b * bs, *sa = wa + at_sc, *sb = wb + at_sc;
        pair_prefetch(wa, wb, bs, nx);
        if ((b & 7) == 0) {
            const int64_t o = (b >> 3) * nd;
            dsv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + o))),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + o))));
            if (v == V_Q2)
                dmv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + o + 8))),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + o + 8))));
        }
        __m512 sv[2], mv[2];
        k16_scales2(v, dsv, dmv, sa, sb, sv, mv);
        const __m512 s0 = sv[0], s1 = sv[1], m0 = mv[0], m1 = mv[1];
        __m512i lo32[KT], hi32[KT];
        for (int r = 0; r < R; r++) lo32[r] = hi32[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i lo, hi;
            k16_codes2(v, wa, wb, c, &lo, &hi);
            k16_dots2(lo, hi, xq, kb, b, c, R, lo32, hi32);
        }
        k16_fold2(s0, s1, m0, m1, xd, xs16, kb, b, R, lo32, hi32, acc);
    }
    store_pair(acc, R, ya, yb, ldy);
}

/* k16_pair of Q6_K asking for the next task's blocks (next_task_at; as k4_pair_next: out of
 * line). Q3_K and Q2_K keep the others' prefetch. */
static __attribute__((noinline)) void k16_pair_next(const uint8_t *qa, const uint8_t *qb, const uint16_t *da,
                                                    const uint16_t *db, int64_t kb, const int8_t *xq,
                                                    const float *xd, const float *xs16, int R, float *y,
                                                    int64_t ldy, int64_t nx) {
#define K6N(RR) k16_pair(V_Q6, qa, qb, da, db, kb, xq, xd, xs16, RR, y, y + 8, ldy, nx)
    WITH_ROWS_KT(R, K6N)
#undef K6N
}
#endif

#if GL_VNNI512
/* Many rows (a prompt): k16_pair's work, with each super-block's codes and scales of the two
 * groups unpacked once for a chunk of up to RC rows (k16_unpack) instead of once for every tile
 * of MT rows. The unpacking (nibbles, the fifth and sixth bits, the float scales) took more
 * instructions a row than the dots themselves; the tiles now only load it. The accumulators of
 * the chunk's rows wait in acc (RC x 16 floats) between super-blocks. Per output the same sums
 * and float steps in the same order as k16_pair, so the same bits. */
typedef struct {
    __m512i code[8][4][2];  /* block, chunk, lo / hi: the codes as the dots take them */
    __m512 s[8][2], m[8][2]; /* block: the scale of each 16 values, what sum(x) is multiplied by */
} k16_unpacked;

static inline __attribute__((always_inline)) void k16_unpack(int v, const uint8_t *qa, const uint8_t *qb,
                                                             const uint16_t *da, const uint16_t *db,
                                                             int64_t sb, k16_unpacked *u) {
    const int64_t bs = K16_BYTES(v), nd = K16_D(v), at_sc = v == V_Q6 ? 192 : 128;
    const __m512 dsv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + sb * nd))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + sb * nd))));
    __m512 dmv = _mm512_setzero_ps();
    if (v == V_Q2)
        dmv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + sb * nd + 8))),
                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + sb * nd + 8))));
    for (int i = 0; i < 8; i++) {
        const int64_t b = sb * 8 + i;
        const uint8_t *wa = qa + b * bs, *wb = qb + b * bs, *sa = wa + at_sc, *sbp = wb + at_sc;
        k16_scales2(v, dsv, dmv, sa, sbp, u->s[i], u->m[i]);
        for (int c = 0; c < 4; c++) k16_codes2(v, wa, wb, c, &u->code[i][c][0], &u->code[i][c][1]);
    }
}

/* R rows (a tile) of super-block sb through u: acc (16 floats a row) in, and out. */
static inline __attribute__((always_inline)) void k16_tile(const k16_unpacked *u, int64_t sb, int64_t kb,
                                                           const int8_t *xq, const float *xd,
                                                           const float *xs16, int R, float *acc_m) {
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_load_ps(acc_m + 16 * r);
    for (int i = 0; i < 8; i++) {
        const int64_t b = sb * 8 + i;
        __m512i lo32[MT], hi32[MT];
        for (int r = 0; r < R; r++) lo32[r] = hi32[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m512i lo = _mm512_load_si512(&u->code[i][c][0]), hi = _mm512_load_si512(&u->code[i][c][1]);
            k16_dots2(lo, hi, xq, kb, b, c, R, lo32, hi32);
        }
        const __m512 s0 = _mm512_load_ps(&u->s[i][0]), s1 = _mm512_load_ps(&u->s[i][1]);
        const __m512 m0 = _mm512_load_ps(&u->m[i][0]), m1 = _mm512_load_ps(&u->m[i][1]);
        k16_fold2(s0, s1, m0, m1, xd, xs16, kb, b, R, lo32, hi32, acc);
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(acc_m + 16 * r, acc[r]);
}

/* Groups g and g + 1 (qa, da; qb, db) for rows [r0, r1) of x, in chunks of RC rows. */
static void k16_pair_rows(int v, const uint8_t *qa, const uint8_t *qb, const uint16_t *da,
                          const uint16_t *db, int64_t kb, const xbuf *xb, int64_t k, int64_t r0,
                          int64_t r1, float *ya, float *yb, int64_t ldy) {
    k16_unpacked u __attribute__((aligned(64)));
    float acc_m[RC * 16] __attribute__((aligned(64)));
    for (int64_t c0 = r0; c0 < r1; c0 += RC) {
        const int64_t nr = r1 - c0 < RC ? r1 - c0 : RC;
        memset(acc_m, 0, sizeof(float) * 16 * (size_t)nr);
        for (int64_t sb = 0; sb < kb / 8; sb++) {
            k16_unpack(v, qa, qb, da, db, sb, &u);
            for (int64_t t0 = 0; t0 < nr; t0 += MT) {
                const int R = nr - t0 < MT ? (int)(nr - t0) : MT;
                const int64_t row = c0 + t0;
                const int8_t *xt = xb->xq + row * k;
                const float *dt = xb->xd + row * kb, *st = xb->xs16 + row * kb * 2;
#define K16T(RR) k16_tile(&u, sb, kb, xt, dt, st, RR, acc_m + 16 * t0)
                WITH_ROWS(R, K16T)
#undef K16T
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            _mm256_storeu_ps(ya + (c0 + r) * ldy, _mm256_load_ps(acc_m + 16 * r));
            _mm256_storeu_ps(yb + (c0 + r) * ldy, _mm256_load_ps(acc_m + 16 * r + 8));
        }
    }
}
#endif

/* mm_task for a k6 / k3 / k2 weight (kind 3, small = v). */
static void k6_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, ks = k / 256, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
    const int v = (int)w->small;
    int64_t g0 = t * GT; /* the first group the tiles below take */
#if GL_VNNI512
    if (M >= RC) { /* a prompt: the pairs unpacked once a chunk of rows, a last odd group below */
        for (int64_t g = g0; pair_at(M, g, g1, n); g += 2, g0 = g) {
            const uint8_t *qg = (const uint8_t *)w->q + g * kb * K16_BYTES(v);
            const uint16_t *dg = (const uint16_t *)w->d + g * ks * K16_D(v);
            k16_pair_rows(v, qg, qg + kb * K16_BYTES(v), dg, dg + ks * K16_D(v), kb, xb, k, ra, rb,
                          y + g * 8, y + g * 8 + 8, n);
        }
    }
#endif
#if GL_VNNI512 /* tiles of TT rows: with the pairs, Q6_K's of KT (see KT) */
    const int64_t TT = v == V_Q6 && M > KT && M >= gl_pair_rows ? KT : MT;
#else
    const int64_t TT = MT;
#endif
    for (int64_t r0 = ra; r0 < rb; r0 += TT) {
        const int R = rb - r0 < TT ? (int)(rb - r0) : (int)TT;
        const int8_t *xt = xb->xq + r0 * k;
        const float *dt = xb->xd + r0 * kb, *st = xb->xs16 + r0 * kb * 2;
        const int64_t nx = next_task_at(ra, rb, r0, TT, GT * kb * K16_BYTES(v));
        (void)nx; /* (the 256-bit kernels keep their prefetch) */
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *qg = (const uint8_t *)w->q + g * kb * K16_BYTES(v);
            const uint16_t *dg = (const uint16_t *)w->d + g * ks * K16_D(v);
            float *yo = y + r0 * n + g * 8;
            const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#if GL_VNNI512
            if (pair_at(M, g, g1, n)) { /* two whole groups: 512 bits */
                const uint8_t *qh = qg + kb * K16_BYTES(v);
                const uint16_t *dh = dg + ks * K16_D(v);
#define K6P(RR) k16_pair(V_Q6, qg, qh, dg, dh, kb, xt, dt, st, RR, yo, yo + 8, n, 0)
#define K3P(RR) k16_pair(V_Q3, qg, qh, dg, dh, kb, xt, dt, st, RR, yo, yo + 8, n, 0)
#define K2P(RR) k16_pair(V_Q2, qg, qh, dg, dh, kb, xt, dt, st, RR, yo, yo + 8, n, 0)
                if (v == V_Q6 && nx) {
                    k16_pair_next(qg, qh, dg, dh, kb, xt, dt, st, R, yo, n, nx);
                } else if (v == V_Q6) {
                    WITH_ROWS_KT(R, K6P)
                } else if (v == V_Q3) {
                    WITH_ROWS(R, K3P)
                } else {
                    WITH_ROWS(R, K2P)
                }
#undef K6P
#undef K3P
#undef K2P
                g++;
                continue;
            }
#endif
            for (int s0 = 0; s0 < R; s0 += MT) { /* a tile of TT rows: the groups take MT at a time */
                const int Rs = R - s0 < MT ? R - s0 : MT;
                const int8_t *xs_ = xt + s0 * k;
                const float *ds_ = dt + s0 * kb, *ss_ = st + s0 * kb * 2;
                float *ys = yo + s0 * n;
#define K6(RR) k16_group(V_Q6, qg, dg, kb, xs_, ds_, ss_, RR, ys, n, nv)
#define K3(RR) k16_group(V_Q3, qg, dg, kb, xs_, ds_, ss_, RR, ys, n, nv)
#define K2(RR) k16_group(V_Q2, qg, dg, kb, xs_, ds_, ss_, RR, ys, n, nv)
                if (v == V_Q6) {
                    WITH_ROWS(Rs, K6)
                } else if (v == V_Q3) {
                    WITH_ROWS(Rs, K3)
                } else {
                    WITH_ROWS(Rs, K2)
                }
#undef K6
#undef K3
#undef K2
            }
        }
    }
}

/* y (M, n) = x (M, k) @ W.T for a k6 (v 0: Q6_K), k3 (1: Q3_K) or k2 (2: Q2_K) weight. */
void gl_mm_k6(const float *x, int64_t M, int64_t k, const uint8_t *q, const uint16_t *d, int v,
              int64_t n, float *y, int nth) {
    const gl_weight w = {3, 1, 16, v, n, k, q, d, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
