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


#if GL_VNNI512 && defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__BMI2__)
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

/* The sign bytes of 32 7-bit sign indices (KSIGNS: the index and its parity in bit 7), four in
 * each of aux's 32-bit words (bits 0, 7, 14, 21), in their order. */
static inline __m256i iq_ksigns(__m256i aux) {
    const __m256i b = _mm256_multishift_epi64_epi8(_mm256_set1_epi64x(0x352e2720150e0700ll), aux);
    const __m256i m7 = _mm256_set1_epi8(0x7f);
    const __m256i pc = _mm256_popcnt_epi8(_mm256_and_si256(b, m7));
    return _mm256_ternarylogic_epi32(b, _mm256_slli_epi16(pc, 7), m7, 0xE4); /* m7 ? b : pc << 7 */
}

/* The sign bytes of 64 7-bit sign indices (iq_ksigns' 512-bit form): dword o of aux holds four at
 * bits 0, 7, 14, 21; dword o of the result their 32 sign bits (byte e: entry e's 8 values). */
static inline __m512i iq_ksigns512(__m512i aux) {
    const __m512i b = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700ll), aux);
    const __m512i m7 = _mm512_set1_epi8(0x7f);
    const __m512i pc = _mm512_popcnt_epi8(_mm512_and_si512(b, m7));
    return _mm512_ternarylogic_epi32(b, _mm512_slli_epi16(pc, 7), m7, 0xE4); /* m7 ? b : pc << 7 */
}

/* The codes of two super-blocks pa, pb of an IQ2 type: *lo, *hi (byte e: the low and high code
 * byte of entry e, pa's 32 entries then pb's; *_CODE's planes) and their sign bytes *sa, *sb (byte
 * e: entry e's 8 values; IQ2_XXS, IQ2_XS: none, iq2_negs_raw makes their masks); their 32 grid indices each
 * looked up in one vector. */
static inline __attribute__((always_inline)) void iq2_codes2(const uint8_t *pa, const uint8_t *pb, const int v,
                                                             __m512i *plo, __m512i *phi, __m256i *psa, __m256i *psb) {
    __m512i lo, hi;
    __m256i sa, sb;
    if (v == IQ2_XXS) { /* 8 bytes a sub-block: 4 indices (dword u: pa's u < 8, pb's), then signs and ls */
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i idx = _mm512_permutex2var_epi32(_mm512_loadu_si512(pa + 2), ev, _mm512_loadu_si512(pb + 2));
        lo = iq_look256(IQ2XXS_CODE[0], idx), hi = iq_look256(IQ2XXS_CODE[1], idx);
        sa = sb = _mm256_setzero_si256(); /* its signs: iq2_negs_raw */
    } else if (v == IQ2_XS) {
        const __m512i ra = _mm512_loadu_si512(pa + 2), rb = _mm512_loadu_si512(pb + 2);
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(ra)), _mm512_cvtepi16_epi8(rb), 1);
        const __m512i b8 = _mm512_set1_epi16(0x100);
        const __mmask64 h8 = _cvtu64_mask64((uint64_t)_cvtmask32_u32(_mm512_test_epi16_mask(ra, b8)) |
                                            (uint64_t)_cvtmask32_u32(_mm512_test_epi16_mask(rb, b8)) << 32);
        lo = iq_look512(IQ2XS_CODE[0], idx, h8), hi = iq_look512(IQ2XS_CODE[1], idx, h8);
        sa = sb = _mm256_setzero_si256(); /* its signs: iq2_negs_raw */
    } else { /* IQ2_S */
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pa + 2))),
                                               _mm256_loadu_si256((const __m256i *)(pb + 2)), 1);
        uint64_t qa, qb;
        memcpy(&qa, pa + 66, 8);
        memcpy(&qb, pb + 66, 8);
        const uint64_t e = 0x5555555555555555ull, o = ~e;
        const __mmask64 h8 = _pext_u64(qa, e) | _pext_u64(qb, e) << 32, h9 = _pext_u64(qa, o) | _pext_u64(qb, o) << 32;
        lo = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[0], idx, h8), iq_look512(IQ2S_CODE[0] + 512, idx, h8));
        hi = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[1], idx, h8), iq_look512(IQ2S_CODE[1] + 512, idx, h8));
        sa = _mm256_loadu_si256((const __m256i *)(pa + 34)), sb = _mm256_loadu_si256((const __m256i *)(pb + 34));
    }
    *plo = lo, *phi = hi, *psa = sa, *psb = sb;
}

/* ---------------- one to a few rows (iq_group_few): a value order of its own
 *
 * Each output's super-block as four vectors V[k] (k = 0 .. 3) of magnitudes, byte p of V[k] its
 * value 4 p + k, so that a 32-bit lane L of every V[k] holds values of [16 L, 16 L + 16) only:
 * the four VPDPBUSD of a row (V[k] unsigned, x's matching bytes with the output's signs applied,
 * signed) add into one vector whose lane L is the sum of those 16 values (a unit of IQ2_XS and
 * IQ2_S; two lanes one of the others). The IQ3 types' V[k] are a 6-bit code plane of their
 * entries (values 0, 1 or 2, 3: *_PAIR) through a 64-byte table (vpermb), the IQ2 types' the
 * entries' 16-bit codes (4 values' 2-bit codes a byte) through one; a V[k]'s sign bits are
 * picked from the sign bytes (vpshufbitqmb), and x is put in the same order once a row.
 *
 * Where a row's time goes (Zen 4, one thread, 1536 x 2048 in cache, 2026-12-07): ~9.5 ns (~35
 * cycles) an output's super-block for IQ2_XXS, ~8.5 for IQ3_XXS, of which a second row adds only
 * ~2.6: the rest is the per-output unpacking. Left out one at a time (wrong results, timing only):
 * the sign masks (iq_ksigns, iq_negs) 30% of the time, the scales and the sums' transposition into
 * lanes of outputs 18% (IQ2_XXS) and 14% (IQ3_XXS), half of iq_look256's permutes 14%. On Zen 4 a
 * 512-bit vpermb, vpermi2b, vpermd, vpshufb, vpmultishiftqb, vpshufbitqmb, vpmovb2m or VPDPBUSD
 * issues at one a cycle; vpshufbitqmb and kmovq k, m64 share VPDPBUSD's pipes (one a cycle for all),
 * the permutes share theirs with shifts, vpopcntb and conversions. Tried, the same bits, no gain
 * (alternated A/B): the XXS scales from the sign words at hand (0.97-1.03x), IQ2_XXS's indices
 * compacted by two permutes instead of four (0.98-1.01x), two VPDPBUSD chains an output (0.88-1.01x),
 * the 8 output pairs software-pipelined (0.8x, spills), IQ3_XXS's magnitudes looked up from four
 * 256-entry planes without iq3_vals' vpermb (0.79x). */

/* The 64-byte tables of V[k] (iq_vals): t[k][c] the magnitude of the code at bits [b k', ..) of
 * c (IQ3: b = 3, the codes of two values a byte, t[0], t[1]; IQ2: b = 2, four, t[0 .. 2], the
 * fourth's from c >> 6 through t[0]). */
