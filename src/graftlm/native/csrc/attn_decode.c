/* Decode attention's tasks (512-bit, or 256-bit where the CPU or the build has no 512-bit
 * kernels) and the step that splits rows over them and merges their partial results. */
#include "graftlm.h"

#if DECODE_ZMM
/* One task: kv head hk of the row at slot s, its G query heads rotated in Q (G x D), over
 * positions [k0, k1): part = [m (G), l (G), O (G x Dv)], the running max, the sum of
 * exp(score - max) and the unnormalized output. A step takes up to DECODE_STEP tiles (one cache block
 * each): their scores from the keys as the cache holds them (q8_0's: integer dots with VNNI, else
 * transposed into Kf as float32) into P, one online-softmax update over all of them (alpha: the
 * heads' rescales, then their new maxima and the step's sums; the horizontal reductions and the
 * outputs' rescale paid once a step, not once a tile), and the weighted values, read once for up
 * to 4 heads. P: G x DECODE_STEP DT scores, then weights; Vf: room for a q8_0 cache's quantized queries
 * (the values are read in place). The blocks of the next DECODE_AHEAD steps are prefetched, their
 * lines handed out a few at a time inside the step's loops (pf_queue). */
static inline __attribute__((always_inline)) void decode_task(
    const gl_attn *a, const float *Q, int64_t s, int64_t hk, int64_t k0, int64_t k1, float *part,
    float *Kf, float *Vf, float *P, float *alpha, const int t) {
    const gl_kv *kv = &a->kv;
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim, BS = kv->block;
    const int64_t PW = DECODE_STEP * DT; /* P's rows */
    const float softcap = a->softcap, l2e = 1.44269504088896341f; /* scores in base 2 (m too, to the end) */
    const __m512 cap = _mm512_set1_ps(softcap), capl2 = _mm512_set1_ps(softcap * l2e), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 sc = _mm512_set1_ps(a->scale), scl2 = _mm512_set1_ps(a->scale * l2e);
#if DECODE_BF16
    if (t == 2 && decode_bf16_fits(a)) {
        decode_task_bf16(a, Q, s, hk, k0, k1, part, Kf, Vf, P, alpha);
        return;
    }
#endif
    float *m = part, *l = part + G, *O = part + 2 * G, *mnew = alpha + G, *psum = alpha + 2 * G;
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)(G * Dv));
#if DECODE_Q8_DOTS
    /* q8_0 keys: integer dots where the quantized queries fit in Vf */
    const int q8 = t == 3 && q8_queries_bytes(G, D) <= DT * Dv * 4;
    q8_queries qq = {NULL, NULL, NULL};
    if (q8) qq = q8_quantize(Q, G, D, Vf);
    __m512i kq[16 * 16]; /* a tile's keys, up to 1,024 values (MAX_HEAD_DIM) */
    float ks[32 * 16];
#else
    const int q8 = 0;
#endif
    const int kt = t != 3 ? t : 0;
    const int64_t vrb = kv_bytes(Dv, t);
    float vsc[t == 3 ? DECODE_STEP_Q8 * 32 * 16 : 1]; /* q8_0 values' scales (q8_value_scales) */
#if DECODE_Q8_PV16
    float cb[32], pmx[t == 3 ? G : 1]; /* q8_0 values: the blocks' largest scales, the heads' weights */
