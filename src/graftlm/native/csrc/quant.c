/* The quantized weights: repacking at load, exact dequantization, the products.
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

/* ---------------------------------------------------------------- matrix products */

/* The 8 outputs of a row group for R rows of x: nvalid < 8 in the last, padded group. */
static inline __attribute__((always_inline)) void store_group(const __m256 *acc, int R, float *y,
                                                              int64_t ldy, int64_t nvalid) {
    for (int r = 0; r < R; r++) {
        if (nvalid == 8) {
            _mm256_storeu_ps(y + r * ldy, acc[r]);
        } else {
            float t[8];
            _mm256_storeu_ps(t, acc[r]);
            memcpy(y + r * ldy, t, sizeof(float) * (size_t)nvalid);
        }
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Chunk c of a block w of 4-bit (h5: 5-bit) codes as u4 and k4 lay them: its low nibbles in lo,
 * its high in hi, with the fifth bits after the 128 code bytes (h5). */
static inline __attribute__((always_inline)) void nibble_chunk(const uint8_t *w, int h5, int c,
                                                               __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
    *lo = _mm256_and_si256(raw, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if (h5) {
        const __m256i f = _mm256_loadu_si256((const __m256i *)(w + 128));
        *lo = _mm256_or_si256(*lo, fifth_at(f, 2 * c));
        *hi = _mm256_or_si256(*hi, fifth_at(f, 2 * c + 1));
    }
}

#if GL_VNNI
/* R rows' int32 sums of a block w of 4- (h5: 5-) bit codes (xb: the rows' blocks of x, stride
 * apart), chunk by chunk. */
static inline __attribute__((always_inline)) void nibble_dots(const uint8_t *w, int h5, const int8_t *xb,
                                                              int64_t stride, int R, __m256i *s32) {
    for (int r = 0; r < R; r++) s32[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        nibble_chunk(w, h5, c, &lo, &hi);
        for (int r = 0; r < R; r++)
            s32[r] = DPBUSD(DPBUSD(s32[r], lo, bcast4(xb + r * stride + 4 * c)), hi,
                            bcast4(xb + r * stride + 16 + 4 * c));
    }
}
#else
/* Four int16 sums of a row -> its int32 sums: added in int16 two at a time (pairs: where a third
 * could overflow) or all four, then widened. */
static inline __attribute__((always_inline)) __m256i widen_sums(const __m256i *p, int pairs) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (pairs)
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                                _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
}

/* Without VNNI: the block's 8 code vectors are unpacked once for the R rows and stay in
 * registers (lo, hi: nibble_chunk's), and each row's sums (xb: its block of x) come from them:
 * its 8 maddubs summed in int16, all 8 of 4-bit codes (|pair| <= 2 * 15 * 127; quantize_x keeps
 * |x| <= 127) or 4 at a time of 5-bit ones (2 * 31 * 127), then widened. */
static inline __attribute__((always_inline)) __m256i nibble_sums(const __m256i *lo, const __m256i *hi,
                                                                 int h5, const int8_t *xb) {
    __m256i p[4];
    for (int c = 0; c < 4; c++)
        p[c] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], bcast4(xb + 4 * c)),
                                _mm256_maddubs_epi16(hi[c], bcast4(xb + 16 + 4 * c)));
    return widen_sums(p, h5);
}
#endif

