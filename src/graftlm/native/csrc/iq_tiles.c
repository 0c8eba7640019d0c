/* IQ2_XXS's and IQ3_XXS's tiles (iquant.c's layout): one to a few rows (a part of iquant.c, which
 * includes it after iq_few.c).
 *
 * A unit's grid indices of 16 outputs are one vector (IQ3_XXS: two), byte 4 o + i output o's
 * i-th entry of the unit (IQ3_XXS, vector s: its entry 4 s + i), so the lookups give the
 * magnitudes of the 16 outputs in 32-bit lanes of outputs: V[m] byte 4 o + i the value that
 * x's i-th byte of the unit's m-th dword meets, in the tiles' order of x (iq_tiles_x). One
 * VPDPBUSD chain of 8 a unit and row (x's dword broadcast, the signs onto x by a masked
 * subtraction) ends with lane o holding output o's unit sum: no transposition of the sums, the
 * unit's scales in lanes from its 16 sign words (ls), one FMA a unit for 16 outputs, as the
 * products' Semantics say (iquant.c): the same bits as iq_group_few and iq_group.
 *
 * One thread, alternated against iq_group_few on the file's super-blocks (bench/xiq.py, the
 * prototype of this kernel; 768 x 2048, 2048 x 768, 2048 x 2048; Zen 4): IQ2_XXS one row 1.42-1.50x
 * in cache, 1.33-1.50x out of cache (~9.4 -> ~6.3 ns an output's super-block), 2-4 rows 1.30-1.45x
 * (4 rows against iq_group); IQ3_XXS one row 1.24-1.30x in cache, 1.13-1.71x out of cache, 2-4
 * rows 1.18-1.34x. Tried in the prototype: each unit's 8 sign masks stored (8 bits an entry, 70
 * and 102 bytes a super-block): 1.09-1.16x more at one row in cache, from memory 1.00-1.08x
 * (IQ2_XXS) and 0.84-0.89x (IQ3_XXS): not kept, the tiles are the file's bytes. Two VPDPBUSD
 * chains a unit and row (even and odd m, added): 0.94-1.13x, no gain (alternated, busy machine);
 * again on a quiet one: two 1.01x, four 0.98-1.00x (not the chain's latency).
 *
 * One row of IQ2_XXS has a kernel of its own (iq2_tiles_one, below: no sign masks): against the one
 * above, one thread, alternated (768 x 2048, 2048 x 768, 2048 x 2048, Zen 4), in cache 6.11-6.29 ->
 * 5.31-5.47 ns an output's super-block (1.15-1.17x; 2048 x 2048 5.54 -> 4.71, 1.18x), from memory
 * 1.14-1.17x, the same bits; 2-4 rows 0.99-1.02x, IQ3_XXS 1.00-1.04x. On Zen 4 (measured, 512-bit
 * ops): VPDPBUSD, vptestmb, vpshufbitqmb, vpmovb2m, vpmultishiftqb, vgf2p8affineqb and kmovq into
 * a mask share two pipes (together one a cycle); vpermb, vpermi2b and vpshufb two others, one of
 * them shared with the first (the two kinds together 1.5 a cycle); adds, logic, blends and masked
 * subtractions any of four (two a cycle); vpbroadcastd from memory is a load. A unit of the kernel
 * above takes ~21 of the first kind and ~18 of the second for one row (8 of the first its sign
 * masks); left out one at a time (wrong results, timing only): the masks 1.21x, the value lookups
 * 1.40x, the scales 1.04x, iq_tiles_x's permutation 1.006x (so hoisting x's order out of the groups
 * was not worth it). iq2_tiles_one's unit takes ~15 and ~16 (~35 cycles for 16 outputs against
 * ~46): its x work once a super-block 5% of its time, the scales 8%, the shifts of the upper pairs
 * 4% (vpmultishiftqb for them: 1.00x). Tried and dropped: x's sign bits from its own order by
 * shifts and masks in place of IQ2_ONE_SIGN_PERM and pdep 0.97x; the unit loop unrolled 2 or 8
 * 1.00-1.02x; two groups (32 outputs) a call sharing x's work 0.99-1.01x in cache and 0.60-0.76x
 * from memory (two streams of tiles at once); the tiles' tables made per group of 16 outputs cost
 * 1% (the permutation's alone, 2048 x 768 one row: 4%; both made once now).
 *
 * One row of IQ3_XXS likewise (iq3_tiles_one: the sign bits by vpmultishiftqb, no vgf2p8affineqb,
 * so every VBMI build has it): against iq_tiles_few, one thread, alternated 15 rounds (768 x 2048,
 * 2048 x 768, 2048 x 2048, Zen 4), 6.23-7.00 -> 5.62-6.33 ns an output's super-block in cache
 * (1.106-1.109x), from memory 6.51-7.50 -> 5.87-6.67 (1.100-1.125x), the same bits. A unit: 13 of
 * the first kind, 18 permutes and ~11 others against 19, 18 and ~12 (4 blends, 8 masked
 * subtractions); every 512-bit op seemed to count: tried, against the kernel before its last two
 * steps (the grid's lookups by masked vpermi2b 1.03x, x's signs xored from memory 1.01x): KSIGNS'
 * parity by vpopcntb 0.97x, the scales by cvt and FMA 0.99x, each value its own vpermb index (8
 * vpternlogd and one-source permutes for 4 of vpermi2b) 0.95x.
 *
 * IQ2_XS, IQ2_S and IQ3_S have no tiles: one row of them folds x's signs into the values in place
 * (iq_one.c's iq_group_one, 1.10-1.17x; ~9-11 ns an output's super-block in cache against ~5.3
 * here). */