#endif
    int64_t ahead = k0; /* the first position whose block is not prefetched */
    pf_queue pf = {NULL, NULL, {NULL}, {NULL}, 0, 0};
    for (int64_t j = k0; j < k1;) {
        /* the step's tiles: up to DECODE_STEP, each inside one block */
        int64_t jt[DECODE_STEP], nt[DECODE_STEP];
        const char *Vt[DECODE_STEP];
        __mmask16 vis[DECODE_STEP];
        int nts = 0;
        for (int64_t p = j; nts < (t == 3 ? DECODE_STEP_Q8 : DECODE_STEP) && p < k1; nts++) {
            int64_t n = BS - p % BS < k1 - p ? BS - p % BS : k1 - p;
            if (n > DT) n = DT;
            jt[nts] = p, nt[nts] = n, vis[nts] = (__mmask16)((1u << n) - 1u);
            Vt[nts] = kv_at(kv, kv->v, s, hk, p, Dv);
            p += n;
        }
        const int64_t jend = jt[nts - 1] + nt[nts - 1];
        pf_flush(&pf); /* what the last step's loops left */
        for (; ahead < k1 && ahead < jend + DECODE_AHEAD * DECODE_STEP * BS; ahead = (ahead / BS + 1) * BS)
            if (ahead >= jend) pf_block(&pf, kv, s, hk, ahead, k1, D, Dv, t);
        /* raw scores into P: tile by tile, its keys transposed once for all the heads */
        for (int x = 0; x < nts; x++) {
            const char *K = (const char *)Kf;
            int64_t ld = DT;
            if (t != 3) {
                K = kt_plane(kv, s, hk, jt[x], D) + kv_bytes(jt[x] % BS, t);
                ld = BS;
            } else if (!q8) {
                tile_keys_t(kv_at(kv, kv->k, s, hk, jt[x], D), nt[x], D, Kf, t);
            }
#if DECODE_Q8_DOTS
            if (q8) q8_keys_t(kv_at(kv, kv->k, s, hk, jt[x], D), kv_bytes(D, 3), nt[x], D, kq, ks);
#endif
            for (int64_t g0 = 0; g0 < G;) {
                const int64_t gn = G - g0 >= 8 ? 8 : G - g0 >= 4 ? 4 : G - g0 >= 2 ? 2 : 1;
                __m512 S[8];
#if DECODE_Q8_DOTS
                if (q8) switch (gn) {
                    case 8: q8_scores(&qq, g0, D, kq, ks, S, &pf, 8); break;
                    case 4: q8_scores(&qq, g0, D, kq, ks, S, &pf, 4); break;
                    case 2: q8_scores(&qq, g0, D, kq, ks, S, &pf, 2); break;
                    default: q8_scores(&qq, g0, D, kq, ks, S, &pf, 1); break;
                    }
                else
#endif
                switch (gn) {
                case 8: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 8); break;
                case 4: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 4); break;
                case 2: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 2); break;
                default: scores_tile(Q + g0 * D, K, ld, vis[x], D, S, &pf, kt, 1); break;
                }
                for (int64_t gi = 0; gi < gn; gi++) _mm512_storeu_ps(P + (g0 + gi) * PW + x * DT, S[gi]);
                g0 += gn;
            }
        }
        /* each head's weights over the step: P = 2^(log2(e) scale S - m_new), masked (m in base
         * 2 until the task's end) */
        for (int64_t g = 0; g < G; g++) {
            __m512 xs[DECODE_STEP], mxv = ninf;
            for (int x = 0; x < nts; x++) {
                const __m512 sv = _mm512_loadu_ps(P + g * PW + x * DT); /* scaled as llama.cpp: after the dot */
                const __m512 v = softcap > 0.0f ? _mm512_mul_ps(tanh512(_mm512_div_ps(_mm512_mul_ps(sv, sc), cap)), capl2)
                                                : _mm512_mul_ps(sv, scl2);
                xs[x] = _mm512_mask_blend_ps(vis[x], ninf, v);
                mxv = _mm512_max_ps(mxv, xs[x]);
            }
            const float mx = _mm512_reduce_max_ps(mxv), mn = mx > m[g] ? mx : m[g];
            __m512 sum = _mm512_setzero_ps();
            for (int x = 0; x < nts; x++) {
                const __m512 e = _mm512_maskz_mov_ps(vis[x], exp2_512(_mm512_sub_ps(xs[x], _mm512_set1_ps(mn))));
                _mm512_storeu_ps(P + g * PW + x * DT, e);
                sum = _mm512_add_ps(sum, e);
            }
            psum[g] = _mm512_reduce_add_ps(sum);
            mnew[g] = mn;
#if DECODE_Q8_PV16
            if (t == 3) pmx[g] = exp2f(mx - mn); /* (mx: -inf where every lane is masked) */
#endif
        }
        /* alpha = 2^(m_old - m_new) of every head at once (0 where nothing was seen yet) */
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 mk = (__mmask16)(G - g >= 16 ? 0xFFFF : (1u << (G - g)) - 1u);
            const __m512 mo = _mm512_maskz_loadu_ps(mk, m + g), mw = _mm512_maskz_loadu_ps(mk, mnew + g);
            const __mmask16 seen = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ);
            const __m512 al = _mm512_maskz_mov_ps(seen, exp2_512(_mm512_sub_ps(mo, mw)));
            _mm512_mask_storeu_ps(alpha + g, mk, al);
            _mm512_mask_storeu_ps(l + g, mk, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, l + g), al, _mm512_maskz_loadu_ps(mk, psum + g)));
            _mm512_mask_storeu_ps(m + g, mk, mw);
        }
        /* O = alpha O + P V: up to 4 heads x 64 values a pass, in registers (q8_0's: the
         * values' scales in the weights) */
        if (t == 3) {
            q8_value_scales(Vt, nt, nts, vrb, Dv, vsc);
#if DECODE_Q8_PV16
            q8_block_max(vsc, nts, Dv, cb);
#endif
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            const float *al = alpha + g0, *Pg = P + g0 * PW;
            for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
                const int64_t w = Dv - c0 < 64 ? Dv - c0 : 64, nu = (w + 15) / 16;
                const __mmask16 last = (__mmask16)(w % 16 ? (1u << (w % 16)) - 1u : 0xFFFF);
                float *Og = O + g0 * Dv + c0;
                if (t == 3) {
                    switch (gn) {
#if DECODE_Q8_PV16
                    case 1: PVQ8W_NB(1) break;
                    case 2: PVQ8W_NB(2) break;
                    case 3: PVQ8W_NB(3) break;
                    default: PVQ8W_NB(4) break;
#else
                    case 1: PVQ8_NU(1) break;
                    case 2: PVQ8_NU(2) break;
                    case 3: PVQ8_NU(3) break;
                    default: PVQ8_NU(4) break;
#endif
                    }
                    continue;
                }
                switch (gn) {
                case 1: PV16_NU(1) break;
                case 2: PV16_NU(2) break;
                case 3: PV16_NU(3) break;
                default: PV16_NU(4) break;
                }
            }
        }
        j = jend;
    }
