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
 * for each 32 values of a row, the integer dot of the grid's magnitudes (unsigned bytes) with x's
 * codes whose signs the weight's sign bits flip (vpsignb), as llama.cpp's CPU kernels do: VNNI's
 * u8 x s8 dots where the CPU has them, else maddubs + madd (pairs at most 2 * 62 * 127, no
 * saturation): the same int32 sums either way, so every variant gives the same bits. Each sum is
 * scaled in float by (the weight's scale * x's scale) of its 32 values (16: the half of the lanes
 * that sum them) and accumulated in 8 lanes per row of x for the even sub-blocks and 8 for the
 * odd ones (the 512-bit kernels' two halves), summed across every IQ_CHUNK super-blocks. A row of the weight is unpacked (grid bytes, vpsignb operands, scales) once for
 * all the rows of x, which its tiles of MT rows then read from L1: a prompt pays the lookups once
 * an output, not once a tile (Zen 4, one core, 2048 x 2048 IQ3_XXS at 64 rows, 256 bits: 18.5
 * GMAC/s against 8.9 unpacking per tile).
 *
 * The lookups bound a decode step. One at a time (8 or 4 values an insert; vpgatherdd for IQ3's
 * eight entries: 20% slower on Zen 4) one row of x took ~9-11 GMAC/s a core where Q4_K takes
 * ~45-60. With AVX-512 VBMI (iq_unpack2_vbmi) a super-block's 32 or 64 indices are looked up at
 * once: each entry's values as a code (2 or 3 bits a value, iq_grids.h's *_CODE, two byte
 * planes looked up 128 entries a vpermi2b), its qwords cut into a byte a value (vpmultishiftqb)
 * and the magnitudes looked up (vpermb); the sign bytes from the 7-bit indices with their parity
 * (vpopcntb); the 512-bit kernels from one row on, one row of x using each super-block as it is
 * unpacked (iq_row1). Zen 4, one core, 2048 x 2048, GMAC/s at 1 / 4 / 16 / 64 rows: IQ3_XXS
 * 8.7 / 20.7 / 42.6 / 52.8 -> 20.7 / 41.9 / 54.3 / 58.4, IQ2_XXS 10.6 / 22.9 / 39.9 / 51.8 ->
 * 18.8 / 39.5 / 53.4 / 57.9 (IQ3_S, IQ2_XS 2-2.6x at one row, IQ2_S 1.4x). Many rows are bound
 * by the ~7 vector instructions a row and 64 values (x's sign flip, the dot, its scaling) at
 * ~1.7 a cycle, not by the lookups.
 */
#include "graftlm.h"
#include "iq_grids.h"

/* gl_weight.small: the type; IQ_BYTES its super-block's bytes */
enum { IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S };
#define IQ_BYTES(v) ((v) == IQ2_XXS ? 66 : (v) == IQ2_XS ? 74 : (v) == IQ2_S ? 82 : (v) == IQ3_XXS ? 98 : 110)

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

/* The 8 int32 sums (lane i: bytes 4i .. 4i + 3) of g (unsigned) times xs (signed). */
static inline __attribute__((always_inline)) __m256i iq_dot(__m256i g, __m256i xs) {
#if GL_VNNI
    return DPBUSD(_mm256_setzero_si256(), g, xs);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, xs), _mm256_set1_epi16(1));
#endif
}

/* A super-block unpacked: its 8 sub-blocks' magnitudes, their vpsignb operands, its scales. */
typedef struct {
    __m256i g[8], sv[8];
    __m256 a, b;
} iq_unpacked;

#define IQ_CHUNK 8 /* super-blocks a row is unpacked by, for all the rows of x (<= 4.5 KiB) */

static inline __attribute__((always_inline)) void iq_unpack(const uint8_t *p, const int v, iq_unpacked *u) {
    iq_scales(p, v, _cvtsh_ss(rd16(p)), &u->a, &u->b);
    for (int ib = 0; ib < 8; ib++) {
        uint32_t sg;
        u->g[ib] = iq_sub(p, v, ib, &sg);
        u->sv[ib] = iq_signs(sg);
    }
}

