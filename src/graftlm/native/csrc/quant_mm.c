/* The products of the u4 / u5 and s8 weights (quant.c's layouts): the 256-bit group kernels,
 * the 512-bit pairs, and mm_task, which sends each kind of weight to its kernels. */
#include "graftlm.h"

/* ---------------------------------------------------------------- matrix products */

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

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Chunk c of a block w of 4-bit (h5: 5-bit) codes as u4 and k4 lay them: its low nibbles in lo,
 * its high in hi, with the fifth bits after the 128 code bytes (h5). */
static inline __attribute__((always_inline)) void nibble_chunk(const uint8_t *w, int h5, int c,
                                                               __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
    *lo = _mm256_and_si256(raw, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if (h5) {
        const __m256i f = _mm256_loadu_si256((const __m256i *)(w + 128));
        *lo = _mm256_or_si256(*lo, fifth_at(f, 2 * c));
        *hi = _mm256_or_si256(*hi, fifth_at(f, 2 * c + 1));
    }
}

#if GL_VNNI
/* R rows' int32 sums of a block w of 4- (h5: 5-) bit codes (xb: the rows' blocks of x, stride
 * apart), chunk by chunk. */
static inline __attribute__((always_inline)) void nibble_dots(const uint8_t *w, int h5, const int8_t *xb,
                                                              int64_t stride, int R, __m256i *s32) {
    for (int r = 0; r < R; r++) s32[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        nibble_chunk(w, h5, c, &lo, &hi);
        for (int r = 0; r < R; r++)
            s32[r] = DPBUSD(DPBUSD(s32[r], lo, bcast4(xb + r * stride + 4 * c)), hi,
                            bcast4(xb + r * stride + 16 + 4 * c));
    }
}
#else
/* Four int16 sums of a row -> its int32 sums: added in int16 two at a time (pairs: where a third
 * could overflow) or all four, then widened. */
static inline __attribute__((always_inline)) __m256i widen_sums(const __m256i *p, int pairs) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (pairs)
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                                _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
}

/* Without VNNI: the block's 8 code vectors are unpacked once for the R rows and stay in
 * registers (lo, hi: nibble_chunk's), and each row's sums (xb: its block of x) come from them:
 * its 8 maddubs summed in int16, all 8 of 4-bit codes (|pair| <= 2 * 15 * 127; quantize_x keeps
 * |x| <= 127) or 4 at a time of 5-bit ones (2 * 31 * 127), then widened. */
static inline __attribute__((always_inline)) __m256i nibble_sums(const __m256i *lo, const __m256i *hi,
                                                                 int h5, const int8_t *xb) {
    __m256i p[4];
    for (int c = 0; c < 4; c++)
        p[c] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], bcast4(xb + 4 * c)),
                                _mm256_maddubs_epi16(hi[c], bcast4(xb + 16 + 4 * c)));
    return widen_sums(p, h5);
}
#endif

