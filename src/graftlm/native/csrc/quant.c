/* The quantized weights: repacking at load, exact dequantization, x quantized to int8 (their
 * products: quant_mm.c).
 *
 * Two weight formats, both repacked once at load from GGUF blocks (layouts: see gl_pack_u4):
 *   u4: Q4_0, Q4_1 (u5: Q5_0, Q5_1).  4-bit (5-bit) codes q in 0..15 (0..31) with a float
 *       scale d and offset m per 32 values: w = q * d + m   (bit-exact with
 *       gguf.quants.dequantize for the four types).
 *       (Q4_K, Q5_K and Q6_K keep their super-blocks: kquant.c.)
 *   s8: Q8_0 (scale per 32 values).  One int8 code per
 *       value and a float scale per block: w = q * s   (bit-exact likewise).
 *   n4: IQ4_NL, IQ4_XS.  s8 whose codes are kept as 4-bit indices into IQ4_NL's table of 16
 *       int8 values (N4_VALUES), in u4's layout, and looked up in the products (vpshufb); the
 *       scale per 32 is the file's d (IQ4_NL), or d * (ls - 32) made in the products from IQ4_XS's
 *       own super-block scales (its d per 256, its 6-bit ls per 32, kept as the int8 ls - 32).
 * Matrix products quantize x to int8 per 32 values (xd = max|x| / 127, as llama.cpp's Q8_0 /
 * Q8_1 activations do) and accumulate the integer dot products of each block in float:
 *   y[r, n] = sum_b (d[n,b] * xd[r,b]) * sum_j q[n,b,j] * xq[r,b,j]  +  sum_b m[n,b] * xs[r,b]
 * with xs[r,b] = xd[r,b] * sum_j xq[r,b,j].  Built with -ffp-contract=off so the dequantizers
 * round exactly as numpy does.
 */
#include "graftlm.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23 };

#define U4_BYTES(h5) (128 + 32 * (h5)) /* a block of 8 rows: the 4-bit codes, u5's fifth bits */
/* s8's variants (gl_weight.small): int8 codes (Q8_0); 4-bit codes with a scale per 32 (IQ4_NL);
 * 4-bit codes and the int8 ls - 32 of each row after them, d per super-block (IQ4_XS) */
enum { S8_Q8, S8_N4, S8_N4X };
#define S8_BYTES(v) ((v) == S8_Q8 ? 256 : (v) == S8_N4 ? 128 : 136) /* a block of 8 rows */

/* The value of each 4-bit code of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl). */
static const int8_t N4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, f;
    if (exp == 0) {
        if (man == 0) {
            f = sign;
        } else {
            exp = 113;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (man << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (man << 13);
    }
    float r;
    memcpy(&r, &f, 4);
    return r;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ---------------------------------------------------------------- repacking (load time) */

/* Scales are stored as float, or as float16 where every one of a weight's scales is exactly a
 * float16 (the file's own d and m of Q4_0, Q4_1, Q5_0, Q8_0): a quarter less to read per step. */
static inline void put_scale(void *dst, int64_t idx, float v, int h, int *inexact) {
    if (h) {
        const uint16_t b = (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
        if (h2f(b) != v) *inexact = 1;
        ((uint16_t *)dst)[idx] = b;
    } else {
        ((float *)dst)[idx] = v;
    }
}

static inline float get_scale(const void *src, int64_t idx, int h) {
    return h ? h2f(((const uint16_t *)src)[idx]) : ((const float *)src)[idx];
}

static inline __m256 load_scales8(const void *src, int64_t idx, int h) {
    return h ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + idx)))
             : _mm256_loadu_ps((const float *)src + idx);
}

/* One GGUF row of a u4 / u5 type -> codes (k bytes, 0..15 or 0..31), d and m per 32 values.
 * Q4_0 and Q5_0 have no m: m = -8 d, -16 d (dequantization subtracts the offset instead). */
static void row_u4(int type, const uint8_t *src, int64_t k, uint8_t *q, float *d, float *m) {
    const int bs = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
    const int five = type == T_Q5_0 || type == T_Q5_1, has_m = type == T_Q4_1 || type == T_Q5_1;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *blk = src + b * bs, *qs = blk + bs - 16;
        uint32_t qh = 0;
        if (five) memcpy(&qh, qs - 4, 4);
        d[b] = h2f(rd16(blk));
        m[b] = has_m ? h2f(rd16(blk + 2)) : (five ? -16.0f : -8.0f) * d[b];
        for (int j = 0; j < 16; j++) {
            q[b * 32 + j] = (uint8_t)((qs[j] & 0xF) | (((qh >> j) & 1u) << 4));
            q[b * 32 + j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
        }
    }
}

