/* Prompt attention in bfloat16 tiles (fast steps where the CPU has AVX-512 BF16): included by
 * attn_prompt.c after its gathers and key transposes, before gl_attn_prefill, which calls
 * prompt_bf16. */
#if ATTN_BF16
/* ---------------------------------------------------------------- bfloat16 tiles */

/* The prompt attention of fast steps in bfloat16 pairs (VDPBF16PS: two products a lane, float32
 * sums), where the CPU has AVX-512 BF16: the queries rounded to bfloat16 once a task, the keys and
 * values once a block of PK positions (a bfloat16 cache's as they are, a float16 or float32 one's
 * rounded, q8_0's dequantized first), the softmax's weights once a block. The tasks are the
 * float32 path's; a register tile is BR score rows x a block's keys, its scores never leave the
 * registers: scaled into base 2, soft-capped, masked only in the blocks a mask reaches (the
 * diagonal's, a window's edges, a block's last positions past the chunk; every block below
 * the diagonal is whole), the online softmax's max and weights (lazily where no mask reaches:
 * attn_prompt_lazy.c), the weights rounded to bfloat16 pairs (their sums l are the rounded
 * weights', so the output stays a convex combination of the values), then O = alpha O + P V for
 * the same rows, after the next tile's softmax. */
#define BR 6 /* score rows a register tile */
#define PRB 512 /* the score rows a task aims at (fewer where the tasks would not fill the threads) */

/* Kt2 (D / 2, PK): the keys of the nb blocks of (slot s, kv head h) from position k0 (a block's
 * first) as bfloat16 pairs, dims (2i, 2i + 1) of key j in Kt2[i PK + j] (garbage past the chunk:
 * those scores are masked). q8_0's keys (rows) through float32 Kf and Kt. */
static void prompt_keys_bf16(const gl_kv *kv, int64_t s, int64_t h, int64_t k0, int64_t nk,
                             int64_t D, uint32_t *Kt2, float *Kf, float *Kt) {
    const int64_t t = kv->type, D2 = D / 2, nb = (nk + DT - 1) / DT;
    if (t == 3) {
        kv_gather(kv, kv->k, s, h, k0, nk, D, Kf);
        key_block_t(Kf, nk, D, Kt);
        for (int64_t i = 0; i < D2; i++)
            for (int64_t j0 = 0; j0 < nb * DT; j0 += 16)
                _mm512_store_si512(Kt2 + i * PK + j0, bf16_pairs(_mm512_load_ps(Kt + 2 * i * PK + j0),
                                                                 _mm512_load_ps(Kt + (2 * i + 1) * PK + j0)));
        return;
    }
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t x = 0; x < nb; x++) {
        const char *plane = kt_plane(kv, s, h, k0 + x * DT, D); /* rows 2i, 2i + 1: adjacent */
        uint32_t *dst = Kt2 + x * DT;
        if (t == 2)
            for (int64_t i = 0; i < D2; i++)
                _mm512_store_si512(dst + i * PK, _mm512_permutexvar_epi16(ilv, _mm512_loadu_si512(plane + 64 * i)));
        else if (t == 1)
            for (int64_t i = 0; i < D2; i++) {
                const __m512i w = _mm512_loadu_si512(plane + 64 * i);
                _mm512_store_si512(dst + i * PK, bf16_pairs(_mm512_cvtph_ps(_mm512_castsi512_si256(w)),
                                                            _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1))));
            }
        else
            for (int64_t i = 0; i < D2; i++)
                _mm512_store_si512(dst + i * PK, bf16_pairs(_mm512_loadu_ps(plane + 128 * i),
                                                            _mm512_loadu_ps(plane + 128 * i + 64)));
    }
}

/* 16 cached values from value c of row p (type t) as float32. */
static inline __attribute__((always_inline)) __m512 kv_load16_f32(const char *p, int64_t c, const int t) {
    if (t == 0) return _mm512_loadu_ps((const float *)p + c);
    if (t == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + c)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + c))), 16));
}

/* Vt2 (PK / 2, D): the values of positions k0 + 2i, k0 + 2i + 1 as bfloat16 pairs in Vt2[i D + c]
 * for the (nk + 1) / 2 pairs of the chunk, the one past nk zero (unwritten positions may hold
 * anything; their weights are 0, 0 x NaN is not). q8_0's through float32 Vf. */