/* y[r, 8g .. 8g+7] for R rows of x, one group g of a u4 (h5: u5) weight. */
static inline __attribute__((always_inline)) void u4_group(
    const uint8_t *qs, const void *d, const void *m, int h, int h5, int64_t kb, const int8_t *xq,
    const float *xd, const float *xs, int R, float *y, int64_t ldy, int64_t nvalid) {
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *w = qs + b * U4_BYTES(h5);
        prefetch_block(w, U4_BYTES(h5));
        const __m256 dv = load_scales8(d, b * 8, h), mv = load_scales8(m, b * 8, h);
#if GL_VNNI
        __m256i s32[MT];
        nibble_dots(w, h5, xq + b * 32, kb * 32, R, s32);
#else
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) nibble_chunk(w, h5, c, &lo[c], &hi[c]);
#endif
        for (int r = 0; r < R; r++) {
#if GL_VNNI
            const __m256 isum = _mm256_cvtepi32_ps(s32[r]);
#else
            const __m256 isum = _mm256_cvtepi32_ps(nibble_sums(lo, hi, h5, xq + (r * kb + b) * 32));
#endif
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* u4_group for two whole groups at once (qa, da, ma, ya: group g; qb, db, mb, yb: g + 1), in
 * 512-bit vectors: the same sums and float steps per output as u4_group, so the same bits. */
static inline __attribute__((always_inline)) void u4_pair(
    const uint8_t *qa, const uint8_t *qb, const void *da, const void *db, const void *ma,
    const void *mb, int h, int h5, int64_t kb, const int8_t *xq, const float *xd, const float *xs,
    int R, float *ya, float *yb, int64_t ldy) {
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *wa = qa + b * U4_BYTES(h5), *wb = qb + b * U4_BYTES(h5);
        prefetch_block(wa, U4_BYTES(h5));
        prefetch_block(wb, U4_BYTES(h5));
        __m512i s32[MT];
        nibble_dots2(wa, wb, h5, xq, kb, b, R, s32);
        const __m512 dv = cat_ps(load_scales8(da, b * 8, h), load_scales8(db, b * 8, h));
        const __m512 mv = cat_ps(load_scales8(ma, b * 8, h), load_scales8(mb, b * 8, h));
        for (int r = 0; r < R; r++) {
            const __m512 isum = _mm512_cvtepi32_ps(s32[r]);
            acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_pair(acc, R, ya, yb, ldy);
}
#endif

/* Chunks c and c + 4 (0 <= c < 4: values 4 c .. 4 c + 3 and 16 + 4 c .. of every row) of an s8
 * block w of variant v as signed codes: loaded (Q8_0), or looked up from the 4-bit codes. */
static inline __attribute__((always_inline)) void s8_chunks(const int8_t *w, int v, int c, __m256i *a,
                                                            __m256i *b) {
    if (v != S8_Q8) {
        const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)N4_VALUES));
        __m256i lo, hi;
        nibble_chunk((const uint8_t *)w, 0, c, &lo, &hi);
        *a = _mm256_shuffle_epi8(tbl, lo);
        *b = _mm256_shuffle_epi8(tbl, hi);
    } else {
        *a = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
        *b = _mm256_loadu_si256((const __m256i *)(w + 32 * c + 128));
    }
}

/* The bytes of an s8 weight's scales a group of 8 rows: a scale per 32 values (float16 or float),
 * or IQ4_XS's float16 d per 256. */
static inline int64_t s8_scale_bytes(const gl_weight *w) {
    return w->small == S8_N4X ? w->k / 256 * 16 : w->k / 32 * 8 * (w->half ? 2 : 4);
}

/* The 8 rows' scales of block b (w) of an s8 weight of variant v, s the group's scales: a scale
 * per 32 (float16 or float: h), or IQ4_XS's d * (ls - 32) from its super-block's float16 d and the
 * block's int8 ls - 32, as gguf computes it. */
static inline __attribute__((always_inline)) __m256 s8_scales(int v, const void *s, int h, int64_t b,
                                                              const int8_t *w) {
    if (v != S8_N4X) return load_scales8(s, b * 8, h);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + (b >> 3) * 8)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 128)))));
}

/* The same for an s8 weight of variant v (a scale per 32 values). With VNNI, x comes unsigned (xu: xq + 128,
 * see quantize_x) against the signed codes, and each block's sums lose 128 * sum(w), one dot of
 * the block's codes with 128s shared by all R rows: the same integer sums as sum(xq * w), so the
 * same bits, in one instruction a row and chunk (was three: w's sign onto x, a dot, an add).
 * Without VNNI, maddubs's int16 pairs would saturate on xu: |w| against x with w's sign. */
