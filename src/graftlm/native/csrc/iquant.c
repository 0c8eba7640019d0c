/* The grid quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (kind 6), read in place: the file's
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
 * per output, row of x and unit of one scale (32 values; 16 for IQ2_XS and IQ2_S), the exact
 * integer dot of the signed values with x's codes, scaled in float by (the unit's scale * x's
 * scale of its 32 values) and accumulated with one FMA a unit, from the row's first unit to its
 * last (below, "the products"): every kernel and variant takes the same integer sums and rounds
 * the same float operations in the same order, so a row's product has the same bits whatever
 * the rows beside it and whatever the CPU.
 *
 * The lookups: one at a time (8 or 4 values an insert; vpgatherdd for IQ3's eight entries: 20%
 * slower on Zen 4), or with AVX-512 VBMI a super-block's 32 or 64 indices at once: each entry's
 * values as a code (2 or 3 bits a value, iq_grids.h's *_CODE or *_PAIR, byte planes looked up
 * 128 entries a vpermi2b), cut into a byte a value and the magnitudes looked up (vpermb); the
 * sign bytes from the 7-bit indices with their parity (vpopcntb). One row of x went from ~9-11
 * GMAC/s a core (Zen 4) to ~19-21 with them, and to ~24-28 with iq_group_few's order of values.
 *
 * The tiles (gl_weight.half 1: IQ2_XXS and IQ3_XXS where the build has VBMI, gl_pack_iq at load;
 * else half 0, the file's super-blocks in place): the same bytes regrouped, 16 outputs' super-
 * blocks sb as one tile (16 x 66 or 98 bytes), a group's tiles one after another, the groups of
 * 16 outputs in order (the last padded with zero super-blocks). A tile is its 8 units (32 values,
 * one scale), IQ_TILE_UNIT bytes each, then the 16 outputs' float16 d:
 *   IQ2_XXS: 64 bytes of grid indices (byte 4 o + i: output o's index of the unit's entry i),
 *            64 of sign words (dword o: output o's word of 4 7-bit sign indices and ls);
 *   IQ3_XXS: two vectors of indices (vector s, byte 4 o + i: entry 4 s + i of the unit), the
 *            sign words likewise;
 * what iq_lanes_fill_t transposed out of the 16 super-blocks, stored so (iq_tiles.c's few rows,
 * iq_group's lanes, gl_deq_iq_tiles). One row of the other three types in place: iq_one.c.
 */
#include "graftlm.h"
#include "iq_grids.h"

/* gl_weight.small: the type; IQ_BYTES its super-block's bytes */
enum { IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S };
#define IQ_BYTES(v) ((v) == IQ2_XXS ? 66 : (v) == IQ2_XS ? 74 : (v) == IQ2_S ? 82 : (v) == IQ3_XXS ? 98 : 110)
#define IQ_TILE_UNIT(v) ((v) == IQ2_XXS ? 128 : 192) /* a tile's bytes a unit (IQ2_XXS, IQ3_XXS) */

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

static inline uint32_t ksigns4(uint32_t aux) { /* four 7-bit sign indices -> 32 sign bits */
    return (uint32_t)KSIGNS[aux & 127] | (uint32_t)KSIGNS[(aux >> 7) & 127] << 8 |
           (uint32_t)KSIGNS[(aux >> 14) & 127] << 16 | (uint32_t)KSIGNS[(aux >> 21) & 127] << 24;
}

/* Values [32 ib, 32 ib + 32) of the super-block p: their grid magnitudes (byte i: value i) and
 * *sg their sign bits (bit i set: value i negative). */