static void prompt_values_bf16(const gl_kv *kv, int64_t s, int64_t h, int64_t k0, int64_t nk,
                               int64_t D, uint32_t *Vt2, float *Vf) {
    const int t = (int)kv->type;
    const int64_t np = (nk + 1) / 2;
    if (t == 3) {
        kv_gather(kv, kv->v, s, h, k0, nk, D, Vf);
        for (int64_t i = 0; i < np; i++)
            for (int64_t c = 0; c < D; c += 16) {
                const __m512 hi = 2 * i + 1 < nk ? _mm512_loadu_ps(Vf + (2 * i + 1) * D + c) : _mm512_setzero_ps();
                _mm512_storeu_si512(Vt2 + i * D + c, bf16_pairs(_mm512_loadu_ps(Vf + 2 * i * D + c), hi));
            }
        return;
    }
    for (int64_t i = 0; i < np; i++) {
        const char *r0 = kv_at(kv, kv->v, s, h, k0 + 2 * i, D); /* k0 even: both in one block */
        const char *r1 = r0 + kv_bytes(D, t);
        const int two = 2 * i + 1 < nk;
        for (int64_t c = 0; c < D; c += 16) {
            __m512 lo, hi = _mm512_setzero_ps();
            switch (t) {
            case 0: lo = kv_load16_f32(r0, c, 0); if (two) hi = kv_load16_f32(r1, c, 0); break;
            case 1: lo = kv_load16_f32(r0, c, 1); if (two) hi = kv_load16_f32(r1, c, 1); break;
            default: lo = kv_load16_f32(r0, c, 2); if (two) hi = kv_load16_f32(r1, c, 2); break;
            }
            _mm512_storeu_si512(Vt2 + i * D + c, bf16_pairs(lo, hi));
        }
    }
}

/* 2^x for 16 floats x (below -126: 0) to a relative 7.5e-5, a cubic on x - floor(x) (one
VREDUCEPS) and VSCALEFPS's 2^floor(x): the softmax's weights, rounded to bfloat16 next (2^-9),
need no more, and the products' pipes are this kernel's limit (5 vector operations, where a
clamp, a rounding and a subtraction took 7). x may pass 0 (lazy weights, attn_prompt_lazy.c). */
static inline __m512 exp2_w(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); /* [0, 1) */
    __m512 y = _mm512_set1_ps(7.802334e-2f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.2606643e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.958351e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999249e-1f));
    return _mm512_scalef_ps(y, x);
}

/* One chunk's part of a task state: rows' running max m (base 2), sums L (16 lanes a row), O. */
typedef struct {
    const uint32_t *Qb, *Kt2, *Vt2; /* queries (rows x D / 2), keys (D / 2 x PK), values (PK / 2 x D) */
    uint32_t *Pb;                   /* weights as bfloat16 pairs (rows x PK / 2) */
    float *m, *L, *O;
    const int64_t *pr; /* each row's position */
    int64_t D, k0, nk, window;
    float c1, cs, cc; /* scale log2(e); softcap: scale / cap, cap log2(e) */
    int mask, capped;
#if ATTN_I8
    /* int8 scores (attn_prompt_i8.c): queries' codes + 128 (rows x D / 4) and scales, the keys'
     * codes (D / 4 x PK), each key's -128 x its codes' sum and scale; a q8_0 cache's scores
     * (attn_prompt_q8.c): the queries' q8_0 codes (rows x D / 4), scales times f and -128 x
     * codes' sums (rows x D / 32: sQ, qs), the keys' codes + 128 (Kq) and scales (D / 32 x PK) */
    const uint32_t *Qq, *Kq;
    const float *sQ, *sK;
    const int32_t *kb, *qs;
#endif
} prompt_chunk;

/* Weights e0, e1 of two 16-key blocks (a pair: e1 unused for a chunk's odd last block) stored
 * to pb as bfloat16 pairs (2i, 2i + 1) in key order, and the rounded weights' sums added to sum. */