static inline __attribute__((always_inline)) void s8_group(
    const int8_t *q, const void *s, int h, int v, int64_t kb, const int8_t *xq, const uint8_t *xu,
    const float *xd, int R, float *y, int64_t ldy, int64_t nvalid) {
#if GL_VNNI
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    (void)xq;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    (void)xu;
#endif
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *w = q + b * S8_BYTES(v);
        prefetch_block(w, S8_BYTES(v));
        __m256i i0[MT];
        for (int r = 0; r < R; r++) i0[r] = _mm256_setzero_si256();
#if GL_VNNI
        __m256i corr = _mm256_setzero_si256();
#endif
        for (int c = 0; c < 4; c++) {
            __m256i wc[2];
            s8_chunks(w, v, c, &wc[0], &wc[1]);
            for (int u = 0; u < 2; u++) { /* chunk c, then c + 4 */
                const __m256i wv = wc[u];
                const int at = 4 * c + 16 * u;
#if GL_VNNI
                corr = DPBUSD(corr, bias, wv);
                for (int r = 0; r < R; r++)
                    i0[r] = DPBUSD(i0[r], bcast4((const int8_t *)xu + (r * kb + b) * 32 + at), wv);
#else
                const __m256i aw = _mm256_sign_epi8(wv, wv);
                for (int r = 0; r < R; r++) {
                    const __m256i xv = bcast4(xq + (r * kb + b) * 32 + at);
                    i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
                }
#endif
            }
        }
#if GL_VNNI
        for (int r = 0; r < R; r++) i0[r] = _mm256_sub_epi32(i0[r], corr);
#endif
        const __m256 sv = s8_scales(v, s, h, b, w);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[r]), _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* s8_chunks of two groups' blocks wa, wb (the low and high 256 bits). */
static inline __attribute__((always_inline)) void s8_chunks2(const int8_t *wa, const int8_t *wb, int v,
                                                             int c, __m512i *a, __m512i *b) {
    if (v != S8_Q8) {
        const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)N4_VALUES));
        __m512i lo, hi;
        nibbles2((const uint8_t *)wa, (const uint8_t *)wb, c, 0, &lo, &hi);
        *a = _mm512_shuffle_epi8(tbl, lo);
        *b = _mm512_shuffle_epi8(tbl, hi);
    } else {
        *a = cat_si(_mm256_loadu_si256((const __m256i *)(wa + 32 * c)), _mm256_loadu_si256((const __m256i *)(wb + 32 * c)));
        *b = cat_si(_mm256_loadu_si256((const __m256i *)(wa + 32 * c + 128)),
                    _mm256_loadu_si256((const __m256i *)(wb + 32 * c + 128)));
    }
}

/* A tile's rows of x as s8_pair addresses them: row r's block b of codes at q + 32 b + 8 o[r],
 * its scale at xd + b and o[r] bytes on (o[r] = 4 r kb, laundered each block so that the compiler
 * neither hoists 8 o[r] as a second register a row nor keeps a pointer a row and array): one
 * register a row, where the pointers a row and array had spilled to vector registers, a VMOVQ
 * back before every broadcast of x (about half a VPDPBUSD slot each on a Zen 4 core: 12 with 12
 * dots, 136 GMAC/s of 234). Q8_0 640 x 2048 one thread, with S8_CORR_KB: 1.08x at 16 rows, 1.11x
 * at 512. Not taken elsewhere: the nibble pairs (k4, u4, mx4) gained nothing with it (Q4_K
 * 0.99-1.02x, Q5_K 0.96x), the k16 pairs lost (Q6_K 0.80x at 16 rows), and for Q4_K even its
 * scales from one pointer for all 8 rows (a wrong product, as a bound) ran 1.004-1.009x. */
