/* graftlm's native kernels (x86-64 AVX2 + FMA, OpenMP): the one header of one translation unit.
 *
 * graftlm.c includes the files of each concern, so the compiler sees (and inlines across) them all
 * as it saw the one file they were:
 *   quant.c  the weight formats: repacking, exact dequantization; quant_mm.c their products
 *   kquant.c the K-quant formats kept at the file's size (Q4_K, Q5_K, Q6_K); kquant_k4.c and
 *            kquant_k16.c their products
 *   mxfp4.c  MXFP4 (gpt-oss's experts) at the file's size: dequantization and products
 *   iquant.c the grid quants (IQ2_*, IQ3_*) read in place, IQ2_XXS and IQ3_XXS as tiles (with iq_*.c):
 *            dequantization, products
 *   attn.c   RMS norm, RoPE, the KV cache's writes, the gated activation
 *   attn_decode*.c  attention of decode steps through the KV cache (tiles, q8_0, bfloat16, the
 *            tasks and the step); attn_prompt*.c: of prompts
 *   lora.c   the LoRA delta's layouts; lora_xa.c its s*A*x dots; proj.c a projection that adds
 *            the delta to the base product in one pass (its tasks claimed by the threads)
 *   layer.c  a llama-style decoder layer's decode step (moe.c: routed experts), and a model's
 *            layers, in one call
 * Here: what crosses files. The structs Python mirrors, the exported functions, the vector helpers
 * more than one file uses, and the pieces one file takes from another (static: one unit).
 * AVX-512 variants of a helper or a kernel go beside it, behind #ifdef __AVX512F__ (__AVX512VNNI__,
 * __AVX512BF16__): the helpers here, the kernels in the file of their concern.
 */
#ifndef GRAFTLM_H
#define GRAFTLM_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "graftlm native kernels need AVX2, FMA and F16C"
#endif

#ifdef GL_COUNT_ALLOC /* a build that counts its heap allocations (gl_alloc_count) */
static int64_t gl_allocs;
#define GL_COUNTED(call) (__atomic_fetch_add(&gl_allocs, 1, __ATOMIC_RELAXED), call)
#define malloc(n) GL_COUNTED(malloc(n))
#define calloc(n, size) GL_COUNTED(calloc(n, size))
#define aligned_alloc(align, n) GL_COUNTED(aligned_alloc(align, n))
#endif

/* ---------------------------------------------------------------- the structs Python mirrors */

/* graftlm/native/abi.py mirrors these in ctypes, field for field and by the same names; the
 * library describes their layout (gl_abi_layout, graftlm.c) and the loader refuses a library whose
 * layout is not the mirrors'. */

/* A quantized weight of n rows of k values, as the packers lay it out. */
typedef struct {
    int64_t kind; /* 0: u4 / u5 (q = qs, d, m), 1: s8 (q, d = scales), 2: k4 / k5, 3: k6 / k3 / k2 (q, d: kquant.c),
                   * 4: float rows as stored (q; half 0 float16, 1 bfloat16, 2 float32: float.c),
                   * 5: MXFP4 regrouped by 8 rows (q: mxfp4.c),
                   * 6: the grid quants' super-blocks as stored, or (half 1) IQ2_XXS's and IQ3_XXS's as
                   *    tiles of 16 outputs (q; small the type: iquant.c) */
    /* small: the 5-bit codes of u5 and k5 (a fifth-bit plane after each block's 4-bit codes); kind
     * 1's variant (0 Q8_0; 1 IQ4_NL, 2 IQ4_XS: 4-bit codes of IQ4_NL's table, quant.c); kind 3's
     * (0 Q6_K, 1 Q3_K, 2 Q2_K) */
    int64_t half, sblk, small, n, k;
    const void *q, *d, *m;
} gl_weight;

/* The adapters attached to one projection, each packed once when it was attached
 * (graftlm/lora/packed.py; layouts: lora.c's LoRA delta section). */
typedef struct { /* one adapter's columns of B that reach one range of outputs */
    const void *b; /* blocks [lo, hi) of 32 outputs, each block's r columns in turn, 32 values each */
    int64_t c0, r, lo, hi; /* its columns c0 .. c0 + r - 1 of the adapter's rank */
} gl_lora_part;

typedef struct { /* one adapter on one projection */
    const void *a; /* (r, n_in), float32 or bfloat16 (the site's bf); NULL where aq serves */
    /* A again as an s8 weight of r rows (Q8_0 codes and scales, laid out as gl_pack_s8 lays
     * them), or NULL: the products take A . x from the quantized x the base product already
     * made, with the base kernel's integer dots (a quarter of the instructions and half the
     * bytes of the bfloat16 dots) */
    const void *aq, *a_scales;
    const gl_lora_part *parts; /* in column order; a column in none is zero in B */
    int64_t id;                /* its column in the rows' scale table */
    int64_t r, a_half, n_parts;
} gl_lora_slot;

typedef struct {
    const gl_lora_slot *slot; /* the n adapters on this projection (n 0: none) */
    const float *scales; /* row i's scale of slot j: scales[i * ld + slot[j].id], 0 past ld */
    int64_t n, bf, ld;   /* bf: A and B in bfloat16 (float32 arithmetic either way) */
} gl_lora_site;

/* One layer's paged KV cache (step/kv_cache.py): keys and values in blocks of `block` positions
 * from one pool, and each sequence slot's row of the block table naming the pool block that holds
 * its positions [i * block, (i + 1) * block). Pool block 0 is never handed out: table entries no
 * sequence owns point at it (padding writes land there, nothing reads them). */
