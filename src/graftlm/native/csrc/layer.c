/* A llama-style decoder layer's decode step in one call, and a model's layers in one call. */
#include "graftlm.h"

/* x (B, n_embd), the residual stream of B rows each decoding one token, updated in place:
 *   x += [post-norm] O(attention(RoPE([QK-norm] QKV(norm(x)))))
 *   x += [post-norm] down(act(gate) * up)(norm(x))
 * with every projection's LoRA delta, exactly as the PyTorch blocks compose the same kernels. */
void gl_layer_decode(const gl_layer *L, float *x, int64_t B, const int64_t *slots,
                     const int64_t *pos, int nth) {
    const int64_t d = L->n_embd, D = L->head_dim, H = L->n_head, Hkv = L->n_head_kv;
    const int64_t nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv, ff = L->n_ff;
    float *h = malloc(sizeof(float) * (size_t)(B * (ff > d ? ff : d)));
    float *big = malloc(sizeof(float) * (size_t)(B * (2 * ff > nqkv ? 2 * ff : nqkv)));
    float *att = malloc(sizeof(float) * (size_t)(B * (nq > d ? nq : d)));
    float *o = malloc(sizeof(float) * (size_t)(B * d));
    float *qb, *kb, *vb;
    int64_t qs, ks, vs;
    gl_rms_norm(x, B, d, L->attn_norm, L->eps, h, nth);
    if (L->n_qkv == 1) {
        proj_run(&L->qkv[0], h, B, 1, &L->l_qkv[0], big, nth);
        qb = big, kb = big + nq, vb = big + nq + nkv, qs = ks = vs = nqkv;
    } else {
        qb = big, kb = big + B * nq, vb = kb + B * nkv, qs = nq, ks = vs = nkv;
        float *outs[3] = {qb, kb, vb};
        for (int p = 0; p < 3; p++) proj_run(&L->qkv[p], h, B, 1, &L->l_qkv[p], outs[p], nth);
    }
    for (int64_t b = 0; b < B; b++) {
        if (L->q_norm) gl_rms_norm(qb + b * qs, H, D, L->q_norm, L->eps, qb + b * qs, nth);
        if (L->k_norm) gl_rms_norm(kb + b * ks, Hkv, D, L->k_norm, L->eps, kb + b * ks, nth);
    }
    const gl_attn a = {L->kc, L->vc, L->cos_t, L->sin_t, H, Hkv, D, D, L->n_ctx, L->rot, L->neox,
                       L->window, L->scale, 0.0f};
    gl_attn_decode(&a, qb, qs, kb, ks, vb, vs, slots, pos, B, att, nth);
    proj_run(&L->o, att, B, 1, &L->l_o, o, nth);
    if (L->post_attn_norm) gl_rms_norm(o, B, d, L->post_attn_norm, L->eps, o, nth);
    for (int64_t i = 0; i < B * d; i++) x[i] += o[i];
    gl_rms_norm(x, B, d, L->ffn_norm, L->eps, h, nth);
    proj_run(&L->gate_up, h, B, 1, &L->l_gate_up, big, nth);
    gl_gated(big, B, ff, L->act, h, nth);
    proj_run(&L->down, h, B, 1, &L->l_down, o, nth);
    if (L->post_ffw_norm) gl_rms_norm(o, B, d, L->post_ffw_norm, L->eps, o, nth);
    for (int64_t i = 0; i < B * d; i++) x[i] += o[i];
    free(h);
    free(big);
    free(att);
    free(o);
}

/* n layers one after another: a model's whole decode step between the embedding and the final
 * norm in one call. */
void gl_layers_decode(const gl_layer *const *layers, int64_t n, float *x, int64_t B,
                      const int64_t *slots, const int64_t *pos, int nth) {
    for (int64_t i = 0; i < n; i++) gl_layer_decode(layers[i], x, B, slots, pos, nth);
}