/* acc[2 r], acc[2 r + 1] += the lanes of the dot of super-block u with block sb of R rows of x
 * (xq, xd: rows k and k / 32 apart): per sub-block, its integer dot times (its scale * x's scale)
 * per 16 values, the even sub-blocks into acc[2 r], the odd ones into acc[2 r + 1] (the 512-bit
 * kernels' low and high lanes: the same sums rounded in the same order). */
static inline __attribute__((always_inline)) void iq_dots(const iq_unpacked *u, int64_t sb,
                                                          const int8_t *xq, const float *xd, int64_t k,
                                                          const int R, __m256 *acc) {
    const int64_t kb = k / 32;
    const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    __m256 sa[MT], sb2[MT];
    for (int r = 0; r < R; r++) {
        const __m256 xv = _mm256_loadu_ps(xd + r * kb + sb * 8);
        sa[r] = _mm256_mul_ps(u->a, _mm256_permutevar8x32_ps(xv, lo));
        sb2[r] = _mm256_mul_ps(u->b, _mm256_permutevar8x32_ps(xv, hi));
    }
    for (int ib = 0; ib < 8; ib++) {
        const __m256i lane = _mm256_setr_epi32(2 * (ib & 3), 2 * (ib & 3), 2 * (ib & 3), 2 * (ib & 3),
                                               2 * (ib & 3) + 1, 2 * (ib & 3) + 1, 2 * (ib & 3) + 1, 2 * (ib & 3) + 1);
        const __m256i g = u->g[ib], sv = u->sv[ib];
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * k + (sb * 8 + ib) * 32));
            const __m256 sc = _mm256_permutevar8x32_ps(ib < 4 ? sa[r] : sb2[r], lane);
            acc[2 * r + (ib & 1)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iq_dot(g, _mm256_sign_epi8(x, sv))), sc,
                                                    acc[2 * r + (ib & 1)]);
        }
    }
}

/* y[r * ldy] (+)= super-blocks [c, c + nc) (buf: unpacked) of a row against R rows of x. */
static inline __attribute__((always_inline)) void iq_tile(const iq_unpacked *buf, int64_t c, int64_t nc,
                                                          const int8_t *xq, const float *xd, int64_t k,
                                                          const int R, float *y, int64_t ldy) {
    __m256 acc[2 * MT];
    for (int r = 0; r < 2 * R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nc; i++) iq_dots(&buf[i], c + i, xq, xd, k, R, acc);
    for (int r = 0; r < R; r++) y[r * ldy] = (c ? y[r * ldy] : 0.0f) + hsum8(_mm256_add_ps(acc[2 * r], acc[2 * r + 1]));
}

#if GL_VNNI512
/* The same in 512 bits, two sub-blocks an instruction (lanes 0-7 the even one), their signs a
 * mask register (a masked subtraction flips x's codes), from IQ_ZMM_ROWS rows of x: below, the
 * 256-bit kernels were faster on Zen 4 (IQ2_XXS 2048 x 2048, one core, GMAC/s: 1 row 11.7
 * against 10.8, 2 rows 19.3 against 13.0; 16 rows 35.6 against 41.4, 64 rows 25.0 against 51.9). */
#define IQ_ZMM_ROWS 8
typedef struct {
    __m512i g2[4];   /* sub-blocks 2 i and 2 i + 1, each stored whole (its load forwards) */
    uint64_t sg2[4]; /* their sign bits */
    __m512 s16;      /* the scales per 16 values (iq_scales' a, then b) */
} iq_unpacked2;

#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__BMI2__)
#define IQ_VBMI 1
/* The grid's code bytes (plane: 256 entries, *_CODE's [0] or [1]) at the indices in idx's bytes
 * (their bit 7 picks the upper 128; vpermi2b reads the low 7). */
static inline __m512i iq_look256(const uint8_t *plane, __m512i idx) {
    const __m512i *t = (const __m512i *)plane;
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), _mm512_permutex2var_epi8(t[0], idx, t[1]),
                                  _mm512_permutex2var_epi8(t[2], idx, t[3]));
}

/* The same for 512 entries, the indices' bit 8 in hi8 (a bit a byte of idx). */
static inline __m512i iq_look512(const uint8_t *plane, __m512i idx, __mmask64 hi8) {
    return _mm512_mask_blend_epi8(hi8, iq_look256(plane, idx), iq_look256(plane + 256, idx));
}