typedef struct {
    /* v: (n_blocks, n_head_kv, block, v_dim); k: (n_blocks, n_head_kv, head_dim, block), each
     * block's keys transposed (a value of 16 positions is one vector: kv_keys_t), except in q8_0,
     * whose blocks of 32 values run along a key: (n_blocks, n_head_kv, block, head_dim) */
    void *k, *v;
    const int32_t *tables; /* (n_slots, max_blocks) */
    int64_t n_blocks, n_slots, max_blocks, block, n_head_kv;
    int64_t type; /* 0: float32, 1: float16, 2: bfloat16, 3: q8_0 (ggml's block_q8_0: per 32
                   * values a float16 scale d and 32 int8 codes q, value = d * q; rows of a
                   * multiple of 32 values) */
} gl_kv;

/* The weights, vectors, cache and dimensions of one decoder layer (layer.c). */
typedef struct {
    gl_weight qkv[3], o, gate_up, down; /* qkv: one stacked weight (n_qkv 1) or Q, K, V (3) */
    gl_lora_site l_qkv[3], l_o, l_gate_up, l_down;
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm, *post_attn_norm, *post_ffw_norm; /* NULL: none */
    const float *q_bias, *k_bias, *v_bias, *o_bias; /* added to the products; NULL: none */
    gl_kv kv;
    const float *cos_t, *sin_t;
    int64_t n_qkv, n_embd, n_head, n_head_kv, head_dim, n_ff, n_ctx, rot, neox, window;
    int64_t act; /* 0: SiLU, 1: GELU (tanh approximation), 2: gpt-oss's clamped SwiGLU */
    float eps, scale, softcap; /* softcap: cap * tanh(score / cap) on attention scores, 0: none */
    /* A routed FFN in place of gate_up / down where n_expert > 0 (Mixtral, qwen3moe): the router
     * (n_expert rows; GGUF files keep it float32: kind 4) with its adapter site, the same product
     * as the composed block's; expert e's stacked [gate; up] (2 n_ff rows) and down at
     * exp_gate_up[e] and exp_down[e]; n_expert_used experts a token. */
    gl_weight router;
    gl_lora_site l_router;
    const gl_weight *exp_gate_up, *exp_down;
    int64_t n_expert, n_expert_used;
    /* gpt-oss: the attention's sinks (gl_attn's), the router's bias (n_expert), each expert's
     * bias of [gate; up] (n_expert, 2 n_ff) and of down (n_expert, n_embd); NULL: none. gating 0:
     * w = the softmax of all the router's logits at the chosen, over their sum (Mixtral,
     * qwen3moe); 1: the softmax of the chosen logits alone (gpt-oss: the same weights, rounded
     * as its composed block rounds them). */
    const float *sinks, *router_bias, *exp_gate_up_bias, *exp_down_bias;
    int64_t gating;
    /* The routed experts' adapters: n_expert sites each, expert e's [gate; up] and down at
     * l_exp_gate_up[e] and l_exp_down[e] (n 0: none on it), their scales the batch rows'; NULL:
     * no adapter on any of this layer's experts (moe.c's moe_run adds their delta). */
    const gl_lora_site *l_exp_gate_up, *l_exp_down;
} gl_layer;

/* One layer's attention through its KV cache (attn_decode.c, attn_prompt.c): the cache, the RoPE
 * tables, the dimensions and the scales, which a decode step's or a prompt's rows share. */
typedef struct {
    gl_kv kv;                   /* n_ctx = max_blocks * block positions a sequence */
    const float *cos_t, *sin_t; /* (n_ctx, rot / 2); prompts: unused (q comes rotated) */
    int64_t n_head, n_head_kv, head_dim, v_dim, n_ctx, rot, neox, window; /* window 0: all */
    float scale, softcap; /* softcap 0: none */
    /* (n_head,) or NULL: one more logit a head in each softmax's denominator, with no value
     * (gpt-oss's attention sinks), folded in where a row's sums are finished */
    const float *sinks;
} gl_attn;

/* Memory the decode layers carve their buffers from, kept between calls so that a step allocates
 * nothing: grown when a step needs more than any before it (more rows, an adapter of higher
 * rank), freed by gl_scratch_free. Python owns one per FusedLayer and FusedStack (abi.Scratch),
 * zeroed: empty. busy: a call is using it; a call that finds it busy (two threads on one model)
 * takes a block of its own instead. Inside a call only the calling thread carves it; the OpenMP
 * threads work in what it carved. */
typedef struct {
    char *base;
    int64_t cap, used, busy;
} gl_scratch;

/* ---------------------------------------------------------------- exported functions */

/* Each declared here once, after GL_API: the loader reads these prototypes and checks abi.py's
 * argument types against them. Pointers go over as void pointers; int64_t, int and float as
 * themselves. */
#define GL_API __attribute__((visibility("default")))

/* graftlm.c: names[i] = "struct" (values[i] its size) or "struct.field" (its offset), for i below
 * cap; returns how many there are. */
GL_API int64_t gl_abi_layout(const char **names, int64_t *values, int64_t cap);
/* graftlm.c: s's block freed, s zeroed. */
GL_API void gl_scratch_free(gl_scratch *s);
/* graftlm.c: the heap allocations the library has made, in a build with -DGL_COUNT_ALLOC (tests
 * count a decode step's); -1 in any other. */
GL_API int64_t gl_alloc_count(void);
/* graftlm.c: what the library was compiled to use: bit 0 AVX-512F, 1 AVX-512BW with VL, 2 VNNI
 * (AVX-512 VNNI with VL, or AVX-VNNI), 3 AVX-512 BF16, 4 the 512-bit VNNI kernels (GL_VNNI512), 5 the
 * AMX tiles (GL_AMX; build.py's FEATURES names them). */
GL_API int64_t gl_features(void);
/* graftlm.c: from how many rows of x the 512-bit pair kernels serve a product (at least 1; no
 * effect in a build without them); returns the value it replaces. */
GL_API int64_t gl_set_pair_rows(int64_t m);
/* moe.c: whether a routed FFN's threads take whole experts where they split evenly (1, the
 * default) or share each step (0: the twin of tests/native); returns the value it replaces. */