/* An IQ4 block's 16 bytes of codes qs -> its 32 codes in order (value j low, 16 + j high). */
static void iq4_codes(int8_t *o, const uint8_t *qs) {
    for (int j = 0; j < 16; j++) {
        o[j] = (int8_t)(qs[j] & 0xF);
        o[16 + j] = (int8_t)(qs[j] >> 4);
    }
}

/* One GGUF row of an s8 type -> codes (k int8; IQ4: the 4-bit indices) and scales per 32 values;
 * IQ4_XS: its d per 256 (d16, float16) and ls - 32 per 32 (ls) instead. */
static void row_s8(int type, const uint8_t *src, int64_t k, int8_t *o, float *s, uint16_t *d16,
                   int8_t *ls) {
    if (type == T_Q8_0) {
        for (int64_t b = 0; b < k / 32; b++) {
            s[b] = h2f(rd16(src + b * 34));
            memcpy(o + b * 32, src + b * 34 + 2, 32);
        }
    } else if (type == T_IQ4_NL) {
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *blk = src + b * 18;
            s[b] = h2f(rd16(blk));
            iq4_codes(o + b * 32, blk + 2);
        }
    } else if (type == T_IQ4_XS) {
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *blk = src + sb * 136;
            const unsigned sh = rd16(blk + 2);
            d16[sb] = rd16(blk);
            for (int ib = 0; ib < 8; ib++) {
                const int l = ((blk[4 + ib / 2] >> 4 * (ib % 2)) & 0xF) | (int)(((sh >> 2 * ib) & 3u) << 4);
                const int64_t b = sb * 8 + ib;
                ls[b] = (int8_t)(l - 32);
                iq4_codes(o + b * 32, blk + 8 + 16 * ib);
            }
        }
    }
}

/* Row i's 32 codes v of a block into w, a block of 8 rows in u4's layout (below): the codes'
 * low 4 bits, value 4 c + j in the low nibble of byte 32 c + 4 i + j, 16 + 4 c + j in its high.
 * u4, k4, k16 and the IQ4 codes of s8 share it. */
static void put_nibbles(uint8_t *w, int i, const uint8_t *v) {
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 4; j++)
            w[32 * c + 4 * i + j] = (uint8_t)((v[4 * c + j] & 0xF) | (v[16 + 4 * c + j] & 0xF) << 4);
}

/* The fifth bits of row i's 32 codes v into the 32 bytes after w's 128 code bytes (u5, k5; w
 * zeroed first): bit 2 c of byte 4 i + j is value 4 c + j's, bit 2 c + 1 value 16 + 4 c + j's. */
static void put_fifth_bits(uint8_t *w, int i, const uint8_t *v) {
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 4; j++) {
            const int L = 4 * i + j;
            w[128 + L] |= (uint8_t)(((v[4 * c + j] >> 4) & 1) << (2 * c));
            w[128 + L] |= (uint8_t)(((v[16 + 4 * c + j] >> 4) & 1) << (2 * c + 1));
        }
}

/* Layouts, rows in groups of 8 (n padded to a multiple of 8 with zero rows), g = row / 8,
 * i = row % 8, b = block of 32 values, j = 0..3:
 *   u4: qs[(g*kb + b)*U4_BYTES + c*32 + 4i + j] = q[32b + 4c + j] & 15 | (q[32b + 16 + 4c + j] & 15) << 4
 *       d[(g*kb + b)*8 + i], m[(g*kb + b)*8 + i]
 *       u5: then 32 bytes of fifth bits: bit 2c of byte 4i + j is value 4c + j's, bit 2c + 1
 *       value 16 + 4c + j's (graftlm.h's fifth_at; kquant.c's k5 lays them out the same)
 *   s8: q[((g*kb + b)*8 + t)*32 + 4i + j] = q[32b + 4t + j]
 *       s[(g*ns + u)*8 + i] for scale block u of the row (ns = k / sblk)
 * so one 32-byte load holds 4 consecutive values of 8 rows: the products below yield 8 outputs
 * per vector, with their scales loaded as one vector. */