#if DECODE_Q8_PV16
    if (t == 3) decode_bf16_order(O, G * Dv); /* pv_q8w's order of the values */
#endif
    for (int64_t g = 0; g < G; g++) m[g] *= 0.69314718056f; /* the merge's base: e */
}
#else

/* One task: kv head hk of the row at slot s, its G query heads rotated in Q (G x D), over
 * positions [k0, k1): part = [m (G), l (G), O (G x Dv)], the running max, the sum of
 * exp(score - max) and the unnormalized output. Kf: a tile's keys transposed as float32 (when
 * the cache's cannot be read in place), Vf: its values' float32 rows; P: G x DT weights. The
 * 256-bit twin of the 512-bit task above. */
static inline __attribute__((always_inline)) void decode_task(
    const gl_attn *a, const float *Q, int64_t s, int64_t hk, int64_t k0, int64_t k1, float *part,
    float *Kf, float *Vf, float *P, float *alpha, const int t) {
    const gl_kv *kv = &a->kv;
    const int64_t G = a->n_head / a->n_head_kv, D = a->head_dim, Dv = a->v_dim, BS = kv->block;
    const float softcap = a->softcap;
    const __m256 cap = _mm256_set1_ps(softcap), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float *m = part, *l = part + G, *O = part + 2 * G;
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)(G * Dv));
    for (int64_t j = k0; j < k1;) {
        int64_t n = BS - j % BS < k1 - j ? BS - j % BS : k1 - j;
        if (n > DT) n = DT;
        decode_ahead(kv, s, hk, j, k1, D, Dv, t);
        /* the tile's keys transposed (value d of its keys at K + kv_bytes(d * ld), type kt): in
         * the cache when the tile is a whole block of them, else into Kf as float32, zero past n */
        const int kt = t != 3 && n == DT ? t : 0;
        const char *K = (const char *)Kf;
        int64_t ld = DT;
        if (t != 3) {
            const char *plane = kt_plane(kv, s, hk, j, D) + kv_bytes(j % BS, t);
            if (n == DT) {
                K = plane;
                ld = BS;
            } else {
                for (int64_t d = 0; d < D; d++)
                    for (int64_t i = 0; i < DT; i++) Kf[d * DT + i] = i < n ? kv_get(plane, d * BS + i, t) : 0.0f;
            }
        } else { /* q8_0's rows, 8 values at a time */
            const char *rows = kv_at(kv, kv->k, s, hk, j, D);
            float r8[8];
            memset(Kf, 0, sizeof(float) * (size_t)(D * DT));
            for (int64_t i = 0; i < n; i++)
                for (int64_t d0 = 0; d0 < D; d0 += 8) {
                    _mm256_storeu_ps(r8, kv_load8(rows + kv_bytes(i * D, t), d0, t));
                    for (int u = 0; u < 8; u++) Kf[(d0 + u) * DT + i] = r8[u];
                }
        }
        const float *V = tile_f32(kv_at(kv, kv->v, s, hk, j, Dv), n, Dv, Vf, t);
        /* scores of G heads x 16 keys (two vectors a head): FMAs over d with each head's value
         * broadcast, up to 4 heads' chains interleaved */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            __m256 acc[4][2];
            for (int gi = 0; gi < 4; gi++) acc[gi][0] = acc[gi][1] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const char *kd = K + kv_bytes(d * ld, kt);
                const __m256 lo = kv_load8(kd, 0, kt), hi = kv_load8(kd, 8, kt);
                for (int gi = 0; gi < 4; gi++) {
                    if (gi >= gn) break;
                    const __m256 qv = _mm256_broadcast_ss(Q + (g0 + gi) * D + d);
                    acc[gi][0] = _mm256_fmadd_ps(qv, lo, acc[gi][0]);
                    acc[gi][1] = _mm256_fmadd_ps(qv, hi, acc[gi][1]);
                }
            }
            for (int64_t gi = 0; gi < gn; gi++) {
                const int64_t g = g0 + gi;
                __m256 sv[DT / 8];
                float mx = -INFINITY;
                for (int h = 0; h < DT / 8; h++) {
                    __m256 x = _mm256_mul_ps(acc[gi][h], _mm256_set1_ps(a->scale));
                    if (softcap > 0.0f) x = _mm256_mul_ps(tanh256(_mm256_div_ps(x, cap)), cap);
                    const __m256i out = _mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32(8 * h)), _mm256_set1_epi32((int)n - 1));
                    sv[h] = _mm256_blendv_ps(x, ninf, _mm256_castsi256_ps(out));
                    const float hm = hmax8(sv[h]);
                    mx = hm > mx ? hm : mx;
                }
                const float mnew = mx > m[g] ? mx : m[g];
                alpha[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - mnew);
                const __m256 mv = _mm256_set1_ps(mnew);
                __m256 sum = _mm256_setzero_ps();
                for (int h = 0; h < DT / 8; h++) {
                    const __m256 vis = _mm256_cmp_ps(sv[h], ninf, _CMP_NEQ_OQ);
                    const __m256 e = _mm256_and_ps(vis, exp256(_mm256_sub_ps(sv[h], mv)));
                    _mm256_store_ps(P + g * DT + 8 * h, e);
                    sum = _mm256_add_ps(sum, e);
                }
                l[g] = l[g] * alpha[g] + hsum8(sum);
                m[g] = mnew;
            }
        }
        /* O = alpha O + P V: up to 4 heads x 32 values a pass, in registers */
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t gn = G - g0 < 4 ? G - g0 : 4;
            const float *al = alpha + g0, *Pg = P + g0 * DT;
            for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
                const int64_t nu = Dv - c0 < 32 ? (Dv - c0) / 8 : 4;
                float *Og = O + g0 * Dv + c0;
                const float *Vc = V + c0;
                switch (gn) {
                case 1: PV_NU(1) break;
                case 2: PV_NU(2) break;
                case 3: PV_NU(3) break;
                default: PV_NU(4) break;
                }
            }
        }
        j += n;
    }
}
#endif

