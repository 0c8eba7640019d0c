/* The products of the k6 / k3 / k2 weights (Q6_K, Q3_K, Q2_K; kquant.c's layout): the 256-bit
 * groups, the 512-bit pairs, a prompt's pairs unpacked once a chunk of rows, and k6_task. */
#include "graftlm.h"

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
                                                             int c, int shift, __m512i *lo, __m512i *hi) {
    nibbles2(wa, wb, c, 0, lo, hi);
    if (v == V_Q6) {
        __m512i lh, hh;
        q6_high2(wa + 128 + 16 * c, wb + 128 + 16 * c, shift, &lh, &hh);
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
            k16_codes2(v, wa, wb, c, R >= BITS_BY_SHIFT_ROWS, &lo, &hi);
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
 * groups unpacked once for a chunk of up to K16_RC rows (k16_unpack) instead of once for every tile
 * of MT rows. The unpacking (nibbles, the fifth and sixth bits, the float scales) took more
 * instructions a row than the dots themselves; the tiles now only load it. The accumulators of
 * the chunk's rows wait in acc (K16_RC x 16 floats) between super-blocks. Per output the same sums
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
        for (int c = 0; c < 4; c++) k16_codes2(v, wa, wb, c, 1, &u->code[i][c][0], &u->code[i][c][1]);
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

/* Rows a chunk of k16_pair_rows (a multiple of MT, at least RC): each super-block is unpacked
 * once for them (12 vectors a block stored). At RC's 48 rows the unpacking was 7% of Q6_K
 * 640 x 2048's time at 512 rows and 11% at 64 (one thread, in cache: a probe that unpacked only
 * the first super-block); 96: 1.02-1.03x at 512 rows, 1.04-1.06x at 64 (one chunk, where 48 made
 * two); 192 no more than 1.01x beyond. */
#define K16_RC 96
/* Groups g and g + 1 (qa, da; qb, db) for rows [r0, r1) of x, in chunks of K16_RC rows. */
static void k16_pair_rows(int v, const uint8_t *qa, const uint8_t *qb, const uint16_t *da,
                          const uint16_t *db, int64_t kb, const xbuf *xb, int64_t k, int64_t r0,
                          int64_t r1, float *ya, float *yb, int64_t ldy) {
    k16_unpacked u __attribute__((aligned(64)));
    float acc_m[K16_RC * 16] __attribute__((aligned(64)));
    for (int64_t c0 = r0; c0 < r1; c0 += K16_RC) {
        const int64_t nr = r1 - c0 < K16_RC ? r1 - c0 : K16_RC;
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