static inline __attribute__((always_inline)) __m256i iq_sub(const uint8_t *p, const int v, int ib,
                                                            uint32_t *sg) {
    if (v == IQ2_XXS) {
        const uint8_t *q = p + 2 + 8 * ib;
        *sg = ksigns4(rd32(q + 4));
        return _mm256_setr_epi64x((long long)IQ2XXS_GRID[q[0]], (long long)IQ2XXS_GRID[q[1]],
                                  (long long)IQ2XXS_GRID[q[2]], (long long)IQ2XXS_GRID[q[3]]);
    }
    if (v == IQ2_XS) {
        uint16_t q[4];
        memcpy(q, p + 2 + 8 * ib, 8);
        *sg = (uint32_t)KSIGNS[q[0] >> 9] | (uint32_t)KSIGNS[q[1] >> 9] << 8 |
              (uint32_t)KSIGNS[q[2] >> 9] << 16 | (uint32_t)KSIGNS[q[3] >> 9] << 24;
        return _mm256_setr_epi64x((long long)IQ2XS_GRID[q[0] & 511], (long long)IQ2XS_GRID[q[1] & 511],
                                  (long long)IQ2XS_GRID[q[2] & 511], (long long)IQ2XS_GRID[q[3] & 511]);
    }
    if (v == IQ2_S) {
        const uint8_t *q = p + 2 + 4 * ib, h = p[66 + ib];
        *sg = rd32(p + 34 + 4 * ib);
        return _mm256_setr_epi64x((long long)IQ2S_GRID[q[0] | (h & 3) << 8],
                                  (long long)IQ2S_GRID[q[1] | (h >> 2 & 3) << 8],
                                  (long long)IQ2S_GRID[q[2] | (h >> 4 & 3) << 8],
                                  (long long)IQ2S_GRID[q[3] | (h >> 6 & 3) << 8]);
    }
    const uint8_t *q = p + 2 + 8 * ib;
    if (v == IQ3_XXS) {
        *sg = ksigns4(rd32(p + 66 + 4 * ib));
        return _mm256_setr_epi32((int)IQ3XXS_GRID[q[0]], (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[2]],
                                 (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[5]],
                                 (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[7]]);
    }
    const unsigned h = p[66 + ib]; /* IQ3_S */
    *sg = rd32(p + 74 + 4 * ib);
    return _mm256_setr_epi32((int)IQ3S_GRID[q[0] | (h << 8 & 256)], (int)IQ3S_GRID[q[1] | (h << 7 & 256)],
                             (int)IQ3S_GRID[q[2] | (h << 6 & 256)], (int)IQ3S_GRID[q[3] | (h << 5 & 256)],
                             (int)IQ3S_GRID[q[4] | (h << 4 & 256)], (int)IQ3S_GRID[q[5] | (h << 3 & 256)],
                             (int)IQ3S_GRID[q[6] | (h << 2 & 256)], (int)IQ3S_GRID[q[7] | (h << 1 & 256)]);
}

/* The scales of super-block p (d its float16 d as float) per 16 values: *a those of values
 * [0, 128) (lane j: values [16 j, 16 j + 16)), *b of [128, 256); gguf's expressions, in float32. */
static inline __attribute__((always_inline)) void iq_scales(const uint8_t *p, const int v, float d,
                                                            __m256 *a, __m256 *b) {
    const __m256 vd = _mm256_set1_ps(d), half = _mm256_set1_ps(0.5f);
    const __m256i nib = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m4 = _mm256_set1_epi32(15);
    if (v == IQ2_XS || v == IQ2_S) { /* 16 4-bit ls, one per 16 values */
        const uint8_t *s = p + (v == IQ2_XS ? 66 : 74);
        const __m256 q = _mm256_set1_ps(0.25f);
        const __m256 la = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)rd32(s)), nib), m4));
        const __m256 lb = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)rd32(s + 4)), nib), m4));
        *a = _mm256_mul_ps(_mm256_mul_ps(vd, _mm256_add_ps(half, la)), q);
        *b = _mm256_mul_ps(_mm256_mul_ps(vd, _mm256_add_ps(half, lb)), q);
        return;
    }
    __m256 db; /* one per 32 values */
    if (v == IQ3_S) {
        const __m256i ls = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)rd32(p + 106)), nib), m4);
        db = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(ls, ls))));
    } else { /* IQ2_XXS: ls in the top 4 bits of the second word of each 8 bytes; IQ3_XXS: of 8 words */
        __m256i aux;
        if (v == IQ2_XXS) {
            const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
            aux = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p + 2)), odd),
                                     _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p + 34)), odd), 0xF0);
        } else {
            aux = _mm256_loadu_si256((const __m256i *)(p + 66));
        }
        const __m256 ls = _mm256_cvtepi32_ps(_mm256_srli_epi32(aux, 28));
        db = _mm256_mul_ps(_mm256_mul_ps(vd, _mm256_add_ps(half, ls)), _mm256_set1_ps(v == IQ2_XXS ? 0.25f : 0.5f));
    }
    *a = _mm256_permutevar8x32_ps(db, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    *b = _mm256_permutevar8x32_ps(db, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

/* 32 sign bits -> a byte per value: -1 where its bit is set, else 1 (vpsignb's second operand). */
static inline __m256i iq_signs(uint32_t sg) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                          2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201ll);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)sg), pick), bits);
    return _mm256_or_si256(_mm256_cmpeq_epi8(b, bits), _mm256_set1_epi8(1));
}

