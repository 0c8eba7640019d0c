/* A prototype (bench/xiq.py builds and checks it): the products of one to four rows of x with
 * IQ2_XXS and IQ3_XXS weights repacked at load into tiles of 16 outputs x one super-block, laid
 * out so that the grid lookups give the values of the 16 outputs in lanes of outputs at once.
 *
 * A tile (16 outputs o, one super-block of 256 values; v 0 IQ2_XXS, 3 IQ3_XXS):
 *   per unit u = 0 .. 7 (32 values, one scale):
 *     the grid indices, 64 a vector: byte 4 o + i = output o's entry 4 u + i (IQ2_XXS, one
 *       vector) or 8 u + 4 s + i (IQ3_XXS, vectors s = 0, 1);
 *     explicit signs (expl = 1): 8 masks of 64 bits, mask m bit 4 o + i = the sign of value m
 *       (IQ2_XXS: of the entry's 8) or k (IQ3_XXS, m = 4 s + k: of its 4) of that entry;
 *     or the file's own (expl = 0): dword o = output o's unit-u word of 4 7-bit sign indices
 *       (bits 0, 7, 14, 21) and ls (bits 28 .. 31), as in the file;
 *   then d of the 16 outputs (float16, 32 bytes), and with expl 4 x 16 bytes of ls: chunk j
 *   byte o = ls(o, 2 j) | ls(o, 2 j + 1) << 4.
 * Bytes a tile: IQ2_XXS 1120 (70 an output's super-block; the file 66) with expl, 1056 without;
 * IQ3_XXS 1632 (102; the file 98), 1568 without.
 *
 * Semantics (the library's gl_mm_iq, the same bits): x quantized per 32 values as quant.c's
 * quantize_blocks; y[r][o] = sum over super-blocks, then units u in order, of
 *   acc = fma((float)S(r, o, u), s(o, u) * xd[r][u], acc)
 * S the exact integer dot of the unit's signed grid values with x's codes, s = d * (0.5 + ls) *
 * (0.25 IQ2_XXS, 0.5 IQ3_XXS) (exact in float32: an 11-bit d times a 5-bit 2 ls + 1).
 *
 * The dot: per unit and output pair of lanes none: lane o of one VPDPBUSD accumulator is output
 * o's unit sum (x's 4 bytes of a lane broadcast, signs onto x by masked subtraction), so the
 * units' sums need no transposition and the scales come 16 outputs at once. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "iq_grids.h"

#ifndef XIQ_PF
#define XIQ_PF 1 /* tiles ahead the kernel asks for (< 0: none; iq_tiles.c has the A/B) */
#endif

int64_t xiq_tile_bytes(int v, int expl) {
    return v == 0 ? (expl ? 1120 : 1056) : (expl ? 1632 : 1568);
}

static inline __m512i look256(const uint8_t *plane, __m512i idx) {
    const __m512i *t = (const __m512i *)plane;
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), _mm512_permutex2var_epi8(t[0], idx, t[1]),
                                  _mm512_permutex2var_epi8(t[2], idx, t[3]));
}

static inline __m512i ksigns512(__m512i aux) {
    const __m512i b = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352e2720150e0700ll), aux);
    const __m512i m7 = _mm512_set1_epi8(0x7f);
    const __m512i pc = _mm512_popcnt_epi8(_mm512_and_si512(b, m7));
    return _mm512_ternarylogic_epi32(b, _mm512_slli_epi16(pc, 7), m7, 0xE4);
}

/* quant.c's quantize_blocks: codes and scales only */
static void quantize(const float *x, int64_t nb, int8_t *xq, float *xd) {
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++) {
        const float *p = x + i * 32;
        __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signbit, v0), _mm256_andnot_ps(signbit, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(signbit, v2), _mm256_andnot_ps(signbit, v3)));
        __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
        a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
        const float amax = _mm_cvtss_f32(a4);
        const float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 mul = _mm256_set1_ps(id);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), rnd));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), rnd));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), rnd));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), rnd));
        __m256i pk = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        pk = _mm256_permutevar8x32_epi32(pk, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * 32), pk);
        xd[i] = dd;
    }
}

