/* One row of IQ2_XS, IQ2_S and IQ3_S read in place (iq_group_one): x's signs in the values (a part
 * of iquant.c, which includes it after iq_few.c).
 *
 * These types have no tiles (iquant.c's header), so one row went through iq_group_few, whose time
 * at one row went to the sign masks a super-block (4 vpshufbitqmb, on the pipes VPDPBUSD issues
 * on) and the masked subtractions that put them on x. With one row, x's signs fold into the
 * weights' as in iq2_tiles_one (|x| the unsigned operand, the values signed: the same integers):
 * the super-block's 256 sign bits (the file's bytes, IQ2_XS's KSIGNS of its 7-bit indices) xored
 * with x's, and the sign bits of values 4 p .. 4 p + 3 moved beside byte p's codes (one
 * vpmultishiftqb a pair of values) as the index of a table of signed values. The rest is
 * iq_group_few's: its value order, its lookups of the codes (through iq_look256m, no blends inside
 * a 256-entry half), its sums' transposition into lanes of outputs and its scales' float
 * operations (0.5 + ls or 1 + 2 ls by vpermps of the nibble), so the same integer sums and float
 * operations, the same bits.
 *
 * One thread, alternated 11 rounds, against the library built with -DIQ_GROUP_ONE=0 (768 x 2048,
 * 2048 x 768, 2048 x 2048, Zen 4, in cache / from memory): IQ2_XS 1.16-1.17x (~11.5 -> ~9.9 ns an
 * output's super-block), IQ2_S 1.13-1.16x (~12.5 -> ~10.9), IQ3_S 1.11-1.13x in cache (~9.8 ->
 * ~8.8), 1.10-1.17x from memory (~15 -> ~13: 16 rows' streams at once, ~8 GB/s a thread).
 * Left out one at a time (wrong results, timing only): the grid lookups 23-38% of the time, the
 * scales 11-17% (before vpermps; after it IQ2_XS 15%, IQ3_S 10%, IQ2_S 0%), the sums'
 * transposition 6%. Tried: the masked lookups alone 1.00-1.02x, IQ2_XS's signs by vpermi2b of
 * KSIGNS 1.02x, the scales made after the products 1.02-1.06x (all kept); asking for each row's
 * super-block 2 or 4 ahead in place of the next group's bytes 0.6-0.8x, the scales' words by
 * vpgatherdd (no copy through the stack) 0.97-0.98x (both dropped). What is left
 * wants tiles (docs/design-notes.md). */

#if IQ_VBMI
#ifndef IQ_GROUP_ONE
#define IQ_GROUP_ONE 1 /* 0: one row of these types through iq_group_few (the A/B's old side) */
#endif
#if IQ_GROUP_ONE
/* The signed values' tables: IQ2 types T[0][c] the value of code bits 0-1 and sign bit 4 of c,
 * T[1] of bits 2-3 and sign bit 5; IQ3_S T[0], T[1] 128 entries (vpermi2b) of code bits 0-2 and
 * sign bit 6, T[2] of bits 1-3 and sign bit 5. */
static inline void iq_one_tables(const int v, __m512i *T) {
    const __m512i m = _mm512_load_si512(v == IQ3_S ? IQ3S_MAG64 : v == IQ2_XS ? IQ2XS_MAG64 : IQ2S_MAG64);
    const __m512i iota = _mm512_set_epi64(0x3f3e3d3c3b3a3938ll, 0x3736353433323130ll, 0x2f2e2d2c2b2a2928ll,
                                          0x2726252423222120ll, 0x1f1e1d1c1b1a1918ll, 0x1716151413121110ll,
                                          0x0f0e0d0c0b0a0908ll, 0x0706050403020100ll);
    const __m512i z = _mm512_setzero_si512();
    if (v == IQ3_S) { /* m[c]: the magnitude of code c mod 8 */
        T[0] = m, T[1] = _mm512_sub_epi8(z, m);
        const __m512i m1 = _mm512_permutexvar_epi8(_mm512_srli_epi16(iota, 1), m);
        T[2] = _mm512_mask_sub_epi8(m1, _mm512_test_epi8_mask(iota, _mm512_set1_epi8(0x20)), z, m1);
    } else { /* m[c]: the magnitude of code c mod 4 */
        T[0] = _mm512_mask_sub_epi8(m, _mm512_test_epi8_mask(iota, _mm512_set1_epi8(0x10)), z, m);
        const __m512i m2 = _mm512_permutexvar_epi8(_mm512_srli_epi16(iota, 2), m);
        T[1] = _mm512_mask_sub_epi8(m2, _mm512_test_epi8_mask(iota, _mm512_set1_epi8(0x20)), z, m2);
    }
}

/* x's super-block x (256 codes): xa[k] its magnitudes in iq_x4's order (byte p: x[4 p + k]), *xs
 * its sign bits (qword j: those of x[32 j ..] at bits 0 .. 31, as the weights' Q below). */