#if IQ_VBMI
/* x's 256 codes of a super-block in the tiles' order: xo[32 u + 4 m + i] = x[32 u + 8 i + m]
 * (IQ2_XXS: value m of the unit's entry i) or x[32 u + 16 (m / 4) + 4 i + m % 4] (IQ3_XXS); pm the
 * permutation of two units (iq_tiles_perm). */
static inline __attribute__((always_inline)) void iq_tiles_x(const int8_t *x, __m512i pm, int8_t *xo) {
    for (int h = 0; h < 4; h++) _mm512_store_si512(xo + 64 * h, _mm512_permutexvar_epi8(pm, _mm512_loadu_si512(x + 64 * h)));
}

/* F(0) .. F(63), an initializer's 64 entries */
#define IQ_R8(F, b) F(b) F(b + 1) F(b + 2) F(b + 3) F(b + 4) F(b + 5) F(b + 6) F(b + 7)
#define IQ_R64(F) IQ_R8(F, 0) IQ_R8(F, 8) IQ_R8(F, 16) IQ_R8(F, 24) IQ_R8(F, 32) IQ_R8(F, 40) IQ_R8(F, 48) IQ_R8(F, 56)
/* iq_tiles_x's permutation of two units, byte j: u = j / 32, m = j % 32 / 4, i = j % 4 (tables
 * made once: made per group of 16 outputs, they cost 2048 x 768's one row 4%) */
#define IQ_PERM2(j) (uint8_t)(32 * ((j) / 32) + 8 * ((j) % 4) + (j) % 32 / 4),
#define IQ_PERM3(j) (uint8_t)(32 * ((j) / 32) + 16 * ((j) % 32 / 16) + 4 * ((j) % 4) + (j) % 16 / 4),
static const uint8_t IQ_TILES_PERM[2][64] __attribute__((aligned(64))) = {{IQ_R64(IQ_PERM2)}, {IQ_R64(IQ_PERM3)}};
#undef IQ_PERM2
#undef IQ_PERM3

static inline __m512i iq_tiles_perm(const int v) { return _mm512_load_si512(IQ_TILES_PERM[v == IQ2_XXS ? 0 : 1]); }

/* (0.5 + ls) * f, IQ2_XXS's f = 0.25, IQ3_XXS's 0.5: exact, as d times it */
#define IQ_HL(i, f) (0.5f + (float)(i)) * (f)
#define IQ_HL16(f) IQ_HL(0, f), IQ_HL(1, f), IQ_HL(2, f), IQ_HL(3, f), IQ_HL(4, f), IQ_HL(5, f), IQ_HL(6, f), IQ_HL(7, f), \
                   IQ_HL(8, f), IQ_HL(9, f), IQ_HL(10, f), IQ_HL(11, f), IQ_HL(12, f), IQ_HL(13, f), IQ_HL(14, f), IQ_HL(15, f)
static const float IQ_HALF_LS[2][16] __attribute__((aligned(64))) = {{IQ_HL16(0.25f)}, {IQ_HL16(0.5f)}};
#undef IQ_HL16
#undef IQ_HL

