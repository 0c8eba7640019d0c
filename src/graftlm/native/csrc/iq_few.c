/* The grid quants' products of one to a few rows, read in place (a part of iquant.c, which includes
 * it; IQ2_XXS and IQ3_XXS in tiles: iq_tiles.c). */

#if IQ_VBMI
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
static inline __attribute__((always_inline)) __m512i iq2_signq_raw(const uint8_t *p, const int v) {
    const long long at = v == IQ2_XXS ? 0x20202020352e2720ll : 0x2020202039291909ll; /* IQ2_XS: bits 9 .. 15 of 4 words */
    const __m512i b = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(at), _mm512_loadu_si512(p + 2));
    const __m512i m7 = _mm512_set1_epi8(0x7f);
    const __m512i pc = _mm512_popcnt_epi8(_mm512_and_si512(b, m7));
    return _mm512_ternarylogic_epi32(b, _mm512_slli_epi16(pc, 7), m7, 0xE4); /* m7 ? b : pc << 7 */
}
static inline __attribute__((always_inline)) void iq2_negs_raw(const uint8_t *p, const int v, __mmask64 *neg) {
    const __m512i q = iq2_signq_raw(p, v); /* qword j: sub-block j's 32 sign bits at bits 0 .. 31 */
    for (int k = 0; k < 4; k++)
        neg[k] = _mm512_bitshuffle_epi64_mask(q, _mm512_set1_epi64(0x1c1814100c080400ll + 0x0101010101010101ll * k));
}

/* IQ3 entries' code bytes of values 0, 1 (a) and 2, 3 (b) -> V[0 .. 3]: a through t[0], t[1],
 * then b (tables t: iq_tables; iq3_vals and iq_tiles_vals) */
static inline __attribute__((always_inline)) void iq3_codes_vals(__m512i a, __m512i b, const __m512i *t, __m512i *V) {
    V[0] = _mm512_permutexvar_epi8(a, t[0]), V[1] = _mm512_permutexvar_epi8(a, t[1]);
    V[2] = _mm512_permutexvar_epi8(b, t[0]), V[3] = _mm512_permutexvar_epi8(b, t[1]);
}

/* IQ2 entries' 16-bit codes c -> V[0 .. 3]: c through t[0 .. 2], then c >> 6 through t[0] (tables
 * t: iq_tables; iq2_vals2 and iq_tiles_vals) */
static inline __attribute__((always_inline)) void iq2_codes_vals(__m512i c, const __m512i *t, __m512i *V) {
    for (int k = 0; k < 3; k++) V[k] = _mm512_permutexvar_epi8(c, t[k]);
    V[3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(c, 6), t[0]);
}

/* An IQ3 super-block p's code bytes (byte e: entry e's codes of values 0, 1 (*a), 2, 3 (*b)) and
 * its sign bytes *S (m: iq_look512x's). */
static inline __attribute__((always_inline)) void iq3_codes(const uint8_t *p, const int v, const int m, __m512i *a,
                                                            __m512i *b, __m256i *S) {
    const __m512i idx = _mm512_loadu_si512(p + 2);
    if (v == IQ3_XXS) {
        *a = iq_look256(IQ3XXS_PAIR[0], idx), *b = iq_look256(IQ3XXS_PAIR[1], idx);
        *S = iq_ksigns(_mm256_loadu_si256((const __m256i *)(p + 66)));
    } else { /* IQ3_S: bit 8 of the indices in qh */
        uint64_t qh;
        memcpy(&qh, p + 66, 8);
        *a = iq_look512x(IQ3S_PAIR[0], idx, qh, m), *b = iq_look512x(IQ3S_PAIR[1], idx, qh, m);
        *S = _mm256_loadu_si256((const __m256i *)(p + 74));
    }
}

/* An IQ3 super-block p's V[k] (tables t: iq_tables) and its sign bytes *S. */
static inline __attribute__((always_inline)) void iq3_vals(const uint8_t *p, const int v, const __m512i *t, __m512i *V,
                                                           __m256i *S) {
    __m512i a, b;
    iq3_codes(p, v, 0, &a, &b, S);
    iq3_codes_vals(a, b, t, V);
}

/* Two IQ2 super-blocks pa, pb's codes *ca, *cb (byte p: the 2-bit codes of values 4 p .. 4 p + 3)
 * and sign bytes (*Sa, *Sb) (m: iq_look512x's). */
static inline __attribute__((always_inline)) void iq2_codes_two(const uint8_t *pa, const uint8_t *pb, const int v,
                                                                const int m, __m512i *ca, __m256i *Sa, __m512i *cb,
                                                                __m256i *Sb) {
    __m512i lo, hi;
    iq2_codes2(pa, pb, v, m, &lo, &hi, Sa, Sb);
    /* word e: entry e's 16-bit code (byte 2 e: its low byte, 2 e + 1 its high), pa's then pb's */
    const __m512i ia = _mm512_set_epi64(0x5f1f5e1e5d1d5c1cll, 0x5b1b5a1a59195818ll, 0x5717561655155414ll,
                                        0x5313521251115010ll, 0x4f0f4e0e4d0d4c0cll, 0x4b0b4a0a49094808ll,
                                        0x4707460645054404ll, 0x4303420241014000ll);
    const __m512i ib = _mm512_add_epi8(ia, _mm512_set1_epi8(0x20)); /* entries 32 .. 63 */
    *ca = _mm512_permutex2var_epi8(lo, ia, hi);
    *cb = _mm512_permutex2var_epi8(lo, ib, hi);
}

/* Two IQ2 super-blocks pa, pb's V[k] (Va, Vb) and sign bytes (*Sa, *Sb). */
static inline __attribute__((always_inline)) void iq2_vals2(const uint8_t *pa, const uint8_t *pb, const int v,
                                                            const __m512i *t, __m512i *Va, __m256i *Sa, __m512i *Vb,
                                                            __m256i *Sb) {
    __m512i ca, cb;
    iq2_codes_two(pa, pb, v, 0, &ca, Sa, &cb, Sb);
    iq2_codes_vals(ca, t, Va);
    iq2_codes_vals(cb, t, Vb);
}

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

/* few (iq_group_few, iq_tiles_few) of the rb - ra rows from ra (at most IQ_FEW), the count a
 * constant in each case so the kernel is built for it */
#define IQ_BY_ROWS(few, w, v, xb, ra, rb, og, nv, y)                                                       \
    do {                                                                                               \
        switch ((rb) - (ra)) {                                                                         \
        case 4: few(w, v, xb, ra, 4, og, nv, y); break;                                                \
        case 3: few(w, v, xb, ra, 3, og, nv, y); break;                                                \
        case 2: few(w, v, xb, ra, 2, og, nv, y); break;                                                \
        default: few(w, v, xb, ra, 1, og, nv, y); break;                                               \
        }                                                                                              \
    } while (0)