/* The positions a split hands one task of a row that sees n positions: its kv heads over the
 * threads, about four tasks a thread, never fewer than DECODE_MIN_CHUNK positions (a whole number
 * of tiles). The row's own length decides, never the batch's: a row's result is the same bits
 * whatever else the step holds (a speculative draft's rows, other sequences). */
static int64_t decode_chunk(int64_t n, int64_t Hkv, int nth) {
    int64_t c = (n * Hkv + 4 * nth - 1) / (4 * nth);
    c = (c + DT - 1) / DT * DT;
    return c < DECODE_MIN_CHUNK ? DECODE_MIN_CHUNK : c;
}

/* The first position row b sees. */
static inline int64_t decode_lo(const gl_attn *a, int64_t p) {
    return a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
}

#if defined(DECODE_BF16) && DECODE_BF16 && DECODE_BF16_STEP > DECODE_STEP
#define DECODE_PW (DECODE_BF16_STEP * DT) /* P's row: the scores of a step */
#else
#define DECODE_PW (DECODE_STEP * DT)
#endif
/* A decode thread's part of the work buffer: a tile's K and V as float32, the group's rotated
 * queries, the tile's weights, and the heads' rescales, maxima and sums (G each); 64-byte whole. */
static inline int64_t decode_thread_bytes(int64_t G, int64_t D, int64_t Dv) {
    return ((DT * (D + Dv) + G * D + G * DECODE_PW + 3 * G) * (int64_t)sizeof(float) + 63) / 64 * 64;
}