/* A tile's unit u (pu)'s value vectors V[m] (tables t: iq_tables) */
static inline __attribute__((always_inline)) void iq_tiles_vals(const uint8_t *pu, const int v, const __m512i *t, __m512i *V) {
    if (v == IQ2_XXS) { /* the entries' code bytes of values 0 .. 3 (lo), 4 .. 7 (hi) */
        const __m512i idx = _mm512_loadu_si512(pu);
        const __m512i lo = iq_look256m(IQ2XXS_CODE[0], idx), hi = iq_look256m(IQ2XXS_CODE[1], idx);
        iq2_codes_vals(lo, t, V);
        iq2_codes_vals(hi, t, V + 4);
    } else { /* vector s: the codes of values 0, 1 (a), 2, 3 (b) of the entries 4 s + i */
        for (int s = 0; s < 2; s++) {
            const __m512i idx = _mm512_loadu_si512(pu + 64 * s);
            const __m512i a = iq_look256m(IQ3XXS_PAIR[0], idx), b = iq_look256m(IQ3XXS_PAIR[1], idx);
            iq3_codes_vals(a, b, t, V + 4 * s);
        }
    }
}

/* V[m]'s sign masks from the unit's sign words W (dword o: output o's 4 7-bit sign indices; ks:
 * KSIGNS as two vectors) */
static inline __attribute__((always_inline)) void iq_tiles_negs(__m512i W, const int v, const __m512i *ks,
                                                                __mmask64 *neg) {
    /* dword o: output o's 32 sign bits of the unit, KSIGNS looked up (vpermi2b reads an index's
     * low 7 bits): iq_ksigns512's parity in 2 instructions, not 5 */
    const __m512i sg = _mm512_permutex2var_epi8(
        ks[0], _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700ll), W), ks[1]);
    for (int m = 0; m < 8; m++) {
        if (v == IQ2_XXS) { /* byte 4 o + i: entry i's signs, bit m value m */
            neg[m] = _mm512_test_epi8_mask(sg, _mm512_set1_epi8((char)(1 << m)));
        } else { /* bit 4 o + i: bit 16 (m / 4) + 4 i + m % 4 of dword o (a qword: outputs 2 j, 2 j + 1) */
            const long long c = 0x2c2824200c080400ll + 0x0101010101010101ll * (16 * (m / 4) + m % 4);
            neg[m] = _mm512_bitshuffle_epi64_mask(sg, _mm512_set1_epi64(c));
        }
    }
}

/* The outputs [og, og + nv) (og a multiple of 16) of R <= IQ_FEW rows from ra of x, a group's
 * tiles one after another. */
static inline __attribute__((always_inline)) void iq_tiles_few(const gl_weight *w, const int v, const xbuf *xb,
                                                               int64_t ra, const int R, int64_t og, int nv, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, tb = IQ_W * IQ_BYTES(v), ub = IQ_TILE_UNIT(v);
    const uint8_t *tl = (const uint8_t *)w->q + og / IQ_W * nsb * tb;
    __m512i t[3];
    iq_tables(v, t);
    const __m512i pm = iq_tiles_perm(v);
    const __m512 H = _mm512_load_ps(IQ_HALF_LS[v == IQ2_XXS ? 0 : 1]);
    const __m512i ks[2] = {_mm512_loadu_si512(KSIGNS), _mm512_loadu_si512(KSIGNS + 64)};
    __m512 acc[IQ_FEW];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = tl + sb * tb;
        /* the next tile's lines asked for at once (a group's tiles are one stream): from memory,
         * one row, IQ3_XXS 1.07-1.12x what asking 8 tiles ahead gave, IQ2_XXS 1.01x; asking for
         * none 0.87-1.04x of 8 ahead (bench/xiq.c's XIQ_PF, one thread, alternated) */
        for (int64_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)p + tb + o, _MM_HINT_T0);
        int8_t xo[IQ_FEW][256] __attribute__((aligned(64)));
        for (int r = 0; r < R; r++) iq_tiles_x(xb->xq + (ra + r) * k + sb * 256, pm, xo[r]);
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 8 * ub)));
        for (int u = 0; u < 8; u++) {
            const uint8_t *pu = p + u * ub;
            __m512i V[8];
            iq_tiles_vals(pu, v, t, V);
            const __m512i W = _mm512_loadu_si512(pu + ub - 64);
            __mmask64 neg[8];
            iq_tiles_negs(W, v, ks, neg);
            const __m512 s = _mm512_mul_ps(vd, _mm512_permutexvar_ps(_mm512_srli_epi32(W, 28), H));
            for (int r = 0; r < R; r++) {
                __m512i A = _mm512_setzero_si512();
                for (int m = 0; m < 8; m++) {
                    const __m512i xv = _mm512_set1_epi32((int)rd32((const uint8_t *)xo[r] + 32 * u + 4 * m));
                    A = DPBUSD512(A, V[m], _mm512_mask_sub_epi8(xv, neg[m], _mm512_setzero_si512(), xv));
                }
                const __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(xb->xd[(ra + r) * kb + sb * 8 + u]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), sx, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (ra + r) * n + og, (__mmask16)((1u << nv) - 1), acc[r]);
}