static inline void iq_tables(const int v, __m512i *t) {
    const int iq3 = v == IQ3_XXS || v == IQ3_S;
    const uint8_t *mag = v == IQ2_XXS ? IQ2XXS_MAG64 : v == IQ2_XS ? IQ2XS_MAG64 : v == IQ2_S ? IQ2S_MAG64
                       : v == IQ3_XXS ? IQ3XXS_MAG64 : IQ3S_MAG64;
    const __m512i m = _mm512_load_si512(mag); /* m[c]: the magnitude of code c mod 2^b */
    const __m512i iota = _mm512_set_epi64(0x3f3e3d3c3b3a3938ll, 0x3736353433323130ll, 0x2f2e2d2c2b2a2928ll,
                                          0x2726252423222120ll, 0x1f1e1d1c1b1a1918ll, 0x1716151413121110ll,
                                          0x0f0e0d0c0b0a0908ll, 0x0706050403020100ll);
    t[0] = m;
    for (int k = 1; k < (iq3 ? 2 : 3); k++) {
        const int sh = (iq3 ? 3 : 2) * k; /* bytes 0 .. 63 shifted right: no bit crosses into the next */
        t[k] = _mm512_permutexvar_epi8(_mm512_srli_epi16(iota, sh), m);
    }
}

/* x's 256 values (a super-block's) in V[k]'s order: xk[k] byte p = x[4 p + k]. */
static inline __attribute__((always_inline)) void iq_x4(const int8_t *x, __m512i *xk) {
    const __m512i tr = _mm512_set_epi64(0x3f3b37332f2b2723ll, 0x1f1b17130f0b0703ll, 0x3e3a36322e2a2622ll,
                                        0x1e1a16120e0a0602ll, 0x3d3935312d292521ll, 0x1d1915110d090501ll,
                                        0x3c3834302c282420ll, 0x1c1814100c080400ll); /* byte 16 k + e <- 4 e + k */
    __m512i t[4];
    for (int j = 0; j < 4; j++) t[j] = _mm512_permutexvar_epi8(tr, _mm512_loadu_si512(x + 64 * j));
    /* xk[k] = 128-bit lane k of t[0], t[1], t[2], t[3] */
    const __m512i a = _mm512_shuffle_i32x4(t[0], t[1], 0x44), b = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(t[2], t[3], 0x44), d = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
    xk[0] = _mm512_shuffle_i32x4(a, c, 0x88), xk[1] = _mm512_shuffle_i32x4(a, c, 0xDD);
    xk[2] = _mm512_shuffle_i32x4(b, d, 0x88), xk[3] = _mm512_shuffle_i32x4(b, d, 0xDD);
}

/* The sign masks of V[k] from a super-block's 32 sign bytes S (byte g: values 8 g .. 8 g + 7):
 * bit p of neg[k] the sign of value 4 p + k, from S's dword p / 8 (bits 4 m + k, m = 0 .. 7). */
static inline __attribute__((always_inline)) void iq_negs(__m256i S, __mmask64 *neg) {
    const __m512i q = _mm512_cvtepu32_epi64(S);
    for (int k = 0; k < 4; k++)
        neg[k] = _mm512_bitshuffle_epi64_mask(q, _mm512_set1_epi64(0x1c1814100c080400ll + 0x0101010101010101ll * k));
}

/* IQ2_XXS's and IQ2_XS's iq_negs from super-block p's own words rather than the sign bytes of
 * iq2_codes2 (made after its compaction of the words): qword j of the words is sub-block j (IQ2_XXS:
 * 4 indices then 4 7-bit sign indices; IQ2_XS: 4 words of a 9-bit index and a 7-bit sign index),
 * which iq_ksigns512's steps turn into sign bytes at bytes 0 .. 3 of qword j, where iq_negs'
 * vpshufbitqmb wants them (one row: IQ2_XXS 1.08-1.09x, IQ2_XS 1.02-1.06x, alternated). */
static inline __attribute__((always_inline)) void iq2_negs_raw(const uint8_t *p, const int v, __mmask64 *neg) {
    const long long at = v == IQ2_XXS ? 0x20202020352e2720ll : 0x2020202039291909ll; /* IQ2_XS: bits 9 .. 15 of 4 words */
    const __m512i b = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(at), _mm512_loadu_si512(p + 2));
    const __m512i m7 = _mm512_set1_epi8(0x7f);
    const __m512i pc = _mm512_popcnt_epi8(_mm512_and_si512(b, m7));
    const __m512i q = _mm512_ternarylogic_epi32(b, _mm512_slli_epi16(pc, 7), m7, 0xE4); /* m7 ? b : pc << 7 */
    for (int k = 0; k < 4; k++)
        neg[k] = _mm512_bitshuffle_epi64_mask(q, _mm512_set1_epi64(0x1c1814100c080400ll + 0x0101010101010101ll * k));
}

/* An IQ3 super-block p's V[k] (tables t: iq_tables) and its sign bytes *S. */
static inline __attribute__((always_inline)) void iq3_vals(const uint8_t *p, const int v, const __m512i *t, __m512i *V,
                                                           __m256i *S) {
    const __m512i idx = _mm512_loadu_si512(p + 2);
    __m512i a, b; /* byte e: entry e's codes of values 0, 1 (a), 2, 3 (b) */
    if (v == IQ3_XXS) {
        a = iq_look256(IQ3XXS_PAIR[0], idx), b = iq_look256(IQ3XXS_PAIR[1], idx);
        *S = iq_ksigns(_mm256_loadu_si256((const __m256i *)(p + 66)));
    } else { /* IQ3_S: bit 8 of the indices in qh */
        uint64_t qh;
        memcpy(&qh, p + 66, 8);
        a = iq_look512(IQ3S_PAIR[0], idx, qh), b = iq_look512(IQ3S_PAIR[1], idx, qh);
        *S = _mm256_loadu_si256((const __m256i *)(p + 74));
    }
    V[0] = _mm512_permutexvar_epi8(a, t[0]), V[1] = _mm512_permutexvar_epi8(a, t[1]);
    V[2] = _mm512_permutexvar_epi8(b, t[0]), V[3] = _mm512_permutexvar_epi8(b, t[1]);
}

/* Two IQ2 super-blocks pa, pb's V[k] (Va, Vb) and sign bytes (*Sa, *Sb). */
static inline __attribute__((always_inline)) void iq2_vals2(const uint8_t *pa, const uint8_t *pb, const int v,
                                                            const __m512i *t, __m512i *Va, __m256i *Sa, __m512i *Vb,
                                                            __m256i *Sb) {
    __m512i lo, hi;
    iq2_codes2(pa, pb, v, &lo, &hi, Sa, Sb);
    /* word e: entry e's 16-bit code (byte 2 e: its low byte, 2 e + 1 its high), pa's then pb's */
    const __m512i ia = _mm512_set_epi64(0x5f1f5e1e5d1d5c1cll, 0x5b1b5a1a59195818ll, 0x5717561655155414ll,
                                        0x5313521251115010ll, 0x4f0f4e0e4d0d4c0cll, 0x4b0b4a0a49094808ll,
                                        0x4707460645054404ll, 0x4303420241014000ll);
    const __m512i ib = _mm512_add_epi8(ia, _mm512_set1_epi8(0x20)); /* entries 32 .. 63 */
    const __m512i ca = _mm512_permutex2var_epi8(lo, ia, hi);
    const __m512i cb = _mm512_permutex2var_epi8(lo, ib, hi);
    for (int h = 0; h < 2; h++) {
        const __m512i c = h ? cb : ca;
        __m512i *V = h ? Vb : Va;
        for (int k = 0; k < 3; k++) V[k] = _mm512_permutexvar_epi8(c, t[k]);
        V[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(c, 6), t[0]);
    }
}

