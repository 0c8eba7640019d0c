/* Prompt attention's scores through a q8_0 cache from the cache's own codes (VPDPBUSD: four
 * products a lane, 64 an instruction where VDPBF16PS does 32), where the CPU has AVX-512 VNNI and
 * BF16 (ATTN_I8; included by attn_prompt_bf16.c, whose tasks, softmax and P V in bfloat16 pairs
 * these share). llama.cpp's way for a q8_0 cache: the queries rounded to q8_0, integer dots per
 * block of 32, both scales after. The keys are not rounded again (the user chose their int8).
 *
 * Semantics (tests/native/test_prompt_attention.py's twin does the same in PyTorch):
 *   qc, dq  = q8_0 of each query row (q8_0_block: ggml's quantize_row_q8_0_ref, the cache's
 *             own rounding; dq its float16 scale, a block of 32 values)
 *   score   = sum_b (sum_{d in b} qc kc) * dk_b * (dq_b * f)   (int32 sums, exact; f: scale
 *             log2(e), or scale / cap where soft-capped; kc, dk_b the cached key's codes, scale)
 * so the scores are the float reference's on the same cache with q replaced by dq qc: the error
 * of a score against it is at most scale sum_b (dq_b / 2 + 2^-11 max_b |q|) sum_{d in b} |k_d|
 * (half a code step of the query's block, and its float16 scale's rounding), as llama.cpp's.
 * The keys' codes + 128 (XOR 0x80) are the unsigned operand, each query block's -128 x its
 * codes' sum starts its sums. */

#if ATTN_I8
/* A query row x (D) as q8_0: codes (D bytes, as D / 4 dwords q), per block b of 32 sQ[b] = its
 * float16 scale times f and qs[b] = -128 x its codes' sum. */
static void prompt_query_q8(const float *x, int64_t D, float f, uint32_t *q, float *sQ, int32_t *qs) {
    int32_t codes[32];
    for (int64_t b = 0; b < D / 32; b++) {
        const uint16_t dh = q8_0_block(x + 32 * b, codes);
        const __m512i c0 = _mm512_loadu_si512(codes), c1 = _mm512_loadu_si512(codes + 16);
        _mm_storeu_si128((__m128i *)((int8_t *)q + 32 * b), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)((int8_t *)q + 32 * b + 16), _mm512_cvtepi32_epi8(c1));
        sQ[b] = _cvtsh_ss(dh) * f;
        qs[b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    }
}

/* The nk keys of (slot s, kv head h) from k0 (a block's first) as the cache holds them: codes +
 * 128 in Kq (D / 4, PK), dims 4i .. 4i + 3 of key j in the bytes of Kq[i PK + j], and key j's
 * scale of block b (of D / 32) in sK[b PK + j]. Keys past nk in the last block: its last
 * written key's (those scores are masked). A dword column of 16 keys is one gather (a block of
 * the pool holds DT = 16 keys' rows, rb bytes apart). */
static void prompt_keys_q8(const gl_kv *kv, int64_t s, int64_t h, int64_t k0, int64_t nk, int64_t D,
                           uint32_t *Kq, float *sK) {
    const int64_t rb = kv_bytes(D, 3), nb = (nk + DT - 1) / DT;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t x = 0; x < nb; x++) {
        const char *rows = kv_at(kv, kv->k, s, h, k0 + x * DT, D);
        const int n = nk - x * DT < DT ? (int)(nk - x * DT) : DT;
        const __m512i at = _mm512_mullo_epi32(_mm512_min_epi32(iota, _mm512_set1_epi32(n - 1)), _mm512_set1_epi32((int)rb));
        for (int64_t b = 0; b < D / 32; b++) {
            const char *blk = rows + 34 * b;
            const __m512i dh = _mm512_i32gather_epi32(at, blk, 1); /* the scale in the low 16 bits */
            _mm512_store_ps(sK + b * PK + x * DT, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh)));
            for (int l = 0; l < 8; l++)
                _mm512_store_si512(Kq + (b * 8 + l) * PK + x * DT,
                                   _mm512_xor_si512(_mm512_i32gather_epi32(at, blk + 2 + 4 * l, 1), flip));
        }
    }
}

/* Rows r0 .. r0 + nr - 1 of a chunk of NB blocks: scores from the cache's codes, softmax. Half a
 * tile (BR / 2 rows) at a time, softmax included: its int32 sums of a block and its float32
 * scores (BR / 2 x NB each) and a block's keys fit the 32 registers (a whole tile's scores held
 * past its first half left GCC no room for the keys: it loaded each again for every row). */
static inline __attribute__((always_inline)) int prompt_scores_q8(const prompt_chunk *c, int64_t r0, int nr,
                                                                  float *alpha, const int NB) {
    const int64_t D4 = c->D / 4, nb = c->D / 32;
    int scaled = 0;
    for (int r = nr; r < BR; r++) alpha[r] = 1.0f; /* rows past nr: none (a second half skipped) */
    for (int hf = 0; hf < nr; hf += BR / 2) {
        __m512 z[BR / 2][4];
        const int32_t *q[BR / 2], *qs[BR / 2];
        const float *sq[BR / 2];
        for (int r = 0; r < BR / 2; r++) {
            const int64_t row = r0 + (hf + r < nr ? hf + r : 0);
            q[r] = (const int32_t *)c->Qq + row * D4;
            qs[r] = c->qs + row * nb;
            sq[r] = c->sQ + row * nb;
            for (int x = 0; x < NB; x++) z[r][x] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            __v16si acc[BR / 2][4];
            for (int r = 0; r < BR / 2; r++)
                for (int x = 0; x < NB; x++) acc[r][x] = (__v16si)_mm512_set1_epi32(qs[r][b]);
            for (int l = 0; l < 8; l++) {
                __v16si k[4];
                for (int x = 0; x < NB; x++) {
                    k[x] = (__v16si)_mm512_load_si512(c->Kq + (b * 8 + l) * PK + 16 * x);
                    __asm__("" : "+v"(k[x])); /* held: GCC loads it again for every row otherwise */
                }
                for (int r = 0; r < BR / 2; r++) {
                    const __v16si qp = (__v16si)_mm512_set1_epi32(q[r][b * 8 + l]);
                    for (int x = 0; x < NB; x++) acc[r][x] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][x], (__m512i)k[x], (__m512i)qp);
                }
            }
            for (int x = 0; x < NB; x++) {
                const __m512 sk = _mm512_load_ps(c->sK + b * PK + 16 * x);
                for (int r = 0; r < BR / 2; r++)
                    z[r][x] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)acc[r][x]), sk),
                                              _mm512_set1_ps(sq[r][b]), z[r][x]);
            }
        }
        scaled |= prompt_softmax_bf16(c, r0 + hf, nr - hf, alpha + hf, z, 1.0f, NB, BR / 2);
    }
    return scaled;
}
#endif