/* y[r, 8g .. 8g+7] for R rows of x, one group g of a u4 (h5: u5) weight. */
static inline __attribute__((always_inline)) void u4_group(
    const uint8_t *qs, const void *d, const void *m, int h, int h5, int64_t kb, const int8_t *xq,
    const float *xd, const float *xs, int R, float *y, int64_t ldy, int64_t nvalid) {
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *w = qs + b * U4_BYTES(h5);
        prefetch_block(w, U4_BYTES(h5));
        const __m256 dv = load_scales8(d, b * 8, h), mv = load_scales8(m, b * 8, h);
#if GL_VNNI
        __m256i s32[MT];
        nibble_dots(w, h5, xq + b * 32, kb * 32, R, s32);
#else
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) nibble_chunk(w, h5, c, &lo[c], &hi[c]);
#endif
        for (int r = 0; r < R; r++) {
#if GL_VNNI
            const __m256 isum = _mm256_cvtepi32_ps(s32[r]);
#else
            const __m256 isum = _mm256_cvtepi32_ps(nibble_sums(lo, hi, h5, xq + (r * kb + b) * 32));
#endif
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* u4_group for two whole groups at once (qa, da, ma, ya: group g; qb, db, mb, yb: g + 1), in
 * 512-bit vectors: the same sums and float steps per output as u4_group, so the same bits. */
static inline __attribute__((always_inline)) void u4_pair(
    const uint8_t *qa, const uint8_t *qb, const void *da, const void *db, const void *ma,
    const void *mb, int h, int h5, int64_t kb, const int8_t *xq, const float *xd, const float *xs,
    int R, float *ya, float *yb, int64_t ldy) {
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *wa = qa + b * U4_BYTES(h5), *wb = qb + b * U4_BYTES(h5);
        prefetch_block(wa, U4_BYTES(h5));
        prefetch_block(wb, U4_BYTES(h5));
        __m512i s32[MT];
        nibble_dots2(wa, wb, h5, xq, kb, b, R, s32);
        const __m512 dv = cat_ps(load_scales8(da, b * 8, h), load_scales8(db, b * 8, h));
        const __m512 mv = cat_ps(load_scales8(ma, b * 8, h), load_scales8(mb, b * 8, h));
        for (int r = 0; r < R; r++) {
            const __m512 isum = _mm512_cvtepi32_ps(s32[r]);
            acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * kb + b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * kb + b]), acc[r]);
        }
    }
    store_pair(acc, R, ya, yb, ldy);
}
#endif

/* Chunks c and c + 4 (0 <= c < 4: values 4 c .. 4 c + 3 and 16 + 4 c .. of every row) of an s8
 * block w of variant v as signed codes: loaded (Q8_0), or looked up from the 4-bit codes. */
static inline __attribute__((always_inline)) void s8_chunks(const int8_t *w, int v, int c, __m256i *a,
                                                            __m256i *b) {
    if (v != S8_Q8) {
        const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)N4_VALUES));
        __m256i lo, hi;
        nibble_chunk((const uint8_t *)w, 0, c, &lo, &hi);
        *a = _mm256_shuffle_epi8(tbl, lo);
        *b = _mm256_shuffle_epi8(tbl, hi);
    } else {
        *a = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
        *b = _mm256_loadu_si256((const __m256i *)(w + 32 * c + 128));
    }
}

/* The bytes of an s8 weight's scales a group of 8 rows: a scale per 32 values (float16 or float),
 * or IQ4_XS's float16 d per 256. */
static inline int64_t s8_scale_bytes(const gl_weight *w) {
    return w->small == S8_N4X ? w->k / 256 * 16 : w->k / 32 * 8 * (w->half ? 2 : 4);
}

/* The 8 rows' scales of block b (w) of an s8 weight of variant v, s the group's scales: a scale
 * per 32 (float16 or float: h), or IQ4_XS's d * (ls - 32) from its super-block's float16 d and the
 * block's int8 ls - 32, as gguf computes it. */
static inline __attribute__((always_inline)) __m256 s8_scales(int v, const void *s, int h, int64_t b,
                                                              const int8_t *w) {
    if (v != S8_N4X) return load_scales8(s, b * 8, h);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + (b >> 3) * 8)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 128)))));
}

/* The same for an s8 weight of variant v (a scale per 32 values). With VNNI, x comes unsigned (xu: xq + 128,
 * see quantize_x) against the signed codes, and each block's sums lose 128 * sum(w), one dot of
 * the block's codes with 128s shared by all R rows: the same integer sums as sum(xq * w), so the
 * same bits, in one instruction a row and chunk (was three: w's sign onto x, a dot, an add).
 * Without VNNI, maddubs's int16 pairs would saturate on xu: |w| against x with w's sign. */