/* AVX-512 VBMI: the grids looked up 64 indices a vector, the sign bytes */
#include "iq_vbmi.c"

/* the products in lanes of outputs (iq_group) */
#include "iq_lanes.c"
#include "iq_group.c"

/* one to a few rows (iq_group_few) */
#include "iq_few.c"

/* one row of IQ2_XS, IQ2_S, IQ3_S (iq_group_one) */
#include "iq_one.c"

/* the tiles' one to a few rows (iq_tiles_few) */
#include "iq_tiles.c"

/* The outputs [og, og + nv) of rows [ra, rb) of x of one type: iq_group, or iq_group_few for up to
 * IQ_FEW_ROWS rows where it is built; each a function of its own for each type: inlined all five
 * into iq_task, the compiler's one function for them all ran IQ2_XXS's 3-16 rows at 0.7-0.9x and
 * IQ3_S's 8-16 at 0.9x these, and iq_group_few inlined beside iq_group, IQ2_S's 4 and 5 rows
 * (iq_group) at 0.94x (one thread, alternated). */
#if IQ_VBMI
#define IQ_FEW_OF(V, NAME)                                                                           \
    static __attribute__((noinline)) void NAME##_few(const gl_weight *w, const xbuf *xb, int64_t ra, \
                                                     int64_t rb, int64_t og, int nv, float *y) {     \
        IQ_BY_ROWS(iq_group_few, w, V, xb, ra, rb, og, nv, y);                                       \
    }
#define IQ_FEW_CALL(V, NAME)                                                                         \
    if (IQ_ONE_TYPE(V) && rb - ra == 1) {                                                            \
        IQ_ONE_CALL(V, w, xb, ra, og, nv, y);                                                        \
        return;                                                                                      \
    }                                                                                                \
    if (rb - ra <= IQ_FEW_ROWS(V)) {                                                                 \
        NAME##_few(w, xb, ra, rb, og, nv, y);                                                        \
        return;                                                                                      \
    }
#else
#define IQ_FEW_OF(V, NAME)
#define IQ_FEW_CALL(V, NAME)
#endif
/* the types one row of which iq_group_one takes, each a function of its own */
#define IQ_ONE_TYPE(V) (IQ_GROUP_ONE && ((V) == IQ2_XS || (V) == IQ2_S || (V) == IQ3_S))
#if IQ_GROUP_ONE
#define IQ_ONE_FN(V, NAME)                                                                                     \
    static __attribute__((noinline)) void NAME(const gl_weight *w, const xbuf *xb, int64_t ra, int64_t og, int nv, \
                                               float *y) {                                                     \
        iq_group_one(w, V, xb, ra, og, nv, y);                                                                 \
    }