#ifdef __GFNI__
#define IQ2_ONE 1 /* iq2_tiles_one needs vgf2p8affineqb (the nogfni build: iq_tiles_few) */
/* ---------------- IQ2_XXS, one row (iq2_tiles_one): the signs in the values
 *
 * A row's time went to the sign masks (8 vptestmb a unit, on the pipes of VPDPBUSD) and the
 * values' lookups. With one row, x's signs fold into the weights' (x's magnitudes |x| the
 * unsigned operand, the values signed): sum w x = sum (sign(w) sign(x) mag) |x|, the same
 * integers. Each pair of values (2 j, 2 j + 1) of an entry is one index byte of vpermb (6 bits:
 * their 2-bit codes and 2 sign bits), from the code planes (iq_look256m) and the sign bytes S0, S1
 * (a vgf2p8affineqb each from the 7-bit sign indices: the bits moved and KSIGNS' parity in one
 * op) with x's signs xored in (xs, made with x's magnitudes once a super-block), merged by one
 * vpternlogd, the upper pairs shifted down by 2: no masks, no masked subtraction. */

/* The signed values of a pair's index byte c: T[0] value 2 j (code bits 0-1, sign bit 4), T[1]
 * value 2 j + 1 (bits 2-3, 5) of the pairs (0, 1), (4, 5); T[2], T[3] those (bits 2-3, 0; 4-5, 1)
 * of (2, 3), (6, 7) (their index shifted down by 2). */
#define IQ2_MAG(c) ((c) == 0 ? 8 : (c) == 1 ? 25 : (c) == 2 ? 43 : 0) /* IQ2XXS_MAG64 */
#define IQ2_SIGNED(code, neg) (int8_t)((neg) ? -IQ2_MAG(code) : IQ2_MAG(code)),
#define IQ2_T0(c) IQ2_SIGNED((c) & 3, (c) >> 4 & 1)
#define IQ2_T1(c) IQ2_SIGNED((c) >> 2 & 3, (c) >> 5 & 1)
#define IQ2_T2(c) IQ2_SIGNED((c) >> 2 & 3, (c) & 1)
#define IQ2_T3(c) IQ2_SIGNED((c) >> 4 & 3, (c) >> 1 & 1)
static const int8_t IQ2_ONE_T[4][64] __attribute__((aligned(64))) = {
    {IQ_R64(IQ2_T0)}, {IQ_R64(IQ2_T1)}, {IQ_R64(IQ2_T2)}, {IQ_R64(IQ2_T3)}};
#undef IQ2_T0
#undef IQ2_T1
#undef IQ2_T2
#undef IQ2_T3
#undef IQ2_SIGNED
#undef IQ2_MAG

/* x's bytes of two units in the order of xs' bits: byte 16 j + 4 i + r of unit u (32 bytes) x's
 * value (2, 3, 0, 1)[r] + 4 j of entry i */
#define IQ2_SP(b) (uint8_t)(32 * ((b) / 32) + 8 * ((b) % 16 / 4) + ((b) % 4 + 2) % 4 + 4 * ((b) % 32 / 16)),
static const uint8_t IQ2_ONE_SIGN_PERM[64] __attribute__((aligned(64))) = {IQ_R64(IQ2_SP)};
#undef IQ2_SP

/* x's super-block x (256 codes) for iq2_tiles_one: xa its magnitudes in iq_tiles_x's order, xs[2 u + j]
 * unit u's signs where S0 (j = 0) and S1 have the weights' (byte i bits 2-5: those of entry i's
 * values (2, 3, 0, 1) + 4 j); ps: IQ2_ONE_SIGN_PERM (from x's own order, masks shifted and
 * merged in place of the permutation and pdep: 0.97x) */