#endif
#ifndef IQ_VBMI
#define IQ_VBMI 0
#endif

/* ---------------------------------------------------------------- the products
 *
 * A group of IQ_W outputs (16 with 512-bit VNNI, else 8) is unpacked a super-block at a time
 * into lanes (iq_lanes): its values as signed bytes, 4 consecutive values of each output a
 * 32-bit lane, a vector a chunk of 4 values (s8's layout, quant.c), with each unit's scale (16
 * values for IQ2_XS and IQ2_S, else 32) and each unit's sum times -128 per output. Every row of
 * x then takes a unit's integer dot for all IQ_W outputs in one VPDPBUSD a chunk, against its 4
 * values as unsigned bytes (xu = xq + 128, broadcast) starting from the -128 sum (so the exact
 * sum of xq * w), and one conversion, multiply and FMA a unit:
 *   acc[o] = fma(float(sum of the unit's w * xq), s[o, unit] * xd[block], acc[o])
 * from the row's first unit to its last, in one lane per output. The AVX2 kernels take the same
 * integer sums with maddubs (|w| against x with w's sign: pairs at most 2 * 62 * 127) and round
 * the same float operations in the same order, so every variant and every row count (a decode
 * row, a prompt's tiles) gives the same bits.
 *
 * The unpacking (the grid lookups, the signs, a transposition into lanes) is paid once for all
 * the rows of a chunk of IQ_RC; each row then costs 8 VPDPBUSD and 3 float operations per 16
 * outputs and 32 values, where a row took 4 x 5 instructions per output and 64 values when
 * each output's values were dotted in place (x's sign flip, the dot, its conversion, its scale's
 * lanes, the FMA). Zen 4, one thread, alternated on a loaded machine (2x swings): Qwen3-30B-A3B
 * (6 layers, ~8 rows an expert) pp128 IQ3_XXS 1.15-1.66x the kernels before (1.2-1.56x
 * llama.cpp's -t 1), IQ2_XXS 1.44-1.85x (0.94-1.89x); decode about even (tg32 0.87-1.19x).
 *
 * With VBMI (iq_lanes_fill_t) the lanes are made from the 16 outputs'
 * grid indices and sign words transposed, not from their values: a quarter to an eighth of the
 * bytes through the transposition, each chunk's magnitudes cut straight into the lanes and its
 * sign bits picked from the outputs' (vpshufbitqmb). 2048 x 768, one thread, alternated against
 * the values' transposition (with iq_task's per-type functions): 3-16 rows IQ2_XXS 1.27-1.48x,
 * IQ2_XS 1.10-1.26x, IQ2_S 1.15-1.46x, IQ3_XXS 1.15-1.19x, IQ3_S (later) 7-16 rows 1.03-1.18x;
 * 64 rows 0.97-1.21x (the dots' VPDPBUSD bound; IQ3_S at 64 and 128 rows 0.88-1.06x, noisy). */

#if GL_VNNI512
#define IQ_W 16
#define IQ_MT 8
#else
#define IQ_W 8
#define IQ_MT 4
#endif
/* rows of x a group's super-block is unpacked for, at most: 128 ran 1.1-1.2x faster than 48 at
 * 96-128 rows (one thread, alternated), the unpacking repaid by more rows */
#define IQ_RC 128
#define IQ_UNITS(v) ((v) == IQ2_XS || (v) == IQ2_S ? 16 : 8) /* units of one scale a super-block */

typedef struct {
    int8_t w[64][4 * IQ_W]; /* chunk c (values 4 c .. 4 c + 3): lane o's 4 values, signed */
    int32_t nc[16][IQ_W];   /* per unit: -128 times the sum of its values (VNNI's xu dots) */
    float s[16][IQ_W];      /* per 16 values: the scale */
} iq_lanes;

/* The 256 values of super-block p as signed bytes (nat) and its scales per 16 values (s16). */
static inline __attribute__((always_inline)) void iq_nat(const uint8_t *p, const int v, int8_t *nat,
                                                         float *s16) {
    __m256 a, b;
    iq_scales(p, v, _cvtsh_ss(rd16(p)), &a, &b);
    _mm256_storeu_ps(s16, a);
    _mm256_storeu_ps(s16 + 8, b);
    for (int ib = 0; ib < 8; ib++) {
        uint32_t sg;
        const __m256i g = iq_sub(p, v, ib, &sg);
        _mm256_storeu_si256((__m256i *)(nat + 32 * ib), _mm256_sign_epi8(g, iq_signs(sg)));
    }
}

/* The lanes' transposition: 16 x 16 dwords by attn.c's transpose16 (the files are one unit), 8 x 8 here. */
#if IQ_W == 8
/* r[i] (8 rows of 8 dwords) -> r[j]: dword i of row j in, dword j of row i out. */
static inline __attribute__((always_inline)) void iq_transpose8(__m256i *r) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* b[4 i + m], 128-bit lane L: rows 4 i .. 4 i + 3, column 4 L + m */
        b[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x20);
        r[4 + m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x31);
    }
}
#endif

/* A group reads its IQ_W rows (next: the IQ_W after them) a super-block of each at a time: 16
 * streams, which the hardware's prefetchers left waiting on memory at every group's start (one
 * decode row, IQ2_XXS experts from memory: 0.8x the one stream a row of the kernels before). At
 * its super-block sb it asks for the sb-th IQ_W super-blocks' worth of the next group's bytes,
 * so the next group is in cache when it starts. */
static inline __attribute__((always_inline)) void iq_prefetch_next(const uint8_t *next, int64_t sb, int64_t bytes) {
    for (int64_t o = 0; o < IQ_W * bytes; o += 64) _mm_prefetch((const char *)next + sb * IQ_W * bytes + o, _MM_HINT_T0);
}