/* 64 values' magnitudes: the codes (their low bytes lo, high bytes hi) of entries [16 j, 16 j + 16)
 * (IQ3: 4 values an entry, 3 bits a value) or [8 j, 8 j + 8) (IQ2: 8 values, 2 bits), each
 * qword's made of its entries' two code words (vpermi2b), cut into a byte a value (vpmultishiftqb),
 * the bytes' low bits looked up in mag64 (vpermb). */
static inline __m512i iq_expand(__m512i lo, __m512i hi, const int iq3, int j, const uint8_t *mag64) {
    uint64_t c[8];
    for (int q = 0; q < 8; q++) {
        const uint64_t e0 = iq3 ? 16 * j + 2 * q : 8 * j + q, e1 = e0 + 1;
        c[q] = iq3 ? e0 | (64 + e0) << 8 | e1 << 16 | (64 + e1) << 24 : e0 | (64 + e0) << 8;
    }
    const __m512i ctrl = _mm512_setr_epi64((long long)c[0], (long long)c[1], (long long)c[2], (long long)c[3],
                                           (long long)c[4], (long long)c[5], (long long)c[6], (long long)c[7]);
    const __m512i cut = _mm512_set1_epi64(iq3 ? 0x1916131009060300ll : 0x0e0c0a0806040200ll);
    const __m512i codes = _mm512_permutex2var_epi8(lo, ctrl, hi);
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(cut, codes), _mm512_load_si512(mag64));
}

/* The sign bytes of 32 7-bit sign indices (KSIGNS: the index and its parity in bit 7), four in
 * each of aux's 32-bit words (bits 0, 7, 14, 21), in their order. */
static inline __m256i iq_ksigns(__m256i aux) {
    const __m256i b = _mm256_multishift_epi64_epi8(_mm256_set1_epi64x(0x352e2720150e0700ll), aux);
    const __m256i m7 = _mm256_set1_epi8(0x7f);
    const __m256i pc = _mm256_popcnt_epi8(_mm256_and_si256(b, m7));
    return _mm256_ternarylogic_epi32(b, _mm256_slli_epi16(pc, 7), m7, 0xE4); /* m7 ? b : pc << 7 */
}

/* iq_unpack2 in vector instructions: a super-block's 32 or 64 grid indices looked up at once. */
static inline __attribute__((always_inline)) void iq_unpack2_vbmi(const uint8_t *p, const int v, iq_unpacked2 *u) {
    __m512i lo, hi;
    __m256i sg;
    const uint8_t *mag;
    int iq3 = 0;
    if (v == IQ2_XXS) { /* 8 bytes a sub-block: 4 indices, then their signs and ls */
        const __m512i sep = _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), _mm512_loadu_si512(p + 2));
        lo = iq_look256(IQ2XXS_CODE[0], sep), hi = iq_look256(IQ2XXS_CODE[1], sep);
        sg = iq_ksigns(_mm512_extracti64x4_epi64(sep, 1));
        mag = IQ2XXS_MAG64;
    } else if (v == IQ2_XS) { /* 16 bits an entry: 9 of index, 7 of signs */
        const __m512i raw = _mm512_loadu_si512(p + 2);
        const __m512i idx = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(raw));
        const __mmask64 h8 = _mm512_test_epi16_mask(raw, _mm512_set1_epi16(0x100));
        lo = iq_look512(IQ2XS_CODE[0], idx, h8), hi = iq_look512(IQ2XS_CODE[1], idx, h8);
        const __m512i s = _mm512_srli_epi16(raw, 9);
        const __m512i pc = _mm512_popcnt_epi16(s);
        sg = _mm512_cvtepi16_epi8(_mm512_ternarylogic_epi32(s, _mm512_slli_epi16(pc, 7), _mm512_set1_epi16(0x7f), 0xE4));
        mag = IQ2XS_MAG64;
    } else if (v == IQ2_S) { /* 10-bit indices: 8 bits in qs, 2 in qh; the sign bytes as they are */
        const __m512i idx = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2)));
        uint64_t qh;
        memcpy(&qh, p + 66, 8);
        const __mmask64 h8 = _pext_u64(qh, 0x5555555555555555ull), h9 = _pext_u64(qh, 0xAAAAAAAAAAAAAAAAull);
        lo = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[0], idx, h8), iq_look512(IQ2S_CODE[0] + 512, idx, h8));
        hi = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[1], idx, h8), iq_look512(IQ2S_CODE[1] + 512, idx, h8));
        sg = _mm256_loadu_si256((const __m256i *)(p + 34));
        mag = IQ2S_MAG64;
    } else if (v == IQ3_XXS) {
        const __m512i idx = _mm512_loadu_si512(p + 2);
        lo = iq_look256(IQ3XXS_CODE[0], idx), hi = iq_look256(IQ3XXS_CODE[1], idx);
        sg = iq_ksigns(_mm256_loadu_si256((const __m256i *)(p + 66)));
        mag = IQ3XXS_MAG64, iq3 = 1;
    } else { /* IQ3_S: 9-bit indices, bit 8 in qh (a bit an entry); the sign bytes as they are */
        const __m512i idx = _mm512_loadu_si512(p + 2);
        uint64_t qh;
        memcpy(&qh, p + 66, 8);
        lo = iq_look512(IQ3S_CODE[0], idx, qh), hi = iq_look512(IQ3S_CODE[1], idx, qh);
        sg = _mm256_loadu_si256((const __m256i *)(p + 74));
        mag = IQ3S_MAG64, iq3 = 1;
    }
    for (int j = 0; j < 4; j++) u->g2[j] = iq_expand(lo, hi, iq3, j, mag);
    _mm256_storeu_si256((__m256i *)u->sg2, sg);
    __m256 a, b;
    iq_scales(p, v, _cvtsh_ss(rd16(p)), &a, &b);
    u->s16 = cat_ps(a, b);
}
#endif

