/* Decode attention's q8_0 cache on 512 bits: its keys in integer dots (VNNI), its values'
 * scales folded into the weights (pv_q8), or the weights in 16-bit integers (pv_q8w). */
#include "graftlm.h"

#if DECODE_ZMM
/* The float16 scales at p + i rb of rows i < n as 16 floats (0 past n): one gather (16 scalar
 * loads through memory measured 9% slower: the 16-bit stores do not forward to the wide load). */
static inline void q8_scales16(const char *p, int64_t rb, int64_t n, float *out) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)rb));
    const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << n) - 1u), at, p, 1);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
}

#if defined(__AVX512VNNI__) && !defined(GL_NO_Q8_DOTS) /* (-DGL_NO_Q8_DOTS: tests of the rest) */
#define DECODE_Q8_DOTS 1
/* q8_0 keys against int8 queries (llama.cpp's q8_0 x q8_0 dot for a q8_0 cache): the group's
 * queries quantized per 32 values (qi, their scales qd, and 128 x each block's sum, qs, for the
 * unsigned keys), 1.25 G D bytes of the thread's Vf (the 512-bit task reads values in place). */
typedef struct {
    int8_t *qi;
    float *qd;
    int32_t *qs;
} q8_queries;

/* Round half away from zero, as roundf (the cache's kv_store and KVCache's q8_0_pack). */
static inline __m512i round_away(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
    return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
}

/* The bytes q8_quantize lays out in its room: the codes (G D, to a multiple of 64), then a scale
 * and a code sum each 32 values. */
static inline int64_t q8_queries_bytes(int64_t G, int64_t D) {
    return (G * D + 63) / 64 * 64 + 8 * G * (D / 32);
}

static inline q8_queries q8_quantize(const float *Q, int64_t G, int64_t D, void *room) {
    const int64_t nb = D / 32;
    q8_queries out = {(int8_t *)room, NULL, NULL};
    out.qd = (float *)((char *)room + (G * D + 63) / 64 * 64);
    out.qs = (int32_t *)(out.qd + G * nb);
    for (int64_t g = 0; g < G; g++)
        for (int64_t b = 0; b < nb; b++) { /* as ggml's quantize_row_q8_0: d = amax / 127 */
            const float *x = Q + g * D + b * 32;
            const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512i a = round_away(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
            const __m512i c = round_away(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(out.qi + g * D + b * 32), _mm512_cvtsepi32_epi8(a));
            _mm_storeu_si128((__m128i *)(out.qi + g * D + b * 32 + 16), _mm512_cvtsepi32_epi8(c));
            out.qd[g * nb + b] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); /* stored as float16 */
            out.qs[g * nb + b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
        }
    return out;
}

/* A tile's n q8_0 keys (rows of 34-byte blocks at rows, rb bytes apart) as unsigned bytes (+128),
 * transposed in dwords: kq[c * 16 + l] lanes = keys, dword l of 64-value chunk c (values 4 l ..
 * 4 l + 3 of block 2c, then of block 2c + 1); ks[b * 16 + i] key i's scale of block b. Keys past
 * n: key 0's (masked out later). */
static inline void q8_keys_t(const char *rows, int64_t rb, int64_t n, int64_t D, __m512i *kq, float *ks) {
    const int64_t nb = D / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; 2 * c < nb; c++) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) {
            const char *row = rows + (i < n ? i : 0) * rb + 2 * c * 34;
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(row + 2));
            const __m256i hi = 2 * c + 1 < nb ? _mm256_loadu_si256((const __m256i *)(row + 36)) : _mm256_setzero_si256();
            r[i] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
        }
        transpose16(r);
        for (int l = 0; l < 16; l++) kq[c * 16 + l] = _mm512_xor_si512(_mm512_castps_si512(r[l]), flip);
    }
    for (int64_t b = 0; b < nb; b++) q8_scales16(rows + b * 34, rb, n, ks + b * 16);
}

/* GN heads' scores of the tile from head g0 (S[gi]: lanes = keys): per block the exact int32
 * dot of the keys' codes with each query's, then times both scales; each vector of keys loaded
 * once for the GN heads, their chains of VPDPBUSD interleaved (one head at a time: 8 dependent
 * VPDPBUSDs a block, each vector of keys loaded G times). */