/* The work buffer of a decode step of B rows on nth threads: each thread's part, the tasks'
 * partial results (at most 4 nth + Hkv tasks a row: see decode_chunk) and the tasks' first index
 * per row. */
static int64_t attn_decode_bytes(int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t B, int nth) {
    const int64_t G = H / Hkv;
    return nth * decode_thread_bytes(G, D, Dv) + B * (4 * nth + Hkv) * G * (Dv + 2) * (int64_t)sizeof(float) +
           (B + 1) * (int64_t)sizeof(int64_t);
}

static void attn_decode_run(const gl_attn *a, const float *q, int64_t q_rs, const float *k,
                            int64_t k_rs, const float *v, int64_t v_rs, const int64_t *slots,
                            const int64_t *pos, int64_t B, float *out, void *work_, int nth) {
    const gl_kv *kv = &a->kv;
    const int t = (int)kv->type;
    char *work = work_;
    const float *cos_t = a->cos_t, *sin_t = a->sin_t;
    const int64_t H = a->n_head, Hkv = a->n_head_kv, D = a->head_dim, Dv = a->v_dim;
    const int64_t G = H / Hkv, rot = a->rot, half = rot / 2;
    const int neox = (int)a->neox;
    for (int64_t b = 0; b < B; b++) {
        const int64_t p = pos[b], s = slots[b];
        for (int64_t h = 0; h < Hkv; h++) {
            float kr[1024];
            rope_head(k + b * k_rs + h * D, kr, D, rot, cos_t + p * half, sin_t + p * half, neox);
            key_store(kv, s, h, p, kr, D);
            kv_store(kv_at(kv, kv->v, s, h, p, Dv), v + b * v_rs + h * Dv, Dv, t);
        }
    }
    const int64_t thread = decode_thread_bytes(G, D, Dv), pw = G * (Dv + 2);
    float *parts = (float *)(work + nth * thread);
    int64_t *first = (int64_t *)(parts + B * (4 * nth + Hkv) * pw); /* row b's tasks: first[b] .. */
    int64_t total = 0; /* the keys every head of every row reads */
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = pos[b] + 1 - decode_lo(a, pos[b]), chunk = decode_chunk(n, Hkv, nth);
        first[b + 1] = first[b] + Hkv * ((n + chunk - 1) / chunk);
        total += n * Hkv;
    }
    const int64_t ntask = first[B];