static inline __attribute__((always_inline)) void iq_unpack2(const uint8_t *p, const int v, iq_unpacked2 *u) {
#if IQ_VBMI
    iq_unpack2_vbmi(p, v, u);
    return;
#endif
    __m256 a, b;
    iq_scales(p, v, _cvtsh_ss(rd16(p)), &a, &b);
    u->s16 = cat_ps(a, b);
    for (int i = 0; i < 4; i++) {
        uint32_t s0, s1;
        const __m256i g0 = iq_sub(p, v, 2 * i, &s0), g1 = iq_sub(p, v, 2 * i + 1, &s1);
        u->g2[i] = cat_si(g0, g1);
        u->sg2[i] = (uint64_t)s0 | (uint64_t)s1 << 32;
    }
}

static inline __attribute__((always_inline)) void iq_dots2(const iq_unpacked2 *u, int64_t sb,
                                                           const int8_t *xq, const float *xd, int64_t k,
                                                           const int R, __m512 *acc) {
    const int64_t kb = k / 32;
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 s16[MT]; /* lanes 2 j, 2 j + 1: the scales of sub-block j's halves times x's */
    for (int r = 0; r < R; r++) {
        const __m512 xv = _mm512_castps256_ps512(_mm256_loadu_ps(xd + r * kb + sb * 8));
        s16[r] = _mm512_mul_ps(u->s16, _mm512_permutexvar_ps(dup, xv));
    }
    for (int i = 0; i < 4; i++) {
        const __m512i lane = _mm512_setr_epi32(4 * i, 4 * i, 4 * i, 4 * i, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i + 1,
                                               4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 3, 4 * i + 3,
                                               4 * i + 3, 4 * i + 3);
        const __m512i g = u->g2[i];
        const __mmask64 neg = _cvtu64_mask64(u->sg2[i]);
        for (int r = 0; r < R; r++) {
            const __m512i x = _mm512_loadu_si512(xq + r * k + (sb * 8 + 2 * i) * 32);
            const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
            const __m512i dot = DPBUSD512(_mm512_setzero_si512(), g, xs);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane, s16[r]), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void iq_tile2(const iq_unpacked2 *buf, int64_t c, int64_t nc,
                                                           const int8_t *xq, const float *xd, int64_t k,
                                                           const int R, float *y, int64_t ldy) {
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nc; i++) iq_dots2(&buf[i], c + i, xq, xd, k, R, acc);
    for (int r = 0; r < R; r++) {
        const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
        y[r * ldy] = (c ? y[r * ldy] : 0.0f) + hsum8(s);
    }
}
#endif

#if IQ_VBMI
/* iq_tile2 for one row of x (xq, xd), its outputs [o0, o1) each unpacked a super-block at a time
 * into registers and used at once (no buffer): the same sums in the same order. */
static inline __attribute__((always_inline)) void iq_row1(const uint8_t *q, const int v, int64_t o0, int64_t o1,
                                                          int64_t k, const int8_t *xq, const float *xd, float *y) {
    const int64_t nsb = k / 256, bytes = IQ_BYTES(v), rowbytes = nsb * bytes;
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *wr = q + o * rowbytes;
        for (int64_t c = 0; c < nsb; c += IQ_CHUNK) {
            const int64_t c1 = nsb - c < IQ_CHUNK ? nsb : c + IQ_CHUNK;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = c; i < c1; i++) {
                const uint8_t *p = wr + i * bytes;
                prefetch_block(p, bytes);
                iq_unpacked2 u;
                iq_unpack2(p, v, &u);
                iq_dots2(&u, i, xq, xd, k, 1, &acc);
            }
            const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
            y[o] = (c ? y[o] : 0.0f) + hsum8(s);
        }
    }
}
#endif