GL_API int64_t gl_set_moe_jobs(int64_t on);
/* proj.c: whether the decode products and the routed experts' jobs are claimed as the threads go
 * (1, the default) or split statically (0: their twin, GRAFTLM_DYNAMIC=0; 2 and 3: graftlm.h's
 * drills); returns the value it replaces. */
GL_API int64_t gl_set_dynamic(int64_t on);
/* proj.c: how many items (product tasks, experts' jobs) threads have taken from another's share
 * since the library loaded. */
GL_API int64_t gl_stolen_items(void);
GL_API int64_t gl_release_threads(void);
/* From how many rows of x a product runs on AMX tiles (0: never); asks Linux for the tiles' state
 * first. The previous value, or -1: no AMX in this library, or the state was refused. */
GL_API int64_t gl_set_amx_rows(int64_t m);

/* quant.c */
GL_API int gl_pack_u4(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k,
                      uint8_t *qs, void *d, void *m, int h, int nth);
GL_API int gl_pack_s8(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k,
                      int8_t *q, void *s, int h, int nth);
GL_API void gl_pack_q8_0_f32(const float *x, int64_t n, int64_t k, int8_t *q, void *s);
GL_API void gl_deq_u4(const uint8_t *qs, const void *d, const void *m, int h, int h5, int offset,
                      int64_t k, const int64_t *ids, int64_t row0, int64_t nrows, float *out,
                      int nth);
GL_API void gl_deq_s8(const int8_t *q, const void *s, int h, int v, int64_t sblk, int64_t k,
                      const int64_t *ids, int64_t row0, int64_t nrows, float *out, int nth);
GL_API void gl_mm_u4(const float *x, int64_t M, int64_t k, const uint8_t *qs, const void *d,
                     const void *m, int h, int h5, int64_t n, float *y, int nth);
GL_API void gl_mm_s8(const float *x, int64_t M, int64_t k, const int8_t *q, const void *s, int h,
                     int v, int sblk, int64_t n, float *y, int nth);
/* mxfp4.c */
GL_API int gl_pack_mx4(const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k, uint8_t *q, int nth);
GL_API void gl_deq_mx4(const uint8_t *q, int64_t k, const int64_t *ids, int64_t row0, int64_t nrows,
                       float *out, int nth);
GL_API void gl_mm_mx4(const float *x, int64_t M, int64_t k, const uint8_t *q, int64_t n, float *y,
                      int nth);
/* float.c (k a multiple of 32, as every product's) */
GL_API void gl_mm_f(const float *x, int64_t M, int64_t k, const void *w, int h, int64_t n, float *y,
                    int nth);

/* kquant.c */
GL_API int gl_pack_k4(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k,
                      uint8_t *q, uint16_t *d, int nth);
GL_API void gl_deq_k4(const uint8_t *q, const uint16_t *d, int h5, int64_t k, const int64_t *ids,
                      int64_t row0, int64_t nrows, float *out, int nth);
GL_API void gl_mm_k4(const float *x, int64_t M, int64_t k, const uint8_t *q, const uint16_t *d,
                     int h5, int64_t n, float *y, int nth);
GL_API int gl_pack_k6(int type, const uint8_t *raw, int64_t rowbytes, int64_t n, int64_t k,
                      uint8_t *q, uint16_t *d, int nth);
GL_API void gl_deq_k6(const uint8_t *q, const uint16_t *d, int v, int64_t k, const int64_t *ids,
                      int64_t row0, int64_t nrows, float *out, int nth);
GL_API void gl_mm_k6(const float *x, int64_t M, int64_t k, const uint8_t *q, const uint16_t *d,
                     int v, int64_t n, float *y, int nth);

/* iquant.c (k a multiple of 256; v: 0 IQ2_XXS, 1 IQ2_XS, 2 IQ2_S, 3 IQ3_XXS, 4 IQ3_S) */
GL_API void gl_deq_iq(const uint8_t *q, int v, int64_t k, const int64_t *ids, int64_t row0,
                      int64_t nrows, float *out, int nth);
GL_API void gl_mm_iq(const float *x, int64_t M, int64_t k, const uint8_t *q, int v, int64_t n,
                     float *y, int nth);
/* IQ2_XXS and IQ3_XXS as tiles of 16 outputs (iquant.c; gl_iq_tiles: 1 where this build takes
 * them; gl_pack_iq: 0, or 1 where this build takes none and the weight stays in place) */
GL_API int gl_iq_tiles(void);
GL_API int gl_pack_iq(int v, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out, int nth);
GL_API void gl_deq_iq_tiles(const uint8_t *q, int v, int64_t k, const int64_t *ids, int64_t row0,
                            int64_t nrows, float *out, int nth);
GL_API void gl_mm_iq_tiles(const float *x, int64_t M, int64_t k, const uint8_t *q, int v, int64_t n,
                           float *y, int nth);

/* attn.c (gl_attn_decode: attn_decode.c, gl_attn_prefill: attn_prompt.c) */
GL_API void gl_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps,
                        float *y, int nth);
GL_API int gl_rope(const float *x, int64_t N, int64_t rs, int64_t H, int64_t D,
                   const int64_t *pos, const float *cos_t, const float *sin_t, int64_t n_pos,
                   int64_t rot, int neox, float *out, int nth);
GL_API void gl_attn_decode(const gl_attn *a, const float *q, int64_t q_rs, const float *k,
                           int64_t k_rs, const float *v, int64_t v_rs, const int64_t *slots,
                           const int64_t *pos, int64_t B, float *out, int nth);
GL_API void gl_attn_prefill(const gl_attn *a, const float *q, const int64_t *slots,
                            const int64_t *starts, int64_t B, int64_t T, float *out,
                            int64_t exact, int nth);
GL_API void gl_gated(const float *gu, int64_t B, int64_t ff, int64_t act, float *out, int nth);
GL_API void gl_kv_write(const gl_kv *kv, int64_t which, const float *x, int64_t rs,
                        const int64_t *slots, const int64_t *starts, int64_t B, int64_t T,
                        int64_t D, int nth);

