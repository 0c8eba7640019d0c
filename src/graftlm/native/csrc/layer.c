/* A llama-style decoder layer's decode step in one call, and a model's layers in one call. */
#include "graftlm.h"

/* One layer's buffers for B rows: the normed input and the gated activation (h), the QKV or
 * gate/up outputs (big), the attention output (att), each block's output (o), and the
 * attention's work (attn_decode_bytes). A routed FFN's (else NULL; K = n_expert_used): the
 * router's logits (B, n_expert), each row's experts and their weights (B, K), then every chosen
 * (row, expert) pair's row of h gathered in the experts' order (gath, (B K, n_embd)), its row,
 * expert and weight, its gate/up outputs (gu, (B K, 2 n_ff)), gated activations (act,
 * (B K, n_ff)) and outputs (y, (B K, n_embd)), the experts' runs of pairs (jobs) and the quantized inputs of
 * both products (xg, xd). */
/* The routed experts' adapters on one of their products ([gate; up] or down) in a step where
 * some row has one at a nonzero scale (src: the layer's n_expert sites; NULL: no delta): each
 * job's (a run of pairs on one expert, moe_run's) site, its scales the pairs' rows (psc); its
 * plan (lora.c's lora_plan over those pairs: their slots at a nonzero scale, js (pairs, nmax)
 * and cnt from the job's first pair's row on, off (nmax) a job); and its pairs' s * A . x (av:
 * pair r's row at av + r0 umax + (r - r0) U, r0 its job's first pair, U its plan's width).
 * nmax, umax: the most slots, and the most rank summed, an expert's site has; s8: some slot's A
 * takes the integer dots (the product's x quantized as an s8 weight's); scales, ld: the step's
 * scale table (row b's scale of slot id at scales[b * ld + id]) as the sites with adapters see
 * it (a site with none may point nowhere). */
typedef struct {
    const gl_lora_site *src;
    gl_lora_site *sites;
    lora_plan *plans;
    int64_t *js, *cnt, *off;
    float *av;
    const float *scales;
    int64_t nmax, umax, s8, ld;
} expert_lora;

typedef struct {
    float *h, *big, *att, *o;
    void *work;
    float *logits, *weight, *row_w, *gath, *gu, *act, *y;
    int64_t *chosen, *rows, *row_e, *jobs;
    xbuf xg, xd;
    expert_lora xl[2]; /* the experts' adapters on [gate; up], on down */
    float *psc;        /* (R, ld): each pair's row of the step's scale table */
} layer_bufs;

/* Whether any of B rows has slot j of l at a nonzero scale; memo (by slot id, -1 unknown) keeps
 * the answer for the other experts' sites, which name the same ids in the same table. */
static int slot_on(const gl_lora_site *l, int64_t j, int64_t B, int8_t *memo, int64_t nmemo) {
    const int64_t id = l->slot[j].id;
    if (id >= 0 && id < nmemo && memo[id] >= 0) return memo[id];
    int on = 0;
    for (int64_t b = 0; b < B && !on; b++) on = lora_scale(l, b, j) != 0.0f;
    if (id >= 0 && id < nmemo) memo[id] = (int8_t)on;
    return on;
}

/* The buffers of the experts' adapters on one product (sites: n_expert of them, or NULL) for B
 * rows and R pairs: none (src NULL) unless some row has one of them at a nonzero scale. */
static expert_lora expert_lora_take(const gl_lora_site *sites, int64_t E, int64_t B, int64_t R,
                                    gl_scratch *s) {
    expert_lora x = {0};
    int on = 0;
    int8_t memo[64];
    memset(memo, -1, sizeof(memo));
    for (int64_t e = 0; sites && e < E; e++) {
        const gl_lora_site *l = sites + e;
        int64_t u = 0;
        for (int64_t j = 0; j < l->n; j++) {
            u += l->slot[j].r;
            x.s8 |= l->slot[j].aq != NULL;
            if (!on && slot_on(l, j, B, memo, 64)) on = 1, x.scales = l->scales, x.ld = l->ld;
        }
        x.nmax = l->n > x.nmax ? l->n : x.nmax;
        x.umax = u > x.umax ? u : x.umax;
    }
    if (!on) return (expert_lora){0};
    const int64_t i8 = (int64_t)sizeof(int64_t);
    x.src = sites;
    x.sites = scratch_take(s, (int64_t)sizeof(gl_lora_site) * E);
    x.plans = scratch_take(s, (int64_t)sizeof(lora_plan) * E);
    x.js = scratch_take(s, i8 * R * x.nmax);
    x.cnt = scratch_take(s, i8 * R);
    x.off = scratch_take(s, i8 * E * x.nmax);
    x.av = scratch_take(s, (int64_t)sizeof(float) * R * x.umax);
    return x;
}