static inline __attribute__((always_inline)) void s8_group(
    const int8_t *q, const void *s, int h, int v, int64_t kb, const int8_t *xq, const uint8_t *xu,
    const float *xd, int R, float *y, int64_t ldy, int64_t nvalid) {
#if GL_VNNI
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    (void)xq;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    (void)xu;
#endif
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *w = q + b * S8_BYTES(v);
        prefetch_block(w, S8_BYTES(v));
        __m256i i0[MT];
        for (int r = 0; r < R; r++) i0[r] = _mm256_setzero_si256();
#if GL_VNNI
        __m256i corr = _mm256_setzero_si256();
#endif
        for (int c = 0; c < 4; c++) {
            __m256i wc[2];
            s8_chunks(w, v, c, &wc[0], &wc[1]);
            for (int u = 0; u < 2; u++) { /* chunk c, then c + 4 */
                const __m256i wv = wc[u];
                const int at = 4 * c + 16 * u;
#if GL_VNNI
                corr = DPBUSD(corr, bias, wv);
                for (int r = 0; r < R; r++)
                    i0[r] = DPBUSD(i0[r], bcast4((const int8_t *)xu + (r * kb + b) * 32 + at), wv);
#else
                const __m256i aw = _mm256_sign_epi8(wv, wv);
                for (int r = 0; r < R; r++) {
                    const __m256i xv = bcast4(xq + (r * kb + b) * 32 + at);
                    i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
                }
#endif
            }
        }
#if GL_VNNI
        for (int r = 0; r < R; r++) i0[r] = _mm256_sub_epi32(i0[r], corr);
#endif
        const __m256 sv = s8_scales(v, s, h, b, w);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[r]), _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * kb + b])), acc[r]);
    }
    store_group(acc, R, y, ldy, nvalid);
}

#if GL_VNNI512
/* s8_chunks of two groups' blocks wa, wb (the low and high 256 bits). */
static inline __attribute__((always_inline)) void s8_chunks2(const int8_t *wa, const int8_t *wb, int v,
                                                             int c, __m512i *a, __m512i *b) {
    if (v != S8_Q8) {
        const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)N4_VALUES));
        __m512i lo, hi;
        nibbles2((const uint8_t *)wa, (const uint8_t *)wb, c, 0, &lo, &hi);
        *a = _mm512_shuffle_epi8(tbl, lo);
        *b = _mm512_shuffle_epi8(tbl, hi);
    } else {
        *a = cat_si(_mm256_loadu_si256((const __m256i *)(wa + 32 * c)), _mm256_loadu_si256((const __m256i *)(wb + 32 * c)));
        *b = cat_si(_mm256_loadu_si256((const __m256i *)(wa + 32 * c + 128)),
                    _mm256_loadu_si256((const __m256i *)(wb + 32 * c + 128)));
    }
}

/* s8_group for two whole groups at once (qa, sa, ya: group g; qb, sb, yb: g + 1), in 512-bit
 * vectors: the same sums and float steps per output, so the same bits. */
static inline __attribute__((always_inline)) void s8_pair(
    const int8_t *qa, const int8_t *qb, const void *sa, const void *sb, int h, int v, int64_t kb,
    const uint8_t *xu, const float *xd, int R, float *ya, float *yb, int64_t ldy) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const int8_t *wa = qa + b * S8_BYTES(v), *wb = qb + b * S8_BYTES(v);
        prefetch_block(wa, S8_BYTES(v));
        prefetch_block(wb, S8_BYTES(v));
        __m512i i0[MT], corr = _mm512_setzero_si512();
        for (int r = 0; r < R; r++) i0[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i wc[2];
            s8_chunks2(wa, wb, v, c, &wc[0], &wc[1]);
            for (int u = 0; u < 2; u++) { /* chunk c, then c + 4 */
                corr = DPBUSD512(corr, bias, wc[u]);
                for (int r = 0; r < R; r++) {
                    int32_t x4;
                    memcpy(&x4, xu + (r * kb + b) * 32 + 4 * c + 16 * u, 4);
                    i0[r] = DPBUSD512(i0[r], _mm512_set1_epi32(x4), wc[u]);
                }
            }
        }
        const __m512 sv = cat_ps(s8_scales(v, sa, h, b, wa), s8_scales(v, sb, h, b, wb));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i0[r], corr)),
                                     _mm512_mul_ps(sv, _mm512_set1_ps(xd[r * kb + b])), acc[r]);
    }
    store_pair(acc, R, ya, yb, ldy);
}
#endif