/* x's codes in the tiles' order: per row, super-block, unit u and m, the 4 bytes of a lane
 * (IQ2_XXS: values 8 i + m of the unit, i = 0 .. 3; IQ3_XXS, m = 4 s + k: 4 (4 s + i) + k). */
static void x_order(const int8_t *xq, int64_t M, int64_t k, int v, int8_t *xo) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < k / 32; c++) /* unit c of the row */
            for (int m = 0; m < 8; m++)
                for (int i = 0; i < 4; i++)
                    xo[(r * (k / 32) + c) * 32 + 4 * m + i] =
                        xq[r * k + 32 * c + (v == 0 ? 8 * i + m : 4 * (4 * (m / 4) + i) + m % 4)];
}

static inline void tables(const int v, __m512i *t) {
    const uint8_t *mag = v == 0 ? IQ2XXS_MAG64 : IQ3XXS_MAG64;
    const __m512i m = _mm512_load_si512(mag);
    uint8_t io[64];
    for (int i = 0; i < 64; i++) io[i] = (uint8_t)i;
    const __m512i iota = _mm512_loadu_si512(io);
    t[0] = m;
    for (int k = 1; k < (v == 3 ? 2 : 3); k++) t[k] = _mm512_permutexvar_epi8(_mm512_srli_epi16(iota, (v == 3 ? 3 : 2) * k), m);
}

/* unit pu's 8 value vectors V[m] (byte 4 o + i: the magnitude that x's lane byte i meets) */
static inline __attribute__((always_inline)) void unit_vals(const uint8_t *pu, const int v, const __m512i *t, __m512i *V) {
    if (v == 0) {
        const __m512i idx = _mm512_loadu_si512(pu);
        const __m512i lo = look256(IQ2XXS_CODE[0], idx), hi = look256(IQ2XXS_CODE[1], idx);
        for (int h = 0; h < 2; h++) {
            const __m512i c = h ? hi : lo;
            for (int k = 0; k < 3; k++) V[4 * h + k] = _mm512_permutexvar_epi8(c, t[k]);
            V[4 * h + 3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(c, 6), t[0]);
        }
    } else {
        for (int s = 0; s < 2; s++) {
            const __m512i idx = _mm512_loadu_si512(pu + 64 * s);
            const __m512i a = look256(IQ3XXS_PAIR[0], idx), b = look256(IQ3XXS_PAIR[1], idx);
            V[4 * s] = _mm512_permutexvar_epi8(a, t[0]), V[4 * s + 1] = _mm512_permutexvar_epi8(a, t[1]);
            V[4 * s + 2] = _mm512_permutexvar_epi8(b, t[0]), V[4 * s + 3] = _mm512_permutexvar_epi8(b, t[1]);
        }
    }
}