/* A routed FFN's buffers for B rows (layer_bufs'), into b. */
static void moe_take(const gl_layer *L, int64_t B, gl_scratch *s, layer_bufs *b) {
    const int64_t d = L->n_embd, ff = L->n_ff, f = (int64_t)sizeof(float);
    const int64_t K = L->n_expert_used, R = B * K, i = (int64_t)sizeof(int64_t);
    b->logits = scratch_take(s, f * B * L->n_expert);
    b->weight = scratch_take(s, f * R);
    b->chosen = scratch_take(s, i * R);
    b->rows = scratch_take(s, i * R);
    b->row_e = scratch_take(s, i * R);
    b->row_w = scratch_take(s, f * R);
    b->jobs = scratch_take(s, i * 3 * L->n_expert);
    b->gath = scratch_take(s, f * R * d);
    b->gu = scratch_take(s, f * R * 2 * ff);
    b->act = scratch_take(s, f * R * ff);
    b->y = scratch_take(s, f * R * d);
    b->xl[0] = expert_lora_take(L->l_exp_gate_up, L->n_expert, B, R, s);
    b->xl[1] = expert_lora_take(L->l_exp_down, L->n_expert, B, R, s);
    const int64_t ld = b->xl[0].src ? b->xl[0].ld : b->xl[1].ld;
    if (b->xl[0].src || b->xl[1].src) b->psc = scratch_take(s, f * R * ld);
    /* the experts of one 3-D tensor share its type: expert 0 stands for all (float
     * experts read x itself: no quantized x, unless an adapter's A takes integer dots) */
    const gl_weight *gu = &L->exp_gate_up[0], *dn = &L->exp_down[0];
    const int64_t s8g = b->xl[0].s8, s8d = b->xl[1].s8;
    if (gu->kind != 4 || s8g) b->xg = xbuf_take(s, R, d, gu->kind == 1 || gu->kind == 6 || s8g);
    if (dn->kind != 4 || s8d) b->xd = xbuf_take(s, R, ff, dn->kind == 1 || dn->kind == 6 || s8d);
}

static layer_bufs layer_take(const gl_layer *L, int64_t B, int nth, gl_scratch *s) {
    const int64_t d = L->n_embd, nq = L->n_head * L->head_dim;
    const int64_t nqkv = nq + 2 * L->n_head_kv * L->head_dim, ff = L->n_ff;
    const int64_t f = (int64_t)sizeof(float);
    layer_bufs b = {0};
    b.h = scratch_take(s, f * B * (ff > d ? ff : d));
    b.big = scratch_take(s, f * B * (2 * ff > nqkv ? 2 * ff : nqkv));
    b.att = scratch_take(s, f * B * (nq > d ? nq : d));
    b.o = scratch_take(s, f * B * d);
    b.work = scratch_take(s, attn_decode_bytes(L->n_head, L->n_head_kv, L->head_dim, L->head_dim, B, nth));
    if (L->n_expert) moe_take(L, B, s, &b);
    return b;
}

/* The scratch a decode step of layer L takes for B rows: its buffers, then the largest of its
 * projections' (they run one after another). */