/* Super-blocks p[0 .. IQ_W) (one of each output of a group) into lanes. */
static inline __attribute__((always_inline)) void iq_lanes_fill(const uint8_t *const *p, const int v,
                                                                iq_lanes *L) {
    int8_t nat[IQ_W][256] __attribute__((aligned(64)));
    float s16[IQ_W][16] __attribute__((aligned(64)));
    for (int o = 0; o < IQ_W; o++) iq_nat(p[o], v, nat[o], s16[o]);
#if IQ_W == 16
    __m512i r[16];
    for (int j = 0; j < 4; j++) {
        for (int o = 0; o < 16; o++) r[o] = _mm512_load_si512(nat[o] + 64 * j);
        transpose16((__m512 *)r);
        for (int c = 0; c < 16; c++) _mm512_store_si512(L->w[16 * j + c], r[c]);
    }
    for (int o = 0; o < 16; o++) r[o] = _mm512_load_si512(s16[o]);
    transpose16((__m512 *)r);
    for (int u = 0; u < 16; u++) _mm512_store_si512(L->s[u], r[u]);
#else
    __m256i r[8];
    for (int j = 0; j < 8; j++) {
        for (int o = 0; o < 8; o++) r[o] = _mm256_load_si256((const __m256i *)(nat[o] + 32 * j));
        iq_transpose8(r);
        for (int c = 0; c < 8; c++) _mm256_store_si256((__m256i *)L->w[8 * j + c], r[c]);
    }
    for (int h = 0; h < 2; h++) {
        for (int o = 0; o < 8; o++) r[o] = _mm256_load_si256((const __m256i *)(s16[o] + 8 * h));
        iq_transpose8(r);
        for (int u = 0; u < 8; u++) _mm256_store_si256((__m256i *)L->s[8 * h + u], r[u]);
    }
#endif
#if GL_VNNI
    const int units = IQ_UNITS(v), cpu = 64 / units;
    for (int u = 0; u < units; u++) {
#if IQ_W == 16
        const __m512i bias = _mm512_set1_epi8((char)0x80);
        __m512i s = _mm512_setzero_si512();
        for (int c = 0; c < cpu; c++) s = DPBUSD512(s, bias, _mm512_load_si512(L->w[u * cpu + c]));
        _mm512_store_si512(L->nc[u], _mm512_sub_epi32(_mm512_setzero_si512(), s));
#else
        const __m256i bias = _mm256_set1_epi8((char)0x80);
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < cpu; c++) s = DPBUSD(s, bias, _mm256_load_si256((const __m256i *)L->w[u * cpu + c]));
        _mm256_store_si256((__m256i *)L->nc[u], _mm256_sub_epi32(_mm256_setzero_si256(), s));
#endif
    }
#endif
}

#if IQ_VBMI && IQ_W == 16
/* The sign mask of a chunk (bit 4 o + i: output o's value i of the chunk negative) from S (dword o:
 * output o's 32 sign bits of the chunk's 32 values, the chunk's at bits [4 c, 4 c + 4)). */
static inline __mmask64 iq_chunk_neg(__m512i S, int c) {
    const long long lo = 0x03020100ll + 0x04040404ll * c, hi = lo + 0x20202020ll;
    return _mm512_bitshuffle_epi64_mask(S, _mm512_set1_epi64(lo | hi << 32));
}

/* The lanes' chunks 8 ib .. 8 ib + 7 of an IQ2 type: pl[h] (h = 0, 1) byte 4 o + e the low and
 * high code bytes of output o's entry e of sub-block ib, S dword o their 32 sign bits. */
static inline __attribute__((always_inline)) void iq2_chunks(const __m512i *pl, __m512i S, __m512i mag, int ib,
                                                             iq_lanes *L) {
    for (int e = 0; e < 4; e++) {
        const long long c0 = 0x06040200ll + 0x08080808ll * e; /* 2 bits a value: 8 e + 2 i */
        const __m512i cut = _mm512_set1_epi64(c0 | (c0 + 0x20202020ll) << 32);
        for (int h = 0; h < 2; h++) { /* chunk 8 ib + 2 e + h: entry e's values 4 h .. 4 h + 3 */
            const __m512i g = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(cut, pl[h]), mag);
            _mm512_store_si512(L->w[8 * ib + 2 * e + h],
                               _mm512_mask_sub_epi8(g, iq_chunk_neg(S, 2 * e + h), _mm512_setzero_si512(), g));
        }
    }
}

/* The lanes' chunks 4 m .. 4 m + 3 of an IQ3 type: lo, hi byte 4 o + e the code bytes of output
 * o's entry 4 m + e, S dword o the 32 sign bits of its sub-block (m / 2). */
static inline __attribute__((always_inline)) void iq3_chunks(__m512i lo, __m512i hi, __m512i S, __m512i mag, int m,
                                                             iq_lanes *L) {
    const __m512i cut = _mm512_set1_epi64(0x2926232009060300ll); /* 3 bits a value: 0, 3, 6, 9 | 32 .. */
    const __m512i q8 = _mm512_mullo_epi64(_mm512_setr_epi64(0, 8, 16, 24, 32, 40, 48, 56),
                                          _mm512_set1_epi64(0x0101010101010101ll)); /* 8 q a byte */
    for (int e = 0; e < 4; e++) { /* qword q: output 2 q's code at bytes 0, 1, 2 q + 1's at 4, 5 */
        const long long c0 = e | (64 + e) << 8 | e << 16 | (64 + e) << 24, c1 = c0 + 0x04040404ll;
        const __m512i ctrl = _mm512_add_epi8(_mm512_set1_epi64(c0 | c1 << 32), q8);
        const __m512i g = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(cut, _mm512_permutex2var_epi8(lo, ctrl, hi)), mag);
        const int c = 4 * m + e;
        _mm512_store_si512(L->w[c], _mm512_mask_sub_epi8(g, iq_chunk_neg(S, c % 8), _mm512_setzero_si512(), g));
    }
}

/* Two masks of 4 bits an output from 16 outputs' 64-bit words (q0: outputs 0 .. 7, q1: 8 .. 15):
 * bit 4 o + i of *a is bit ctrl[i] of output o's word, of *b bit ctrl[4 + i] (ctrl: one qword's bytes). */
static inline __attribute__((always_inline)) void iq_pick_bits(__m512i q0, __m512i q1, long long ctrl, __mmask64 *a,
                                                               __mmask64 *b) {
    const __m512i c = _mm512_set1_epi64(ctrl);
    const uint64_t m0 = _cvtmask64_u64(_mm512_bitshuffle_epi64_mask(q0, c));
    const uint64_t m1 = _cvtmask64_u64(_mm512_bitshuffle_epi64_mask(q1, c));
    const uint64_t lo = 0x0F0F0F0F0F0F0F0Full, hi = ~lo;
    *a = _cvtu64_mask64(_pext_u64(m0, lo) | _pext_u64(m1, lo) << 32);
    *b = _cvtu64_mask64(_pext_u64(m0, hi) | _pext_u64(m1, hi) << 32);
}

/* The 16 outputs' 8 bytes at offset off of their super-blocks, as qwords: *q0 outputs 0 .. 7, *q1 8 .. 15. */
static inline void iq_qwords(const uint8_t *const *p, int off, __m512i *q0, __m512i *q1) {
    uint64_t t[16] __attribute__((aligned(64)));
    for (int o = 0; o < 16; o++) memcpy(t + o, p[o] + off, 8);
    *q0 = _mm512_load_si512(t), *q1 = _mm512_load_si512(t + 8);
}

/* The 8 dwords at off of the 16 outputs' super-blocks p[o], transposed: U[j] dword o: output o's
 * dword j (iq_transpose8 in each 256-bit half: outputs 0 .. 7 in the low, 8 .. 15 in the high). */