/* proj.c */
GL_API void gl_proj(const gl_weight *w, const gl_lora_site *l, const float *x, int64_t M,
                    int64_t T, float *y, int nth);
GL_API void gl_lora(const gl_lora_site *l, int64_t n_in, int64_t n_out, const float *x,
                    int64_t M, int64_t T, float *y, int nth);

/* layer.c */
GL_API void gl_layer_decode(const gl_layer *L, float *x, int64_t B, const int64_t *slots,
                            const int64_t *pos, gl_scratch *scratch, int nth);
GL_API void gl_layers_decode(const gl_layer *const *layers, int64_t n, float *x, int64_t B,
                             const int64_t *slots, const int64_t *pos, gl_scratch *scratch,
                             int nth);
GL_API void gl_moe_ffn(const gl_layer *L, const float *h, int64_t B, float *o,
                       gl_scratch *scratch, int nth);
GL_API int64_t gl_moe_bytes(const gl_layer *L, int64_t B);

/* ---------------------------------------------------------------- vector helpers */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Flush-to-zero and denormals-are-zero for the calling thread, until ftz_end(the value returned):
 * the attention kernels run under it. Their softmax weights of far-below-the-max scores are tiny
 * (exp256 clamps at e^-87.3), and each product of one with a value is a denormal, which the CPU
 * computes through a microcode assist tens of times slower than an FMA: without it, Llama-1B's
 * 512-token prompt spent 17% of its time in attention, three quarters of it in P V. What is
 * flushed is below 2^-126 of the row's largest weight (1), far under float32's precision. */
static inline unsigned ftz_begin(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */
    return csr;
}
static inline void ftz_end(unsigned csr) { _mm_setcsr(csr); }

/* e^x for 8 floats (Cephes' expf polynomial; ~2 ulp), x clamped to [-87.3, 88.3]. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* tanh(x) for 8 floats: 2 / (1 + e^-2x) - 1 (exp256's clamp makes it -1 or 1 far out; near 0
 * it is x to within ~1e-7 absolute, not relative). */
static inline __m256 tanh256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp256(_mm256_mul_ps(x, _mm256_set1_ps(-2.0f)));
    return _mm256_sub_ps(_mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(one, e)), one);
}

#if defined(__AVX512F__)
/* e^x for 16 floats: exp256's polynomial. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 fx = _mm512_floor_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* tanh(x) for 16 floats, as tanh256. */
static inline __m512 tanh512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp512(_mm512_mul_ps(x, _mm512_set1_ps(-2.0f)));
    return _mm512_sub_ps(_mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(one, e)), one);
}
#endif

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float t = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* ---------------------------------------------------------------- the KV cache's values */

/* Bytes n cached values of type t take (q8_0: n a multiple of 32). */
static inline __attribute__((always_inline)) int64_t kv_bytes(int64_t n, const int64_t t) {
    return t == 0 ? 4 * n : t == 3 ? n / 32 * 34 : 2 * n;
}

/* Where the values of (slot s, kv head h, position p) start, in pool base (k or v) whose rows
 * are n values: positions of one block and head are contiguous rows. */
static inline char *kv_at(const gl_kv *kv, void *base, int64_t s, int64_t h, int64_t p, int64_t n) {
    const int64_t blk = kv->tables[s * kv->max_blocks + p / kv->block];
    const int64_t row = (blk * kv->n_head_kv + h) * kv->block + p % kv->block;
    return (char *)base + kv_bytes(row * n, kv->type);
}

/* 8 bfloat16 values as float32 (the LoRA factors' and the bf16 cache's loads). */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 cached values from value i of p, as float32 (t: gl_kv.type, a constant where inlined). */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, int64_t i, const int t) {
    if (t == 0) return _mm256_loadu_ps((const float *)p + i);
    if (t == 3) { /* i a multiple of 8: its 8 codes lie in one block */
        const char *b = (const char *)p + (i >> 5) * 34;
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + (i & 31)));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dh)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
    if (t == 1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return bf16x8((const uint16_t *)p + i);
}

static inline __attribute__((always_inline)) float kv_get(const void *p, int64_t i, const int t) {
    if (t == 0) return ((const float *)p)[i];
    if (t == 3) {
        const char *b = (const char *)p + (i >> 5) * 34;
        uint16_t dh;
        memcpy(&dh, b, 2);
        return _cvtsh_ss(dh) * (float)(int8_t)b[2 + (i & 31)];
    }
    const uint16_t h = ((const uint16_t *)p)[i];
    if (t == 1) return _cvtsh_ss(h);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The dot product of n float32 values a with n values b of type t (gl_kv.type: the cache's
 * keys; t 2, bfloat16: the LoRA factors too). */
static inline __attribute__((always_inline)) float dot_kv(const float *a, const void *b, int64_t n,
                                                          const int t) {
    if (t == 0) return dot_f32(a, b, n);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_load8(b, i, t), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), kv_load8(b, i + 8, t), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), kv_load8(b, i, t), s0);
    float r = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) r += a[i] * kv_get(b, i, t);
    return r;
}

/* float32 -> bfloat16, round to nearest even (torch's conversion; NaN stays NaN). */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Whether the cache's key blocks are transposed (every type but q8_0: see gl_kv). */
static inline int kv_keys_t(const gl_kv *kv) { return kv->type != 3; }

/* Where the keys of (slot s, kv head h) in the block holding position p start: a transposed
 * block's (head_dim x block) values, value d of position p at d * block + p % block. */
static inline char *kt_plane(const gl_kv *kv, int64_t s, int64_t h, int64_t p, int64_t D) {
    const int64_t blk = kv->tables[s * kv->max_blocks + p / kv->block];
    return (char *)kv->k + kv_bytes((blk * kv->n_head_kv + h) * kv->block * D, kv->type);
}

static inline void kv_store(void *dst, const float *src, int64_t n, int64_t t);