/* Returns 1 when h (float16 scales) was asked for but some scale is not a float16. */
int gl_pack_u4(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k,
               uint8_t *qs, void *d, void *m, int h, int nth) {
    const int h5 = type == T_Q5_0 || type == T_Q5_1;
    const int64_t kb = k / 32, groups = (n + 7) / 8, bs = U4_BYTES(h5);
    int inexact = 0;
#pragma omp parallel for num_threads(nth) schedule(static) reduction(| : inexact)
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *q = calloc((size_t)(8 * k), 1);
        float *dd = calloc((size_t)(8 * kb), sizeof(float)), *mm = calloc((size_t)(8 * kb), sizeof(float));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_u4(type, raw + (g * 8 + i) * rowbytes, k, q + i * k, dd + i * kb, mm + i * kb);
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *w = qs + (g * kb + b) * bs;
            memset(w, 0, (size_t)bs);
            for (int i = 0; i < 8; i++) {
                put_scale(d, (g * kb + b) * 8 + i, dd[i * kb + b], h, &inexact);
                put_scale(m, (g * kb + b) * 8 + i, mm[i * kb + b], h, &inexact);
                put_nibbles(w, i, q + i * k + 32 * b);
                if (h5) put_fifth_bits(w, i, q + i * k + 32 * b);
            }
        }
        free(q);
        free(dd);
        free(mm);
    }
    return inexact;
}

int gl_pack_s8(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, int8_t *q,
               void *s, int h, int nth) {
    if (type != T_Q8_0 && type != T_IQ4_NL && type != T_IQ4_XS) return -1;
    if (type == T_IQ4_XS && k % 256) return -1;
    const int v = type == T_Q8_0 ? S8_Q8 : type == T_IQ4_NL ? S8_N4 : S8_N4X;
    const int64_t kb = k / 32, groups = (n + 7) / 8, ns = k / 32, bs = S8_BYTES(v);
    const int64_t ks = k / 256;
    int inexact = 0;
#pragma omp parallel for num_threads(nth) schedule(static) reduction(| : inexact)
    for (int64_t g = 0; g < groups; g++) {
        int8_t *t = calloc((size_t)(8 * k), 1), *ls = calloc((size_t)(8 * kb), 1);
        float *ss = calloc((size_t)(8 * ns), sizeof(float));
        uint16_t *d16 = calloc((size_t)(8 * ks + 1), sizeof(uint16_t));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_s8(type, raw + (g * 8 + i) * rowbytes, k, t + i * k, ss + i * ns, d16 + i * ks, ls + i * kb);
        for (int i = 0; i < 8; i++) {
            if (v == S8_N4X)
                for (int64_t sb = 0; sb < ks; sb++) ((uint16_t *)s)[(g * ks + sb) * 8 + i] = d16[i * ks + sb];
            else
                for (int64_t u = 0; u < ns; u++) put_scale(s, (g * ns + u) * 8 + i, ss[i * ns + u], h, &inexact);
            for (int64_t b = 0; b < kb; b++) {
                uint8_t *w = (uint8_t *)q + (g * kb + b) * bs;
                const int8_t *c8 = t + i * k + 32 * b;
                if (v == S8_Q8) {
                    for (int c = 0; c < 8; c++) memcpy(w + 32 * c + 4 * i, c8 + 4 * c, 4);
                    continue;
                }
                put_nibbles(w, i, (const uint8_t *)c8);
                if (v == S8_N4X) w[128 + i] = (uint8_t)ls[i * kb + b];
            }
        }
        free(t);
        free(ls);
        free(ss);
        free(d16);
    }
    return inexact;
}

/* Rows of x (n, k float32, k whole blocks of 32) quantized to Q8_0 as gguf.quants.quantize does
 * (q8_0_block, graftlm.h) and laid out as gl_pack_s8 lays out a Q8_0 weight with float16 scales (q, s sized for (n + 7) / 8
 * groups, the rows past n zero): the same bytes as gguf's quantizer, then the packer. One thread,
 * no allocation: an adapter's A, made on a reader thread beside the engine's steps. */
void gl_pack_q8_0_f32(const float *x, int64_t n, int64_t k, int8_t *q, void *s) {
    const int64_t kb = k / 32, groups = (n + 7) / 8;
    uint16_t *s16 = s;
    memset(q, 0, (size_t)(groups * kb * 256));
    memset(s16, 0, sizeof(uint16_t) * (size_t)(groups * kb * 8));
    for (int64_t r = 0; r < n; r++) {
        const int64_t g = r / 8;
        const int i = (int)(r % 8);
        for (int64_t b = 0; b < kb; b++) {
            int32_t codes[32];
            s16[(g * kb + b) * 8 + i] = q8_0_block(x + r * k + 32 * b, codes);
            uint8_t *w = (uint8_t *)q + (g * kb + b) * 256;
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) w[32 * c + 4 * i + j] = (uint8_t)(int8_t)codes[4 * c + j];
        }
    }
}

/* ---------------------------------------------------------------- dequantization (exact) */

/* Rows ids[i] (or row0 + i when ids is NULL) of a u4 weight -> out (nrows, k) float.
 * offset 8 (Q4_0): w = (q - 8) * d, as gguf computes it (which keeps the sign of a zero). */