static inline __attribute__((always_inline)) void iq_dwords8(const uint8_t *const *p, int off, __m512i *U) {
    __m512i a[8], b[8];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p[j] + off))),
                                  _mm256_loadu_si256((const __m256i *)(p[j + 8] + off)), 1);
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(b[2 * i], b[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(b[2 * i], b[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int m = 0; m < 4; m++) {
        U[m] = _mm512_permutex2var_epi64(b[m], lo, b[4 + m]);
        U[4 + m] = _mm512_permutex2var_epi64(b[m], hi, b[4 + m]);
    }
}

/* The scales of the 16 outputs' super-blocks p[o] per 16 values (iq_scales' values, the same
 * float operations) in lanes: s[u] lane o, 16 outputs at a time. */
static inline __attribute__((always_inline)) void iq_lane_scales(const uint8_t *const *p, const int v, float (*s)[16]) {
    uint16_t dh[16];
    for (int o = 0; o < 16; o++) dh[o] = rd16(p[o]);
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)), half = _mm512_set1_ps(0.5f);
    if (v == IQ2_XS || v == IQ2_S) { /* 16 4-bit ls, one per 16 values */
        __m512i s0, s1;
        iq_qwords(p, v == IQ2_XS ? 66 : 74, &s0, &s1);
        const __m512i o8 = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
        for (int u = 0; u < 16; u++) {
            const __m512i b = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, s0, _mm512_add_epi32(o8, _mm512_set1_epi32(u / 2)), s1);
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 4 * (u & 1)), _mm512_set1_epi32(15)));
            _mm512_store_ps(s[u], _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(0.25f)));
        }
        return;
    }
    __m512 db[8]; /* one per 32 values */
    if (v == IQ3_S) {
        uint32_t sc[16] __attribute__((aligned(64)));
        for (int o = 0; o < 16; o++) sc[o] = rd32(p[o] + 106);
        const __m512i all = _mm512_load_si512(sc);
        for (int ib = 0; ib < 8; ib++) {
            const __m512i ls = _mm512_and_si512(_mm512_srli_epi32(all, 4 * ib), _mm512_set1_epi32(15));
            db[ib] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_set1_epi32(1), _mm512_add_epi32(ls, ls))));
        }
    } else { /* ls in the top 4 bits of each sub-block's sign word: IQ2_XXS's at 2 + 8 ib + 4, IQ3_XXS's at 66 + 4 ib */
        __m512i A[16];
        if (v == IQ2_XXS) {
            for (int o = 0; o < 16; o++) A[o] = _mm512_loadu_si512(p[o] + 2);
            transpose16((__m512 *)A);
            for (int ib = 0; ib < 8; ib++) A[ib] = A[2 * ib + 1];
        } else {
            iq_dwords8(p, 66, A);
        }
        for (int ib = 0; ib < 8; ib++) {
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_srli_epi32(A[ib], 28));
            db[ib] = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(v == IQ2_XXS ? 0.25f : 0.5f));
        }
    }
    for (int ib = 0; ib < 8; ib++) {
        _mm512_store_ps(s[2 * ib], db[ib]);
        _mm512_store_ps(s[2 * ib + 1], db[ib]);
    }
}

/* iq_lanes_fill_t's IQ3 types: T[m] byte 4 o + e output o's index of entry 4 m + e (chunk 4 m + e),
 * vd the 16 outputs' d. */
static inline __attribute__((always_inline)) void iq3_lanes(const uint8_t *const *p, const int v, const __m512i *T,
                                                            __m512 vd, iq_lanes *L) {
    const __m512 half = _mm512_set1_ps(0.5f);
    __m512i A[8], q0, q1;
    iq_dwords8(p, v == IQ3_XXS ? 66 : 74, A); /* A[ib] dword o: output o's sub-block ib's signs (and ls) */
    if (v == IQ3_S) iq_qwords(p, 66, &q0, &q1); /* qh: bit 8 of entry e's index at its bit e */
    const __m512i mag = _mm512_load_si512(v == IQ3_XXS ? IQ3XXS_MAG64 : IQ3S_MAG64);
    for (int m = 0; m < 16; m += 2) {
        __mmask64 h8[2];
        if (v == IQ3_S)
            iq_pick_bits(q0, q1, 0x0706050403020100ll + 0x0404040404040404ll * m, &h8[0], &h8[1]);
        for (int e = 0; e < 2; e++) {
            const __m512i S = v == IQ3_XXS ? iq_ksigns512(A[(m + e) / 2]) : A[(m + e) / 2];
            if (v == IQ3_XXS)
                iq3_chunks(iq_look256(IQ3XXS_CODE[0], T[m + e]), iq_look256(IQ3XXS_CODE[1], T[m + e]), S, mag, m + e, L);
            else
                iq3_chunks(iq_look512(IQ3S_CODE[0], T[m + e], h8[e]), iq_look512(IQ3S_CODE[1], T[m + e], h8[e]), S,
                           mag, m + e, L);
        }
    }
    if (v == IQ3_S) {
        iq_lane_scales(p, v, L->s);
    } else {
        for (int ib = 0; ib < 8; ib++) {
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_srli_epi32(A[ib], 28));
            const __m512 db = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(0.5f));
            _mm512_store_ps(L->s[2 * ib], db);
            _mm512_store_ps(L->s[2 * ib + 1], db);
        }
    }
}

/* iq_lanes_fill with VBMI: the 16 outputs' grid indices and sign words
 * transposed (16 x 16 dwords, 4 bytes of an output a lane), not their 256 values each, then
 * looked up and cut straight into the lanes, a chunk's sign bits picked from its outputs'
 * (vpshufbitqmb), the scales made in lanes: 4-8x fewer bytes through the transposition. The same
 * lanes (values, scales, nc) as iq_lanes_fill, so the same products. */