#pragma omp parallel num_threads(nth) if (total * (D + Dv) * G > 100000)
    {
        const unsigned csr = ftz_begin();
        char *mine = work + omp_get_thread_num() * thread;
        float *Kf = (float *)mine, *Vf = Kf + DT * D, *Q = Vf + DT * Dv, *P = Q + G * D, *al = P + G * DECODE_PW;
        int64_t b = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            while (first[b + 1] <= task) b++; /* tasks come in order to each thread */
            while (first[b] > task) b--;
            const int64_t ns = (first[b + 1] - first[b]) / Hkv, i = task - first[b];
            const int64_t hk = i / ns, c = i % ns, p = pos[b], lo = decode_lo(a, p);
            const int64_t chunk = decode_chunk(p + 1 - lo, Hkv, nth);
            const int64_t k0 = lo + c * chunk, k1 = k0 + chunk < p + 1 ? k0 + chunk : p + 1;
            for (int64_t g = 0; g < G; g++) /* the group's queries, rotated */
                rope_head(q + b * q_rs + (hk * G + g) * D, Q + g * D, D, rot, cos_t + p * half,
                          sin_t + p * half, neox);
            float *part = parts + task * pw;
            switch (t) { /* here, not around the region: OpenMP outlines the region's body before
                          * inlining, and each case must see its type as a constant */
            case 1: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 1); break;
            case 2: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 2); break;
            case 3: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 3); break;
            default: decode_task(a, Q, slots[b], hk, k0, k1, part, Kf, Vf, P, al, 0); break;
            }
        }
        /* each head's output: its chunks' outputs weighted by exp(m - max), over their sum */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t rb = bh / H, h = bh % H, hk = h / G, g = h % G;
            const int64_t ns = (first[rb + 1] - first[rb]) / Hkv;
            const float *p0 = parts + (first[rb] + hk * ns) * pw;
            float mx = -INFINITY;
            for (int64_t c = 0; c < ns; c++) mx = p0[c * pw + g] > mx ? p0[c * pw + g] : mx;
            const float sink = a->sinks ? a->sinks[h] : -INFINITY; /* a logit with no value */
            mx = sink > mx ? sink : mx;
            float wsum = 0.0f;
            float *o = out + (rb * H + h) * Dv;
            for (int64_t d = 0; d < Dv; d++) o[d] = 0.0f;
            for (int64_t c = 0; c < ns; c++) {
                const float *pc = p0 + c * pw;
                const float wc = expf(pc[g] - mx);
                wsum += wc * pc[G + g];
                scale_axpy(o, 1.0f, wc, pc + 2 * G + g * Dv, Dv);
            }
            if (a->sinks) wsum += expf(sink - mx);
            const float il = 1.0f / wsum;
            for (int64_t d = 0; d < Dv; d++) o[d] *= il;
        }
        ftz_end(csr);
    }
}

/* Attention of a decode step from Python: its work buffer in one allocation. */
void gl_attn_decode(const gl_attn *a, const float *q, int64_t q_rs, const float *k, int64_t k_rs,
                    const float *v, int64_t v_rs, const int64_t *slots, const int64_t *pos,
                    int64_t B, float *out, int nth) {
    const int64_t bytes = attn_decode_bytes(a->n_head, a->n_head_kv, a->head_dim, a->v_dim, B, nth);
    gl_scratch own, *s = scratch_open(NULL, &own, bytes);
    attn_decode_run(a, q, q_rs, k, k_rs, v, v_rs, slots, pos, B, out, scratch_take(s, bytes), nth);
    scratch_close(s, &own);
}