static inline __attribute__((always_inline)) __m512 weights_store(uint32_t *pb, __m512 e0, __m512 e1,
                                                                  const int pair, __m512 sum) {
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3F803F80); /* bfloat16 pairs (1, 1) */
    __m512i w;
    if (pair) {
        w = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        _mm512_storeu_si512(pb, w);
    } else {
        w = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e0)), _mm256_setzero_si256(), 1);
        _mm256_storeu_si256((__m256i *)pb, _mm512_castsi512_si256(w));
    }
    return _mm512_dpbf16_ps(sum, (__m512bh)w, ones);
}

#include "attn_prompt_lazy.c" /* prompt_weights_lazy */

/* Rows r0 .. r0 + nr - 1 (nr <= R, R <= BR) of a chunk of NB blocks, their products z (times f: q.k
 * times c1, or times cs where soft-capped): softmax, weights into Pb; alpha: each row's rescaling
 * of O (nr may pass R: rows past R are another call's). A tile's missing rows repeat row r0 and
 * are left out of every store. Returns whether a row's alpha is not 1. */
static inline __attribute__((always_inline)) int prompt_softmax_bf16(const prompt_chunk *c, int64_t r0, int nr,
                                                                     float *alpha, __m512 acc[][4], const float f,
                                                                     const int NB, const int R) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int scaled = 0;
    for (int r = 0; r < R; r++) alpha[r] = 1.0f;
    if (!c->mask && !c->capped && nr >= R && prompt_weights_lazy(c, r0, acc, f, NB, R)) return 0;
    for (int r = 0; r < nr && r < R; r++) {
        const int64_t row = r0 + r, p = c->pr[row];
        __m512 v[4];
        __mmask16 vis[4];
        __m512 mxv = ninf;
        for (int x = 0; x < NB; x++) {
            v[x] = f != 1.0f ? _mm512_mul_ps(acc[r][x], _mm512_set1_ps(f)) : acc[r][x];
            if (c->capped) v[x] = _mm512_mul_ps(tanh512(v[x]), _mm512_set1_ps(c->cc));
            vis[x] = 0xFFFF;
            if (c->mask) { /* keys [lo, min(p, k0 + nk - 1)] of the chunk */
                const int64_t lo = c->window > 0 ? p - c->window + 1 : 0;
                const int64_t hi = p < c->k0 + c->nk - 1 ? p : c->k0 + c->nk - 1;
                const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(c->k0 + 16 * x)), iota);
                vis[x] = _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32((int)hi), _MM_CMPINT_LE) &
                         _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32((int)lo), _MM_CMPINT_NLT);
                v[x] = _mm512_mask_blend_ps(vis[x], ninf, v[x]);
            }
            mxv = _mm512_max_ps(mxv, v[x]);
        }
        const float mx = _mm512_reduce_max_ps(mxv), mo = c->m[row];
        uint32_t *pb = c->Pb + row * (PK / 2);
        if (mx == -INFINITY) { /* nothing visible in this chunk: weights 0, the state unchanged */
            for (int x = 0; x < NB; x++) _mm256_storeu_si256((__m256i *)(pb + 8 * x), _mm256_setzero_si256());
            continue;
        }
        const float mn = mx > mo ? mx : mo;
        if (mn > mo) alpha[r] = mo == -INFINITY ? 0.0f : exp2f(mo - mn), scaled = 1;
        c->m[row] = mn;
        const __m512 mv = _mm512_set1_ps(mn);
        __m512 sum = _mm512_setzero_ps();
        for (int x = 0; x < NB; x += 2) {
            __m512 e0 = exp2_w(_mm512_sub_ps(v[x], mv)), e1 = e0;
            if (c->mask) e0 = _mm512_maskz_mov_ps(vis[x], e0);
            if (x + 1 < NB) {
                e1 = exp2_w(_mm512_sub_ps(v[x + 1], mv));
                if (c->mask) e1 = _mm512_maskz_mov_ps(vis[x + 1], e1);
            }
            sum = weights_store(pb + 8 * x, e0, e1, x + 1 < NB, sum);
        }
        float *L = c->L + row * 16;
        _mm512_store_ps(L, _mm512_fmadd_ps(_mm512_load_ps(L), _mm512_set1_ps(alpha[r]), sum));
    }
    return scaled;
}