typedef struct {
    int64_t o[8];
} xrows;
static inline __attribute__((always_inline)) void xrows_at(xrows *xo, int64_t kb, int R) {
    for (int r = 0; r < R; r++) {
        xo->o[r] = 4 * r * kb;
        __asm__("" : "+r"(xo->o[r]));
    }
}
/* Row r's 4 bytes at byte `at` of block b of codes q (xrows). */
static inline __attribute__((always_inline)) int32_t xrow_i4(const xrows *xo, const void *q, int r, int64_t b, int at) {
    int32_t v;
    memcpy(&v, (const char *)q + 32 * b + 8 * xo->o[r] + at, 4);
    return v;
}
/* Row r's float of block b of scales a (xd, xs: a float a block). */
static inline __attribute__((always_inline)) float xrow_f(const xrows *xo, const float *a, int r, int64_t b) {
    float v;
    memcpy(&v, (const char *)(a + b) + xo->o[r], 4);
    return v;
}

/* s8_group for two whole groups at once (qa, sa, ya: group g; qb, sb, yb: g + 1), in 512-bit
 * vectors: the same sums and float steps per output, so the same bits. cb: NULL, or the pair's
 * corrections (128 times each output's sum of codes a block: of the weights alone), kb of them,
 * which the tile summing them (fill) writes and the task's other tiles of rows read. */
static inline __attribute__((always_inline)) void s8_pair(
    const int8_t *qa, const int8_t *qb, const void *sa, const void *sb, int h, int v, int64_t kb,
    const uint8_t *xu, const float *xd, int R, float *ya, float *yb, int64_t ldy, __m512i *cb, int fill) {
    const int own = cb == NULL || fill; /* this tile sums the corrections itself */
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[MT];
    xrows xo;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        xrows_at(&xo, kb, R);
        const int8_t *wa = qa + b * S8_BYTES(v), *wb = qb + b * S8_BYTES(v);
        prefetch_block(wa, S8_BYTES(v));
        prefetch_block(wb, S8_BYTES(v));
        __m512i i0[MT], corr = own ? _mm512_setzero_si512() : cb[b];
        for (int r = 0; r < R; r++) i0[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i wc[2];
            s8_chunks2(wa, wb, v, c, &wc[0], &wc[1]);
            for (int u = 0; u < 2; u++) { /* chunk c, then c + 4 */
                if (own) corr = DPBUSD512(corr, bias, wc[u]);
                for (int r = 0; r < R; r++)
                    i0[r] = DPBUSD512(i0[r], _mm512_set1_epi32(xrow_i4(&xo, xu, r, b, 4 * c + 16 * u)), wc[u]);
            }
        }
        if (cb && fill) cb[b] = corr;
        const __m512 sv = cat_ps(s8_scales(v, sa, h, b, wa), s8_scales(v, sb, h, b, wb));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i0[r], corr)),
                                     _mm512_mul_ps(sv, _mm512_set1_ps(xrow_f(&xo, xd, r, b))), acc[r]);
    }
    store_pair(acc, R, ya, yb, ldy);
}
#endif

/* Room for M rows of k values of x quantized (quantize_x fills it); with s8 (an s8 or grid-quant
 * product reads x: a Q8_0 or IQ2/IQ3 weight, an int8 A) and VNNI, for x as unsigned bytes too. */
static xbuf xbuf_take(gl_scratch *s, int64_t M, int64_t k, int s8) {
    xbuf b;
    b.xq = scratch_take(s, M * k);
    b.xu = GL_VNNI && s8 ? scratch_take(s, M * k) : NULL;
    b.xd = scratch_take(s, (int64_t)sizeof(float) * M * (k / 32));
    b.xs = scratch_take(s, (int64_t)sizeof(float) * M * (k / 32));
    b.xs16 = scratch_take(s, (int64_t)sizeof(float) * M * (k / 16));
    b.xf = NULL;
    return b;
}

/* Blocks a row of x up to which an s8 product's task keeps its pairs' corrections (s8_pair) for
 * its tiles of rows after the first, which read them instead of summing them again: 8 of a
 * block's 56 dots at 6 rows (Q8_0 640 x 2048, one thread: with them kept, 1.05x at 16 rows and
 * 1.11x at 512 against summing them in every tile). */
#define S8_CORR_KB 256