IQ_ONE_FN(IQ2_XS, iq_one_iq2_xs)
IQ_ONE_FN(IQ2_S, iq_one_iq2_s)
IQ_ONE_FN(IQ3_S, iq_one_iq3_s)
#undef IQ_ONE_FN
#define IQ_ONE_CALL(V, w, xb, ra, og, nv, y) \
    ((V) == IQ2_XS ? iq_one_iq2_xs(w, xb, ra, og, nv, y) : (V) == IQ2_S ? iq_one_iq2_s(w, xb, ra, og, nv, y) : iq_one_iq3_s(w, xb, ra, og, nv, y))
#else
#define IQ_ONE_CALL(V, w, xb, ra, og, nv, y) ((void)0)
#endif
#define IQ_OUTPUTS_OF(V, NAME)                                                                           \
    IQ_FEW_OF(V, NAME)                                                                                   \
    static __attribute__((noinline)) void NAME##_lanes(const gl_weight *w, const xbuf *xb, int64_t ra,   \
                                                       int64_t rb, int64_t og, int nv, float *y) {       \
        iq_group(w, V, 0, xb, ra, rb, og, nv, y);                                                        \
    }                                                                                                    \
    static void NAME(const gl_weight *w, const xbuf *xb, int64_t ra, int64_t rb, int64_t og, int nv, float *y) { \
        IQ_FEW_CALL(V, NAME)                                                                             \
        NAME##_lanes(w, xb, ra, rb, og, nv, y);                                                          \
    }
IQ_OUTPUTS_OF(IQ2_XXS, iq_outputs_iq2_xxs)
IQ_OUTPUTS_OF(IQ2_XS, iq_outputs_iq2_xs)
IQ_OUTPUTS_OF(IQ2_S, iq_outputs_iq2_s)
IQ_OUTPUTS_OF(IQ3_XXS, iq_outputs_iq3_xxs)
IQ_OUTPUTS_OF(IQ3_S, iq_outputs_iq3_s)
#undef IQ_FEW_OF
#undef IQ_FEW_CALL
#undef IQ_OUTPUTS_OF

/* The same from the tiles (gl_weight.half 1, IQ2_XXS and IQ3_XXS with VBMI): iq_tiles_few up to
 * IQ_FEW rows (4 rows of IQ2_XXS 1.35-1.45x the lanes in the prototype, bench/xiq.py), the lanes
 * past them. */
#if IQ_VBMI
#define IQ_TILES_OF(V, NAME)                                                                             \
    static __attribute__((noinline)) void NAME##_few(const gl_weight *w, const xbuf *xb, int64_t ra,     \
                                                     int64_t rb, int64_t og, int nv, float *y) {         \
        IQ_BY_ROWS(iq_tiles_few, w, V, xb, ra, rb, og, nv, y);                                           \
    }                                                                                                    \
    static __attribute__((noinline)) void NAME##_lanes(const gl_weight *w, const xbuf *xb, int64_t ra,   \
                                                       int64_t rb, int64_t og, int nv, float *y) {       \
        iq_group(w, V, 1, xb, ra, rb, og, nv, y);                                                        \
    }                                                                                                    \
    static void NAME(const gl_weight *w, const xbuf *xb, int64_t ra, int64_t rb, int64_t og, int nv, float *y) { \
        if (V == IQ2_XXS && IQ2_ONE && rb - ra == 1)                                                     \
            iq2_tiles_one(w, xb, ra, og, nv, y);                                                         \
        else if (V == IQ3_XXS && IQ3_ONE && rb - ra == 1)                                                \
            iq3_tiles_one(w, xb, ra, og, nv, y);                                                         \
        else if (rb - ra <= IQ_FEW)                                                                      \
            NAME##_few(w, xb, ra, rb, og, nv, y);                                                        \
        else                                                                                             \
            NAME##_lanes(w, xb, ra, rb, og, nv, y);                                                      \
    }