/* Rows r0 .. r0 + nr - 1 of a chunk of NB blocks: scores in bfloat16 pairs, softmax (returns
 * whether a row rescales O). */
static inline __attribute__((always_inline)) int prompt_scores_bf16(const prompt_chunk *c, int64_t r0, int nr,
                                                                    float *alpha, const int NB) {
    const int64_t D2 = c->D / 2;
    const uint32_t *q[BR];
    for (int r = 0; r < BR; r++) q[r] = c->Qb + (r0 + (r < nr ? r : 0)) * D2;
    __m512 acc[BR][4];
    for (int r = 0; r < BR; r++)
        for (int x = 0; x < NB; x++) acc[r][x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D2; i++) {
        __m512bh k[4];
        for (int x = 0; x < NB; x++) k[x] = (__m512bh)_mm512_load_si512(c->Kt2 + i * PK + 16 * x);
        for (int r = 0; r < BR; r++) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q[r][i]);
            for (int x = 0; x < NB; x++) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], qp, k[x]);
        }
    }
    return prompt_softmax_bf16(c, r0, nr, alpha, acc, c->capped ? c->cs : c->c1, NB, BR);
}

#include "attn_prompt_i8.c"
#include "attn_prompt_q8.c"

/* O[rows r0 .., values c0 .. c0 + 16 NC) = alpha O + P V over the chunk's np pairs of keys
 * (scaled: whether an alpha is not 1). */
static inline __attribute__((always_inline)) void prompt_pv_bf16(const prompt_chunk *c, int64_t r0, int nr,
                                                                 const float *alpha, int scaled, int64_t np,
                                                                 int64_t c0, const int NC) {
    const int64_t D = c->D;
    const uint32_t *pb[BR];
    float *o[BR];
    __m512 acc[BR][4];
    for (int r = 0; r < BR; r++) {
        const int64_t row = r0 + (r < nr ? r : 0);
        pb[r] = c->Pb + row * (PK / 2);
        o[r] = c->O + row * D + c0;
        const __m512 al = _mm512_set1_ps(alpha[r]);
        for (int u = 0; u < NC; u++)
            acc[r][u] = scaled ? _mm512_mul_ps(al, _mm512_load_ps(o[r] + 16 * u)) : _mm512_load_ps(o[r] + 16 * u);
    }
    for (int64_t i = 0; i < np; i++) {
        __m512bh v[4];
        for (int u = 0; u < NC; u++) v[u] = (__m512bh)_mm512_load_si512(c->Vt2 + i * D + c0 + 16 * u);
        for (int r = 0; r < BR; r++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[r][i]);
            for (int u = 0; u < NC; u++) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], pp, v[u]);
        }
    }
    if (nr == BR) /* (one test: GCC copied the sums through the stack for the rows' tests) */
        for (int r = 0; r < BR; r++)
            for (int u = 0; u < NC; u++) _mm512_store_ps(o[r] + 16 * u, acc[r][u]);
    else
        for (int r = 0; r < nr && r < BR; r++)
            for (int u = 0; u < NC; u++) _mm512_store_ps(o[r] + 16 * u, acc[r][u]);
}

/* The cache lines of the nk keys and values of (slot s, kv head h) from position k0 (a block's
 * first) into L2: the next chunk's, while this one's products run (a task reads its kv head's
 * whole context, from L3 or memory at depth). */
static void prompt_prefetch(const gl_kv *kv, int64_t s, int64_t h, int64_t k0, int64_t nk, int64_t D) {
    const int64_t bytes = kv_bytes(DT * D, kv->type); /* a block's keys, its values */
    __asm__ volatile(""); /* without it GCC finds no effect here (prefetches count as none) and drops the call */
    for (int64_t p = k0; p < k0 + nk; p += DT) {
        prefetch_l2(kv_keys_t(kv) ? kt_plane(kv, s, h, p, D) : kv_at(kv, kv->k, s, h, p, D), bytes);
        prefetch_l2(kv_at(kv, kv->v, s, h, p, D), bytes);
    }
}

static inline int prompt_bf16_fits(const gl_attn *a) { return a->kv.block == DT && a->head_dim % 16 == 0; }