/* F(h, variant, rows) for an s8 weight's h and variant v, with R rows: each a compile-time
 * constant where the kernel is inlined (WITH_ROWS). */
#define WITH_ROWS_HV(R, F, HH, VV)                                                                 \
    switch (R) {                                                                                   \
    case 6: F(HH, VV, 6); break;                                                                   \
    case 5: F(HH, VV, 5); break;                                                                   \
    case 4: F(HH, VV, 4); break;                                                                   \
    case 3: F(HH, VV, 3); break;                                                                   \
    case 2: F(HH, VV, 2); break;                                                                   \
    default: F(HH, VV, 1); break;                                                                  \
    }
#define S8_BY_VARIANT(F)                                                                           \
    if (v == S8_N4X) {                                                                             \
        WITH_ROWS_HV(R, F, 1, S8_N4X)                                                              \
    } else if (v == S8_N4 && h) {                                                                  \
        WITH_ROWS_HV(R, F, 1, S8_N4)                                                               \
    } else if (v == S8_N4) {                                                                       \
        WITH_ROWS_HV(R, F, 0, S8_N4)                                                               \
    } else if (h) {                                                                                \
        WITH_ROWS_HV(R, F, 1, S8_Q8)                                                               \
    } else {                                                                                       \
        WITH_ROWS_HV(R, F, 0, S8_Q8)                                                               \
    }

/* mm_task for a u4 / u5 weight (kind 0): tiles of MT rows, each over the task's groups, two
 * whole ones at a time in the pair kernels. */
static __attribute__((noinline)) void u4_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra,
                                              int64_t rb, int64_t t, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
    const int h = (int)w->half;
    const int64_t ss = h ? 2 : 4; /* bytes per stored scale */
    const uint8_t *qs = (const uint8_t *)w->q;
    const int h5 = (int)w->small;
    for (int64_t r0 = ra; r0 < rb; r0 += MT) {
        const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
        const int8_t *xt = xb->xq + r0 * k;
        const float *dt = xb->xd + r0 * kb, *st = xb->xs + r0 * kb;
        for (int64_t g = t * GT; g < g1; g++) {
            const uint8_t *qg = qs + g * kb * U4_BYTES(h5);
            const void *dg = (const char *)w->d + g * kb * 8 * ss, *mg = (const char *)w->m + g * kb * 8 * ss;
            float *yo = y + r0 * n + g * 8;
            const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#if GL_VNNI512
            if (pair_at(M, g, g1, n)) { /* two whole groups: 512 bits */
                const uint8_t *qh = qg + kb * U4_BYTES(h5);
                const void *dh = (const char *)dg + kb * 8 * ss, *mh = (const char *)mg + kb * 8 * ss;
#define U4P(RR) u4_pair(qg, qh, dg, dh, mg, mh, h, h5, kb, xt, dt, st, RR, yo, yo + 8, n)
                WITH_ROWS(R, U4P)
#undef U4P
                g++;
                continue;
            }
#endif
#define U4H(RR) u4_group(qg, dg, mg, 1, 0, kb, xt, dt, st, RR, yo, n, nv)
#define U4F(RR) u4_group(qg, dg, mg, 0, 0, kb, xt, dt, st, RR, yo, n, nv)
#define U5H(RR) u4_group(qg, dg, mg, 1, 1, kb, xt, dt, st, RR, yo, n, nv)
#define U5F(RR) u4_group(qg, dg, mg, 0, 1, kb, xt, dt, st, RR, yo, n, nv)
            if (h5) {
                if (h) {
                    WITH_ROWS(R, U5H)
                } else {
                    WITH_ROWS(R, U5F)
                }
            } else if (h) {
                WITH_ROWS(R, U4H)
            } else {
                WITH_ROWS(R, U4F)
            }
#undef U4H
#undef U4F
#undef U5H
#undef U5F
        }
    }
}

