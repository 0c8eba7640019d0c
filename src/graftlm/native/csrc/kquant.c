/* The K-quant super-block formats (their products: kquant_k4.c, kquant_k16.c): k4 (Q4_K), k5
 * (Q5_K) and k6 (Q6_K) at the file's size, and k3 (Q3_K), k2 (Q2_K) with their codes in 4 bits
 * (4.625 and 5.125 bits a weight; the files' 3.44 and 2.63).
 *
 * A Q4_K / Q5_K super-block of 256 values has float16 d and dmin, and per 32 values a 6-bit scale
 * sc and min mn: w = q * (d * sc) - dmin * mn, q in 0..15 (Q4_K) or 0..31 (Q5_K). Repacked at
 * load, in groups of 8 rows (g = row / 8, i = row % 8, b = block of 32 values, L = 4 i + j):
 *   q: per (g, b), K4_BYTES(h5) bytes:
 *      [0, 128)    the low 4 bits, as u4 lays them (quant.c, gl_pack_u4): byte 32 c + L holds
 *                  value 4 c + j of row i (low nibble) and value 16 + 4 c + j (high nibble)
 *      [128, 160)  Q5_K only: the fifth bits, a byte a lane: bit 2 c of byte 128 + L is the low
 *                  nibble's of lane L in chunk c, bit 2 c + 1 the high nibble's (fifth_at)
 *      then 16     sc of the 8 rows, mn of the 8 rows (bytes)
 *   d: per (g, super-block), 16 float16: the 8 rows' d, then their dmin (the file's own values)
 * 4.625 bits a weight for Q4_K (the file: 4.5), 5.625 for Q5_K (5.5): what a decode step reads.
 * The scales d * sc and dmin * mn are made per block in the product (one multiply for 8 rows);
 * dequantization computes them as gguf does, so it is bit-exact.
 *
 * Q6_K: w = (d * sc) * (q - 32), q in 0..63, d float16 per 256 values, sc int8 per 16. k6 keeps
 *   q: per (g, b), 208 bytes: the low 4 bits as above; at 128 + 16 c, the fifth and sixth bits of
 *      chunk c's 32 bytes of codes (graftlm.h's q6_high: byte i holds two bits each of low-nibble
 *      lanes i and i + 16, then of high-nibble lanes i and i + 16); then sc of the 8 rows for
 *      values 0..15 of the block (the low nibbles) and for 16..31 (the high nibbles), int8
 *   d: per (g, super-block), the 8 rows' d (float16)
 * 6.5625 bits a weight, the file's own size. Q3_K and Q2_K keep the same layout with no planes
 * (and Q2_K its mins after its scales, its dmin after its d): see the k16 section.
 */
#include "graftlm.h"

#define K4_BYTES(h5) (144 + 32 * (h5))

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a super-block's 12 bytes. */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One GGUF row of Q4_K / Q5_K -> codes (k bytes, 0..31), sc and mn per 32 values, and the raw
 * float16 d, dmin per 256 (dd[2 sb], dd[2 sb + 1]). */
static void row_k4(int type, const uint8_t *src, int64_t k, uint8_t *q, uint8_t *sc, uint8_t *mn,
                   uint16_t *dd) {
    const int five = type == T_Q5_K, bs = five ? 176 : 144;
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = src + sb * bs, *qh = blk + 16, *ql = blk + (five ? 48 : 16);
        dd[2 * sb] = rd16(blk);
        dd[2 * sb + 1] = rd16(blk + 2);
        for (int j = 0; j < 8; j++) {
            int s, m;
            scale_min_k4(j, blk + 4, &s, &m);
            const int64_t b = sb * 8 + j;
            sc[b] = (uint8_t)s;
            mn[b] = (uint8_t)m;
            const uint8_t *c = ql + (j / 2) * 32;
            for (int t = 0; t < 32; t++) {
                const int lo = (j & 1) ? c[t] >> 4 : c[t] & 0xF;
                q[b * 32 + t] = (uint8_t)(lo | (five ? ((qh[t] >> j) & 1) << 4 : 0));
            }
        }
    }
}