/* How a chunk's scores are made: bfloat16 pairs, int8 codes of the keys less their mean
 * (attn_prompt_i8.c), a q8_0 cache's own codes (attn_prompt_q8.c). */
enum { SCORES_BF16, SCORES_I8, SCORES_Q8 };

/* A tile's scores by f into alpha and scaled, its NB (1 to 4 blocks of 16 keys) a constant */
#define PROMPT_SCORES(f, alpha, scaled) \
    switch (nb) { \
    case 1: scaled = f(c, r0, nr, alpha, 1); break; \
    case 2: scaled = f(c, r0, nr, alpha, 2); break; \
    case 3: scaled = f(c, r0, nr, alpha, 3); break; \
    default: scaled = f(c, r0, nr, alpha, 4); break; \
    }

/* O = alpha O + P V for rows r0 .. r0 + nr - 1 of a chunk (D values: 64, 32 and 16 at a time). */
static void prompt_pv_rows(const prompt_chunk *c, int64_t r0, int nr, const float *alpha, int scaled) {
    const int64_t D = c->D, np = (c->nk + 1) / 2;
    int64_t c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) prompt_pv_bf16(c, r0, nr, alpha, scaled, np, c0, 4);
    for (; c0 + 32 <= D; c0 += 32) prompt_pv_bf16(c, r0, nr, alpha, scaled, np, c0, 2);
    for (; c0 < D; c0 += 16) prompt_pv_bf16(c, r0, nr, alpha, scaled, np, c0, 1);
}

/* One chunk's rows, BR at a time: scores (as `scores` says), softmax, O = alpha O + P V, each
 * tile's P V after the next tile's softmax (the weights' 64-byte stores long done when P V
 * loads them a pair at a time: 0.93x the kernel's time where each tile's followed its own). */
static void prompt_chunk_rows(const prompt_chunk *c, int64_t rows, int64_t nb, int scores) {
    float alpha[2][BR];
    int scaled[2], t = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += BR, t ^= 1) {
        const int nr = rows - r0 < BR ? (int)(rows - r0) : BR;
#if ATTN_I8
        if (scores == SCORES_Q8)
            PROMPT_SCORES(prompt_scores_q8, alpha[t], scaled[t])
        else if (scores == SCORES_I8)
            PROMPT_SCORES(prompt_scores_i8, alpha[t], scaled[t])
        else
#endif
            PROMPT_SCORES(prompt_scores_bf16, alpha[t], scaled[t])
        (void)scores;
        if (r0 > 0) prompt_pv_rows(c, r0 - BR, BR, alpha[t ^ 1], scaled[t ^ 1]);
    }
    if (rows > 0) {
        const int64_t r0 = (rows - 1) / BR * BR;
        prompt_pv_rows(c, r0, (int)(rows - r0), alpha[t ^ 1], scaled[t ^ 1]);
    }
}
#undef PROMPT_SCORES

/* The outputs of a task's rows: O / l (with gpt-oss's sinks in the denominator). */
static void prompt_rows_out(const gl_attn *a, const prompt_chunk *c, int64_t rows, int64_t group,
                            int64_t g, const int64_t *bt0, float *out) {
    const int64_t H = a->n_head, D = a->head_dim, b = bt0[0], T = bt0[1], t0 = bt0[2];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r / group, h = g * group + r % group;
        float *dst = out + ((b * T + t) * H + h) * D;
        const float l = _mm512_reduce_add_ps(_mm512_load_ps(c->L + r * 16));
        const float mr = c->m[r] * 0.69314718056f; /* base e, the sinks' */
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        if (a->sinks) { /* the sink's logit joins the sum, no value: both at max(m, sink) */
            const float sk = a->sinks[h], mm = mr > sk ? mr : sk;
            const float cf = c->m[r] == -INFINITY ? 0.0f : expf(mr - mm), den = l * cf + expf(sk - mm);
            inv = den > 0.0f ? cf / den : 0.0f;
        }
        for (int64_t d = 0; d < D; d++) dst[d] = c->O[r * D + d] * inv;
    }
}

#define A64(T, n) ((T *)aligned_alloc(64, (sizeof(T) * (size_t)(n) + 63) / 64 * 64))

/* A thread's buffers for tasks of up to rows_max rows (see prompt_chunk; Kf, Kt, Vf: float32
 * tiles where the cache is q8_0 or the scores int8 codes; the int8 ones where codes). */