/* 32 float32 values as ggml's quantize_row_q8_0_ref (and gguf's quantizer) make a Q8_0 block:
 * d = max|v| / 127 (returned as float16 bits), codes v * (1 / d) rounded half away from zero
 * (floor(a) + floor(2 (a - floor(a))) of a = |v / d|, the sign put back). The KV cache's q8_0
 * rows (kv_store) and an adapter's A (quant.c's gl_pack_q8_0_f32) both take it. */
static inline uint16_t q8_0_block(const float *v, int32_t codes[32]) {
    const __m256 sign = _mm256_set1_ps(-0.0f), two = _mm256_set1_ps(2.0f);
    __m256 xv[4], m = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        xv[c] = _mm256_loadu_ps(v + 8 * c);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, xv[c]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float d = _mm_cvtss_f32(m4) / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
    const __m256 idv = _mm256_set1_ps(id);
    for (int c = 0; c < 4; c++) {
        const __m256 t = _mm256_mul_ps(xv[c], idv), a = _mm256_andnot_ps(sign, t);
        const __m256 f = _mm256_floor_ps(a);
        const __m256 rnd = _mm256_add_ps(f, _mm256_floor_ps(_mm256_mul_ps(two, _mm256_sub_ps(a, f))));
        const __m256 val = _mm256_or_ps(rnd, _mm256_and_ps(sign, t)); /* the sign back */
        _mm256_storeu_si256((__m256i *)(codes + 8 * c), _mm256_cvtps_epi32(val));
    }
    return (uint16_t)_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* A key of D float32 values into the cache at (slot s, kv head h, position p), rounded as
 * kv_store rounds: along its block's row where keys are transposed. */
static inline void key_store(const gl_kv *kv, int64_t s, int64_t h, int64_t p, const float *src,
                             int64_t D) {
    if (!kv_keys_t(kv)) {
        kv_store(kv_at(kv, kv->k, s, h, p, D), src, D, kv->type);
        return;
    }
    char *plane = kt_plane(kv, s, h, p, D);
    const int64_t BS = kv->block, o = p % BS;
    for (int64_t d = 0; d < D; d++) kv_store(plane + kv_bytes(d * BS + o, kv->type), src + d, 1, kv->type);
}

/* n float32 values into the cache at dst, as type t (rounded to nearest even, as torch does). */
static inline void kv_store(void *dst, const float *src, int64_t n, int64_t t) {
    if (t == 0) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    if (t == 3) { /* ggml's block_q8_0: the scale's float16 bits, then the 32 codes */
        char *b = dst;
        int32_t codes[32];
        for (int64_t j = 0; j < n; j += 32, b += 34) {
            const uint16_t dh = q8_0_block(src + j, codes);
            memcpy(b, &dh, 2);
            for (int i = 0; i < 32; i++) b[2 + i] = (char)(int8_t)codes[i];
        }
        return;
    }
    uint16_t *o = dst;
    int64_t i = 0;
    if (t == 1) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++) o[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        for (; i < n; i++) o[i] = bf16_of(src[i]);
    }
}

/* ---------------------------------------------------------------- between the files of the unit */

/* VNNI: u8 x s8 dots of 4 accumulated into int32 in one instruction (AVX-512 VNNI with VL, or
 * AVX-VNNI); without it maddubs + madd (the int16 sums bounded as each kernel says). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GL_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define GL_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define GL_VNNI 0
#endif

/* 512-bit VNNI: a product kernel takes two groups of 8 output rows at once, group g in the low
 * half of every vector and g + 1 in the high one, with the same integer sums and float steps per
 * output as its 256-bit twin (so the same bits) in half the instructions. -DGL_NO_ZMM (the "ymm"
 * variant of build.py) keeps the 256-bit kernels on such a CPU, so that both stay tested. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && GL_VNNI && !defined(GL_NO_ZMM)
#define GL_VNNI512 1
/* Rows of x from which the pairs serve a product (gl_set_pair_rows; build.py's pair_rows() picks
 * it for the CPU). One row (decode, bound by the weights' reads) streams faster through the
 * 256-bit kernels on a Zen 5 (Q4_K 16384 x 4096 on a core pair: 0.41-0.46 ms against 0.53; even at
 * 2 rows, ahead from 4) and slower on an Intel Xeon with AVX-512 (Llama-1B Q4_K_M decode: 26 t/s
 * through the pairs, 21 without). */
static int64_t gl_pair_rows = 2;