static inline __attribute__((always_inline)) void iq_one_x(const int8_t *x, __m512i *xa, __m512i *xs) {
    __m512i xk[4];
    iq_x4(x, xk);
    for (int j = 0; j < 4; j++) xa[j] = _mm512_abs_epi8(xk[j]);
    uint64_t b[4];
    for (int h = 0; h < 4; h++) b[h] = _cvtmask64_u64(_mm512_movepi8_mask(_mm512_loadu_si512(x + 64 * h)));
    *xs = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)b));
}

/* vpmultishiftqb's offsets: byte b of a qword takes bits 4 b - 4 .. (bits 4-7: those of values
 * 4 p .. 4 p + 3, p = 8 j + b), or 4 b - 2 .. (bits 4, 5: values 4 p + 2, 4 p + 3) */
#define IQ_ONE_AT01 0x1814100c0804003cll
#define IQ_ONE_AT23 0x1a16120e0a06023ell

/* An IQ2 output's signed V[k] from its codes c (byte p: values 4 p .. 4 p + 3's 2-bit codes) and
 * Q, its sign bits xor x's (qword j: values 32 j .. 32 j + 31 at bits 0 .. 31): pairs (0, 1) and
 * (2, 3) of a byte as vpermb indices of two codes and two signs. */
static inline __attribute__((always_inline)) void iq2_one_signed(__m512i c, __m512i Q, const __m512i *T, __m512i *V) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i n01 = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(IQ_ONE_AT01), Q);
    const __m512i n23 = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(IQ_ONE_AT23), Q);
    const __m512i i01 = _mm512_ternarylogic_epi32(low4, c, n01, 0xCA); /* low4 ? c : n01 */
    const __m512i i23 = _mm512_ternarylogic_epi32(low4, _mm512_srli_epi16(c, 4), n23, 0xCA);
    V[0] = _mm512_permutexvar_epi8(i01, T[0]), V[1] = _mm512_permutexvar_epi8(i01, T[1]);
    V[2] = _mm512_permutexvar_epi8(i23, T[0]), V[3] = _mm512_permutexvar_epi8(i23, T[1]);
}

/* IQ3_S's likewise from an output's code bytes a, b (iq3_codes): a pair's two signs at bits 6, 7
 * of its index byte, value 4 p + 2 i through vpermi2b (7 bits), 4 p + 2 i + 1 through vpermb of
 * the byte shifted down by 2 (as iq3_one_vals) */
static inline __attribute__((always_inline)) void iq3_one_signed(__m512i a, __m512i b, __m512i Q, const __m512i *T,
                                                                 __m512i *V) {
    const __m512i m6 = _mm512_set1_epi8(0x3f);
    const __m512i N = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(IQ_ONE_AT01), Q);
    const __m512i ia = _mm512_ternarylogic_epi32(m6, a, _mm512_slli_epi16(N, 2), 0xCA), ib = _mm512_ternarylogic_epi32(m6, b, N, 0xCA);
    V[0] = _mm512_permutex2var_epi8(T[0], ia, T[1]), V[1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(ia, 2), T[2]);
    V[2] = _mm512_permutex2var_epi8(T[0], ib, T[1]), V[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(ib, 2), T[2]);
}

/* IQ2_XS's super-block p's sign bits (qword j: sub-block j's 32 at bits 0 .. 31): its 7-bit sign
 * indices (bits 9-15 of 4 words a qword) through KSIGNS by vpermi2b (its parity by vpopcntb, as
 * iq2_signq_raw: 0.98x) */
static inline __attribute__((always_inline)) __m512i iq2_xs_one_signs(const uint8_t *p) {
    const __m512i b = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x2020202039291909ll), _mm512_loadu_si512(p + 2));
    return _mm512_permutex2var_epi8(_mm512_loadu_si512(KSIGNS), b, _mm512_loadu_si512(KSIGNS + 64));
}

/* Outputs 2 q2, 2 q2 + 1's sums of a row's super-block (P[h], lane L: the sum of its values
 * [16 L, 16 L + 16)), super-blocks p0, p1, x's magnitudes xa and signs xs */
static inline __attribute__((always_inline)) void iq_one_pair(const uint8_t *p0, const uint8_t *p1, const int v,
                                                              const __m512i *xa, __m512i xs, const __m512i *T,
                                                              __m512i *P) {
    __m512i V[2][4];
    if (v == IQ3_S) {
        for (int h = 0; h < 2; h++) {
            __m512i a, b;
            __m256i S;
            iq3_codes(h ? p1 : p0, v, 1, &a, &b, &S); /* (m 1: iq_look256m) */
            iq3_one_signed(a, b, _mm512_xor_si512(_mm512_cvtepu32_epi64(S), xs), T, V[h]);
        }
    } else {
        __m512i c[2];
        __m256i S[2];
        iq2_codes_two(p0, p1, v, 1, &c[0], &S[0], &c[1], &S[1]); /* (m 1: iq_look256m) */
        for (int h = 0; h < 2; h++) {
            const __m512i Q = v == IQ2_XS ? iq2_xs_one_signs(h ? p1 : p0) : _mm512_cvtepu32_epi64(S[h]);
            iq2_one_signed(c[h], _mm512_xor_si512(Q, xs), T, V[h]);
        }
    }
    for (int h = 0; h < 2; h++) {
        __m512i d = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) d = DPBUSD512(d, xa[j], V[h][j]);
        P[h] = d;
    }
}