static inline __attribute__((always_inline)) void q8_scores(const q8_queries *qq, int64_t g0, int64_t D,
                                                            const __m512i *kq, const float *ks, __m512 *S,
                                                            pf_queue *pf, const int GN) {
    const int64_t nb = D / 32;
    __m512 acc[8];
    for (int g = 0; g < GN; g++) acc[g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[8];
        for (int g = 0; g < GN; g++) dot[g] = _mm512_set1_epi32(-qq->qs[(g0 + g) * nb + b]);
        const __m512i *kb = kq + (b / 2) * 16 + (b % 2) * 8;
        for (int l = 0; l < 8; l++) {
            if (l % (8 / PF_Q8_SCORES) == 0) pf_issue(pf);
            const __m512i k = kb[l];
            for (int g = 0; g < GN; g++) {
                const int32_t *q4 = (const int32_t *)(qq->qi + (g0 + g) * D);
                dot[g] = _mm512_dpbusd_epi32(dot[g], k, _mm512_set1_epi32(q4[b * 8 + l]));
            }
        }
        const __m512 kd = _mm512_loadu_ps(ks + b * 16);
        for (int g = 0; g < GN; g++) {
            const __m512 sc = _mm512_mul_ps(kd, _mm512_set1_ps(qq->qd[(g0 + g) * nb + b]));
            acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g]), sc, acc[g]);
        }
    }
    for (int g = 0; g < GN; g++) S[g] = acc[g];
}
#else
#define DECODE_Q8_DOTS 0
#endif

/* The scales of the values of a step's q8_0 tiles: vs[(x 32 + b) 16 + i] = tile x's key i's
 * scale of block b (of Dv / 32), 0 past the tile's n[x] keys (a block's scales lie 34 bytes
 * apart, a tile's rows rb apart). */
static inline void q8_value_scales(const char *const *V, const int64_t *n, int nts, int64_t rb,
                                   int64_t Dv, float *vs) {
    for (int x = 0; x < nts; x++)
        for (int64_t b = 0; b < Dv / 32; b++) q8_scales16(V[x] + 34 * b, rb, n[x], vs + (x * 32 + b) * 16);
}

/* pv_step16 for q8_0 values (c0 and Dv multiples of 32, NU even): each key's block scales folded
 * into its weights a tile at a time (p'[g][i] = p[g][i] s_i, vs: q8_value_scales'), so a value
 * is its code converted, and one broadcast weight serves a block's two vectors. */
static inline __attribute__((always_inline)) void pv_q8(float *O, const float *alpha, const float *P,
                                                        int64_t pw, const char *const *V, const int64_t *n,
                                                        int nts, int64_t rb, int64_t c0, int64_t Dv,
                                                        const float *vs, pf_queue *pf, const int GN,
                                                        const int NU) {
    __m512 acc[4][4];
    float pp[4][2][16];
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int u = 0; u < NU; u++) acc[g][u] = _mm512_mul_ps(a, _mm512_loadu_ps(O + g * Dv + 16 * u));
    }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x] + (c0 / 32) * 34 + 2;
        for (int g = 0; g < GN; g++)
            for (int b = 0; b < NU / 2; b++)
                _mm512_storeu_ps(pp[g][b], _mm512_mul_ps(_mm512_loadu_ps(P + g * pw + x * DT),
                                                         _mm512_loadu_ps(vs + (x * 32 + c0 / 32 + b) * 16)));
        for (int64_t i = 0; i < n[x]; i++) {
            for (int f = 0; f < PF_Q8_PV; f++) pf_issue(pf);
            __m512 v[4];
            for (int u = 0; u < NU; u++)
                v[u] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(Vx + i * rb + (u / 2) * 34 + (u % 2) * 16))));
            for (int g = 0; g < GN; g++)
                for (int b = 0; b < NU / 2; b++) {
                    const __m512 p = _mm512_set1_ps(pp[g][b][i]);
                    acc[g][2 * b] = _mm512_fmadd_ps(p, v[2 * b], acc[g][2 * b]);
                    acc[g][2 * b + 1] = _mm512_fmadd_ps(p, v[2 * b + 1], acc[g][2 * b + 1]);
                }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int u = 0; u < NU; u++) _mm512_storeu_ps(O + g * Dv + 16 * u, acc[g][u]);
}

#define PVQ8_NU(GN)                                                                    \
    if (nu == 2) pv_q8(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, &pf, GN, 2);          \
    else pv_q8(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, &pf, GN, 4);