static inline __attribute__((always_inline)) void iq2_one_x(const int8_t *x, __m512i pm, __m512i ps, uint8_t *xa,
                                                             uint32_t *xs) {
    for (int h = 0; h < 4; h++) {
        const __m512i r = _mm512_loadu_si512(x + 64 * h);
        _mm512_store_si512(xa + 64 * h, _mm512_abs_epi8(_mm512_permutexvar_epi8(pm, r)));
        const uint64_t b = _cvtmask64_u64(_mm512_movepi8_mask(_mm512_permutexvar_epi8(ps, r)));
        const uint64_t lo = _pdep_u64(b, 0x3c3c3c3c3c3c3c3cull), hi = _pdep_u64(b >> 32, 0x3c3c3c3c3c3c3c3cull);
        xs[4 * h] = (uint32_t)lo, xs[4 * h + 1] = (uint32_t)(lo >> 32);
        xs[4 * h + 2] = (uint32_t)hi, xs[4 * h + 3] = (uint32_t)(hi >> 32);
    }
}

/* A tile's unit pu's signed values V[m] (byte 4 o + i: output o's value m of entry i times the
 * sign of x there) from x's signs xs (2 dwords) */
static inline __attribute__((always_inline)) void iq2_one_vals(const uint8_t *pu, const uint32_t *xs, const __m512i *T,
                                                               __m512i *V) {
    /* vgf2p8affineqb's matrices (byte 7 - b: the input bits of output bit b): S0 bits 2-5 the signs
     * of values 2, 3, 0, 1; S1 of 6, 7 (the parity of the index's 7 bits), 4, 5 */
    const __m512i g0 = _mm512_set1_epi64(0x0000040801020000ll), g1 = _mm512_set1_epi64(0x0000407f10200000ll);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i idx = _mm512_loadu_si512(pu);
    const __m512i lo = iq_look256m(IQ2XXS_CODE[0], idx), hi = iq_look256m(IQ2XXS_CODE[1], idx);
    const __m512i sgi = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700ll), _mm512_loadu_si512(pu + 64));
    const __m512i s0 = _mm512_xor_si512(_mm512_gf2p8affine_epi64_epi8(sgi, g0, 0), _mm512_set1_epi32((int)xs[0]));
    const __m512i s1 = _mm512_xor_si512(_mm512_gf2p8affine_epi64_epi8(sgi, g1, 0), _mm512_set1_epi32((int)xs[1]));
    /* low4 ? codes : signs (0xCA), and the upper pairs' (low4 ? signs : codes) >> 2 */
    const __m512i i01 = _mm512_ternarylogic_epi32(low4, lo, s0, 0xCA), i45 = _mm512_ternarylogic_epi32(low4, hi, s1, 0xCA);
    const __m512i i23 = _mm512_srli_epi16(_mm512_ternarylogic_epi32(low4, s0, lo, 0xCA), 2);
    const __m512i i67 = _mm512_srli_epi16(_mm512_ternarylogic_epi32(low4, s1, hi, 0xCA), 2);
    V[0] = _mm512_permutexvar_epi8(i01, T[0]), V[1] = _mm512_permutexvar_epi8(i01, T[1]);
    V[2] = _mm512_permutexvar_epi8(i23, T[2]), V[3] = _mm512_permutexvar_epi8(i23, T[3]);
    V[4] = _mm512_permutexvar_epi8(i45, T[0]), V[5] = _mm512_permutexvar_epi8(i45, T[1]);
    V[6] = _mm512_permutexvar_epi8(i67, T[2]), V[7] = _mm512_permutexvar_epi8(i67, T[3]);
}

/* iq_tiles_few of IQ2_XXS for the one row ra: the same products (iquant.c's iq_tiles_iq2_xxs
 * calls it: called from the rows' dispatch, IQ_BY_ROWS, iq_tiles_few's 4 rows ran at 0.95-0.97x) */