#ifndef IQ_VBMI
#define IQ_VBMI 0
#endif

/* The task's outputs, each row unpacked (UNPACK into BUF) IQ_CHUNK super-blocks at a time and
 * read by every tile of x's rows (TILE). */
#define IQ_OUTPUTS(BUF, UNPACK, TILE)                                                              \
    for (int64_t o = o0; o < o1; o++) {                                                            \
        const uint8_t *wr = (const uint8_t *)w->q + o * rowbytes;                                  \
        for (int64_t c = 0; c < nsb; c += IQ_CHUNK) {                                              \
            const int64_t nc = nsb - c < IQ_CHUNK ? nsb - c : IQ_CHUNK;                            \
            for (int64_t i = 0; i < nc; i++) {                                                     \
                const uint8_t *p = wr + (c + i) * bytes;                                           \
                prefetch_block(p, bytes);                                                          \
                switch (v) {                                                                       \
                case IQ2_XXS: UNPACK(p, IQ2_XXS, &BUF[i]); break;                                  \
                case IQ2_XS: UNPACK(p, IQ2_XS, &BUF[i]); break;                                    \
                case IQ2_S: UNPACK(p, IQ2_S, &BUF[i]); break;                                      \
                case IQ3_XXS: UNPACK(p, IQ3_XXS, &BUF[i]); break;                                  \
                default: UNPACK(p, IQ3_S, &BUF[i]); break;                                         \
                }                                                                                  \
            }                                                                                      \
            for (int64_t r0 = ra; r0 < rb; r0 += MT) {                                             \
                const int R = rb - r0 < MT ? (int)(rb - r0) : MT;                                  \
                const int8_t *xt = xb->xq + r0 * k;                                                \
                const float *dt = xb->xd + r0 * kb;                                                \
                float *yo = y + r0 * n + o;                                                        \
                switch (R) {                                                                       \
                case 6: TILE(BUF, c, nc, xt, dt, k, 6, yo, n); break;                              \
                case 5: TILE(BUF, c, nc, xt, dt, k, 5, yo, n); break;                              \
                case 4: TILE(BUF, c, nc, xt, dt, k, 4, yo, n); break;                              \
                case 3: TILE(BUF, c, nc, xt, dt, k, 3, yo, n); break;                              \
                case 2: TILE(BUF, c, nc, xt, dt, k, 2, yo, n); break;                              \
                default: TILE(BUF, c, nc, xt, dt, k, 1, yo, n); break;                             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* mm_task for a grid-quant weight (kind 6, small = the type): the outputs [8 GT t, 8 GT (t + 1))
 * of rows [ra, rb) of x. Each output's row is unpacked IQ_CHUNK super-blocks at a time, once for
 * all the rows of x, in tiles of MT; a row's sums run in the same order whatever M is. */
static void iq_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    const int v = (int)w->small;
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, bytes = IQ_BYTES(v), rowbytes = nsb * bytes;
    const int64_t o0 = t * GT * 8, o1 = o0 + GT * 8 < n ? o0 + GT * 8 : n;
#if IQ_VBMI
    if (rb - ra == 1) {
        const int8_t *xq = xb->xq + ra * k;
        const float *xd = xb->xd + ra * kb;
        float *yr = y + ra * n;
        switch (v) {
        case IQ2_XXS: iq_row1(w->q, IQ2_XXS, o0, o1, k, xq, xd, yr); break;
        case IQ2_XS: iq_row1(w->q, IQ2_XS, o0, o1, k, xq, xd, yr); break;
        case IQ2_S: iq_row1(w->q, IQ2_S, o0, o1, k, xq, xd, yr); break;
        case IQ3_XXS: iq_row1(w->q, IQ3_XXS, o0, o1, k, xq, xd, yr); break;
        default: iq_row1(w->q, IQ3_S, o0, o1, k, xq, xd, yr); break;
        }
        return;
    }
#endif
#if GL_VNNI512
    if (IQ_VBMI || M >= IQ_ZMM_ROWS) {
        iq_unpacked2 buf2[IQ_CHUNK];
        IQ_OUTPUTS(buf2, iq_unpack2, iq_tile2)
        return;
    }
#else
    (void)M;
#endif
    iq_unpacked buf[IQ_CHUNK];
    IQ_OUTPUTS(buf, iq_unpack, iq_tile)
}

/* One row of k values of type v, dequantized: gguf's (scale * grid) * sign, in float32. */
static inline __attribute__((always_inline)) void iq_deq_row(const uint8_t *wr, const int v, int64_t k,
                                                             float *out) {
    const int64_t bytes = IQ_BYTES(v);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *p = wr + sb * bytes;
        float s[16];
        __m256 a, b;
        iq_scales(p, v, _cvtsh_ss(rd16(p)), &a, &b);
        _mm256_storeu_ps(s, a);
        _mm256_storeu_ps(s + 8, b);
        for (int ib = 0; ib < 8; ib++) {
            uint32_t sg;
            uint8_t mag[32];
            _mm256_storeu_si256((__m256i *)mag, iq_sub(p, v, ib, &sg));
            float *o = out + sb * 256 + ib * 32;
            for (int j = 0; j < 4; j++) { /* 8 values: their sign bits -> -1.0 / 1.0 */
                const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(sg >> (8 * j))), bit), bit);
                const __m256 sign = _mm256_or_ps(one, _mm256_castsi256_ps(_mm256_slli_epi32(set, 31)));
                const __m256 gv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mag + 8 * j))));
                const __m256 wv = _mm256_mul_ps(_mm256_set1_ps(s[2 * ib + j / 2]), gv);
                _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(wv, sign));
            }
        }
    }
}