static int64_t layer_bytes(const gl_layer *L, int64_t B, int nth) {
    gl_scratch count = SCRATCH_COUNTER;
    layer_take(L, B, nth, &count);
    int64_t most = 0;
    const gl_weight *w[6] = {&L->o, &L->gate_up, &L->down, &L->qkv[0], &L->qkv[1], &L->qkv[2]};
    const gl_lora_site *l[6] = {&L->l_o, &L->l_gate_up, &L->l_down, &L->l_qkv[0], &L->l_qkv[1],
                                &L->l_qkv[2]};
    for (int p = 0; p < 3 + L->n_qkv; p++) {
        if (L->n_expert && (p == 1 || p == 2)) continue; /* no dense gate_up / down */
        const int64_t bytes = proj_bytes(w[p], l[p], B, 1);
        most = bytes > most ? bytes : most;
    }
    if (L->n_expert) { /* the router's (the experts' products take layer_take's buffers) */
        const int64_t r = proj_bytes(&L->router, &L->l_router, B, 1);
        most = r > most ? r : most;
    }
    return count.used + most;
}

/* x's rows [r0, ...) of a buffer of rows of k values: quantized, or x itself (xf). */
static inline xbuf xbuf_rows(const xbuf *x, int64_t r0, int64_t k) {
    if (!x->xq) { /* a float weight's: x itself */
        const xbuf o = {NULL, NULL, NULL, NULL, NULL, x->xf + r0 * k};
        return o;
    }
    const xbuf o = {x->xq + r0 * k, x->xu ? x->xu + r0 * k : NULL, x->xd + r0 * (k / 32),
                    x->xs + r0 * (k / 32), x->xs16 + r0 * (k / 16), NULL};
    return o;
}

static inline void add_bias(float *y, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) y[i] += bias[i];
}

/* the routed experts: their adapters' delta, the router, the experts' products (moe_run) */
#include "moe.c"

/* x (B, n_embd), the residual stream of B rows each decoding one token, updated in place:
 *   x += [post-norm] (O(attention(RoPE([QK-norm] (QKV(norm(x)) [+ biases])) [, sinks])) [+ bias])
 *   x += [post-norm] down(act(gate) * up)(norm(x))
 * with every projection's LoRA delta, exactly as the PyTorch blocks compose the same kernels.
 * Its buffers come from sc, which holds layer_bytes(L, B, nth) past sc->used. */
static void layer_run(const gl_layer *L, float *x, int64_t B, const int64_t *slots,
                      const int64_t *pos, gl_scratch *sc, int nth) {
    const int64_t d = L->n_embd, D = L->head_dim, H = L->n_head, Hkv = L->n_head_kv;
    const int64_t nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv, ff = L->n_ff;
    const int64_t mark = sc->used;
    const layer_bufs bufs = layer_take(L, B, nth, sc);
    float *h = bufs.h, *big = bufs.big, *att = bufs.att, *o = bufs.o;
    float *qb, *kb, *vb;
    int64_t qs, ks, vs;
    gl_rms_norm(x, B, d, L->attn_norm, L->eps, h, nth);
    if (L->n_qkv == 1) {
        proj_run(&L->qkv[0], h, B, 1, &L->l_qkv[0], big, sc, nth);
        qb = big, kb = big + nq, vb = big + nq + nkv, qs = ks = vs = nqkv;
    } else {
        qb = big, kb = big + B * nq, vb = kb + B * nkv, qs = nq, ks = vs = nkv;
        float *outs[3] = {qb, kb, vb};
        for (int p = 0; p < 3; p++) proj_run(&L->qkv[p], h, B, 1, &L->l_qkv[p], outs[p], sc, nth);
    }
    for (int64_t b = 0; b < B; b++) { /* biases, as the PyTorch block adds them: after the product */
        add_bias(qb + b * qs, L->q_bias, nq);
        add_bias(kb + b * ks, L->k_bias, nkv);
        add_bias(vb + b * vs, L->v_bias, nkv);
    }
    for (int64_t b = 0; b < B; b++) {
        if (L->q_norm) gl_rms_norm(qb + b * qs, H, D, L->q_norm, L->eps, qb + b * qs, nth);
        if (L->k_norm) gl_rms_norm(kb + b * ks, Hkv, D, L->k_norm, L->eps, kb + b * ks, nth);
    }
    const gl_attn a = {L->kv, L->cos_t, L->sin_t, H, Hkv, D, D, L->n_ctx, L->rot, L->neox,
                       L->window, L->scale, L->softcap, L->sinks};
    attn_decode_run(&a, qb, qs, kb, ks, vb, vs, slots, pos, B, att, bufs.work, nth);
    proj_run(&L->o, att, B, 1, &L->l_o, o, sc, nth);
    for (int64_t b = 0; b < B; b++) add_bias(o + b * d, L->o_bias, d);
    if (L->post_attn_norm) gl_rms_norm(o, B, d, L->post_attn_norm, L->eps, o, nth);
    for (int64_t i = 0; i < B * d; i++) x[i] += o[i];
    gl_rms_norm(x, B, d, L->ffn_norm, L->eps, h, nth);
    if (L->n_expert) {
        moe_run(L, h, B, &bufs, o, sc, nth);
    } else {
        proj_run(&L->gate_up, h, B, 1, &L->l_gate_up, big, sc, nth);
        gl_gated(big, B, ff, L->act, h, nth);
        proj_run(&L->down, h, B, 1, &L->l_down, o, sc, nth);
    }
    if (L->post_ffw_norm) gl_rms_norm(o, B, d, L->post_ffw_norm, L->eps, o, nth);
    for (int64_t i = 0; i < B * d; i++) x[i] += o[i];
    sc->used = mark;
}