/* mm_task for an s8 weight (kind 1), as u4_task. */
static __attribute__((noinline)) void s8_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra,
                                              int64_t rb, int64_t t, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
    const int h = (int)w->half;
    /* s8: a scale per 32 values (IQ4_XS: made from its super-block's) */
    const int8_t *q = (const int8_t *)w->q;
    const int v = (int)w->small;
    const int64_t bs = S8_BYTES(v), sg_bytes = s8_scale_bytes(w);
#if GL_VNNI512
    /* the task's pairs' corrections, summed by the first tile of rows that takes a pair for the
     * rest (at most S8_CORR_KB blocks a row: 32 KB of stack; beyond, each tile sums them as one
     * tile does); filled[s]: pair s's are there (not "the first tile": a pair_at that answered
     * otherwise for it, gl_pair_rows changed meanwhile, would leave them unwritten) */
    __m512i corrs[GT / 2][S8_CORR_KB];
    int filled[GT / 2] = {0};
    const int keep = rb - ra > MT && kb <= S8_CORR_KB;
#endif
    for (int64_t r0 = ra; r0 < rb; r0 += MT) {
        const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
        const int8_t *xt = xb->xq + r0 * k;
        const uint8_t *ut = xb->xu ? xb->xu + r0 * k : NULL;
        const float *dt = xb->xd + r0 * kb;
        for (int64_t g = t * GT; g < g1; g++) {
            const int8_t *qg = q + g * kb * bs;
            const void *sg = (const char *)w->d + g * sg_bytes;
            float *yo = y + r0 * n + g * 8;
            const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#if GL_VNNI512
            if (pair_at(M, g, g1, n)) { /* two whole groups: 512 bits */
                const int8_t *qh = qg + kb * bs;
                const void *sh = (const char *)sg + sg_bytes;
                const int64_t slot = (g - t * GT) / 2;
                __m512i *cb = keep ? corrs[slot] : NULL;
                const int fill = !filled[slot];
#define S8P(HH, VV, RR) s8_pair(qg, qh, sg, sh, HH, VV, kb, ut, dt, RR, yo, yo + 8, n, cb, fill)
                S8_BY_VARIANT(S8P)
#undef S8P
                filled[slot] = 1;
                g++;
                continue;
            }
#endif
#define S8G(HH, VV, RR) s8_group(qg, sg, HH, VV, kb, xt, ut, dt, RR, yo, n, nv)
            S8_BY_VARIANT(S8G)
#undef S8G
        }
    }
}

/* One task of y (M, n) = x (M, k) @ W.T: the outputs [8 GT t, 8 GT (t + 1)) of rows [ra, rb) of
 * x. The tasks split the output rows, so the task's weights stay in L1 across the tiles of x. */
static void mm_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    if (w->kind == 2 || w->kind == 3) {
        (w->kind == 2 ? k4_task : k6_task)(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 4) {
        f_task(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 5) {
        mx4_task(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 6) {
        iq_task(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 0) {
        u4_task(w, xb, M, ra, rb, t, y);
        return;
    }
    s8_task(w, xb, M, ra, rb, t, y); /* kind 1 */
}

/* y (M, n) = x (M, k) @ W.T for a u4 (h5: u5) weight (qs, d, m) of n rows. */
void gl_mm_u4(const float *x, int64_t M, int64_t k, const uint8_t *qs, const void *d,
              const void *m, int h, int h5, int64_t n, float *y, int nth) {
    const gl_weight w = {0, h, 32, h5, n, k, qs, d, m};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}

/* y (M, n) = x (M, k) @ W.T for an s8 weight (q, s) of variant v and n rows, s per 32 values
 * (sblk 32; IQ4_XS: per 256). */
void gl_mm_s8(const float *x, int64_t M, int64_t k, const int8_t *q, const void *s, int h, int v,
              int sblk, int64_t n, float *y, int nth) {
    const gl_weight w = {1, h, sblk, v, n, k, q, s, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