static __attribute__((noinline)) void iq2_tiles_one(const gl_weight *w, const xbuf *xb, int64_t ra,
                                                                int64_t og, int nv, float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, tb = IQ_W * IQ_BYTES(IQ2_XXS);
    const int64_t ub = IQ_TILE_UNIT(IQ2_XXS);
    const uint8_t *tl = (const uint8_t *)w->q + og / IQ_W * nsb * tb;
    __m512i T[4];
    for (int j = 0; j < 4; j++) T[j] = _mm512_load_si512(IQ2_ONE_T[j]);
    const __m512i pm = iq_tiles_perm(IQ2_XXS), ps = _mm512_load_si512(IQ2_ONE_SIGN_PERM);
    const __m512 H = _mm512_load_ps(IQ_HALF_LS[0]);
    const int8_t *x = xb->xq + ra * k;
    const float *xd = xb->xd + ra * kb;
    __m512 acc = _mm512_setzero_ps();
    /* x's next super-block made while this one's products run (its stores retired when its loads
     * come; made at the top of each with 8-byte stores: 0.98-1.00x) */
    uint8_t xa[2][256] __attribute__((aligned(64)));
    uint32_t xs[2][16];
    iq2_one_x(x, pm, ps, xa[0], xs[0]);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = tl + sb * tb;
        for (int64_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)p + tb + o, _MM_HINT_T0);
        if (sb + 1 < nsb) iq2_one_x(x + (sb + 1) * 256, pm, ps, xa[(sb + 1) % 2], xs[(sb + 1) % 2]);
        const uint8_t *xu = xa[sb % 2];
        const uint32_t *xsu = xs[sb % 2];
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 8 * ub)));
        for (int u = 0; u < 8; u++) {
            const uint8_t *pu = p + u * ub;
            __m512i V[8];
            iq2_one_vals(pu, xsu + 2 * u, T, V);
            const __m512 s = _mm512_mul_ps(vd, _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_loadu_si512(pu + 64), 28), H));
            __m512i A = _mm512_setzero_si512();
            for (int m = 0; m < 8; m++) A = DPBUSD512(A, _mm512_set1_epi32((int)rd32(xu + 32 * u + 4 * m)), V[m]);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), _mm512_mul_ps(s, _mm512_set1_ps(xd[sb * 8 + u])), acc);
        }
    }
    _mm512_mask_storeu_ps(y + ra * n + og, (__mmask16)((1u << nv) - 1), acc);
}

#else
#define IQ2_ONE 0
#define iq2_tiles_one(w, xb, ra, og, nv, y) ((void)0)
#endif

#ifndef IQ3_ONE
#define IQ3_ONE 1 /* iq3_tiles_one (0: one row of IQ3_XXS through iq_tiles_few, for an A/B) */
#endif
#if IQ3_ONE
/* ---------------- IQ3_XXS, one row (iq3_tiles_one): the signs in the values, as iq2_tiles_one
 *
 * A pair's index byte (iq_tiles_vals' a or b: the 3-bit codes of values 2 j, 2 j + 1 at bits 0-2,
 * 3-5) takes their signs (the weights' xor x's) at bits 6, 7: value 2 j through vpermi2b (7 bits,
 * sign bit 6), 2 j + 1 through vpermb of the byte shifted down by 2 (bits 1-3, sign bit 5). The
 * signs: dword o of sg the 32 sign bits of output o's unit (KSIGNS), entry e's at 4 e .. 4 e + 3,
 * as x's are (movepi8_mask of the unit's x): xored, then one vpmultishiftqb a vector s puts entry
 * 4 s + i's 4 signs at bits 4-7 of byte 4 o + i (the upper pair's at 6, 7; the lower's shifted
 * up by 2). The grid's planes through iq_look256m (no blends: 1.03x). */
#define IQ3_MAG(c) ((c) == 7 ? 62 : 4 + 8 * (c)) /* IQ3XXS_MAG64 */
#define IQ3_T0(c) (int8_t)((c) >> 6 & 1 ? -IQ3_MAG((c) & 7) : IQ3_MAG((c) & 7)),
#define IQ3_T1(c) (int8_t)((c) >> 5 & 1 ? -IQ3_MAG((c) >> 1 & 7) : IQ3_MAG((c) >> 1 & 7)),
static const int8_t IQ3_ONE_T[3][64] __attribute__((aligned(64))) = {
    {IQ_R64(IQ3_T0)}, {IQ_R8(IQ3_T0, 64) IQ_R8(IQ3_T0, 72) IQ_R8(IQ3_T0, 80) IQ_R8(IQ3_T0, 88) IQ_R8(IQ3_T0, 96)
                           IQ_R8(IQ3_T0, 104) IQ_R8(IQ3_T0, 112) IQ_R8(IQ3_T0, 120)},
    {IQ_R64(IQ3_T1)}};
#undef IQ3_T0
#undef IQ3_T1
#undef IQ3_MAG