static inline __attribute__((always_inline)) void iq_deq_rows(const uint8_t *q, const int v, int64_t k, const int64_t *ids, int64_t row0,
                        int64_t i0, int64_t i1, float *out) {
    const int64_t rowbytes = k / 256 * IQ_BYTES(v);
    for (int64_t i = i0; i < i1; i++) iq_deq_row(q + (ids ? ids[i] : row0 + i) * rowbytes, v, k, out + i * k);
}

/* out (nrows, k) = rows ids[i] (ids NULL: row0 + i) of the type-v weight q, dequantized. */
void gl_deq_iq(const uint8_t *q, int v, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
               float *out, int nth) {
#pragma omp parallel num_threads(nth) if (nrows * k >= 65536)
    {
        int64_t i0, i1;
        static_chunk(nrows, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
        switch (v) {
        case IQ2_XXS: iq_deq_rows(q, IQ2_XXS, k, ids, row0, i0, i1, out); break;
        case IQ2_XS: iq_deq_rows(q, IQ2_XS, k, ids, row0, i0, i1, out); break;
        case IQ2_S: iq_deq_rows(q, IQ2_S, k, ids, row0, i0, i1, out); break;
        case IQ3_XXS: iq_deq_rows(q, IQ3_XXS, k, ids, row0, i0, i1, out); break;
        default: iq_deq_rows(q, IQ3_S, k, ids, row0, i0, i1, out); break;
        }
    }
}

/* y (M, n) = x (M, k) @ W.T for a grid-quant weight q of type v (the file's rows of n rows). */
void gl_mm_iq(const float *x, int64_t M, int64_t k, const uint8_t *q, int v, int64_t n, float *y,
              int nth) {
    const gl_weight w = {6, 0, 256, v, n, k, q, NULL, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