typedef struct {
    uint32_t *Qb, *Kt2, *Vt2, *Pb, *Qq, *Kq;
    float *O, *L, *m, *Kf, *Kt, *Vf, *sQ, *sK;
    int64_t *pr;
    int32_t *kb, *qs;
} prompt_bufs;

static prompt_bufs prompt_bufs_new(int64_t rows_max, int64_t D, int floats, int codes) {
    prompt_bufs w = {0};
    w.Qb = A64(uint32_t, rows_max * D / 2 + 16), w.Kt2 = A64(uint32_t, D / 2 * PK);
    w.Vt2 = A64(uint32_t, PK / 2 * D), w.Pb = A64(uint32_t, rows_max * PK / 2);
    w.O = A64(float, rows_max * D), w.L = A64(float, rows_max * 16), w.m = A64(float, rows_max);
    w.pr = A64(int64_t, rows_max);
    if (floats) w.Kf = A64(float, D * PK), w.Kt = A64(float, D * PK), w.Vf = A64(float, D * PK);
    if (codes) {
        const int64_t nb32 = (D + 31) / 32;
        w.Qq = A64(uint32_t, rows_max * D / 4 + 16), w.Kq = A64(uint32_t, D / 4 * PK);
        w.sQ = A64(float, rows_max * nb32), w.sK = A64(float, PK * nb32), w.kb = A64(int32_t, PK);
        w.qs = A64(int32_t, rows_max * nb32);
    }
    return w;
}

static void prompt_bufs_free(prompt_bufs *w) {
    free(w->Qb), free(w->Kt2), free(w->Vt2), free(w->Pb), free(w->O), free(w->L), free(w->m);
    free(w->pr), free(w->Kf), free(w->Kt), free(w->Vf), free(w->Qq), free(w->Kq), free(w->sQ);
    free(w->sK), free(w->kb), free(w->qs);
}

/* A task's chunk over a thread's buffers (k0, nk and mask set chunk by chunk). */
static prompt_chunk prompt_chunk_of(const gl_attn *a, const prompt_bufs *w) {
    const float l2e = 1.44269504088896341f, cap = a->softcap;
    prompt_chunk c = {w->Qb, w->Kt2, w->Vt2, w->Pb, w->m, w->L, w->O, w->pr, a->head_dim, 0, 0, a->window,
                      a->scale * l2e, cap > 0.0f ? a->scale / cap : 0.0f, cap * l2e, 0, cap > 0.0f,
#if ATTN_I8
                      w->Qq, w->Kq, w->sQ, w->sK, w->kb, w->qs
#endif
    };
    return c;
}

/* Row r's query x (D) as the scores take it: bfloat16 pairs, int8 codes or q8_0 blocks. */
static void prompt_query(const prompt_chunk *c, const prompt_bufs *w, const float *x, int64_t r, int scores) {
    const int64_t D = c->D;
#if ATTN_I8
    if (scores == SCORES_Q8)
        prompt_query_q8(x, D, c->capped ? c->cs : c->c1, w->Qq + r * (D / 4), w->sQ + r * (D / 32), w->qs + r * (D / 32));
    else if (scores == SCORES_I8)
        prompt_query_i8(x, D, w->Qq + r * (D / 4), w->sQ + r);
    else
#endif
        bf16_row(x, D, (uint16_t *)(w->Qb + r * (D / 2)));
    (void)scores;
}

/* gl_attn_prefill's tasks (see there) in bfloat16 tiles, their scores as `scores` says (SCORES_*:
 * gl_attn_prefill's choice). */