static inline __attribute__((always_inline)) void iq_lanes_fill_t(const uint8_t *const *p, const int v,
                                                                  iq_lanes *L) {
    uint16_t dh[16];
    for (int o = 0; o < 16; o++) dh[o] = rd16(p[o]);
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)), half = _mm512_set1_ps(0.5f);
    __m512i T[16];
    for (int o = 0; o < 16; o++) T[o] = _mm512_loadu_si512(p[o] + 2);
    transpose16((__m512 *)T); /* T[m] dword o: output o's dword m of bytes [2, 66) */
    if (v == IQ2_XXS) { /* T[2 ib]: sub-block ib's 4 indices, T[2 ib + 1]: its signs and ls */
        const __m512i mag = _mm512_load_si512(IQ2XXS_MAG64);
        for (int ib = 0; ib < 8; ib++) {
            const __m512i pl[2] = {iq_look256(IQ2XXS_CODE[0], T[2 * ib]), iq_look256(IQ2XXS_CODE[1], T[2 * ib])};
            iq2_chunks(pl, iq_ksigns512(T[2 * ib + 1]), mag, ib, L);
            const __m512 ls = _mm512_cvtepi32_ps(_mm512_srli_epi32(T[2 * ib + 1], 28));
            const __m512 db = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_add_ps(half, ls)), _mm512_set1_ps(0.25f));
            _mm512_store_ps(L->s[2 * ib], db);
            _mm512_store_ps(L->s[2 * ib + 1], db);
        }
    } else if (v == IQ2_XS || v == IQ2_S) {
        const __m512i mag = _mm512_load_si512(v == IQ2_XS ? IQ2XS_MAG64 : IQ2S_MAG64);
        __m512i q0, q1;
        if (v == IQ2_S) iq_qwords(p, 66, &q0, &q1); /* qh: bits 8, 9 of entry 4 ib + e at byte ib's 2 e, 2 e + 1 */
        for (int ib = 0; ib < 8; ib++) {
            __m512i pl[2], S;
            if (v == IQ2_XS) { /* T[2 ib + j] word 2 o + h: entry 4 ib + 2 j + h, 9 bits of index, 7 of signs */
                const __m512i o4 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                      _mm512_set1_epi32(0x04040404));
                const __m512i ev = _mm512_add_epi8(_mm512_set1_epi32(0x42400200), o4); /* byte 4 o + e: entry e's low byte */
                const __m512i idx = _mm512_permutex2var_epi8(T[2 * ib], ev, T[2 * ib + 1]);
                const __m512i hb = _mm512_permutex2var_epi8(T[2 * ib], _mm512_add_epi8(ev, _mm512_set1_epi8(1)), T[2 * ib + 1]);
                const __mmask64 h8 = _mm512_test_epi8_mask(hb, _mm512_set1_epi8(1));
                pl[0] = iq_look512(IQ2XS_CODE[0], idx, h8), pl[1] = iq_look512(IQ2XS_CODE[1], idx, h8);
                const __m512i m7 = _mm512_set1_epi8(0x7f), s7 = _mm512_and_si512(_mm512_srli_epi16(hb, 1), m7);
                const __m512i pc = _mm512_popcnt_epi8(s7);
                S = _mm512_ternarylogic_epi32(s7, _mm512_slli_epi16(pc, 7), m7, 0xE4);
            } else { /* IQ2_S: T[ib] its 4 indices' low bytes, T[8 + ib] their sign bytes */
                __mmask64 h8, h9;
                iq_pick_bits(q0, q1, (0x06040200ll + 0x08080808ll * ib) * 0x0000000100000001ll + 0x0101010100000000ll, &h8, &h9);
                pl[0] = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[0], T[ib], h8), iq_look512(IQ2S_CODE[0] + 512, T[ib], h8));
                pl[1] = _mm512_mask_blend_epi8(h9, iq_look512(IQ2S_CODE[1], T[ib], h8), iq_look512(IQ2S_CODE[1] + 512, T[ib], h8));
                S = T[8 + ib];
            }
            iq2_chunks(pl, S, mag, ib, L);
        }
        iq_lane_scales(p, v, L->s);
    } else {
        iq3_lanes(p, v, T, vd, L);
    }
#if GL_VNNI
    const int units = IQ_UNITS(v), cpu = 64 / units;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int u = 0; u < units; u++) {
        __m512i s = _mm512_setzero_si512();
        for (int c = 0; c < cpu; c++) s = DPBUSD512(s, bias, _mm512_load_si512(L->w[u * cpu + c]));
        _mm512_store_si512(L->nc[u], _mm512_sub_epi32(_mm512_setzero_si512(), s));
    }
#endif
}
#endif

/* acc[o] of R rows (accm: R x IQ_W floats; first: start from 0) += super-block sb of the lanes L
 * against the rows r0 .. r0 + R - 1 of x (xb). */
static inline __attribute__((always_inline)) void iq_lanes_dots(const iq_lanes *L, const int v, int64_t sb,
                                                                const xbuf *xb, int64_t r0, int64_t k,
                                                                const int R, float *accm, int first) {
    const int units = IQ_UNITS(v), cpu = 64 / units;
    const int64_t kb = k / 32;
    const float *xd = xb->xd + r0 * kb + sb * 8;
#if GL_VNNI
    /* x's 256 values as unsigned bytes (every caller takes xu for kind 6 with VNNI: xbuf_take) */
    const uint8_t *xu = xb->xu + r0 * k + sb * 256;
#else
    const int8_t *xq = xb->xq + r0 * k + sb * 256;
    const __m256i ones = _mm256_set1_epi16(1);
#endif
#if IQ_W == 16
    __m512 acc[IQ_MT];
    for (int r = 0; r < R; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(accm + r * 16);
    for (int u = 0; u < units; u++) {
        __m512i I[IQ_MT];
        const __m512i nc = _mm512_load_si512(L->nc[u]);
        for (int r = 0; r < R; r++) I[r] = nc;
        for (int c = u * cpu; c < u * cpu + cpu; c++) {
            const __m512i wv = _mm512_load_si512(L->w[c]);
            for (int r = 0; r < R; r++) I[r] = DPBUSD512(I[r], _mm512_set1_epi32((int)rd32(xu + r * k + 4 * c)), wv);
        }
        const __m512 s = _mm512_load_ps(L->s[u * (16 / units)]);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(s, _mm512_set1_ps(xd[r * kb + u * cpu / 8])), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(accm + r * 16, acc[r]);
#else
    __m256 acc[IQ_MT];
    for (int r = 0; r < R; r++) acc[r] = first ? _mm256_setzero_ps() : _mm256_load_ps(accm + r * 8);
    for (int u = 0; u < units; u++) {
        __m256i I[IQ_MT];
        for (int c = u * cpu; c < u * cpu + cpu; c++) {
            const __m256i wv = _mm256_load_si256((const __m256i *)L->w[c]);
#if GL_VNNI
            if (c == u * cpu)
                for (int r = 0; r < R; r++) I[r] = _mm256_load_si256((const __m256i *)L->nc[u]);
            for (int r = 0; r < R; r++) I[r] = DPBUSD(I[r], _mm256_set1_epi32((int)rd32(xu + r * k + 4 * c)), wv);
#else
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < R; r++) {
                const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32((int)rd32((const uint8_t *)xq + r * k + 4 * c)), wv);
                const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
                I[r] = c == u * cpu ? d : _mm256_add_epi32(I[r], d);
            }
#endif
        }
        const __m256 s = _mm256_load_ps(L->s[u * (16 / units)]);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(s, _mm256_set1_ps(xd[r * kb + u * cpu / 8])), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_store_ps(accm + r * 8, acc[r]);
#endif
}

/* The outputs [og, og + nv) (nv <= IQ_W) of rows [ra, rb) of x: each super-block of the group
 * unpacked into lanes once for every IQ_RC rows. */
static inline __attribute__((always_inline)) void iq_group(const gl_weight *w, const int v, const xbuf *xb,
                                                           int64_t ra, int64_t rb, int64_t og, int nv,
                                                           float *y) {
    const int64_t n = w->n, k = w->k, nsb = k / 256, bytes = IQ_BYTES(v), rowbytes = nsb * bytes;
    const uint8_t *row[IQ_W]; /* the outputs past nv repeat the last (their sums are dropped) */
    for (int o = 0; o < IQ_W; o++) row[o] = (const uint8_t *)w->q + (og + (o < nv ? o : nv - 1)) * rowbytes;
    iq_lanes L __attribute__((aligned(64)));
    float acc[IQ_RC * IQ_W] __attribute__((aligned(64)));
    for (int64_t r0 = ra; r0 < rb; r0 += IQ_RC) {
        const int64_t r1 = rb - r0 < IQ_RC ? rb : r0 + IQ_RC;
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *p[IQ_W];
            for (int o = 0; o < IQ_W; o++) p[o] = row[o] + sb * bytes;
            iq_prefetch_next(row[0] + IQ_W * rowbytes, sb, bytes);
#if IQ_VBMI && IQ_W == 16
            iq_lanes_fill_t(p, v, &L);
#else
            iq_lanes_fill(p, v, &L);
#endif
            for (int64_t t0 = r0; t0 < r1; t0 += IQ_MT) {
                const int R = r1 - t0 < IQ_MT ? (int)(r1 - t0) : IQ_MT;
                float *am = acc + (t0 - r0) * IQ_W;
#define IQD(RR) iq_lanes_dots(&L, v, sb, xb, t0, k, RR, am, sb == 0)
                switch (R) {
#if IQ_MT == 8
                case 8: IQD(8); break;
                case 7: IQD(7); break;
                case 6: IQD(6); break;
                case 5: IQD(5); break;
#endif
                case 4: IQD(4); break;
                case 3: IQD(3); break;
                case 2: IQD(2); break;
                default: IQD(1); break;
                }
#undef IQD
            }
        }
        for (int64_t r = r0; r < r1; r++)
            memcpy(y + r * n + og, acc + (r - r0) * IQ_W, sizeof(float) * (size_t)nv);
    }
}