/* Whether a task's groups g and g + 1 (of [.., g1), n outputs) go to a pair kernel for M rows. */
static inline int pair_at(int64_t M, int64_t g, int64_t g1, int64_t n) {
    return M >= gl_pair_rows && g + 1 < g1 && (g + 2) * 8 <= n;
}
#define DPBUSD512(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
static inline __m512i cat_si(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline __m512 cat_ps(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#else
#define GL_VNNI512 0
#endif

/* AMX: a prompt's products on the tiles in bfloat16 (amx.c), where the compiler targets a CPU
 * with them; whether Linux grants their state is asked at run time (gl_set_amx_rows). */
/* Prompt attention's products in bfloat16 pairs (VDPBF16PS: two products a lane, float32 sums)
 * where the CPU has them: q, k, the softmax weights and v rounded to bfloat16 (8 bits of
 * mantissa, as int8 activations are about as coarse), each block of keys and values converted
 * once a task (attn_prompt.c), twice the products an instruction of the float32 FMAs. -DGL_NO_BF16_ATTN (and the ymm and avx2 variants)
 * keep float32. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(GL_NO_ZMM) && !defined(GL_NO_BF16_ATTN)
#define ATTN_BF16 1
#else
#define ATTN_BF16 0
#endif
/* ... and their scores from int8 codes (VPDPBUSD: four products a lane, int32 sums) where the CPU
 * has AVX-512 VNNI too (attn_prompt_i8.c): the keys less their mean over the context, each key
 * and each query in int8 with its own scale; the weights and values stay bfloat16. A q8_0
 * cache's int8 scores come from its own codes and q8_0 queries (attn_prompt_q8.c).
 * -DGL_NO_I8_ATTN keeps the bfloat16 scores. */
#if ATTN_BF16 && GL_VNNI512 && !defined(GL_NO_I8_ATTN)
#define ATTN_I8 1
#else
#define ATTN_I8 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && GL_VNNI512
#define GL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* Rows of x from which a product runs on the tiles; 0: never (the default, and where Linux
 * refused the tiles' state). */
static int64_t gl_amx_rows = 0;
#else
#define GL_AMX 0
#endif

/* The fifth bits of 5-bit codes (quant.c's u5, kquant.c's k5): the 32 bytes after a block's 128
 * code bytes, byte L for lane L of its chunks (row L / 4, value L % 4 of a chunk), bit 2 c the
 * fifth bit of chunk c's low-nibble value, bit 2 c + 1 its high-nibble value's. One load a block,
 * then bit s of every byte moved to bit 4, the rest 0: with GFNI one affine transform (the 8 x 8
 * bit matrix whose row for bit 4 is bit s); else (Zen 2 and 3) one 16-bit shift, by at most 4 so
 * nothing crosses into bit 4 from the byte beside, and a mask. A bit plane a chunk cost AVX2 a
 * broadcast, shuffle, and, compare and mask (this: Llama-1B Q5_K_M pp512 1.109x there); the
 * AVX-512 kernels took it in a mask register and a masked move, which the affine transform
 * matches and a shift and mask did not (tg128 0.965x on the 256-bit VNNI groups; a byte test and
 * masked move, 0.970x, no better). */
static inline int fifth_bit(const uint8_t *w, int c, int L, int hi) {
    return ((w[128 + L] >> (2 * c + hi)) & 1) << 4;
}

#define FIFTH_MATRIX(s) ((long long)(1ull << (s)) << 24) /* the matrix's byte 3: output bit 4 */

static inline __attribute__((always_inline)) __m256i fifth_at(__m256i f, int s) {
#if defined(__GFNI__)
    return _mm256_gf2p8affine_epi64_epi8(f, _mm256_set1_epi64x(FIFTH_MATRIX(s)), 0);
#else
    const __m256i m = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(s <= 4 ? _mm256_slli_epi16(f, 4 - s) : _mm256_srli_epi16(f, s - 4), m);
#endif
}

/* Q6_K's fifth and sixth bits of a 32-byte chunk of codes (kquant.c's k6), from its 16 bytes at
 * p: byte i holds, two bits each from bit 0 up, those of low-nibble lanes i and i + 16, then of
 * high-nibble lanes i and i + 16. -> *lo, *hi: each lane's two bits at bits 4-5. With GFNI one
 * affine transform each (per 64-bit lane the 8 x 8 bit matrix taking bits s and s + 1 to 4 and 5,
 * s by the lane's half of the chunk; one row of Q6_K 4096 x 2048 from L3 on a Zen 4 core: 39 GB/s
 * against 30); else shifts, a blend and a mask, without the shuffles and compares a bit plane
 * would cost AVX2. */
#define Q6_MATRIX(s) ((long long)(1ull << (s)) << 24 | (long long)(1ull << ((s) + 1)) << 16)
static inline void q6_high(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
#if defined(__GFNI__) /* bits s and s + 1 of each byte to bits 4 and 5, the rest 0: s by the lane's half */
    *lo = _mm256_gf2p8affine_epi64_epi8(v, _mm256_set_epi64x(Q6_MATRIX(2), Q6_MATRIX(2), Q6_MATRIX(0), Q6_MATRIX(0)), 0);
    *hi = _mm256_gf2p8affine_epi64_epi8(v, _mm256_set_epi64x(Q6_MATRIX(6), Q6_MATRIX(6), Q6_MATRIX(4), Q6_MATRIX(4)), 0);
#else
    const __m256i m = _mm256_set1_epi8(0x30);
    *lo = _mm256_and_si256(_mm256_blend_epi32(_mm256_slli_epi16(v, 4), _mm256_slli_epi16(v, 2), 0xF0), m);
    *hi = _mm256_and_si256(_mm256_blend_epi32(v, _mm256_srli_epi16(v, 2), 0xF0), m);
#endif
}

#if GL_VNNI512
/* Rows of x from which the pair kernels take the fifth (and Q6_K's sixth) bits by shifts and
 * masks rather than GFNI's affine transforms: on a Zen 4 core a 512-bit VGF2P8AFFINEQB takes a
 * slot of the pipes VPDPBUSD runs on, as a multiply does (12 dpbusd with 12 of them: 117 GMAC/s
 * of 234), a shift none and a mask or blend a small share (232, 217), so at 8 rows a block's 8
 * transforms cost an eighth of its 64 dots (Q5_K 640 x 2048, one thread: 1.055x at 16 rows,
 * 1.068x at 512; Q5_0 1.03x at 16). One row (Intel's decode, through the pairs) keeps the
 * transforms, as measured there. */
#define BITS_BY_SHIFT_ROWS 2

/* q6_high of two groups' chunks (pa: the low 256 bits, pb: the high); shift: by shifts and masks
 * even with GFNI (BITS_BY_SHIFT_ROWS). */
static inline __attribute__((always_inline)) void q6_high2(const uint8_t *pa, const uint8_t *pb, int shift,
                                                           __m512i *lo, __m512i *hi) {
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)pa))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)pb)), 1);
#if defined(__GFNI__)
    if (!shift) {
        const long long l0 = Q6_MATRIX(0), l2 = Q6_MATRIX(2), h4 = Q6_MATRIX(4), h6 = Q6_MATRIX(6);
        *lo = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set_epi64(l2, l2, l0, l0, l2, l2, l0, l0), 0);
        *hi = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set_epi64(h6, h6, h4, h4, h6, h6, h4, h4), 0);
        return;
    }
