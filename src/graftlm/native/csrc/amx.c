/* A prompt's products on AMX tiles (Intel's Advanced Matrix Extensions), beside the VNNI kernels
 * of quant.c and kquant.c, which the CPUs without AMX, the decode rows and the weights it does not
 * serve keep.
 *
 * The VNNI kernels spend as many instructions on each block's float epilogue and on unpacking the
 * codes as on the dots, and reach about 40% of vpdpbusd's peak. Here a task's 32 outputs are
 * dequantized once into bfloat16 (the weight as gguf dequantizes it, rounded to nearest even),
 * laid out as AMX's B tiles, and every row of x (also in bfloat16) runs through them with
 * tdpbf16ps: 16 x 16 outputs, 32 values deep, float32 sums, no epilogue. Its twin is the same
 * product in PyTorch on the bfloat16 roundings of x and of gguf's dequantized weight
 * (tests/native/test_amx.py); the float sums differ from it only in their order.
 *
 * Tiles: 0-3 the 32 x 32 outputs of a pass (rows m0 .. m0 + 31, the task's two pairs of groups),
 * 4-5 two tiles of x (16 rows x 32 values), 6-7 two of the weight (32 values x 16 outputs, the
 * "VNNI" layout: row p holds values 2p and 2p + 1 of each output). A panel (a task's outputs over
 * all of k): pair h of groups at panel + h * k * 16, tile row p of block b at (16 b + p) * 32.
 *
 * The kernel asks Linux for the tiles' state once (arch_prctl, gl_set_amx_rows); where that is
 * refused or the CPU lacks AMX, gl_amx_rows stays 0 and proj_run never comes here. */
#include "graftlm.h"

/* Whether task t's 32 outputs are all within the weight: a tile pair's whole width. */
static inline int amx_task_whole(const gl_weight *w, int64_t t) { return t * 32 + 32 <= w->n; }

#if GL_AMX

typedef struct __attribute__((packed)) {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Every tile 16 rows of 64 bytes: 16 float32 sums, or 32 bfloat16. */
static void amx_begin(void) {
    amx_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

/* This thread's buffers (0: a task's panel, 32 k bfloat16, 512 KiB at k = 8192; 1: the extra
 * values' panel), kept from call to call and grown when a product needs more. */
static uint16_t *amx_buf(int which, int64_t bytes) {
    static __thread uint16_t *buf[2];
    static __thread int64_t cap[2];
    if (cap[which] < bytes) {
        free(buf[which]);
        buf[which] = aligned_alloc(64, (size_t)bytes);
        if (!buf[which]) abort();
        cap[which] = bytes;
    }
    return buf[which];
}

/* Whether the tiles serve this task of this product (outputs [32 t, 32 t + 32) of M rows). */
static inline int amx_serves(const gl_weight *w, int64_t M) {
    return gl_amx_rows > 0 && M >= gl_amx_rows && w->q != NULL && w->kind <= 3 && /* amx_block's */
           (w->kind != 1 || w->sblk == 32);
}

/* f[j] (16 outputs) for the j-th value of each 4-value lane of v, times a plus c. */
static inline __attribute__((always_inline)) void amx_lanes(__m512i v, int sgn, __m512 a, __m512 c,
                                                            __m512 f[4]) {
    for (int j = 0; j < 4; j++) {
        const __m512i t = sgn ? _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24)
                              : _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xFF));
        f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), a, c);
    }
}

/* One tile row in bfloat16 from two values of 16 outputs: (a[o], b[o]) for each output o. */
static inline __m512i amx_pair_row(__m512 a, __m512 b) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* Two tile rows (values 4 l .. 4 l + 3 of 16 outputs: v, a code vector as the dots take it, 4 values
 * of an output a lane) in bfloat16: row 2 l holds values (4 l, 4 l + 1) of each output, 2 l + 1 the
 * next two. */
static inline __attribute__((always_inline)) void amx_rows4(__m512i v, int sgn, __m512 a, __m512 c,
                                                            uint16_t *row) {
    __m512 f[4];
    amx_lanes(v, sgn, a, c, f);
    _mm512_store_si512(row, amx_pair_row(f[0], f[1]));
    _mm512_store_si512(row + 32, amx_pair_row(f[2], f[3]));
}