#if IQ_VBMI
#define IQ_FEW 4 /* rows of x iq_group_few takes at most */
/* the rows it takes of each type: past them the lanes (iq_group) ran faster, one thread, 2048 x 768,
 * alternated: its 4th row 0.93-0.95x theirs for IQ2_XXS and IQ2_S, its 5th 0.72-0.98x */
#define IQ_FEW_ROWS(v) ((v) == IQ2_XXS || (v) == IQ2_S ? 3 : 4)

/* 0.5 + ls of the 8 units of an XXS type's super-block p, in float32 (iq_scales' sum) */
static inline __attribute__((always_inline)) __m256 iq_xxs_half_ls(const uint8_t *p, const int v) {
    __m256i aux;
    if (v == IQ2_XXS) { /* ls in the top 4 bits of the second word of each 8 bytes */
        const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
        aux = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p + 2)), odd),
                                 _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p + 34)), odd), 0xF0);
    } else {
        aux = _mm256_loadu_si256((const __m256i *)(p + 66));
    }
    return _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_cvtepi32_ps(_mm256_srli_epi32(aux, 28)));
}
#define IQ_SHUF(a, b, imm) _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), imm))

/* The units' sums of outputs 4 q .. 4 q + 3 (a[i]: output 4 q + i, lane L the sum of its values
 * [16 L, 16 L + 16)) into d[i] (i < units / 4): in 128-bit lane l the lanes units / 4 l + i of
 * each, its units 2 l + i (pairs of lanes added) or 4 l + i. */
static inline __attribute__((always_inline)) void iq_few_sums(const __m512i *a, const int units, __m512i *d) {
    if (units == 8) { /* 128-bit lane l: [4q's 2l, 2l+1, 4q+1's 2l, 2l+1], then the units 2 l, 2 l + 1 of four */
        const __m512i ab = _mm512_add_epi32(IQ_SHUF(a[0], a[1], 0x88), IQ_SHUF(a[0], a[1], 0xDD));
        const __m512i cd = _mm512_add_epi32(IQ_SHUF(a[2], a[3], 0x88), IQ_SHUF(a[2], a[3], 0xDD));
        d[0] = IQ_SHUF(ab, cd, 0x88), d[1] = IQ_SHUF(ab, cd, 0xDD);
    } else {
        const __m512i ab0 = _mm512_unpacklo_epi32(a[0], a[1]), ab1 = _mm512_unpackhi_epi32(a[0], a[1]);
        const __m512i cd0 = _mm512_unpacklo_epi32(a[2], a[3]), cd1 = _mm512_unpackhi_epi32(a[2], a[3]);
        d[0] = _mm512_unpacklo_epi64(ab0, cd0), d[1] = _mm512_unpackhi_epi64(ab0, cd0);
        d[2] = _mm512_unpacklo_epi64(ab1, cd1), d[3] = _mm512_unpackhi_epi64(ab1, cd1);
    }
}

/* acc + one row's super-block: D[q] (iq_few_sums' of outputs 4 q ..) with 128-bit lanes transposed
 * into U[u] (lane o: output o's unit u), each unit's FMA in order with s (iq_group_few's scales)
 * and xd (the row's scales of x of the super-block). */