void gl_deq_u4(const uint8_t *qs, const void *d, const void *m, int h, int h5, int offset,
               int64_t k, const int64_t *ids, int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, bs = U4_BYTES(h5);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const float dd = get_scale(d, (g * kb + b) * 8 + i, h), mm = get_scale(m, (g * kb + b) * 8 + i, h);
            const uint8_t *w = qs + (g * kb + b) * bs, *blk = w + 4 * i;
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 4; j++) {
                    const int L = 4 * (int)i + j;
                    int lo = blk[c * 32 + j] & 0xF, hi = blk[c * 32 + j] >> 4;
                    if (h5) {
                        lo |= fifth_bit(w, c, L, 0);
                        hi |= fifth_bit(w, c, L, 1);
                    }
                    float *v0 = o + 32 * b + 4 * c + j, *v1 = v0 + 16;
                    if (offset) {
                        *v0 = (float)(lo - offset) * dd;
                        *v1 = (float)(hi - offset) * dd;
                    } else {
                        const float a = (float)lo * dd, e = (float)hi * dd;
                        *v0 = a + mm;
                        *v1 = e + mm;
                    }
                }
            }
        }
    }
}

void gl_deq_s8(const int8_t *q, const void *s, int h, int v, int64_t sblk, int64_t k,
               const int64_t *ids, int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, ks = k / 256, ns = k / sblk, bs = S8_BYTES(v);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        for (int64_t e = 0; e < k; e++) {
            const int64_t b = e / 32, t = (e % 32) / 4, j = e % 4;
            const uint8_t *w = (const uint8_t *)q + (g * kb + b) * bs;
            int code;
            float sc;
            if (v == S8_Q8) {
                code = (int8_t)w[32 * t + 4 * i + j];
            } else {
                const uint8_t byte = w[32 * (t % 4) + 4 * i + j];
                code = N4_VALUES[t < 4 ? byte & 0xF : byte >> 4];
            }
            if (v == S8_N4X) /* gguf's dl = d * (ls - 32), in float */
                sc = h2f(((const uint16_t *)s)[(g * ks + b / 8) * 8 + i]) * (float)(int8_t)w[128 + i];
            else
                sc = get_scale(s, (g * ns + e / sblk) * 8 + i, h);
            out[r * k + e] = (float)code * sc;
        }
    }
}

/* ---------------------------------------------------------------- activations -> int8 */
/* x (M, k) -> xq (M, k) int8, xd / xs (M, k/32), xs16 (M, k/16): per 32 values
 * xd = max|x| / 127, xq = round(x / xd), xs = xd * sum(xq); xs16 the same sum per 16 values;
 * xu (when not NULL) xq + 128 as unsigned bytes, for the s8 and grid-quant products with VNNI. */
/* Blocks [b0, b1) of x (32 values each, rows of k one after another) quantized as quantize_x does. */
static void quantize_blocks(const float *x, int64_t b0, int64_t b1, int8_t *xq, uint8_t *xu, float *xd,
                            float *xs, float *xs16) {
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    for (int64_t i = b0; i < b1; i++) {
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
        const __m256i sa = _mm256_add_epi32(i0, i1), sb = _mm256_add_epi32(i2, i3);
        __m128i s4 = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(sa), _mm256_extracti128_si256(sa, 1)),
                                    _mm_add_epi32(_mm256_castsi256_si128(sb), _mm256_extracti128_si256(sb, 1)));
        s4 = _mm_hadd_epi32(s4, s4); /* [sum of the first 16, of the last 16, ...] */
        const int32_t sum0 = _mm_cvtsi128_si32(s4), sum1 = _mm_extract_epi32(s4, 1);
        /* pack 32 x int32 -> 32 x int8 in order */
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i pk = _mm256_packs_epi16(p01, p23);
        pk = _mm256_permutevar8x32_epi32(pk, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * 32), pk);
        if (xu) _mm256_storeu_si256((__m256i *)(xu + i * 32), _mm256_xor_si256(pk, _mm256_set1_epi8((char)0x80)));
        xd[i] = dd;
        xs[i] = dd * (float)(sum0 + sum1);
        xs16[2 * i] = dd * (float)sum0;
        xs16[2 * i + 1] = dd * (float)sum1;
    }
}

static void quantize_x(const float *x, int64_t M, int64_t k, int8_t *xq, uint8_t *xu, float *xd,
                       float *xs, float *xs16, int nth) {
    const int64_t kb = k / 32;
    if (M * k <= 65536) {
        quantize_blocks(x, 0, M * kb, xq, xu, xd, xs, xs16);
        return;
    }
#pragma omp parallel num_threads(nth)
    {
        int64_t b0, b1;
        static_chunk(M * kb, omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        quantize_blocks(x, b0, b1, xq, xu, xd, xs, xs16);
    }
}