/* outputs [og, og + 16) of rows [0, R) */
static inline __attribute__((always_inline)) void group(const uint8_t *tl, int64_t nsb, const int v, const int expl,
                                                        const int8_t *xo, const float *xd, int64_t kb, const int R,
                                                        float *y, int64_t n, int64_t og) {
    const int64_t tb = xiq_tile_bytes(v, expl), ub = v == 0 ? 128 : 192;
    __m512i t[3];
    tables(v, t);
    const float f = v == 0 ? 0.25f : 0.5f;
    float tf[16];
    for (int i = 0; i < 16; i++) tf[i] = (0.5f + (float)i) * f;
    const __m512 T = _mm512_loadu_ps(tf);
    __m512i ctrl[8]; /* IQ3_XXS without expl: mask m's bits from the sign dwords (vpshufbitqmb) */
    for (int m = 0; m < 8; m++) {
        uint8_t c[8];
        for (int bp = 0; bp < 8; bp++) c[bp] = (uint8_t)(32 * (bp / 4) + 16 * (m / 4) + 4 * (bp % 4) + m % 4);
        uint64_t q;
        memcpy(&q, c, 8);
        ctrl[m] = _mm512_set1_epi64((long long)q);
    }
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = tl + sb * tb;
        if (XIQ_PF >= 0)
            for (int64_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)p + XIQ_PF * tb + o, _MM_HINT_T0);
        const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 8 * ub)));
        for (int u = 0; u < 8; u++) {
            const uint8_t *pu = p + u * ub;
            __m512i V[8];
            unit_vals(pu, v, t, V);
            __mmask64 neg[8];
            __m512 s;
            if (expl) {
                for (int m = 0; m < 8; m++) {
                    uint64_t q;
                    memcpy(&q, pu + ub - 64 + 8 * m, 8);
                    neg[m] = _cvtu64_mask64(q);
                }
                const __m512i D = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 8 * ub + 32 + 16 * (u / 2))));
                s = _mm512_mul_ps(vd, _mm512_permutexvar_ps(u % 2 ? _mm512_srli_epi32(D, 4) : D, T));
            } else {
                const __m512i W = _mm512_loadu_si512(pu + ub - 64);
                const __m512i sg = ksigns512(W);
                for (int m = 0; m < 8; m++)
                    neg[m] = v == 0 ? _mm512_test_epi8_mask(sg, _mm512_set1_epi8((char)(1 << m)))
                                    : _mm512_bitshuffle_epi64_mask(sg, ctrl[m]);
                s = _mm512_mul_ps(vd, _mm512_permutexvar_ps(_mm512_srli_epi32(W, 28), T));
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xu = xo + ((int64_t)r * kb + sb * 8 + u) * 32;
                __m512i A = _mm512_setzero_si512();
                for (int m = 0; m < 8; m++) {
                    int32_t xw;
                    memcpy(&xw, xu + 4 * m, 4);
                    const __m512i xb = _mm512_set1_epi32(xw);
                    A = _mm512_dpbusd_epi32(A, V[m], _mm512_mask_sub_epi8(xb, neg[m], _mm512_setzero_si512(), xb));
                }
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), _mm512_mul_ps(s, _mm512_set1_ps(xd[r * kb + sb * 8 + u])), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * n + og, acc[r]);
}

#define GROUP_OF(V, E, NAME)                                                                             \
    static __attribute__((noinline)) void NAME(const uint8_t *tl, int64_t nsb, const int8_t *xo,       \
                                               const float *xd, int64_t kb, int R, float *y, int64_t n, \
                                               int64_t og) {                                            \
        switch (R) {                                                                                    \
        case 4: group(tl, nsb, V, E, xo, xd, kb, 4, y, n, og); return;                                  \
        case 3: group(tl, nsb, V, E, xo, xd, kb, 3, y, n, og); return;                                  \
        case 2: group(tl, nsb, V, E, xo, xd, kb, 2, y, n, og); return;                                  \
        default: group(tl, nsb, V, E, xo, xd, kb, 1, y, n, og); return;                                 \
        }                                                                                               \
    }
GROUP_OF(0, 1, group_iq2_e)
GROUP_OF(0, 0, group_iq2_f)
GROUP_OF(3, 1, group_iq3_e)
GROUP_OF(3, 0, group_iq3_f)

/* y (M, n) = x (M, k) @ W.T, W the tiles (n / 16 groups, each k / 256 tiles); one thread; scratch:
 * M k + M k bytes + M k / 32 floats. */
void xiq_mm(const float *x, int64_t M, int64_t k, const uint8_t *tiles, int v, int expl, int64_t n, float *y,
            int8_t *scratch) {
    const int64_t kb = k / 32, nsb = k / 256, tb = xiq_tile_bytes(v, expl);
    int8_t *xq = scratch, *xo = scratch + M * k;
    float *xd = (float *)(scratch + 2 * M * k);
    quantize(x, M * kb, xq, xd);
    x_order(xq, M, k, v, xo);
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int R = M - r0 < 4 ? (int)(M - r0) : 4;
        for (int64_t g = 0; g < n / 16; g++) {
            const uint8_t *tl = tiles + g * nsb * tb;
            const int8_t *xr = xo + r0 * k;
            const float *dr = xd + r0 * kb;
            float *yr = y + r0 * n;
            if (v == 0)
                (expl ? group_iq2_e : group_iq2_f)(tl, nsb, xr, dr, kb, R, yr, n, 16 * g);
            else
                (expl ? group_iq3_e : group_iq3_f)(tl, nsb, xr, dr, kb, R, yr, n, 16 * g);
        }
    }
}