/* Room for M rows of k values of x quantized (quantize_x fills it); with s8 (an s8 or grid-quant
 * product reads x: a Q8_0 or IQ2/IQ3 weight, an int8 A) and VNNI, for x as unsigned bytes too. */
static xbuf xbuf_take(gl_scratch *s, int64_t M, int64_t k, int s8) {
    xbuf b;
    b.xq = scratch_take(s, M * k);
    b.xu = GL_VNNI && s8 ? scratch_take(s, M * k) : NULL;
    b.xd = scratch_take(s, (int64_t)sizeof(float) * M * (k / 32));
    b.xs = scratch_take(s, (int64_t)sizeof(float) * M * (k / 32));
    b.xs16 = scratch_take(s, (int64_t)sizeof(float) * M * (k / 16));
    b.xf = NULL;
    return b;
}

/* F(h, variant, rows) for an s8 weight's h and variant v, with R rows: each a compile-time
 * constant where the kernel is inlined (WITH_ROWS). */
#define WITH_ROWS_HV(R, F, HH, VV)                                                                 \
    switch (R) {                                                                                   \
    case 6: F(HH, VV, 6); break;                                                                   \
    case 5: F(HH, VV, 5); break;                                                                   \
    case 4: F(HH, VV, 4); break;                                                                   \
    case 3: F(HH, VV, 3); break;                                                                   \
    case 2: F(HH, VV, 2); break;                                                                   \
    default: F(HH, VV, 1); break;                                                                  \
    }
#define S8_BY_VARIANT(F)                                                                           \
    if (v == S8_N4X) {                                                                             \
        WITH_ROWS_HV(R, F, 1, S8_N4X)                                                              \
    } else if (v == S8_N4 && h) {                                                                  \
        WITH_ROWS_HV(R, F, 1, S8_N4)                                                               \
    } else if (v == S8_N4) {                                                                       \
        WITH_ROWS_HV(R, F, 0, S8_N4)                                                               \
    } else if (h) {                                                                                \
        WITH_ROWS_HV(R, F, 1, S8_Q8)                                                               \
    } else {                                                                                       \
        WITH_ROWS_HV(R, F, 0, S8_Q8)                                                               \
    }

/* One task of y (M, n) = x (M, k) @ W.T: the outputs [8 GT t, 8 GT (t + 1)) of rows [ra, rb) of
 * x. The tasks split the output rows, so the task's weights stay in L1 across the tiles of x. */