IQ_TILES_OF(IQ2_XXS, iq_tiles_iq2_xxs)
IQ_TILES_OF(IQ3_XXS, iq_tiles_iq3_xxs)
#undef IQ_TILES_OF
#define IQ_TILED(w, NAME) ((w)->half ? iq_tiles_##NAME : iq_outputs_##NAME)
#else
#define IQ_TILED(w, NAME) iq_outputs_##NAME
#endif

/* mm_task for a grid-quant weight (kind 6, small = the type): the outputs [8 GT t, 8 GT (t + 1))
 * of rows [ra, rb) of x, IQ_W at a time. */
static void iq_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    (void)M;
    const int v = (int)w->small;
    const int64_t n = w->n, o0 = t * GT * 8, o1 = o0 + GT * 8 < n ? o0 + GT * 8 : n;
    for (int64_t og = o0; og < o1; og += IQ_W) {
        const int nv = o1 - og < IQ_W ? (int)(o1 - og) : IQ_W;
        switch (v) {
        case IQ2_XXS: IQ_TILED(w, iq2_xxs)(w, xb, ra, rb, og, nv, y); break;
        case IQ2_XS: iq_outputs_iq2_xs(w, xb, ra, rb, og, nv, y); break;
        case IQ2_S: iq_outputs_iq2_s(w, xb, ra, rb, og, nv, y); break;
        case IQ3_XXS: IQ_TILED(w, iq3_xxs)(w, xb, ra, rb, og, nv, y); break;
        default: iq_outputs_iq3_s(w, xb, ra, rb, og, nv, y); break;
        }
    }
}

/* Super-block p of type v dequantized into out (256 values): gguf's (scale * grid) * sign, in float32
 * (scale times the signed value: the same bits, negation being exact), from iq_nat's signed bytes. */
static inline __attribute__((always_inline)) void iq_deq_sb(const uint8_t *p, const int v, float *out) {
    int8_t nat[256];
    float s16[16];
    iq_nat(p, v, nat, s16);
    for (int i = 0; i < 256; i += 8) {
        const __m256 g = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(nat + i))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_set1_ps(s16[i / 16]), g));
    }
}

/* An output's super-block (the file's bytes) and its lane l of a tile of type v (IQ2_XXS, IQ3_XXS):
 * src into dst, to_tile 1: src the super-block, dst the tile; 0: src the tile, dst the super-block. */
static void iq_tile_copy(const int v, int l, const uint8_t *src, uint8_t *dst, const int to_tile) {
    const int64_t ub = IQ_TILE_UNIT(v);
#define IQ_MOVE(fo, to, nb) (to_tile ? memcpy(dst + (to), src + (fo), nb) : memcpy(dst + (fo), src + (to), nb))
    IQ_MOVE(0, 8 * ub + 2 * l, 2); /* d */
    for (int u = 0; u < 8; u++) {
        IQ_MOVE(2 + 8 * u, u * ub + 4 * l, 4);       /* the unit's first 4 indices */
        IQ_MOVE(6 + 8 * u, u * ub + 64 + 4 * l, 4);  /* IQ2_XXS: its sign word; IQ3_XXS: its next 4 indices */
        if (v == IQ3_XXS) IQ_MOVE(66 + 4 * u, u * ub + 128 + 4 * l, 4); /* its sign word */
    }
#undef IQ_MOVE
}

/* out rows [i0, i1) of the weight q (tiles: in tiles, else in place); row i is ids[i] (NULL: row0 + i). */
static inline __attribute__((always_inline)) void iq_deq_rows(const uint8_t *q, const int v, const int tiles, int64_t k,
                                                              const int64_t *ids, int64_t row0, int64_t i0, int64_t i1,
                                                              float *out) {
    const int64_t nsb = k / 256, bytes = IQ_BYTES(v);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t o = ids ? ids[i] : row0 + i;
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t sbuf[IQ_BYTES(IQ3_S)];
            const uint8_t *p = q + (o * nsb + sb) * bytes;
            if (tiles) { /* lane o % 16 of the tile of its group and sb */
                iq_tile_copy(v, (int)(o % 16), q + (o / 16 * nsb + sb) * 16 * bytes, sbuf, 0);
                p = sbuf;
            }
            iq_deq_sb(p, v, out + i * k + sb * 256);
        }
    }
}