int gl_pack_k4(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, uint8_t *q,
               uint16_t *d, int nth) {
    if (type != T_Q4_K && type != T_Q5_K) return 1;
    const int h5 = type == T_Q5_K;
    const int64_t kb = k / 32, ks = k / 256, groups = (n + 7) / 8, bs = K4_BYTES(h5);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *codes = calloc((size_t)(8 * k), 1), *sc = calloc((size_t)(8 * kb), 1);
        uint8_t *mn = calloc((size_t)(8 * kb), 1);
        uint16_t *dd = calloc((size_t)(16 * ks), sizeof(uint16_t));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_k4(type, raw + (g * 8 + i) * rowbytes, k, codes + i * k, sc + i * kb, mn + i * kb,
                   dd + i * 2 * ks);
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *w = q + (g * kb + b) * bs, *sm = w + 128 + 32 * h5;
            memset(w, 0, (size_t)bs);
            for (int i = 0; i < 8; i++) {
                sm[i] = sc[i * kb + b];
                sm[8 + i] = mn[i * kb + b];
                put_nibbles(w, i, codes + i * k + 32 * b);
                if (h5) put_fifth_bits(w, i, codes + i * k + 32 * b);
            }
        }
        for (int64_t sb = 0; sb < ks; sb++)
            for (int i = 0; i < 8; i++) {
                d[(g * ks + sb) * 16 + i] = dd[i * 2 * ks + 2 * sb];
                d[(g * ks + sb) * 16 + 8 + i] = dd[i * 2 * ks + 2 * sb + 1];
            }
        free(codes);
        free(sc);
        free(mn);
        free(dd);
    }
    return 0;
}