#endif
    const __m512i m = _mm512_set1_epi8(0x30);
    *lo = _mm512_and_si512(_mm512_mask_blend_epi32(0xF0F0, _mm512_slli_epi16(v, 4), _mm512_slli_epi16(v, 2)), m);
    *hi = _mm512_and_si512(_mm512_mask_blend_epi32(0xF0F0, v, _mm512_srli_epi16(v, 2)), m);
}

/* fifth_at of two groups' blocks (the low 256 bits, the high), the same way (shift: as q6_high2's). */
static inline __attribute__((always_inline)) __m512i fifth_at2(__m512i f, int s, int shift) {
#if defined(__GFNI__)
    if (!shift) return _mm512_gf2p8affine_epi64_epi8(f, _mm512_set1_epi64(FIFTH_MATRIX(s)), 0);
#endif
    const __m512i m = _mm512_set1_epi8(0x10);
    return _mm512_and_si512(s <= 4 ? _mm512_slli_epi16(f, 4 - s) : _mm512_srli_epi16(f, s - 4), m);
}

/* The codes of chunk c (32 bytes: 4 of every row's 32 values, low nibbles then high) of two
 * groups' blocks wa, wb: lo and hi, with h5 the fifth bits after the 128 code bytes (u5, k5;
 * shift: as q6_high2's). */
static inline __attribute__((always_inline)) void nibbles2_at(const uint8_t *wa, const uint8_t *wb, int c,
                                                              int h5, int shift, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i raw = cat_si(_mm256_loadu_si256((const __m256i *)(wa + 32 * c)),
                               _mm256_loadu_si256((const __m256i *)(wb + 32 * c)));
    *lo = _mm512_and_si512(raw, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    if (h5) {
        const __m512i f = cat_si(_mm256_loadu_si256((const __m256i *)(wa + 128)),
                                 _mm256_loadu_si256((const __m256i *)(wb + 128)));
        *lo = _mm512_or_si512(*lo, fifth_at2(f, 2 * c, shift));
        *hi = _mm512_or_si512(*hi, fifth_at2(f, 2 * c + 1, shift));
    }
}

static inline __attribute__((always_inline)) void nibbles2(const uint8_t *wa, const uint8_t *wb, int c,
                                                           int h5, __m512i *lo, __m512i *hi) {
    nibbles2_at(wa, wb, c, h5, 0, lo, hi);
}

/* s32[r] = the int32 dots of block b of two 4- (h5: 5-) bit groups wa, wb with row r's block of x
 * (kb blocks a row): 16 outputs' sums, 4 a lane, as the 256-bit kernels sum them. tbl: NULL, the
 * codes themselves, else each 4-bit code's byte in it (16 bytes a lane: mxfp4.c's values); a
 * constant at every call, so the u4 kernels' loop has no lookup. */
static inline __attribute__((always_inline)) void nibble_dots2_lut(const uint8_t *wa, const uint8_t *wb,
                                                                   int h5, const __m512i *tbl,
                                                                   const int8_t *xq, int64_t kb,
                                                                   int64_t b, int R, __m512i *s32) {
    for (int r = 0; r < R; r++) s32[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m512i lo, hi;
        nibbles2_at(wa, wb, c, h5, R >= BITS_BY_SHIFT_ROWS, &lo, &hi);
        if (tbl) {
            lo = _mm512_shuffle_epi8(*tbl, lo);
            hi = _mm512_shuffle_epi8(*tbl, hi);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xb = xq + (r * kb + b) * 32;
            int32_t x0, x1;
            memcpy(&x0, xb + 4 * c, 4);
            memcpy(&x1, xb + 16 + 4 * c, 4);
            s32[r] = DPBUSD512(DPBUSD512(s32[r], lo, _mm512_set1_epi32(x0)), hi, _mm512_set1_epi32(x1));
        }
    }
}

static inline __attribute__((always_inline)) void nibble_dots2(const uint8_t *wa, const uint8_t *wb,
                                                               int h5, const int8_t *xq, int64_t kb,
                                                               int64_t b, int R, __m512i *s32) {
    nibble_dots2_lut(wa, wb, h5, NULL, xq, kb, b, R, s32);
}

/* A pair kernel's R rows of 16 outputs: the low 8 to ya, the high 8 to yb (rows ldy apart). */
static inline void store_pair(const __m512 *acc, int R, float *ya, float *yb, int64_t ldy) {
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(ya + r * ldy, _mm512_castps512_ps256(acc[r]));
        _mm256_storeu_ps(yb + r * ldy, _mm512_extractf32x8_ps(acc[r], 1));
    }
}
#endif

/* The quantized products' tiles (quant.c; lora.c's integer dots of A use them too). */
#define MT 6  /* rows of x per tile: their accumulators live in registers */
#define GT 4 /* groups of 8 output rows per task: their weights stay in L1 across the x tiles */
/* The tasks of a product with n outputs (each 8 GT of them: mm_task's t). */
static inline int64_t mm_tasks(int64_t n) { return ((n + 7) / 8 + GT - 1) / GT; }
#define RC 48 /* rows a chunk of a prompt's k16 pairs, unpacked once for them (kquant.c); a multiple of MT */

/* The group and pair kernels ask for every line of a block's codes AHEAD bytes before they read
 * it (one weight stream; a pair calls it for both): a decode step reads each weight once from
 * memory, and the hardware's prefetchers alone left a core waiting on its loads
 * (docs/design-notes.md, "Prefetch"). At a block size that is not a multiple of 64 a line is
 * asked for twice, from two blocks; asking for each line once (from the block its start lies in:
 * a loop of 2 or 3 trips instead of a fixed count) decoded Llama-1B 2-3% slower. 4 KiB ahead, where
 * 2 KiB was: one thread's decode step 3-5% less CPU time (gpt-oss-20b-4l MXFP4, Qwen3-30B-A3B-6l
 * and Llama-1B Q4_K_M, the two builds alternated step by step in one process); two threads: the
 * same (gpt-oss 1.007x, within the noise). */