static void prompt_bf16(const gl_attn *a, const float *q, const int64_t *slots, const int64_t *starts,
                        int64_t B, int64_t T, float *out, int scores, int nth) {
    const gl_kv *kv = &a->kv;
    const int q8 = scores == SCORES_Q8, i8 = scores == SCORES_I8;
    const int64_t H = a->n_head, Hkv = a->n_head_kv, D = a->head_dim;
    const int64_t window = a->window;
    /* a task reads its kv head's context once for all its rows: the more rows, the fewer reads
     * and conversions (Llama-1B at depth 4,096, 1 thread: 1.95 ns a query-key at 64 rows, 1.81
     * at 256; at 16,384 512 rows are about 0.975x 256's, bench/prompt_attention_ab.py) */
    const int64_t group = H / Hkv;
    int64_t pq = PRB / group > PQ ? PRB / group : PQ;
    while (pq > PQ && B * Hkv * ((T + pq - 1) / pq) < 4 * nth) pq = pq / 2 > PQ ? pq / 2 : PQ;
    const int64_t qblocks = (T + pq - 1) / pq, rows_max = pq * group;
    const int64_t ntask = B * Hkv * qblocks;
    float *mus = i8 ? A64(float, B * Hkv * D) : NULL; /* each row's and kv head's key mean */
#pragma omp parallel num_threads(nth)
    {
        const unsigned csr = ftz_begin();
        prompt_bufs w = prompt_bufs_new(rows_max, D, kv->type == 3 || i8, i8 || q8);
        prompt_chunk c = prompt_chunk_of(a, &w);
        float *Kf = w.Kf, *Kt = w.Kt, *Vf = w.Vf; /* q8_0's (and int8 codes') float32 tiles */
#if ATTN_I8
        if (i8) {
#pragma omp for
            for (int64_t bg = 0; bg < B * Hkv; bg++) { /* over every key a row's queries see */
                const int64_t p0 = starts[bg / Hkv], lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
                prompt_key_mean(kv, slots[bg / Hkv], bg % Hkv, lo, p0 + T, D, mus + bg * D, Kt, Kf, Vf);
            }
        }
#endif
        /* later query blocks have more keys: hand them out first, one at a time */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            const int64_t qb = qblocks - 1 - task % qblocks, bg = task / qblocks;
            const int64_t b = bg / Hkv, g = bg % Hkv, s = slots[b], p0 = starts[b];
            const int64_t t0 = qb * pq, nq = T - t0 < pq ? T - t0 : pq, rows = nq * group;
            /* row r: query t0 + r / group of head g * group + r % group */
            for (int64_t r = 0; r < rows; r++) {
                prompt_query(&c, &w, q + ((b * T + t0 + r / group) * H + g * group + r % group) * D, r, scores);
                w.pr[r] = p0 + t0 + r / group;
                w.m[r] = -INFINITY;
            }
            memset(w.O, 0, sizeof(float) * (size_t)(rows * D));
            memset(w.L, 0, sizeof(float) * (size_t)(rows * 16));
            const int64_t pmin = p0 + t0, pmax = p0 + t0 + nq - 1;
            const int64_t klo = window > 0 && pmin - window + 1 > 0 ? pmin - window + 1 : 0;
            for (int64_t k0 = klo / DT * DT; k0 <= pmax; k0 += PK) {
                const int64_t nk = pmax + 1 - k0 < PK ? pmax + 1 - k0 : PK, nb = (nk + DT - 1) / DT;
                c.k0 = k0, c.nk = nk;
                /* a key past the first query, short of a block, or out of the last query's window */
                c.mask = k0 + nk - 1 > pmin || nk % DT != 0 || (window > 0 && pmax - k0 >= window);
                if (k0 + PK <= pmax) {
                    const int64_t k1 = k0 + PK, n1 = pmax + 1 - k1 < PK ? pmax + 1 - k1 : PK;
                    prompt_prefetch(kv, s, g, k1, n1, D);
                }
#if ATTN_I8
                if (q8)
                    prompt_keys_q8(kv, s, g, k0, nk, D, w.Kq, w.sK);
                else if (i8)
                    prompt_keys_i8(kv, s, g, k0, nk, D, mus + bg * D, w.Kq, w.kb, w.sK, Kt, Kf);
                else
#endif
                    prompt_keys_bf16(kv, s, g, k0, nk, D, w.Kt2, Kf, Kt);
                prompt_values_bf16(kv, s, g, k0, nk, D, w.Vt2, Vf);
                prompt_chunk_rows(&c, rows, nb, scores);
            }
            prompt_rows_out(a, &c, rows, group, g, (const int64_t[3]){b, T, t0}, out);
        }
        prompt_bufs_free(&w);
        ftz_end(csr);
    }
    free(mus);
}
#endif