#if DECODE_Q8_DOTS /* (the VNNI of the keys' integer dots: a build without takes pv_q8) */
#define DECODE_Q8_PV16 1
/* The values' side of pv_q8 in 16-bit integers (VPDPWSSD: two products a lane, int32 sums), half
 * the instructions: a step's weights of head g and block b, p'[i] = p[g][i] s_i, rounded to
 * integers w = p' 32767 / c, c = pm[g] cb[b] (pm: the head's largest weight in the step, cb: the
 * block's largest scale there; c >= every p'), an error of at most c / 65534 a weight: a step's 32
 * at most 2^-11 pm max|v|, and as pm <= the step's sum of weights, an output value within 2^-11
 * of the head's largest value of the exact one (the cache's own rounding: 2^-8 of its block's
 * largest; measured: 2^-16 or less, the errors' signs mixed). Two keys' codes are interleaved by value (sign-extended to 16 bits, then unpacklo / unpackhi of words:
 * pv_bf16's order of O, which decode_bf16_order puts back at the task's end) and meet the pair of
 * their weights; a step's int32 sums times c / 32767 join O in float32. */
_Static_assert(DECODE_STEP_Q8 * DT == 32, "the bound above counts a step's 32 keys' rounding");
static inline void q8_block_max(const float *vs, int nts, int64_t Dv, float *cb) {
    for (int64_t b = 0; b < Dv / 32; b++) {
        __m512 mx = _mm512_setzero_ps();
        for (int x = 0; x < nts; x++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(vs + (x * 32 + b) * 16));
        cb[b] = _mm512_reduce_max_ps(mx);
    }
}

static inline __attribute__((always_inline)) void pv_q8w(float *O, const float *alpha, const float *P,
                                                         int64_t pw, const char *const *V, const int64_t *n,
                                                         int nts, int64_t rb, int64_t c0, int64_t Dv,
                                                         const float *vs, const float *pm, const float *cb,
                                                         pf_queue *pf, const int GN, const int NB) {
    __m512i acc[4][4];
    int16_t wq[4][2][DT + 2]; /* a tile's weights (the pair past its last key: 0) */
    float wk[4][2], dk[4][2];
    for (int g = 0; g < GN; g++)
        for (int b = 0; b < NB; b++) {
            const float c = pm[g] * cb[c0 / 32 + b];
            /* (c under 2^-100: weights of at most 2^-100 the head's largest, as 0; a finite wk) */
            const int tiny = !(c > 0x1p-100f);
            wk[g][b] = tiny ? 0.0f : 32767.0f / c;
            dk[g][b] = tiny ? 0.0f : c / 32767.0f;
            acc[g][2 * b] = acc[g][2 * b + 1] = _mm512_setzero_si512();
        }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x] + (c0 / 32) * 34 + 2;
        for (int g = 0; g < GN; g++)
            for (int b = 0; b < NB; b++) {
                const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(P + g * pw + x * DT),
                                               _mm512_mul_ps(_mm512_loadu_ps(vs + (x * 32 + c0 / 32 + b) * 16), _mm512_set1_ps(wk[g][b])));
                _mm256_storeu_si256((__m256i *)wq[g][b], _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(w)));
                wq[g][b][DT] = wq[g][b][DT + 1] = 0;
            }
        for (int64_t i = 0; i < n[x]; i += 2) {
            for (int f = 0; f < 2 * PF_Q8_PV; f++) pf_issue(pf);
            const int two = i + 1 < n[x];
            __m512i lo[2], hi[2];
            for (int b = 0; b < NB; b++) {
                const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(Vx + i * rb + b * 34)));
                const __m512i c = two ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(Vx + (i + 1) * rb + b * 34)))
                                      : _mm512_setzero_si512();
                lo[b] = _mm512_unpacklo_epi16(a, c);
                hi[b] = _mm512_unpackhi_epi16(a, c);
            }
            for (int g = 0; g < GN; g++)
                for (int b = 0; b < NB; b++) {
                    uint32_t pp;
                    memcpy(&pp, &wq[g][b][i], 4);
                    const __m512i pv = _mm512_set1_epi32((int)pp);
                    acc[g][2 * b] = _mm512_dpwssd_epi32(acc[g][2 * b], lo[b], pv);
                    acc[g][2 * b + 1] = _mm512_dpwssd_epi32(acc[g][2 * b + 1], hi[b], pv);
                }
        }
    }
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int u = 0; u < 2 * NB; u++) {
            float *o = O + g * Dv + 16 * u;
            const __m512 d = _mm512_set1_ps(dk[g][u / 2]);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc[g][u]), _mm512_mul_ps(a, _mm512_loadu_ps(o))));
        }
    }
}

#define PVQ8W_NB(GN)                                                                   \
    if (nu == 2) pv_q8w(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, pmx + g0, cb, &pf, GN, 1); \
    else pv_q8w(Og, al, Pg, PW, Vt, nt, nts, vrb, c0, Dv, vsc, pmx + g0, cb, &pf, GN, 2);
#else
#define DECODE_Q8_PV16 0
#endif
#endif
