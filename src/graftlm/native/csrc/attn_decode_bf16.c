/* Decode attention's bfloat16 cache in bfloat16 pairs (VDPBF16PS), and the helpers the
 * prompts' bfloat16 tiles share (attn_prompt.c: exp2_bf16). */
#include "graftlm.h"

#if DECODE_ZMM
#if ATTN_BF16
/* A bfloat16 cache's task in bfloat16 pairs (VDPBF16PS: two products a lane, float32 sums), half
 * the instructions of float32 FMAs and no conversion of the cache's values: the query rounded to
 * bfloat16 once a task, the softmax's weights once a step (the sums l are the rounded weights',
 * so the output stays a convex combination of the values). -DGL_NO_BF16_ATTN (and the ymm and
 * avx2 variants) keep float32 arithmetic. Where a tile of a step starts inside its block (a
 * window's first block, a chunk's), its lanes still are the block's 16 positions, those outside
 * the tile masked. */
#define DECODE_BF16 1

#define DECODE_BF16_STEP 4 /* tiles a step of the bfloat16 task */
#define PF_BF16 4 /* lines a pair of dims of its scores and a pair of keys of its values issue */
#if DECODE_BF16_STEP > DECODE_STEP
#error "pf_queue holds the ranges of DECODE_AHEAD * DECODE_STEP blocks"
#endif

/* S[g NT + x] (the 16 keys of tile x's block: lanes) = Q[g] . K[x] for GN heads and NT blocks,
 * Qb: the heads' queries as bfloat16 pairs (dims 2i, 2i + 1 in dword i; rows D / 2 dwords
 * apart), K[x]: a block's keys transposed (value d of its 16 keys: 32 bytes at K[x] + 32 d). Two
 * rows of a block (dims d and d + 1) are one 64-byte load, interleaved into pairs by key (one
 * VPERMW); each broadcast pair of a query meets the NT blocks. */
static inline __attribute__((always_inline)) void scores_bf16(const uint32_t *Qb, const char *const *K,
                                                              int64_t D, __m512 *S, pf_queue *pf,
                                                              const int GN, const int NT) {
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t D2 = D / 2;
    __m512 acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int x = 0; x < NT; x++) acc[g][x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D2; i++) {
        for (int f = 0; f < PF_BF16; f++) pf_issue(pf);
        __m512bh k[4];
        for (int x = 0; x < NT; x++)
            k[x] = (__m512bh)_mm512_permutexvar_epi16(ilv, _mm512_loadu_si512(K[x] + 64 * i));
        for (int g = 0; g < GN; g++) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)Qb[g * D2 + i]);
            for (int x = 0; x < NT; x++) acc[g][x] = _mm512_dpbf16_ps(acc[g][x], k[x], qp);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int x = 0; x < NT; x++) S[g * NT + x] = acc[g][x];
}

/* 2^x for 16 floats x <= 0 (below -126: about 2^-126), to a relative 5e-5: enough for weights
 * rounded to bfloat16 (2^-9). */
static inline __m512 exp2_bf16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 y = _mm512_set1_ps(9.6181291e-3f); /* ln2^4 / 24, then Taylor's terms down */
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* O (GN heads x 32 NC values from value c0, rows Dv apart) = alpha O + sum_i P[g][i] V[i] over a
 * step's nts tiles (tile x: n[x] keys, its values' rows at V[x], rb bytes apart; its weights as
 * bfloat16 at Pb + x 16 + o[x], rows pw apart). Two keys' rows interleaved by value (unpacklo /
 * unpackhi of 16-bit words) meet the pair of their weights: each 32 values of O are held as two
 * vectors, the first of values 0-3, 8-11, 16-19 and 24-27, the second of the others
 * (decode_bf16_order puts them back in order at the task's end). */
static inline __attribute__((always_inline)) void pv_bf16(float *O, const float *alpha, const uint16_t *Pb,
                                                          int64_t pw, const char *const *V, const int64_t *o,
                                                          const int64_t *n, int nts, int64_t rb, int64_t c0,
                                                          int64_t Dv, pf_queue *pf, const int GN,
                                                          const int NC) {
    __m512 acc[4][4][2];
    for (int g = 0; g < GN; g++) {
        const __m512 a = _mm512_set1_ps(alpha[g]);
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++)
                acc[g][c][h] = _mm512_mul_ps(a, _mm512_loadu_ps(O + g * Dv + c0 + 32 * c + 16 * h));
    }
    for (int x = 0; x < nts; x++) {
        const char *Vx = V[x] + 2 * c0;
        const uint16_t *px = Pb + 16 * x + o[x];
        for (int64_t i = 0; i < n[x]; i += 2) {
            for (int f = 0; f < PF_BF16; f++) pf_issue(pf);
            const int two = i + 1 < n[x];
            __m512bh lo[4], hi[4];
            for (int c = 0; c < NC; c++) {
                const __m512i a = _mm512_loadu_si512(Vx + i * rb + 64 * c);
                const __m512i b = two ? _mm512_loadu_si512(Vx + (i + 1) * rb + 64 * c) : _mm512_setzero_si512();
                lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < GN; g++) {
                uint32_t pp;
                memcpy(&pp, px + g * pw + i, 4); /* (p_i, p_i+1): p_i+1 finite, its row zero past n */
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp);
                for (int c = 0; c < NC; c++) {
                    acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], lo[c], pv);
                    acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], hi[c], pv);
                }
            }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++) _mm512_storeu_ps(O + g * Dv + c0 + 32 * c + 16 * h, acc[g][c][h]);
}