#define AHEAD 4096
static inline __attribute__((always_inline)) void prefetch_block(const void *w, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)w + AHEAD + o, _MM_HINT_T0);
}
/* The lines of [p, p + bytes) toward L2: a stream the hardware's prefetchers do not follow (the
 * decode attention's next block, anywhere in the pool) or should not pull into L1 (float.c's
 * next tile). */
static inline __attribute__((always_inline)) void prefetch_l2(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}

/* F(rows) with rows a compile-time constant 1..MT: the group kernels keep R accumulators in
 * registers only when R is known when they are inlined. */
#define WITH_ROWS(R, F)                                                                            \
    switch (R) {                                                                                   \
    case 6: F(6); break;                                                                           \
    case 5: F(5); break;                                                                           \
    case 4: F(4); break;                                                                           \
    case 3: F(3); break;                                                                           \
    case 2: F(2); break;                                                                           \
    default: F(1); break;                                                                          \
    }

/* [start, end) of n iterations for thread tid of nt under schedule(static), as libgomp splits them. */
static inline void static_chunk(int64_t n, int tid, int nt, int64_t *start, int64_t *end) {
    const int64_t q = n / nt, r = n % nt;
    *start = tid * q + (tid < r ? tid : r);
    *end = *start + q + (tid < r);
}

#include "share.h" /* work claimed as it goes */

/* x quantized to int8 per 32 values, as every product reads it (quant.c: quantize_x). */
typedef struct {
    int8_t *xq;
    uint8_t *xu; /* xq + 128, for the s8 and grid-quant products with VNNI (NULL without, or with none) */
    float *xd, *xs, *xs16;
    const float *xf; /* x itself, rows of k floats: what the float weights (kind 4) read */
} xbuf;

static void quantize_x(const float *x, int64_t M, int64_t k, int8_t *xq, uint8_t *xu, float *xd,
                       float *xs, float *xs16, int nth);
static void quantize_blocks(const float *x, int64_t b0, int64_t b1, int8_t *xq, uint8_t *xu, float *xd,
                            float *xs, float *xs16);
static xbuf xbuf_take(gl_scratch *s, int64_t M, int64_t k, int s8);
static void mm_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y);
/* kquant.c: mm_task for the weights of kind 2 and 3 */
static void k4_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y);
static void k6_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y);
/* mxfp4.c: mm_task for the weights of kind 5 */
static void mx4_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                     float *y);
/* iquant.c: mm_task for the weights of kind 6 */
static void iq_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                    float *y);
/* float.c: mm_task for the weights of kind 4 */
static void f_task(const gl_weight *w, const xbuf *xb, int64_t M, int64_t ra, int64_t rb, int64_t t,
                   float *y);
static inline __attribute__((always_inline)) void s8_group(
    const int8_t *q, const void *s, int h, int v, int64_t kb, const int8_t *xq, const uint8_t *xu,
    const float *xd, int R, float *y, int64_t ldy, int64_t nvalid);

/* attn_decode.c: gl_attn_decode in `work`, attn_decode_bytes(H, Hkv, D, Dv, B, nth) of it. */
#define GL_MAX_EXPERTS_USED 16 /* a routed layer's experts a token, at most (fused.py holds to it) */
static void attn_decode_run(const gl_attn *a, const float *q, int64_t q_rs, const float *k,
                            int64_t k_rs, const float *v, int64_t v_rs, const int64_t *slots,
                            const int64_t *pos, int64_t B, float *out, void *work, int nth);
static int64_t attn_decode_bytes(int64_t H, int64_t Hkv, int64_t D, int64_t Dv, int64_t B, int nth);

/* proj.c: y (M, n) = x (M, k) @ W.T plus l's delta, in one parallel region, its buffers from sc
 * (proj_bytes of them past sc->used); proj_alone: the same with buffers of its own. */
static void proj_run(const gl_weight *w, const float *x, int64_t M, int64_t T, const gl_lora_site *l,
                     float *y, gl_scratch *sc, int nth);
static int64_t proj_bytes(const gl_weight *w, const gl_lora_site *l, int64_t M, int64_t T);
static void proj_alone(const gl_weight *w, const float *x, int64_t M, int64_t T,
                       const gl_lora_site *l, float *y, int nth);

/* Scratch: a call's buffers, carved in turn from one block (64-byte aligned each). A counter
 * (cap -1) carves NULLs and adds up what they would take: the size functions carve into one. */
#define SCRATCH_COUNTER ((gl_scratch){NULL, -1, 0, 0})

static inline void *scratch_take(gl_scratch *s, int64_t bytes) {
    char *p = s->cap < 0 ? NULL : s->base + s->used;
    s->used += (bytes + 63) / 64 * 64;
    if (s->cap >= 0 && s->used > s->cap) abort(); /* a size function missed a buffer */
    return p;
}

/* The scratch a call uses, with room for `bytes`: s, unless it is NULL or another call holds it;
 * then own, a block of the call's own (scratch_close frees it). */
static inline gl_scratch *scratch_open(gl_scratch *s, gl_scratch *own, int64_t bytes) {
    gl_scratch *use = s && !__atomic_exchange_n(&s->busy, 1, __ATOMIC_ACQUIRE) ? s : own;
    if (use == own) *own = (gl_scratch){0};
    if (use->cap < bytes) {
        free(use->base);
        use->cap = (bytes + 63) / 64 * 64;
        use->base = aligned_alloc(64, (size_t)use->cap);
        if (!use->base) abort();
    }
    use->used = 0;
    return use;
}

static inline void scratch_close(gl_scratch *use, gl_scratch *own) {
    if (use == own)
        free(own->base);
    else
        __atomic_store_n(&use->busy, 0, __ATOMIC_RELEASE);
}

#endif
