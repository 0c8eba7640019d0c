/* The grid quants with AVX-512 VBMI: grid lookups and sign bytes (a part of iquant.c, which includes it). */

#if GL_VNNI512 && defined(__AVX512VBMI__) && defined(__AVX512BITALG__) && defined(__BMI2__)
#define IQ_VBMI 1
/* The grid's code bytes (plane: 256 entries, *_CODE's [0] or [1]) at the indices in idx's bytes
 * (their bit 7 picks the upper 128; vpermi2b reads the low 7). */
static inline __m512i iq_look256(const uint8_t *plane, __m512i idx) {
    const __m512i *t = (const __m512i *)plane;
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), _mm512_permutex2var_epi8(t[0], idx, t[1]),
                                  _mm512_permutex2var_epi8(t[2], idx, t[3]));
}

/* iq_look256 by two masked vpermi2b (each writes its half of the indices), no blend: the tiles'
 * kernels 1.01-1.06x (one thread, alternated; in iq_group's 16 rows 0.99-1.00x, so not there). */
static inline __m512i iq_look256m(const uint8_t *plane, __m512i idx) {
    const __m512i *t = (const __m512i *)plane;
    const __mmask64 hi = _mm512_movepi8_mask(idx);
    return _mm512_mask2_permutex2var_epi8(t[0], _mm512_mask2_permutex2var_epi8(t[2], idx, hi, t[3]), _knot_mask64(hi), t[1]);
}

/* The same for 512 entries, the indices' bit 8 in hi8 (a bit a byte of idx). */
static inline __m512i iq_look512(const uint8_t *plane, __m512i idx, __mmask64 hi8) {
    return _mm512_mask_blend_epi8(hi8, iq_look256(plane, idx), iq_look256(plane + 256, idx));
}

/* iq_look512 (m 0) or the same through iq_look256m (m 1: iq_group_one) */
static inline __m512i iq_look512x(const uint8_t *plane, __m512i idx, __mmask64 hi8, const int m) {
    if (!m) return iq_look512(plane, idx, hi8);
    return _mm512_mask_blend_epi8(hi8, iq_look256m(plane, idx), iq_look256m(plane + 256, idx));
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

/* The codes of two super-blocks pa, pb of an IQ2 type (m: iq_look512x's): *lo, *hi (byte e: the low and high code
 * byte of entry e, pa's 32 entries then pb's; *_CODE's planes) and their sign bytes *sa, *sb (byte
 * e: entry e's 8 values; IQ2_XXS, IQ2_XS: none, iq2_negs_raw makes their masks); their 32 grid indices each
 * looked up in one vector. */
static inline __attribute__((always_inline)) void iq2_codes2(const uint8_t *pa, const uint8_t *pb, const int v, const int m,
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
        lo = iq_look512x(IQ2XS_CODE[0], idx, h8, m), hi = iq_look512x(IQ2XS_CODE[1], idx, h8, m);
        sa = sb = _mm256_setzero_si256(); /* its signs: iq2_negs_raw */
    } else { /* IQ2_S */
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pa + 2))),
                                               _mm256_loadu_si256((const __m256i *)(pb + 2)), 1);
        uint64_t qa, qb;
        memcpy(&qa, pa + 66, 8);
        memcpy(&qb, pb + 66, 8);
        const uint64_t e = 0x5555555555555555ull, o = ~e;
        const __mmask64 h8 = _pext_u64(qa, e) | _pext_u64(qb, e) << 32, h9 = _pext_u64(qa, o) | _pext_u64(qb, o) << 32;
        lo = _mm512_mask_blend_epi8(h9, iq_look512x(IQ2S_CODE[0], idx, h8, m), iq_look512x(IQ2S_CODE[0] + 512, idx, h8, m));
        hi = _mm512_mask_blend_epi8(h9, iq_look512x(IQ2S_CODE[1], idx, h8, m), iq_look512x(IQ2S_CODE[1] + 512, idx, h8, m));
        sa = _mm256_loadu_si256((const __m256i *)(pa + 34)), sb = _mm256_loadu_si256((const __m256i *)(pb + 34));
    }
    *plo = lo, *phi = hi, *psa = sa, *psb = sb;
}
#endif
#ifndef IQ_VBMI
#define IQ_VBMI 0
#endif