/* Block b of groups g and g + 1 of w (32 values of 16 outputs) -> its 16 tile rows at out. */
static void amx_block(const gl_weight *w, int64_t g, int64_t b, uint16_t *out) {
    const int64_t k = w->k, kb = k / 32, ks = k / 256;
    if (w->kind == 1) { /* s8: signed codes, a scale per 32 */
        const int v = (int)w->small, h = (int)w->half;
        const int64_t bs = S8_BYTES(v), sg = s8_scale_bytes(w);
        const int8_t *qa = (const int8_t *)w->q + (g * kb + b) * bs, *qb = qa + kb * bs;
        const void *sa = (const char *)w->d + g * sg, *sb = (const char *)sa + sg;
        const __m512 s = cat_ps(s8_scales(v, sa, h, b, qa), s8_scales(v, sb, h, b, qb));
        for (int c = 0; c < 4; c++) {
            __m512i codes[2]; /* chunks c and c + 4 */
            s8_chunks2(qa, qb, v, c, &codes[0], &codes[1]);
            amx_rows4(codes[0], 1, s, _mm512_setzero_ps(), out + 64 * c);
            amx_rows4(codes[1], 1, s, _mm512_setzero_ps(), out + 64 * (c + 4));
        }
        return;
    }
    __m512 a[2], m[2]; /* values 0..15 of the block: a[0] q + m[0]; 16..31: a[1], m[1] */
    const uint8_t *wa, *wb;
    int h5 = 0, v6 = -1;
    if (w->kind == 0) { /* u4 / u5: w = q d + m */
        const int64_t ss = w->half ? 2 : 4, bs = U4_BYTES(w->small);
        h5 = (int)w->small;
        wa = (const uint8_t *)w->q + (g * kb + b) * bs, wb = wa + kb * bs;
        const void *da = (const char *)w->d + g * kb * 8 * ss, *db = (const char *)da + kb * 8 * ss;
        const void *ma = (const char *)w->m + g * kb * 8 * ss, *mb = (const char *)ma + kb * 8 * ss;
        a[0] = a[1] = cat_ps(load_scales8(da, b * 8, (int)w->half), load_scales8(db, b * 8, (int)w->half));
        m[0] = m[1] = cat_ps(load_scales8(ma, b * 8, (int)w->half), load_scales8(mb, b * 8, (int)w->half));
    } else if (w->kind == 2) { /* k4 / k5: w = q (d sc) - dmin mn */
        const int64_t bs = K4_BYTES(w->small);
        h5 = (int)w->small;
        wa = (const uint8_t *)w->q + (g * kb + b) * bs, wb = wa + kb * bs;
        const uint16_t *da = (const uint16_t *)w->d + (g * ks + b / 8) * 16, *db = da + ks * 16;
        const uint8_t *sa = wa + 128 + 32 * h5, *sb = wb + 128 + 32 * h5;
        const __m512 dsv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)da)),
                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)db)));
        const __m512 msv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + 8))),
                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + 8))));
        a[0] = a[1] = _mm512_mul_ps(dsv, cat_ps(u8x8_ps(sa), u8x8_ps(sb)));
        m[0] = m[1] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(msv, cat_ps(u8x8_ps(sa + 8), u8x8_ps(sb + 8))));
    } else { /* k6 / k3 / k2: w = q s - m per 16 values */
        v6 = (int)w->small;
        const int64_t bs = K16_BYTES(v6), nd = K16_D(v6), at_sc = v6 == V_Q6 ? 192 : 128;
        wa = (const uint8_t *)w->q + (g * kb + b) * bs, wb = wa + kb * bs;
        const uint16_t *da = (const uint16_t *)w->d + (g * ks + b / 8) * nd, *db = da + ks * nd;
        const __m512 dsv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)da)),
                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)db)));
        __m512 dmv = _mm512_setzero_ps();
        if (v6 == V_Q2)
            dmv = cat_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(da + 8))),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + 8))));
        k16_scales2(v6, dsv, dmv, wa + at_sc, wb + at_sc, a, m);
        m[0] = _mm512_sub_ps(_mm512_setzero_ps(), m[0]);
        m[1] = _mm512_sub_ps(_mm512_setzero_ps(), m[1]);
    }
    for (int c = 0; c < 4; c++) { /* chunk c: values 4 c .. 4 c + 3 (lo) and 16 + 4 c .. (hi) */
        __m512i lo, hi;
        if (v6 >= 0)
            k16_codes2(v6, wa, wb, c, 0, &lo, &hi);
        else
            nibbles2(wa, wb, c, h5, &lo, &hi);
        amx_rows4(lo, 0, a[0], m[0], out + 64 * c);
        amx_rows4(hi, 0, a[1], m[1], out + 256 + 64 * c);
    }
}

/* The panel of task t for values [32 b0, 32 b1): its 32 outputs (two pairs of groups), in tile
 * rows (pair h at panel + h * 512 (b1 - b0)). */
static void amx_panel(const gl_weight *w, int64_t t, int64_t b0, int64_t b1, uint16_t *panel) {
    for (int h = 0; h < 2; h++)
        for (int64_t b = b0; b < b1; b++) amx_block(w, t * GT + 2 * h, b, panel + (h * (b1 - b0) + b - b0) * 512);
}

