/* Prompt attention's scores from int8 codes (VPDPBUSD: four products a lane, 64 an instruction
 * where VDPBF16PS does 32), SageAttention's way, where the CPU has AVX-512 VNNI and BF16 (ATTN_I8;
 * included by attn_prompt_bf16.c, whose tasks, softmax and P V in bfloat16 pairs these share).
 *
 * Semantics (tests/native/test_prompt_attention.py's twin does the same in PyTorch):
 *   mu[d]   = bf16(mean of key d over the row's context [lo, start + T))  once a call and kv head
 *   kc      = k - mu            (float32)  softmax-invariant: every score of a query row moves by q.mu
 *   sK      = max_d |kc| / 127, codes round(kc * (127 / max_d |kc|))   (half to even; 0 if all 0)
 *   sQ, qc  = the same for each query row (float32, unrotated here: q comes rotated)
 *   score   = (sum_d qc kc) * sK * (sQ * f)   (int32 sums, exact; f: scale log2(e), or scale / cap)
 * A key's codes are made once a task and block of PK keys; the query's codes + 128 are the
 * unsigned operand, each key's -128 x its codes' sum starts its sums. */

#if ATTN_I8
/* mu (D): the keys of (slot s, kv head h) at positions lo .. hi - 1 averaged per dim, rounded to
 * bfloat16; Kt (D, PK) and Kf (PK, D) scratch. */
static void prompt_key_mean(const gl_kv *kv, int64_t s, int64_t h, int64_t lo, int64_t hi, int64_t D,
                            float *mu, float *Kt, float *Kf, float *acc) {
    memset(acc, 0, sizeof(float) * (size_t)(D * 16));
    for (int64_t k0 = lo; k0 < hi; k0 += PK) {
        const int64_t nk = hi - k0 < PK ? hi - k0 : PK;
        if (kv_keys_t(kv)) {
            kt_gather(kv, s, h, k0, nk, D, Kt); /* zero past nk */
            for (int64_t d = 0; d < D; d++) {
                const float *k = Kt + d * PK;
                __m512 a = _mm512_add_ps(_mm512_load_ps(k), _mm512_load_ps(k + 16));
                a = _mm512_add_ps(a, _mm512_add_ps(_mm512_load_ps(k + 32), _mm512_load_ps(k + 48)));
                _mm512_store_ps(acc + d * 16, _mm512_add_ps(_mm512_load_ps(acc + d * 16), a));
            }
        } else {
            kv_gather(kv, kv->k, s, h, k0, nk, D, Kf);
            for (int64_t j = 0; j < nk; j++)
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(acc + d, _mm512_add_ps(_mm512_load_ps(acc + d), _mm512_loadu_ps(Kf + j * D + d)));
        }
    }
    const float inv = hi > lo ? 1.0f / (float)(hi - lo) : 0.0f;
    for (int64_t d = 0; d < D; d++) {
        const float sum = kv_keys_t(kv) ? _mm512_reduce_add_ps(_mm512_load_ps(acc + d * 16)) : acc[d];
        const uint32_t u = (uint32_t)bf16_of(sum * inv) << 16;
        memcpy(mu + d, &u, sizeof u);
    }
}

/* A query row x (D) as codes + 128, four to a lane (q (D / 4)), and its scale. */
static void prompt_query_i8(const float *x, int64_t D, uint32_t *q, float *scale) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    *scale = m / 127.0f;
    for (int64_t d = 0; d < D; d += 16) {
        const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + d), inv)),
                                           _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)((uint8_t *)q + d), _mm512_cvtepi32_epi8(c));
    }
}

/* The nk keys of (slot s, kv head h) from k0 less mu as codes: Kq (D / 4, PK), dims 4i .. 4i + 3
 * of key j in the bytes of Kq[i PK + j]; kb, sK (PK): -128 x the codes' sum, the scale. Kt
 * (D, PK) and Kf scratch (zero past nk: those scores are masked). */
static void prompt_keys_i8(const gl_kv *kv, int64_t s, int64_t h, int64_t k0, int64_t nk, int64_t D,
                           const float *mu, uint32_t *Kq, int32_t *kb, float *sK, float *Kt, float *Kf) {
    if (kv_keys_t(kv)) {
        kt_gather(kv, s, h, k0, nk, D, Kt);
    } else {
        kv_gather(kv, kv->k, s, h, k0, nk, D, Kf);
        key_block_t(Kf, nk, D, Kt);
    }
    const __m512 c127 = _mm512_set1_ps(127.0f);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
        __m512 mx = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m512 kc = _mm512_sub_ps(_mm512_load_ps(Kt + d * PK + j0), _mm512_set1_ps(mu[d]));
            _mm512_store_ps(Kt + d * PK + j0, kc);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(kc));
        }
        const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ), c127, mx);
        _mm512_store_ps(sK + j0, _mm512_div_ps(mx, c127));
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < D / 4; i++) {
            const float *k = Kt + 4 * i * PK + j0;
            const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(k), inv));
            const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(k + PK), inv));
            const __m512i c2 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(k + 2 * PK), inv));
            const __m512i c3 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(k + 3 * PK), inv));
            __m512i w = _mm512_mask_mov_epi8(c0, 0x2222222222222222ull, _mm512_slli_epi32(c1, 8));
            w = _mm512_mask_mov_epi8(w, 0x4444444444444444ull, _mm512_slli_epi32(c2, 16));
            w = _mm512_mask_mov_epi8(w, 0x8888888888888888ull, _mm512_slli_epi32(c3, 24));
            _mm512_store_si512(Kq + i * PK + j0, w);
            sum = _mm512_dpbusd_epi32(sum, ones, w);
        }
        _mm512_store_si512(kb + j0, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
    }
}

/* Rows r0 .. r0 + nr - 1 of a chunk of NB blocks: scores from int8 codes, softmax. */
static inline __attribute__((always_inline)) int prompt_scores_i8(const prompt_chunk *c, int64_t r0, int nr,
                                                                  float *alpha, const int NB) {
    const int64_t D4 = c->D / 4;
    const uint32_t *q[BR];
    for (int r = 0; r < BR; r++) q[r] = c->Qq + (r0 + (r < nr ? r : 0)) * D4;
    /* int32 vectors (cast for the intrinsic: the same code as GCC's builtin): held as __m512i
     * (64-bit lanes) GCC copies every sum through the stack each step */
    __v16si acc[BR][4];
    for (int r = 0; r < BR; r++)
        for (int x = 0; x < NB; x++) acc[r][x] = (__v16si)_mm512_setzero_si512();
    for (int64_t i = 0; i < D4; i++) {
        __v16si k[4];
        for (int x = 0; x < NB; x++) k[x] = (__v16si)_mm512_load_si512(c->Kq + i * PK + 16 * x);
        for (int r = 0; r < BR; r++) {
            const __v16si qp = (__v16si)_mm512_set1_epi32((int)q[r][i]);
            for (int x = 0; x < NB; x++) acc[r][x] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][x], (__m512i)qp, (__m512i)k[x]);
        }
    }
    const float f = c->capped ? c->cs : c->c1;
    __m512 z[BR][4];
    for (int r = 0; r < BR; r++) {
        const __m512 fr = _mm512_set1_ps(c->sQ[r0 + (r < nr ? r : 0)] * f);
        for (int x = 0; x < NB; x++)
            z[r][x] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32((__m512i)acc[r][x], _mm512_load_si512(c->kb + 16 * x))),
                                                  _mm512_load_ps(c->sK + 16 * x)),
                                    fr);
    }
    return prompt_softmax_bf16(c, r0, nr, alpha, z, 1.0f, NB, BR);
}
#endif