static void mm_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y) {
    const int64_t n = w->n, k = w->k, kb = k / 32, groups = (n + 7) / 8;
    const int64_t g1 = t * GT + GT < groups ? t * GT + GT : groups;
    const int h = (int)w->half;
    const int64_t ss = h ? 2 : 4; /* bytes per stored scale */
    if (w->kind == 2 || w->kind == 3) {
        (w->kind == 2 ? k4_task : k6_task)(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 4) {
        f_task(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 5) {
        mx4_task(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 6) {
        iq_task(w, xb, M, ra, rb, t, y);
        return;
    }
    if (w->kind == 0) {
        const uint8_t *qs = (const uint8_t *)w->q;
        const int h5 = (int)w->small;
        for (int64_t r0 = ra; r0 < rb; r0 += MT) {
            const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
            const int8_t *xt = xb->xq + r0 * k;
            const float *dt = xb->xd + r0 * kb, *st = xb->xs + r0 * kb;
            for (int64_t g = t * GT; g < g1; g++) {
                const uint8_t *qg = qs + g * kb * U4_BYTES(h5);
                const void *dg = (const char *)w->d + g * kb * 8 * ss, *mg = (const char *)w->m + g * kb * 8 * ss;
                float *yo = y + r0 * n + g * 8;
                const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#if GL_VNNI512
                if (pair_at(M, g, g1, n)) { /* two whole groups: 512 bits */
                    const uint8_t *qh = qg + kb * U4_BYTES(h5);
                    const void *dh = (const char *)dg + kb * 8 * ss, *mh = (const char *)mg + kb * 8 * ss;
#define U4P(RR) u4_pair(qg, qh, dg, dh, mg, mh, h, h5, kb, xt, dt, st, RR, yo, yo + 8, n)
                    WITH_ROWS(R, U4P)
#undef U4P
                    g++;
                    continue;
                }
#endif
#define U4H(RR) u4_group(qg, dg, mg, 1, 0, kb, xt, dt, st, RR, yo, n, nv)
#define U4F(RR) u4_group(qg, dg, mg, 0, 0, kb, xt, dt, st, RR, yo, n, nv)
#define U5H(RR) u4_group(qg, dg, mg, 1, 1, kb, xt, dt, st, RR, yo, n, nv)
#define U5F(RR) u4_group(qg, dg, mg, 0, 1, kb, xt, dt, st, RR, yo, n, nv)
                if (h5) {
                    if (h) {
                        WITH_ROWS(R, U5H)
                    } else {
                        WITH_ROWS(R, U5F)
                    }
                } else if (h) {
                    WITH_ROWS(R, U4H)
                } else {
                    WITH_ROWS(R, U4F)
                }
#undef U4H
#undef U4F
#undef U5H
#undef U5F
            }
        }
        return;
    }
    /* s8: a scale per 32 values (IQ4_XS: made from its super-block's) */
    const int8_t *q = (const int8_t *)w->q;
    const int v = (int)w->small;
    const int64_t bs = S8_BYTES(v), sg_bytes = s8_scale_bytes(w);
    for (int64_t r0 = ra; r0 < rb; r0 += MT) {
        const int R = rb - r0 < MT ? (int)(rb - r0) : MT;
        const int8_t *xt = xb->xq + r0 * k;
        const uint8_t *ut = xb->xu ? xb->xu + r0 * k : NULL;
        const float *dt = xb->xd + r0 * kb;
        for (int64_t g = t * GT; g < g1; g++) {
            const int8_t *qg = q + g * kb * bs;
            const void *sg = (const char *)w->d + g * sg_bytes;
            float *yo = y + r0 * n + g * 8;
            const int64_t nv = n - g * 8 < 8 ? n - g * 8 : 8;
#if GL_VNNI512
            if (pair_at(M, g, g1, n)) { /* two whole groups: 512 bits */
                const int8_t *qh = qg + kb * bs;
                const void *sh = (const char *)sg + sg_bytes;
#define S8P(HH, VV, RR) s8_pair(qg, qh, sg, sh, HH, VV, kb, ut, dt, RR, yo, yo + 8, n)
                S8_BY_VARIANT(S8P)
#undef S8P
                g++;
                continue;
            }
#endif
#define S8G(HH, VV, RR) s8_group(qg, sg, HH, VV, kb, xt, ut, dt, RR, yo, n, nv)
            S8_BY_VARIANT(S8G)
#undef S8G
        }
    }
}

/* y (M, n) = x (M, k) @ W.T for a u4 (h5: u5) weight (qs, d, m) of n rows. */
void gl_mm_u4(const float *x, int64_t M, int64_t k, const uint8_t *qs, const void *d,
              const void *m, int h, int h5, int64_t n, float *y, int nth) {
    const gl_weight w = {0, h, 32, h5, n, k, qs, d, m};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}

/* y (M, n) = x (M, k) @ W.T for an s8 weight (q, s) of variant v and n rows, s per 32 values
 * (sblk 32; IQ4_XS: per 256). */
void gl_mm_s8(const float *x, int64_t M, int64_t k, const int8_t *q, const void *s, int h, int v,
              int sblk, int64_t n, float *y, int nth) {
    const gl_weight w = {1, h, sblk, v, n, k, q, s, NULL};
    proj_alone(&w, x, M, 1, NULL, y, nth);
}