static inline __attribute__((always_inline)) __m512 iq_few_acc(__m512i (*D)[4], const __m512 *s, const float *xd,
                                                               const int units, __m512 acc) {
    const int nd = units / 4;
    __m512i U[16];
    for (int i = 0; i < nd; i++) { /* 128-bit lane l of D[q][i] -> 128-bit lane q of U[nd l + i] */
        const __m512i c0 = _mm512_shuffle_i32x4(D[0][i], D[1][i], 0x44), c1 = _mm512_shuffle_i32x4(D[0][i], D[1][i], 0xEE);
        const __m512i c2 = _mm512_shuffle_i32x4(D[2][i], D[3][i], 0x44), c3 = _mm512_shuffle_i32x4(D[2][i], D[3][i], 0xEE);
        U[i] = _mm512_shuffle_i32x4(c0, c2, 0x88), U[nd + i] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        U[2 * nd + i] = _mm512_shuffle_i32x4(c1, c3, 0x88), U[3 * nd + i] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
    for (int u = 0; u < units; u++) {
        const __m512 sx = units == 16 ? _mm512_mul_ps(s[u], _mm512_set1_ps(xd[u / 2]))
                                      : _mm512_mul_ps(s[2 * u], _mm512_set1_ps(xd[u]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(U[u]), sx, acc);
    }
    return acc;
}

/* iq_group for R <= IQ_FEW rows: each output's values dotted in place with the rows' x (the signs
 * onto x, as llama.cpp's kernels) in iq_vals' order, a lane's 16 values for a row in one vector
 * of four VPDPBUSD, and those vectors of the group's 16 outputs summed into the units' sums in
 * lanes of outputs (pairs of lanes added and interleaved within 128-bit lanes, then 128-bit lanes
 * transposed): the same integer sums as the lanes' dots, then the same float operations, so the
 * same bits, without the unpacking into lanes that few rows do not repay. */
static inline __attribute__((always_inline)) void iq_group_few(const gl_weight *w, const int v, const xbuf *xb,
                                                               int64_t ra, const int R, int64_t og, int nv,
                                                               float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, bytes = IQ_BYTES(v), rowbytes = nsb * bytes;
    const int units = IQ_UNITS(v);
    const int xxs = v == IQ2_XXS || v == IQ3_XXS, iq3 = v == IQ3_XXS || v == IQ3_S;
    const uint8_t *row[16];
    for (int o = 0; o < 16; o++) row[o] = (const uint8_t *)w->q + (og + (o < nv ? o : nv - 1)) * rowbytes;
    __m512i t[3];
    iq_tables(v, t);
    __m512 acc[IQ_FEW];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        float s16[16][16] __attribute__((aligned(64))), hl[16][8] __attribute__((aligned(32)));
        uint16_t dh[16];
        __m512i xk[IQ_FEW][4], D[IQ_FEW][4][4]; /* D[r][q][i]: outputs 4 q .. 4 q + 3, in 128-bit lane l the
                                                   lanes nd l + i of each (units 2 l + i, or 4 l + i) */
        for (int r = 0; r < R; r++) iq_x4(xb->xq + (ra + r) * k + sb * 256, xk[r]);
        iq_prefetch_next(row[0] + 16 * rowbytes, sb, bytes);
        const uint8_t *ps[16];
        for (int o = 0; o < 16; o++) ps[o] = row[o] + sb * bytes;
        /* s16[u] lane o: output o's scale of values 16 u ..; the XXS types' ls each output's at once and
         * transposed (iq_lane_scales: 0.95-0.96x at one row) */
        if (!xxs) iq_lane_scales(ps, v, s16);
        for (int q = 0; q < 4; q++) {
            __m512i P[IQ_FEW][4]; /* [r][i]: output 4 q + i, lane L: the sum of its values [16 L, 16 L + 16) */
            for (int i = 0; i < 4; i += 2) { /* outputs 4 q + i, 4 q + i + 1 */
                __m512i V[2][4];
                __m256i S[2];
                if (iq3) {
                    iq3_vals(ps[4 * q + i], v, t, V[0], &S[0]);
                    iq3_vals(ps[4 * q + i + 1], v, t, V[1], &S[1]);
                } else {
                    iq2_vals2(ps[4 * q + i], ps[4 * q + i + 1], v, t, V[0], &S[0], V[1], &S[1]);
                }
                for (int h = 0; h < 2; h++) {
                    if (xxs) { /* their d and 0.5 + ls, the scales made in lanes below */
                        dh[4 * q + i + h] = rd16(ps[4 * q + i + h]);
                        _mm256_store_ps(hl[4 * q + i + h], iq_xxs_half_ls(ps[4 * q + i + h], v));
                    }
                    __mmask64 neg[4];
                    if (v == IQ2_XXS || v == IQ2_XS)
                        iq2_negs_raw(ps[4 * q + i + h], v, neg);
                    else
                        iq_negs(S[h], neg);
                    for (int r = 0; r < R; r++) {
                        __m512i d = _mm512_setzero_si512();
                        for (int j = 0; j < 4; j++)
                            d = DPBUSD512(d, V[h][j], _mm512_mask_sub_epi8(xk[r][j], neg[j], _mm512_setzero_si512(), xk[r][j]));
                        P[r][i + h] = d;
                    }
                }
            }
            for (int r = 0; r < R; r++) iq_few_sums(P[r], units, D[r][q]);
        }
        __m512 s[16];
        if (xxs) { /* iq_scales' (d * (0.5 + ls)) * 0.25 or 0.5, in lanes: s[2 u] lane o output o's unit u */
            const uint8_t *hp[16];
            for (int o = 0; o < 16; o++) hp[o] = (const uint8_t *)hl[o];
            __m512i H[8];
            iq_dwords8(hp, 0, H);
            const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
            const __m512 f = _mm512_set1_ps(v == IQ2_XXS ? 0.25f : 0.5f);
            for (int u = 0; u < 8; u++) s[2 * u] = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_castsi512_ps(H[u])), f);
        } else {
            for (int u = 0; u < 16; u++) s[u] = _mm512_load_ps(s16[u]);
        }
        for (int r = 0; r < R; r++) acc[r] = iq_few_acc(D[r], s, xb->xd + (ra + r) * kb + sb * 8, units, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float o16[16];
        _mm512_storeu_ps(o16, acc[r]);
        memcpy(y + (ra + r) * n + og, o16, sizeof(float) * (size_t)nv);
    }
}
#endif

#if IQ_VBMI
/* iq_group_few of rb - ra rows (at most IQ_FEW) */
static inline __attribute__((always_inline)) void iq_few(const gl_weight *w, const int v, const xbuf *xb, int64_t ra,
                                                         int64_t rb, int64_t og, int nv, float *y) {
    switch (rb - ra) {
    case 4: iq_group_few(w, v, xb, ra, 4, og, nv, y); return;
    case 3: iq_group_few(w, v, xb, ra, 3, og, nv, y); return;
    case 2: iq_group_few(w, v, xb, ra, 2, og, nv, y); return;
    default: iq_group_few(w, v, xb, ra, 1, og, nv, y); return;
    }
}
#endif

/* The outputs [og, og + nv) of rows [ra, rb) of x of one type: iq_group, or iq_group_few for up to
 * IQ_FEW_ROWS rows where it is built; each a function of its own for each type: inlined all five
 * into iq_task, the compiler's one function for them all ran IQ2_XXS's 3-16 rows at 0.7-0.9x and
 * IQ3_S's 8-16 at 0.9x these, and iq_group_few inlined beside iq_group, IQ2_S's 4 and 5 rows
 * (iq_group) at 0.94x (one thread, alternated). */
#if IQ_VBMI
#define IQ_FEW_OF(V, NAME)                                                                           \
    static __attribute__((noinline)) void NAME##_few(const gl_weight *w, const xbuf *xb, int64_t ra, \
                                                     int64_t rb, int64_t og, int nv, float *y) {     \
        iq_few(w, V, xb, ra, rb, og, nv, y);                                                         \
    }
#define IQ_FEW_CALL(V, NAME)                                                                         \
    if (rb - ra <= IQ_FEW_ROWS(V)) {                                                                 \
        NAME##_few(w, xb, ra, rb, og, nv, y);                                                        \
        return;                                                                                      \
    }
#else
#define IQ_FEW_OF(V, NAME)
#define IQ_FEW_CALL(V, NAME)
#endif
#define IQ_OUTPUTS_OF(V, NAME)                                                                           \
    IQ_FEW_OF(V, NAME)                                                                                   \
    static __attribute__((noinline)) void NAME##_lanes(const gl_weight *w, const xbuf *xb, int64_t ra,   \
                                                       int64_t rb, int64_t og, int nv, float *y) {       \
        iq_group(w, V, xb, ra, rb, og, nv, y);                                                           \
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
        case IQ2_XXS: iq_outputs_iq2_xxs(w, xb, ra, rb, og, nv, y); break;
        case IQ2_XS: iq_outputs_iq2_xs(w, xb, ra, rb, og, nv, y); break;
        case IQ2_S: iq_outputs_iq2_s(w, xb, ra, rb, og, nv, y); break;
        case IQ3_XXS: iq_outputs_iq3_xxs(w, xb, ra, rb, og, nv, y); break;
        default: iq_outputs_iq3_s(w, xb, ra, rb, og, nv, y); break;
        }
    }
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