/* Rows ids[i] (or row0 + i) -> out (nrows, k): w = q * (d * sc) + -(dmin * mn), gguf's rounding. */
void gl_deq_k4(const uint8_t *q, const uint16_t *d, int h5, int64_t k, const int64_t *ids,
               int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, ks = k / 256, bs = K4_BYTES(h5);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *w = q + (g * kb + b) * bs, *sm = w + 128 + 32 * h5;
            const uint16_t *ds = d + (g * ks + b / 8) * 16;
            const float dd = h2f(ds[i]) * (float)sm[i], mm = -(h2f(ds[8 + i]) * (float)sm[8 + i]);
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 4; j++) {
                    const int L = 4 * (int)i + j;
                    int lo = w[32 * c + L] & 0xF, hi = w[32 * c + L] >> 4;
                    if (h5) {
                        lo |= fifth_bit(w, c, L, 0);
                        hi |= fifth_bit(w, c, L, 1);
                    }
                    const float a = (float)lo * dd, e = (float)hi * dd;
                    o[32 * b + 4 * c + j] = a + mm;
                    o[32 * b + 16 + 4 * c + j] = e + mm;
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- k6, k3, k2: a scale per 16 */

/* Q6_K (v 0), Q3_K (v 1) and Q2_K (v 2): a scale per 16 values. Codes in 4 bits (Q6_K: and its
 * fifth and sixth bits, 16 bytes a chunk), the scales per 16 (Q2_K: and its mins per 16) as bytes, d (and dmin) per 256
 * as the file's float16: q (0..63, 0..7, 0..3), O the offset (32, 4, 0):
 *   w = (q - O) * (d * sc) [ - dmin * mn ]
 * Q3_K's scale is stored as its sc - 32 (int8); Q2_K's sc and mn as unsigned bytes. */
enum { V_Q6, V_Q3, V_Q2 };
#define K16_BYTES(v) (128 + ((v) == V_Q6 ? 64 : 0) + 16 + ((v) == V_Q2 ? 16 : 0))
#define K16_D(v) ((v) == V_Q2 ? 16 : 8) /* float16 per (group, super-block) */
#define K16_OFF(v) ((v) == V_Q6 ? 32 : (v) == V_Q3 ? 4 : 0)

/* One GGUF row -> codes (k bytes), scales (and mins) per 16 values, the raw float16 d (and
 * dmin) per 256. */
static void row_k16(int v, const uint8_t *src, int64_t k, uint8_t *q, int8_t *sc, uint8_t *mn,
                    uint16_t *dd) {
    for (int64_t sb = 0; sb < k / 256; sb++) {
        uint8_t *y = q + sb * 256;
        if (v == V_Q6) { /* ql[128] qh[64] scales[16] d */
            const uint8_t *blk = src + sb * 210;
            dd[sb] = rd16(blk + 208);
            memcpy(sc + sb * 16, blk + 192, 16);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + h * 64, *qh = blk + 128 + h * 32;
                for (int l = 0; l < 32; l++) {
                    y[h * 128 + l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                    y[h * 128 + l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                    y[h * 128 + l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    y[h * 128 + l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        } else if (v == V_Q3) { /* hmask[32] qs[64] scales[12] d: ggml's dequantize_row_q3_K */
            const uint8_t *blk = src + sb * 110, *hm = blk, *qs = blk + 32;
            dd[sb] = rd16(blk + 108);
            uint32_t aux[4];
            memcpy(aux, blk + 96, 12);
            const uint32_t tmp = aux[2], m1 = 0x03030303u, m2 = 0x0f0f0f0fu;
            aux[2] = ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
            aux[3] = ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
            aux[0] = (aux[0] & m2) | (((tmp >> 0) & m1) << 4);
            aux[1] = (aux[1] & m2) | (((tmp >> 2) & m1) << 4);
            const uint8_t *s6 = (const uint8_t *)aux;
            for (int j = 0; j < 16; j++) sc[sb * 16 + j] = (int8_t)(s6[j] - 32);
            for (int half = 0; half < 2; half++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        const int bit = half * 4 + j;
                        const int lo = (qs[half * 32 + l] >> (2 * j)) & 3, h = (hm[l] >> bit) & 1;
                        y[half * 128 + j * 32 + l] = (uint8_t)(lo + 4 * h); /* (lo - 4 (1 - h)) + 4 */
                    }
        } else { /* Q2_K: scales[16] qs[64] d dmin */
            const uint8_t *blk = src + sb * 84, *qs = blk + 16;
            dd[2 * sb] = rd16(blk + 80);
            dd[2 * sb + 1] = rd16(blk + 82);
            for (int j = 0; j < 16; j++) {
                sc[sb * 16 + j] = (int8_t)(blk[j] & 0xF);
                mn[sb * 16 + j] = blk[j] >> 4;
            }
            for (int half = 0; half < 2; half++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++)
                        y[half * 128 + j * 32 + l] = (uint8_t)((qs[half * 32 + l] >> (2 * j)) & 3);
        }
    }
}

static int k16_variant(int type) {
    return type == T_Q6_K ? V_Q6 : type == T_Q3_K ? V_Q3 : type == T_Q2_K ? V_Q2 : -1;
}

int gl_pack_k6(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, uint8_t *q,
               uint16_t *d, int nth) {
    const int v = k16_variant(type);
    if (v < 0) return 1;
    const int64_t kb = k / 32, ks = k / 256, groups = (n + 7) / 8, bs = K16_BYTES(v), nd = K16_D(v);
    const int64_t at_sc = v == V_Q6 ? 192 : 128;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint8_t *codes = calloc((size_t)(8 * k), 1), *mn = calloc((size_t)(8 * kb * 2), 1);
        int8_t *sc = calloc((size_t)(8 * kb * 2), 1);
        uint16_t *dd = calloc((size_t)(8 * ks * 2), sizeof(uint16_t));
        for (int i = 0; i < 8 && g * 8 + i < n; i++)
            row_k16(v, raw + (g * 8 + i) * rowbytes, k, codes + i * k, sc + i * kb * 2,
                    mn + i * kb * 2, dd + i * ks * 2);
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *w = q + (g * kb + b) * bs;
            memset(w, 0, (size_t)bs);
            for (int i = 0; i < 8; i++) {
                w[at_sc + i] = (uint8_t)sc[i * kb * 2 + 2 * b];
                w[at_sc + 8 + i] = (uint8_t)sc[i * kb * 2 + 2 * b + 1];
                if (v == V_Q2) {
                    w[at_sc + 16 + i] = mn[i * kb * 2 + 2 * b];
                    w[at_sc + 24 + i] = mn[i * kb * 2 + 2 * b + 1];
                }
                put_nibbles(w, i, codes + i * k + 32 * b);
                for (int c = 0; c < 4 && v == V_Q6; c++) /* the fifth and sixth bits: q6_high's byte L % 16 */
                    for (int j = 0; j < 4; j++) {
                        const int L = 4 * i + j, sh = L < 16 ? 0 : 2;
                        const uint8_t lo = codes[i * k + 32 * b + 4 * c + j], hi = codes[i * k + 32 * b + 16 + 4 * c + j];
                        w[128 + 16 * c + L % 16] |= (uint8_t)(((lo >> 4) & 3) << sh | ((hi >> 4) & 3) << (4 + sh));
                    }
            }
        }
        for (int64_t sb = 0; sb < ks; sb++)
            for (int i = 0; i < 8; i++) {
                if (v == V_Q2) {
                    d[(g * ks + sb) * nd + i] = dd[i * ks * 2 + 2 * sb];
                    d[(g * ks + sb) * nd + 8 + i] = dd[i * ks * 2 + 2 * sb + 1];
                } else {
                    d[(g * ks + sb) * nd + i] = dd[i * ks * 2 + sb];
                }
            }
        free(codes);
        free(sc);
        free(mn);
        free(dd);
    }
    return 0;
}

/* The scale of 8 rows' bytes: signed (Q6_K, Q3_K) or unsigned (Q2_K). */
static inline float k16_scale(int v, const uint8_t *p) { return v == V_Q2 ? (float)p[0] : (float)(int8_t)p[0]; }

/* Rows ids[i] (or row0 + i) -> out (nrows, k): gguf's rounding, (q - O) * (d * sc) [+ -(dmin * mn)]. */
void gl_deq_k6(const uint8_t *q, const uint16_t *d, int v, int64_t k, const int64_t *ids,
               int64_t row0, int64_t nrows, float *out, int nth) {
    const int64_t kb = k / 32, ks = k / 256, bs = K16_BYTES(v), nd = K16_D(v);
    const int off = K16_OFF(v), at_sc = v == V_Q6 ? 192 : 128;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t row = ids ? ids[r] : row0 + r, g = row / 8, i = row % 8;
        float *o = out + r * k;
        for (int64_t b = 0; b < kb; b++) {
            const uint8_t *w = q + (g * kb + b) * bs, *sm = w + at_sc;
            const uint16_t *ds = d + (g * ks + b / 8) * nd;
            const float dk = h2f(ds[i]);
            const float s0 = dk * k16_scale(v, sm + i), s1 = dk * k16_scale(v, sm + 8 + i);
            float m0 = 0.0f, m1 = 0.0f;
            if (v == V_Q2) {
                const float dm = h2f(ds[8 + i]);
                m0 = -(dm * (float)sm[16 + i]);
                m1 = -(dm * (float)sm[24 + i]);
            }
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 4; j++) {
                    const int L = 4 * (int)i + j;
                    int lo = w[32 * c + L] & 0xF, hi = w[32 * c + L] >> 4;
                    if (v == V_Q6) {
                        const int bits = w[128 + 16 * c + L % 16] >> (L < 16 ? 0 : 2);
                        lo |= (bits & 3) << 4;
                        hi |= ((bits >> 4) & 3) << 4;
                    }
                    float *v0 = o + 32 * b + 4 * c + j, *v1 = v0 + 16;
                    if (v == V_Q2) {
                        const float a = (float)lo * s0, e = (float)hi * s1;
                        *v0 = a + m0;
                        *v1 = e + m1;
                    } else {
                        *v0 = (float)(lo - off) * s0;
                        *v1 = (float)(hi - off) * s1;
                    }
                }
            }
        }
    }
}
