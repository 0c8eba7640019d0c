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
 * chains a unit and row (even and odd m, added): 0.94-1.13x, no gain (alternated, busy machine). */

#if IQ_VBMI
/* x's 256 codes of a super-block in the tiles' order: xo[32 u + 4 m + i] = x[32 u + 8 i + m]
 * (IQ2_XXS: value m of the unit's entry i) or x[32 u + 16 (m / 4) + 4 i + m % 4] (IQ3_XXS); pm the
 * permutation of two units (iq_tiles_perm). */
static inline __attribute__((always_inline)) void iq_tiles_x(const int8_t *x, __m512i pm, int8_t *xo) {
    for (int h = 0; h < 4; h++) _mm512_store_si512(xo + 64 * h, _mm512_permutexvar_epi8(pm, _mm512_loadu_si512(x + 64 * h)));
}

static inline __m512i iq_tiles_perm(const int v) {
    uint8_t pm[64] __attribute__((aligned(64)));
    for (int j = 0; j < 64; j++) {
        const int u = j / 32, m = j % 32 / 4, i = j % 4;
        pm[j] = (uint8_t)(32 * u + (v == IQ2_XXS ? 8 * i + m : 16 * (m / 4) + 4 * i + m % 4));
    }
    return _mm512_load_si512(pm);
}

/* A tile's unit u (pu)'s value vectors V[m] (tables t: iq_tables) */
static inline __attribute__((always_inline)) void iq_tiles_vals(const uint8_t *pu, const int v, const __m512i *t, __m512i *V) {
    if (v == IQ2_XXS) { /* the entries' code bytes of values 0 .. 3 (lo), 4 .. 7 (hi) */
        const __m512i idx = _mm512_loadu_si512(pu);
        const __m512i lo = iq_look256(IQ2XXS_CODE[0], idx), hi = iq_look256(IQ2XXS_CODE[1], idx);
        iq2_codes_vals(lo, t, V);
        iq2_codes_vals(hi, t, V + 4);
    } else { /* vector s: the codes of values 0, 1 (a), 2, 3 (b) of the entries 4 s + i */
        for (int s = 0; s < 2; s++) {
            const __m512i idx = _mm512_loadu_si512(pu + 64 * s);
            const __m512i a = iq_look256(IQ3XXS_PAIR[0], idx), b = iq_look256(IQ3XXS_PAIR[1], idx);
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
    const float f = v == IQ2_XXS ? 0.25f : 0.5f;
    float hl[16] __attribute__((aligned(64))); /* (0.5 + ls) * f: exact, as d times it */
    for (int i = 0; i < 16; i++) hl[i] = (0.5f + (float)i) * f;
    const __m512 H = _mm512_load_ps(hl);
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
    for (int r = 0; r < R; r++) {
        float o16[16];
        _mm512_storeu_ps(o16, acc[r]);
        memcpy(y + (ra + r) * n + og, o16, sizeof(float) * (size_t)nv);
    }
}

/* iq_tiles_few of rb - ra rows (at most IQ_FEW) */
static inline __attribute__((always_inline)) void iq_tiles_rows(const gl_weight *w, const int v, const xbuf *xb,
                                                                int64_t ra, int64_t rb, int64_t og, int nv, float *y) {
    switch (rb - ra) {
    case 4: iq_tiles_few(w, v, xb, ra, 4, og, nv, y); return;
    case 3: iq_tiles_few(w, v, xb, ra, 3, og, nv, y); return;
    case 2: iq_tiles_few(w, v, xb, ra, 2, og, nv, y); return;
    default: iq_tiles_few(w, v, xb, ra, 1, og, nv, y); return;
    }
}
#endif