/* A tile's unit pu's signed values V[m] (as iq2_one_vals) from x's sign bits xs of the unit */
static inline __attribute__((always_inline)) void iq3_one_vals(const uint8_t *pu, const uint8_t *W8, uint32_t xs,
                                                               const __m512i *T, const __m512i *ks, __m512i *V) {
    const __m512i W = _mm512_loadu_si512(W8);
    const __m512i sg = _mm512_xor_si512(
        _mm512_permutex2var_epi8(ks[0], _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700ll), W), ks[1]),
        _mm512_set1_epi32((int)xs));
    const __m512i m6 = _mm512_set1_epi8(0x3f);
    for (int s = 0; s < 2; s++) { /* byte b of a qword: bits 32 (b / 4) + 16 s + 4 (b % 4) - 4 .. of it */
        const long long at = s ? 0x3834302c1814100cll : 0x2824201c0804003cll;
        const __m512i S = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(at), sg);
        const __m512i idx = _mm512_loadu_si512(pu + 64 * s);
        const __m512i a = iq_look256m(IQ3XXS_PAIR[0], idx), b = iq_look256m(IQ3XXS_PAIR[1], idx);
        const __m512i ia = _mm512_ternarylogic_epi32(m6, a, _mm512_slli_epi16(S, 2), 0xCA);
        const __m512i ib = _mm512_ternarylogic_epi32(m6, b, S, 0xCA);
        V[4 * s] = _mm512_permutex2var_epi8(T[0], ia, T[1]);
        V[4 * s + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(ia, 2), T[2]);
        V[4 * s + 2] = _mm512_permutex2var_epi8(T[0], ib, T[1]);
        V[4 * s + 3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(ib, 2), T[2]);
    }
}

/* iq_tiles_few of IQ3_XXS for the one row ra: the same products */
static __attribute__((noinline)) void iq3_tiles_one(const gl_weight *w, const xbuf *xb, int64_t ra, int64_t og, int nv,
                                                    float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, nsb = k / 256, tb = IQ_W * IQ_BYTES(IQ3_XXS);
    const int64_t ub = IQ_TILE_UNIT(IQ3_XXS);
    const uint8_t *tl = (const uint8_t *)w->q + og / IQ_W * nsb * tb;
    __m512i T[3];
    for (int j = 0; j < 3; j++) T[j] = _mm512_load_si512(IQ3_ONE_T[j]);
    const __m512i ks[2] = {_mm512_loadu_si512(KSIGNS), _mm512_loadu_si512(KSIGNS + 64)};
    const __m512i pm = iq_tiles_perm(IQ3_XXS);
    const __m512 H = _mm512_load_ps(IQ_HALF_LS[1]);
    const int8_t *x = xb->xq + ra * k;
    const float *xd = xb->xd + ra * kb;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = tl + sb * tb;
        for (int64_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)p + tb + o, _MM_HINT_T0);
        uint8_t xa[256] __attribute__((aligned(64)));
        uint64_t xs[4];
        for (int h = 0; h < 4; h++) {
            const __m512i r = _mm512_loadu_si512(x + sb * 256 + 64 * h);
            _mm512_store_si512(xa + 64 * h, _mm512_abs_epi8(_mm512_permutexvar_epi8(pm, r)));
            xs[h] = _cvtmask64_u64(_mm512_movepi8_mask(r));
        }
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 8 * ub)));
        for (int u = 0; u < 8; u++) {
            const uint8_t *pu = p + u * ub;
            __m512i V[8];
            iq3_one_vals(pu, pu + ub - 64, rd32((const uint8_t *)xs + 4 * u), T, ks, V);
            const __m512i ls = _mm512_srli_epi32(_mm512_loadu_si512(pu + ub - 64), 28);
            const __m512 s = _mm512_mul_ps(vd, _mm512_permutexvar_ps(ls, H));
            __m512i A = _mm512_setzero_si512();
            for (int m = 0; m < 8; m++) A = DPBUSD512(A, _mm512_set1_epi32((int)rd32(xa + 32 * u + 4 * m)), V[m]);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), _mm512_mul_ps(s, _mm512_set1_ps(xd[sb * 8 + u])), acc);
        }
    }
    _mm512_mask_storeu_ps(y + ra * n + og, (__mmask16)((1u << nv) - 1), acc);
}
#else
#define iq3_tiles_one(w, xb, ra, og, nv, y) ((void)0)
#endif
#endif