/* x (M, k) -> xb (ceil(M / 32) * 32, k) in bfloat16, the rows past M zero. */
static void amx_x(const float *x, int64_t M, int64_t k, uint16_t *xb, int nth) {
    const int64_t Mp = (M + 31) / 32 * 32;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < Mp; r++) {
        uint16_t *o = xb + r * k;
        if (r >= M) {
            memset(o, 0, (size_t)k * 2);
            continue;
        }
        for (int64_t j = 0; j < k; j += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * k + j + 16), _mm512_loadu_ps(x + r * k + j));
            _mm512_storeu_si512(o + j, (__m512i)v);
        }
    }
}

/* Values past k that a product adds to its sums (proj_run: the LoRA delta, rows of s * A . x
 * against B): a (rows padded to 32, 32 blocks values a row) in bfloat16, and the tiles of each
 * task's outputs, which panel(ctx, t, buf) writes as amx_panel lays them out. */
typedef struct {
    const uint16_t *a;
    int64_t blocks;
    void (*panel)(const void *ctx, int64_t t, uint16_t *out);
    const void *ctx;
} amx_extra;

/* Outputs [32 t, 32 t + 32) of all M rows, the sums over values [32 b0, 32 b1) through the
 * panel of those values, and (ex, not NULL) over ex's values through its panel ep: into y, or
 * (acc) added to what y holds. */
static void amx_task(const gl_weight *w, const uint16_t *xb, int64_t M, int64_t t, int64_t b0,
                     int64_t b1, int acc, const uint16_t *panel, const amx_extra *ex,
                     const uint16_t *ep, float *y) {
    const int64_t k = w->k, n = w->n, ldx = 2 * k, kc = 32 * (b1 - b0);
    const uint16_t *p0 = panel, *p1 = panel + kc * 16;
    float tail[32 * 32] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const uint16_t *x0 = xb + m0 * k + 32 * b0, *x1 = x0 + 16 * k;
        float *yo = y + m0 * n + t * 32, *c = yo;
        int64_t ldc = 4 * n;
        if (m0 + 32 > M) { /* the last rows: through a buffer, the rows past M dropped */
            c = tail, ldc = 128;
            for (int64_t r = 0; acc && r < M - m0; r++) memcpy(tail + r * 32, yo + r * n, 128);
        }
        if (acc) {
            _tile_loadd(0, c, ldc);
            _tile_loadd(1, c + 16, ldc);
            _tile_loadd(2, c + ldc / 4 * 16, ldc);
            _tile_loadd(3, c + ldc / 4 * 16 + 16, ldc);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t k0 = 0; k0 < kc; k0 += 32) {
            _tile_loadd(4, x0 + k0, ldx);
            _tile_loadd(5, x1 + k0, ldx);
            _tile_loadd(6, p0 + k0 * 16, 64);
            _tile_loadd(7, p1 + k0 * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        for (int64_t j = 0; ex && j < ex->blocks; j++) {
            const int64_t lde = 32 * ex->blocks;
            _tile_loadd(4, ex->a + m0 * lde + 32 * j, 2 * lde);
            _tile_loadd(5, ex->a + (m0 + 16) * lde + 32 * j, 2 * lde);
            _tile_loadd(6, ep + j * 512, 64);
            _tile_loadd(7, ep + (ex->blocks + j) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, ldc);
        _tile_stored(1, c + 16, ldc);
        _tile_stored(2, c + ldc / 4 * 16, ldc);
        _tile_stored(3, c + ldc / 4 * 16 + 16, ldc);
        if (c == tail)
            for (int64_t r = 0; r < M - m0; r++) memcpy(yo + r * n, tail + r * 32, 128);
    }
}

/* Outputs [32 t0, 32 t1) of all M rows (the tasks of one thread; whole ones only: the caller's
 * VNNI kernels take a last one past n), in chunks of values whose x (M rows of them, bfloat16)
 * stay in L2 while every task of the thread reads them. At 512 rows of k = 8192 a task read 8 MiB
 * of x from L3: Q4_K 2048 x 8192 at 1460 GOP/s, against 2150 for 8192 x 2048. */
static void amx_tasks(const gl_weight *w, const uint16_t *xb, int64_t M, int64_t t0, int64_t t1,
                      const amx_extra *ex, float *y) {
    uint16_t *panel = amx_buf(0, w->k * 64), *ep = ex ? amx_buf(1, ex->blocks * 2048) : NULL;
    const int64_t kb = w->k / 32;
    int64_t cb = (1 << 21) / (64 * M); /* blocks a chunk: 2 MiB of x */
    cb = cb < 8 ? 8 : cb > kb ? kb : cb;
    for (int64_t b0 = 0; b0 < kb; b0 += cb) {
        const int64_t b1 = b0 + cb < kb ? b0 + cb : kb;
        for (int64_t t = t0; t < t1 && amx_task_whole(w, t); t++) {
            const amx_extra *last = b1 == kb ? ex : NULL; /* the extra values with the last chunk */
            amx_panel(w, t, b0, b1, panel);
            if (last) last->panel(last->ctx, t, ep);
            amx_task(w, xb, M, t, b0, b1, b0 > 0, panel, last, ep, y);
        }
    }
}
#endif