static void iq_deq(const uint8_t *q, int v, int tiles, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
                   float *out, int nth) {
#pragma omp parallel num_threads(nth) if (nrows * k >= 65536)
    {
        int64_t i0, i1;
        static_chunk(nrows, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
        switch (v) {
        case IQ2_XXS: iq_deq_rows(q, IQ2_XXS, tiles, k, ids, row0, i0, i1, out); break;
        case IQ2_XS: iq_deq_rows(q, IQ2_XS, 0, k, ids, row0, i0, i1, out); break;
        case IQ2_S: iq_deq_rows(q, IQ2_S, 0, k, ids, row0, i0, i1, out); break;
        case IQ3_XXS: iq_deq_rows(q, IQ3_XXS, tiles, k, ids, row0, i0, i1, out); break;
        default: iq_deq_rows(q, IQ3_S, 0, k, ids, row0, i0, i1, out); break;
        }
    }
}

/* out (nrows, k) = rows ids[i] (ids NULL: row0 + i) of the type-v weight q, dequantized. */
void gl_deq_iq(const uint8_t *q, int v, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
               float *out, int nth) {
    iq_deq(q, v, 0, k, ids, row0, nrows, out, nth);
}

/* The same from gl_pack_iq's tiles. */
void gl_deq_iq_tiles(const uint8_t *q, int v, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
                     float *out, int nth) {
    iq_deq(q, v, 1, k, ids, row0, nrows, out, nth);
}

/* y (M, n) = x (M, k) @ W.T for a grid-quant weight q of type v (the file's rows of n rows). */
void gl_mm_iq(const float *x, int64_t M, int64_t k, const uint8_t *q, int v, int64_t n, float *y,
              int nth) {
    const gl_weight w = {6, 0, 256, v, n, k, q, NULL, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}

/* The same from gl_pack_iq's tiles. */
void gl_mm_iq_tiles(const float *x, int64_t M, int64_t k, const uint8_t *q, int v, int64_t n, float *y,
                    int nth) {
    const gl_weight w = {6, 1, 256, v, n, k, q, NULL, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}

/* 1 where this build takes IQ2_XXS's and IQ3_XXS's tiles (VBMI), else 0: asked before a
 * buffer is made for gl_pack_iq. */
int gl_iq_tiles(void) { return IQ_VBMI; }

/* The n rows of k values of type v (raw: the file's, one after another) as tiles into out
 * ((n + 15) / 16 * 16 rows' bytes; the last group's outputs past n zero): 0; 1 where this build
 * or this type takes none (the weight then stays in place: without VBMI, and types other than
 * IQ2_XXS and IQ3_XXS). */
int gl_pack_iq(int v, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out, int nth) {
    if (!gl_iq_tiles() || (v != IQ2_XXS && v != IQ3_XXS)) return 1;
    const int64_t nsb = k / 256, bytes = IQ_BYTES(v), groups = (n + 15) / 16;
    static const uint8_t zero[IQ_BYTES(IQ3_S)];
    /* threads only for a large weight: one copies ~3 GB/s, and two on a busy machine waited on
     * each other (a 6 MB weight 0.16x; loading Qwen3-30B-A3B-6l IQ2_XXS took 12-13 s of CPU with
     * them on every expert, 4.6 s without, 2.6-3.1 s in place) */
#pragma omp parallel for num_threads(nth) if (n * k >= (1 << 26))
    for (int64_t g = 0; g < groups; g++)
        for (int64_t sb = 0; sb < nsb; sb++)
            for (int l = 0; l < 16; l++) {
                const int64_t o = 16 * g + l;
                iq_tile_copy(v, l, o < n ? raw + (o * nsb + sb) * bytes : zero, out + (g * nsb + sb) * 16 * bytes, 1);
            }
    return 0;
}