/* iq_lane_scales' s (s[u] lane o: output o's scale of values [16 u, 16 u + 16)) of the 16 outputs'
 * super-blocks p[o] with the same float operations, 0.5 + ls (IQ2) or 1 + 2 ls (IQ3_S) looked up
 * by vpermps of the 4-bit ls (which reads an index's low 4 bits: no masking, no conversion) */
static inline __attribute__((always_inline)) void iq_one_scales(const uint8_t *const *p, const int v, __m512 *s) {
    static const float HALF[16] __attribute__((aligned(64))) = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f, 7.5f,
                                                                8.5f, 9.5f, 10.5f, 11.5f, 12.5f, 13.5f, 14.5f, 15.5f};
    static const float ODD[16] __attribute__((aligned(64))) = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    uint16_t dh[16];
    for (int o = 0; o < 16; o++) dh[o] = rd16(p[o]);
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh));
    if (v == IQ3_S) { /* one per 32 values: d * (1 + 2 ls) */
        uint32_t sc[16] __attribute__((aligned(64)));
        for (int o = 0; o < 16; o++) sc[o] = rd32(p[o] + 106);
        const __m512i all = _mm512_load_si512(sc);
        const __m512 odd = _mm512_load_ps(ODD);
        for (int ib = 0; ib < 8; ib++)
            s[2 * ib] = s[2 * ib + 1] = _mm512_mul_ps(vd, _mm512_permutexvar_ps(_mm512_srli_epi32(all, 4 * ib), odd));
        return;
    }
    __m512i q0, q1; /* 16 4-bit ls an output, one per 16 values: (d * (0.5 + ls)) * 0.25 */
    iq_qwords(p, v == IQ2_XS ? 66 : 74, &q0, &q1);
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i L = _mm512_permutex2var_epi32(q0, ev, q1);
    const __m512i H = _mm512_permutex2var_epi32(q0, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), q1);
    const __m512 half = _mm512_load_ps(HALF), f = _mm512_set1_ps(0.25f);
    for (int u = 0; u < 16; u++) {
        const __m512i ls = _mm512_srli_epi32(u < 8 ? L : H, 4 * (u % 8));
        s[u] = _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_permutexvar_ps(ls, half)), f);
    }
}

/* iq_group_few of IQ2_XS, IQ2_S or IQ3_S for the one row ra: the same products */
static inline __attribute__((always_inline)) void iq_group_one(const gl_weight *w, const int v, const xbuf *xb,
                                                               int64_t ra, int64_t og, int nv, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, bytes = IQ_BYTES(v), rowbytes = nsb * bytes;
    const int units = IQ_UNITS(v);
    const uint8_t *row[16];
    for (int o = 0; o < 16; o++) row[o] = (const uint8_t *)w->q + (og + (o < nv ? o : nv - 1)) * rowbytes;
    __m512i T[3];
    iq_one_tables(v, T);
    const int8_t *x = xb->xq + ra * k;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i xa[4], xs, D[1][4][4]; /* D[0][q][i]: iq_group_few's */
        iq_one_x(x + sb * 256, xa, &xs);
        iq_prefetch_next(row[0] + 16 * rowbytes, sb, bytes);
        const uint8_t *ps[16];
        for (int o = 0; o < 16; o++) ps[o] = row[o] + sb * bytes;
        for (int q = 0; q < 4; q++) {
            __m512i P[4]; /* output 4 q + i, lane L: the sum of its values [16 L, 16 L + 16) */
            for (int i = 0; i < 4; i += 2) iq_one_pair(ps[4 * q + i], ps[4 * q + i + 1], v, xa, xs, T, P + i);
            iq_few_sums(P, units, D[0][q]);
        }
        __m512 s[16]; /* made here, not before the products: 16 vectors fewer live across them */
        iq_one_scales(ps, v, s);
        acc = iq_few_acc(D[0], s, xb->xd + ra * kb + sb * 8, units, acc);
    }
    float o16[16];
    _mm512_storeu_ps(o16, acc);
    memcpy(y + ra * n + og, o16, sizeof(float) * (size_t)nv);
}
#endif
#endif
#if !IQ_VBMI /* (a -DIQ_GROUP_ONE=1 on a build without VBMI: no kernel to dispatch to) */
#undef IQ_GROUP_ONE
#endif
#ifndef IQ_GROUP_ONE
#define IQ_GROUP_ONE 0
#endif
