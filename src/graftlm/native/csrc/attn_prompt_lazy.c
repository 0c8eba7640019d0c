/* Softmax weights the lazy way (included by attn_prompt_bf16.c before prompt_softmax_bf16, which
 * tries it first for a tile's rows in a chunk with no mask and no soft-cap, every score route).
 *
 * FlashAttention-3's lazy rescaling: a row's running max m may lag its scores. A tile's weights
 * 2^(f z - m) against each row's max so far go straight into Pb and their sums into l while
 * every lane of the sums (four weights a lane) stays at most LAZY_SUM: no max, no rescaling of O
 * and l, the subtraction folded into the FMA that scales the products. Past it (or NaN, or a row
 * with no max yet) the tile is made again the exact way (prompt_softmax_bf16: a new max, O and l
 * rescaled by alpha). The outputs are O / l at the end either way. At depth a row's max settles
 * in its first chunks: nearly every tile after them takes this path. The margin is small: a
 * weight of exactly 1 (a row's max) is the one bfloat16 carries without rounding, and a lagging
 * max rounds a row's largest weights too. Keys whose scores keep growing (the test's "keys growing
 * past a lazy max"), mean error against the exact max's, q8_0's codes / f16's bfloat16: 1.50x /
 * 1.41x at a margin of 1024, 1.28x / 1.14x at 16, 1.19x / 1.08x at 4 (each within the twin's
 * bound); on ordinary scores at depth 3,000 (Qwen's shapes) 1.30x on f16 and q8_0 at 16 (a
 * reviewer's run; the worst error 0.30-0.38 of the twin's bound where the exact max's is
 * 0.20-0.28). Llama-1B's shapes at depth 4,096, one thread: 0.92x main's kernel time at 1024,
 * 0.94x at 4. Taken only for a tile's full rows (R of them) in chunks with no mask and no
 * soft-cap. */
#define LAZY_SUM 16.0f

/* The R rows r0 .. r0 + R - 1 of a chunk of NB blocks (no mask, no soft-cap), products z (times
 * f): their weights into Pb and sums into l, or 0 (nothing stored to l) where a row has no max
 * yet or a lane of its sums would pass LAZY_SUM. The rows side by side, one test a tile. */
static inline __attribute__((always_inline)) int prompt_weights_lazy(const prompt_chunk *c, int64_t r0,
                                                                     __m512 z[][4], float f, const int NB,
                                                                     const int R) {
    __m512 mv[BR], sum[BR];
    for (int r = 0; r < R; r++) {
        const float mo = c->m[r0 + r];
        if (mo == -INFINITY) return 0;
        mv[r] = _mm512_set1_ps(mo);
        sum[r] = _mm512_setzero_ps();
    }
    const __m512 fv = _mm512_set1_ps(f), big = _mm512_set1_ps(LAZY_SUM);
    __mmask16 past = 0;
    for (int x = 0; x < NB; x += 2)
        for (int r = 0; r < R; r++) {
            uint32_t *pb = c->Pb + (r0 + r) * (PK / 2) + 8 * x;
            const __m512 e0 = exp2_w(_mm512_fmsub_ps(z[r][x], fv, mv[r]));
            const __m512 e1 = x + 1 < NB ? exp2_w(_mm512_fmsub_ps(z[r][x + 1], fv, mv[r])) : e0;
            sum[r] = weights_store(pb, e0, e1, x + 1 < NB, sum[r]);
            if (x + 2 >= NB) past |= _mm512_cmp_ps_mask(sum[r], big, _CMP_NLE_UQ);
        }
    if (past) return 0;
    for (int r = 0; r < R; r++) {
        float *L = c->L + (r0 + r) * 16;
        _mm512_store_ps(L, _mm512_add_ps(_mm512_load_ps(L), sum[r]));
    }
    return 1;
}