#define PVB_NC(GN)                                                                     \
    if (nc == 1) pv_bf16(Og, al, Pg, PWB, Vt, ot, nt, nts, vrb, c0, Dv, &pf, GN, 1);       \
    else pv_bf16(Og, al, Pg, PWB, Vt, ot, nt, nts, vrb, c0, Dv, &pf, GN, 2);

/* Whether a task of these dimensions takes the bfloat16 pairs: a cache's block of DT positions,
 * whole pairs of 32 values a head, its queries and weights in the thread's Kf and Vf. */
static inline int decode_bf16_fits(const gl_attn *a) {
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim;
    return a->kv.block == DT && D % 32 == 0 && Dv % 32 == 0 && G * D * 2 <= DT * D * 4 &&
           G * (DECODE_BF16_STEP * DT + 2) * 2 <= DT * Dv * 4;
}

/* decode_task (below) for a bfloat16 cache in bfloat16 pairs; Kf: the queries' pairs, Vf: the
 * weights as bfloat16. */
static void decode_task_bf16(const gl_attn *a, const float *Q, int64_t s, int64_t hk, int64_t k0,
                             int64_t k1, float *part, float *Kf, float *Vf, float *P, float *alpha) {
    const gl_kv *kv = &a->kv;
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim, BS = DT;
    const int64_t PW = DECODE_BF16_STEP * DT, PWB = PW + 2; /* P's rows, Pb's */
    const float l2e = 1.44269504088896341f; /* scores in base 2: m too, until the task's end */
    const float softcap = a->softcap;
    const __m512 cap = _mm512_set1_ps(softcap), ninf = _mm512_set1_ps(-INFINITY);
    float *m = part, *l = part + G, *O = part + 2 * G, *mnew = alpha + G, *psum = alpha + 2 * G;
    uint32_t *Qb = (uint32_t *)Kf;
    uint16_t *Pb = (uint16_t *)Vf;
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)(G * Dv));
    memset(Pb, 0, sizeof(uint16_t) * (size_t)(G * PWB)); /* the pads past a step's tiles: 0 */
    for (int64_t i = 0; i < G * D; i += 32)
        _mm512_storeu_si512(Qb + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(Q + i + 16), _mm512_loadu_ps(Q + i)));
    const int64_t vrb = 2 * Dv;
    int64_t ahead = k0;
    pf_queue pf = {NULL, NULL, {NULL}, {NULL}, 0, 0};
    for (int64_t j = k0; j < k1;) {
        int64_t jt[DECODE_BF16_STEP], nt[DECODE_BF16_STEP], ot[DECODE_BF16_STEP];
        const char *Vt[DECODE_BF16_STEP], *Kt[DECODE_BF16_STEP];
        __mmask16 vis[DECODE_BF16_STEP];
        int nts = 0;
        for (int64_t p = j; nts < DECODE_BF16_STEP && p < k1; nts++) {
            const int64_t o = p % BS, n = BS - o < k1 - p ? BS - o : k1 - p;
            jt[nts] = p, nt[nts] = n, ot[nts] = o, vis[nts] = (__mmask16)(((1u << n) - 1u) << o);
            Vt[nts] = kv_at(kv, kv->v, s, hk, p, Dv);
            Kt[nts] = kt_plane(kv, s, hk, p, D);
            p += n;
        }
        const int64_t jend = jt[nts - 1] + nt[nts - 1];
        pf_flush(&pf);
        for (; ahead < k1 && ahead < jend + DECODE_AHEAD * DECODE_BF16_STEP * BS; ahead = (ahead / BS + 1) * BS)
            if (ahead >= jend) pf_block(&pf, kv, s, hk, ahead, k1, D, Dv, 2);
        /* raw scores into P: up to 4 heads over all the step's blocks at once (a whole step), or
         * block by block */
        for (int64_t g0 = 0; g0 < G;) {
            const int64_t gn = G - g0 >= 4 ? 4 : G - g0 >= 2 ? 2 : 1;
            const uint32_t *Qg = Qb + g0 * (D / 2);
            __m512 S[16];
            if (nts == DECODE_BF16_STEP) {
                switch (gn) {
                case 4: scores_bf16(Qg, Kt, D, S, &pf, 4, DECODE_BF16_STEP); break;
                case 2: scores_bf16(Qg, Kt, D, S, &pf, 2, DECODE_BF16_STEP); break;
                default: scores_bf16(Qg, Kt, D, S, &pf, 1, DECODE_BF16_STEP); break;
                }
                for (int64_t gi = 0; gi < gn; gi++)
                    for (int x = 0; x < DECODE_BF16_STEP; x++)
                        _mm512_storeu_ps(P + (g0 + gi) * PW + x * DT, S[gi * DECODE_BF16_STEP + x]);
            } else {
                for (int x = 0; x < nts; x++) {
                    switch (gn) {
                    case 4: scores_bf16(Qg, Kt + x, D, S, &pf, 4, 1); break;
                    case 2: scores_bf16(Qg, Kt + x, D, S, &pf, 2, 1); break;
                    default: scores_bf16(Qg, Kt + x, D, S, &pf, 1, 1); break;
                    }
                    for (int64_t gi = 0; gi < gn; gi++) _mm512_storeu_ps(P + (g0 + gi) * PW + x * DT, S[gi]);
                }
            }
            g0 += gn;
        }
        /* each head's weights over the step, rounded to bfloat16: Pb, and their sum */
        for (int64_t g = 0; g < G; g++) {
            __m512 xs[DECODE_BF16_STEP], mxv = ninf;
            for (int x = 0; x < nts; x++) {
                __m512 v = _mm512_loadu_ps(P + g * PW + x * DT);
                if (softcap > 0.0f)
                    v = _mm512_mul_ps(tanh512(_mm512_div_ps(_mm512_mul_ps(v, _mm512_set1_ps(a->scale)), cap)), _mm512_set1_ps(softcap * l2e));
                else
                    v = _mm512_mul_ps(v, _mm512_set1_ps(a->scale * l2e));
                xs[x] = _mm512_mask_blend_ps(vis[x], ninf, v);
                mxv = _mm512_max_ps(mxv, xs[x]);
            }
            const float mx = _mm512_reduce_max_ps(mxv), mn = mx > m[g] ? mx : m[g];
            __m512 sum = _mm512_setzero_ps();
            for (int x = 0; x < nts; x++) {
                const __m512 e = _mm512_maskz_mov_ps(vis[x], exp2_bf16(_mm512_sub_ps(xs[x], _mm512_set1_ps(mn))));
                const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
                _mm256_storeu_si256((__m256i *)(Pb + g * PWB + x * DT), eb);
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
            }
            if (nts < DECODE_BF16_STEP) _mm256_storeu_si256((__m256i *)(Pb + g * PWB + nts * DT), _mm256_setzero_si256());
            psum[g] = _mm512_reduce_add_ps(sum);
            mnew[g] = mn;
        }
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 mk = (__mmask16)(G - g >= 16 ? 0xFFFF : (1u << (G - g)) - 1u);
            const __m512 mo = _mm512_maskz_loadu_ps(mk, m + g), mw = _mm512_maskz_loadu_ps(mk, mnew + g);
            const __mmask16 seen = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ);
            const __m512 al = _mm512_maskz_mov_ps(seen, exp512(_mm512_mul_ps(_mm512_sub_ps(mo, mw), _mm512_set1_ps(0.69314718056f))));
            _mm512_mask_storeu_ps(alpha + g, mk, al);
            _mm512_mask_storeu_ps(l + g, mk, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, l + g), al, _mm512_maskz_loadu_ps(mk, psum + g)));
            _mm512_mask_storeu_ps(m + g, mk, mw);
        }
        /* O = alpha O + P V: up to 4 heads x 64 values a pass */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            const float *al = alpha + g0;
            const uint16_t *Pg = Pb + g0 * PWB;
            for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
                const int64_t nc = Dv - c0 < 64 ? 1 : 2;
                float *Og = O + g0 * Dv;
                switch (gn) {
                case 1: PVB_NC(1) break;
                case 2: PVB_NC(2) break;
                case 3: PVB_NC(3) break;
                default: PVB_NC(4) break;
                }
            }
        }
        j = jend;
    }
    decode_bf16_order(O, G * Dv);
    for (int64_t g = 0; g < G; g++) m[g] *= 0.69314718056f; /* the merge's base: e */
}
#else
#define DECODE_BF16 0
#endif
#endif