/* One layer's decode step (layer_run), its buffers from scratch (grown to fit if need be). */
void gl_layer_decode(const gl_layer *L, float *x, int64_t B, const int64_t *slots,
                     const int64_t *pos, gl_scratch *scratch, int nth) {
    gl_scratch own, *sc = scratch_open(scratch, &own, layer_bytes(L, B, nth));
    layer_run(L, x, B, slots, pos, sc, nth);
    scratch_close(sc, &own);
}

/* n layers one after another: a model's whole decode step between the embedding and the final
 * norm in one call, every layer's buffers from the one scratch. */
void gl_layers_decode(const gl_layer *const *layers, int64_t n, float *x, int64_t B,
                      const int64_t *slots, const int64_t *pos, gl_scratch *scratch, int nth) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t need = layer_bytes(layers[i], B, nth);
        bytes = need > bytes ? need : bytes;
    }
    gl_scratch own, *sc = scratch_open(scratch, &own, bytes);
    for (int64_t i = 0; i < n; i++) layer_run(layers[i], x, B, slots, pos, sc, nth);
    scratch_close(sc, &own);
}

/* The scratch a routed FFN of B rows takes apart from its layer (gl_moe_ffn): its buffers, then
 * the router's product's. */
static int64_t moe_bytes(const gl_layer *L, int64_t B) {
    gl_scratch count = SCRATCH_COUNTER;
    layer_bufs b = {0};
    moe_take(L, B, &count, &b);
    return count.used + proj_bytes(&L->router, &L->l_router, B, 1);
}

/* The bytes of scratch gl_moe_ffn takes for B rows of layer L at the adapters bound now (0: no
 * routed FFN): the caller sizes its calls' rows by it (models/fused.py's routed_ffn). */
int64_t gl_moe_bytes(const gl_layer *L, int64_t B) {
    return L->n_expert && B > 0 ? moe_bytes(L, B) : 0;
}

/* Layer L's routed FFN (moe_run) of B rows h (B, n_embd), normed, into o (B, n_embd): a prompt's
 * tokens (or any step the decode layer does not take) as a decode step's rows, each its row of
 * the sites' scale table (the caller fills one a token); its buffers from scratch (grown to fit
 * if need be). The composed twin: models/moe.py's moe_ffn, models/gpt_oss.py's routed_ffn. */
void gl_moe_ffn(const gl_layer *L, const float *h, int64_t B, float *o, gl_scratch *scratch,
                int nth) {
    if (!L->n_expert || B <= 0) return;
    gl_scratch own, *sc = scratch_open(scratch, &own, moe_bytes(L, B));
    layer_bufs bufs = {0};
    moe_take(L, B, sc, &bufs);
    moe_run(L, h, B, &bufs, o, sc, nth);
    scratch_close(sc, &own);
}
