/* A routed FFN's decode step (moe_run): the experts' adapters' delta, the router, the
 * experts' jobs claimed or split among the threads (a part of layer.c, which includes it). */

/* Each job's site and plan of the experts' adapters xl (jobs: nj runs of pairs, each one
 * expert's; psc: the pairs' scale rows): which of its pairs have which of its expert's slots at
 * a nonzero scale, and where their columns go in av. Before the parallel region, in a step. */
static void expert_lora_plan(expert_lora *xl, const int64_t *jobs, int64_t nj, const float *psc) {
    for (int64_t j = 0; j < nj; j++) {
        const int64_t *job = jobs + 3 * j; /* (expert, first pair, pairs) */
        gl_lora_site *l = xl->sites + j;
        *l = xl->src[job[0]];
        l->scales = psc + job[1] * xl->ld, l->ld = xl->ld; /* scale row i: the job's pair i's row */
        lora_plan *p = xl->plans + j;
        p->js = xl->js + job[1] * xl->nmax, p->cnt = xl->cnt + job[1], p->off = xl->off + j * xl->nmax;
        lora_list(l, job[2], p);
    }
}

/* s * A . x of pairs [a0, a1) for every job's slots (x: the product's input, the pairs' rows of
 * k values; xb: them quantized), into xl's av: a thread's share. A job's slot reads its A once
 * for each run of its pairs on that slot (consecutive: the engine orders a batch's rows by
 * adapter, and a job's pairs follow the rows' order). */
static void expert_lora_xa(const expert_lora *xl, const int64_t *jobs, int64_t nj, const xbuf *xb,
                           const float *x, int64_t k, int64_t a0, int64_t a1) {
    for (int64_t j = 0; j < nj; j++) {
        const int64_t *job = jobs + 3 * j, r0 = job[1];
        const int64_t lo = a0 > r0 ? a0 : r0, hi = a1 < r0 + job[2] ? a1 : r0 + job[2];
        if (lo >= hi || xl->plans[j].U == 0) continue;
        const xbuf xj = xbuf_rows(xb, r0, k);
        lora_xa_rows(xl->sites + j, xl->plans + j, &xj, x + r0 * k, lo - r0, hi - r0, 1, k,
                     xl->av + r0 * xl->umax);
    }
}

/* Block jb (32 outputs) of job jj's pairs' outputs (y: the product's, n a pair) plus their
 * adapters' delta (lora.c's lora_b_block; two pairs on the same slots share each block of B). */
static void expert_lora_block(const expert_lora *xl, int64_t jj, const int64_t *job, int64_t jb,
                              int64_t n, float *y) {
    const lora_plan *p = xl->plans + jj;
    const gl_lora_site *l = xl->sites + jj;
    const float *av = xl->av + job[1] * xl->umax;
    float *yj = y + job[1] * n;
    for (int64_t i = 0; i < job[2]; i++) {
        const int64_t c = p->cnt[i], *js = p->js + i * l->n;
        if (c == 0) continue;
        if (i + 1 < job[2] && jb * 32 + 32 <= n && lora_same_slots(p, l->n, 1, i)) {
            lora_b_two(yj + i * n, yj + (i + 1) * n, av + i * p->U, av + (i + 1) * p->U, js, c, l,
                       p->off, jb);
            i++;
        } else {
            lora_b_block(yj + i * n, av + i * p->U, js, c, l, p->off, jb, n);
        }
    }
}

/* The lines of B that block jb of job jj's adapters reads (each active slot's part reaching jb),
 * asked for before the task's base product, which then runs while they arrive: an expert's B is
 * cold (read once a step, and only where the expert is chosen), no hardware prefetcher follows
 * its blocks, and lora_b_block stalled on them (Qwen3-30B-A3B: 63% of its samples on its loads). */
static void expert_lora_prefetch(const expert_lora *xl, int64_t jj, int64_t jb) {
    const lora_plan *p = xl->plans + jj;
    const gl_lora_site *l = xl->sites + jj;
    const int64_t es = l->bf ? 2 : 4;
    __asm__ volatile(""); /* without it GCC finds no effect here (prefetches count as none) and drops the call */
    for (int64_t j = 0; j < l->n; j++) {
        if (p->off[j] < 0) continue;
        const gl_lora_slot *sl = l->slot + j;
        for (int64_t q = 0; q < sl->n_parts; q++) {
            const gl_lora_part *pt = sl->parts + q;
            if (jb < pt->lo || jb >= pt->hi) continue;
            const char *b = part_block(pt, jb, es);
            for (int64_t o = 0; o < pt->r * 32 * es; o += 64) _mm_prefetch(b + o, _MM_HINT_T0);
        }
    }
}

/* Tasks [t0, t1) of the experts' products: the runs' tasks one after another, each run one
 * expert's weight (ws[e]) over its gathered rows (x's rows r0.., into y's), each task's outputs
 * then its pairs' adapters' delta (xl's, where it has a plan: src not NULL). */
static void expert_tasks(const gl_weight *ws, const int64_t *jobs, int64_t tasks, const xbuf *x,
                         const expert_lora *xl, int64_t t0, int64_t t1, float *y) {
    const int64_t n = ws[0].n, k = ws[0].k;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t jj = t / tasks, *job = jobs + 3 * jj; /* (expert, first row, rows) */
        const xbuf xj = xbuf_rows(x, job[1], k);
        const int lora = xl->src && xl->plans[jj].U;
        if (lora) expert_lora_prefetch(xl, jj, t % tasks);
        mm_task(&ws[job[0]], &xj, job[2], 0, job[2], t % tasks, y + job[1] * n);
        if (lora) expert_lora_block(xl, jj, job, t % tasks, n, y);
    }
}

/* Each row's experts and their weights from the router's logits (B, E, in place): softmax (gating
 * 0), the K largest by selection (E is small; the lower index first among equals), w = p / their
 * sum; gating 1 selects on the logits, w = softmax(l at them). Then the chosen experts in
 * ascending order, each its run of pairs (jobs), every pair's row of h gathered: the jobs' count. */
static int64_t moe_route(const gl_layer *L, const float *h, int64_t B, const layer_bufs *bufs) {
    const int64_t d = L->n_embd, E = L->n_expert, K = L->n_expert_used;
    for (int64_t b = 0; b < B; b++) {
        float *p = bufs->logits + b * E, top = p[0], sum = 0.0f, total = 0.0f;
        int64_t *chosen = bufs->chosen + b * K;
        float *w = bufs->weight + b * K;
        for (int64_t e = 1; e < E; e++) top = p[e] > top ? p[e] : top;
        if (L->gating == 0) {
            for (int64_t e = 0; e < E; e++) sum += p[e] = expf(p[e] - top);
            for (int64_t e = 0; e < E; e++) p[e] /= sum;
        }
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            chosen[j] = best;
            w[j] = L->gating == 0 ? p[best] : expf(p[best] - top);
            total += w[j];
        }
        for (int64_t j = 0; j < K; j++) w[j] /= total;
    }
    int64_t nj = 0, R = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = R;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < K; j++)
                if (bufs->chosen[b * K + j] == e) {
                    bufs->rows[R] = b;
                    bufs->row_e[R] = e;
                    bufs->row_w[R] = bufs->weight[b * K + j];
                    memcpy(bufs->gath + R * d, h + b * d, sizeof(float) * (size_t)d);
                    R++;
                }
        if (R == r0) continue;
        int64_t *job = bufs->jobs + 3 * nj++;
        job[0] = e, job[1] = r0, job[2] = R - r0;
    }
    return nj;
}

/* Whether a routed FFN's threads each take whole jobs (gl_set_moe_jobs; 1 by default): nt of
 * them split the nj jobs evenly, each job as many pairs. */
static int gl_moe_jobs = 1;

int64_t gl_set_moe_jobs(int64_t on) {
    const int64_t old = gl_moe_jobs;
    gl_moe_jobs = on != 0;
    return old;
}

static int moe_by_jobs(const int64_t *jobs, int64_t nj, int nt) {
    if (!gl_moe_jobs || nj % nt) return 0;
    for (int64_t j = 1; j < nj; j++)
        if (jobs[3 * j + 2] != jobs[2]) return 0;
    return 1;
}

/* What moe_run's threads share: the layer, its buffers, the quantized inputs of both products,
 * the experts' adapters on each, the jobs and pairs (nj, R). */
typedef struct {
    const gl_layer *L;
    const layer_bufs *bufs;
    xbuf xg, xd;
    expert_lora xl[2];
    int64_t nj, R;
    gl_claim *claims[3]; /* the owners of the jobs, of the [gate; up] tasks, of the down tasks
                          * (graftlm.h's share_take), or NULL: the static split */
    int nth;
} moe_ctx;

/* Pairs [a0, a1)'s gathered rows quantized (and their dots of the adapters' A on [gate; up]). */
static void moe_inputs(const moe_ctx *c, int64_t a0, int64_t a1) {
    const int64_t d = c->L->n_embd;
    const xbuf *xg = &c->xg;
    if (xg->xq) quantize_blocks(c->bufs->gath, a0 * (d / 32), a1 * (d / 32), xg->xq, xg->xu, xg->xd, xg->xs, xg->xs16);
    if (c->xl[0].src) expert_lora_xa(&c->xl[0], c->bufs->jobs, c->nj, xg, c->bufs->gath, d, a0, a1);
}

/* Pairs [a0, a1)'s gate/up outputs biased and gated, the activations quantized (and their dots
 * of the adapters' A on down). */
static void moe_gate(const moe_ctx *c, int64_t a0, int64_t a1) {
    const gl_layer *L = c->L;
    const layer_bufs *bufs = c->bufs;
    const int64_t ff = L->n_ff;
    const xbuf *xd = &c->xd;
    if (L->exp_gate_up_bias)
        for (int64_t r = a0; r < a1; r++)
            add_bias(bufs->gu + r * 2 * ff, L->exp_gate_up_bias + bufs->row_e[r] * 2 * ff, 2 * ff);
    gated_rows(bufs->gu, a0, a1, ff, L->act, bufs->act);
    if (xd->xq) quantize_blocks(bufs->act, a0 * (ff / 32), a1 * (ff / 32), xd->xq, xd->xu, xd->xd, xd->xs, xd->xs16);
    if (c->xl[1].src) expert_lora_xa(&c->xl[1], bufs->jobs, c->nj, xd, bufs->act, ff, a0, a1);
}

/* o's columns [i0, i1): each row's experts' outputs added in ascending order. */
static void moe_mix(const moe_ctx *c, int64_t B, int64_t i0, int64_t i1, float *o) {
    const gl_layer *L = c->L;
    const layer_bufs *bufs = c->bufs;
    const int64_t d = L->n_embd;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = i0; i < i1; i++) o[b * d + i] = 0.0f;
    for (int64_t r = 0; r < c->R; r++) {
        float *ob = o + bufs->rows[r] * d;
        const float *yr = bufs->y + r * d, we = bufs->row_w[r];
        if (L->exp_down_bias) {
            const float *bd = L->exp_down_bias + bufs->row_e[r] * d;
            for (int64_t i = i0; i < i1; i++) ob[i] += (yr[i] + bd[i]) * we;
        } else {
            for (int64_t i = i0; i < i1; i++) ob[i] += yr[i] * we;
        }
    }
}

/* Jobs [j0, j1) whole: their pairs [a0, a1) from their inputs to their outputs. */
static void moe_jobs(const moe_ctx *c, int64_t j0, int64_t j1) {
    const gl_layer *L = c->L;
    const layer_bufs *bufs = c->bufs;
    const int64_t tgu = mm_tasks(2 * L->n_ff), tdn = mm_tasks(L->n_embd), *jobs = bufs->jobs;
    const int64_t a0 = jobs[3 * j0 + 1], a1 = jobs[3 * (j1 - 1) + 1] + jobs[3 * (j1 - 1) + 2];
    moe_inputs(c, a0, a1);
    expert_tasks(L->exp_gate_up, jobs, tgu, &c->xg, &c->xl[0], j0 * tgu, j1 * tgu, bufs->gu);
    moe_gate(c, a0, a1);
    expert_tasks(L->exp_down, jobs, tdn, &c->xd, &c->xl[1], j0 * tdn, j1 * tdn, bufs->y);
}

/* One product's tasks (tasks of each of the nj runs) as the thread claims them (claims: the
 * product's owners; NULL: its static share). */
static void moe_product(const moe_ctx *c, gl_claim *claims, const gl_weight *ws, int64_t tasks,
                        const xbuf *x, const expert_lora *xl, float *y, int me, int nt) {
    share_walk s = share_begin(claims, c->nth, c->nj * tasks, me, nt, share_step(&ws[0]));
    int64_t t0, t1;
    while (share_take(&s, &t0, &t1)) expert_tasks(ws, c->bufs->jobs, tasks, x, xl, t0, t1, y);
}

/* One thread's share of the experts' work (me of nt): by whole jobs (by_jobs: all of a job's
 * pairs through both products, no barrier until the mix; claimed a job at a time, or its static
 * share in one), else each step split over the threads with a barrier after it (pairs, then the
 * tasks of the runs one after another, claimed as they go). A job is about 3 MiB of Qwen3-30B-A3B's
 * weights: finer claims would need a job's products to wait for each other, which whole jobs do not. */
static void moe_share(const moe_ctx *c, int by_jobs, int me, int nt) {
    const gl_layer *L = c->L;
    const layer_bufs *bufs = c->bufs;
    const int64_t tgu = mm_tasks(2 * L->n_ff), tdn = mm_tasks(L->n_embd);
    int64_t a0, a1;
    if (by_jobs) {
        share_walk s = share_begin(c->claims[0], c->nth, c->nj, me, nt, 1);
        while (share_take(&s, &a0, &a1)) moe_jobs(c, a0, a1);
        return;
    }
    static_chunk(c->R, me, nt, &a0, &a1);
    moe_inputs(c, a0, a1);
#pragma omp barrier
    moe_product(c, c->claims[1], L->exp_gate_up, tgu, &c->xg, &c->xl[0], bufs->gu, me, nt);
#pragma omp barrier
    moe_gate(c, a0, a1);
#pragma omp barrier
    moe_product(c, c->claims[2], L->exp_down, tdn, &c->xd, &c->xl[1], bufs->y, me, nt);
}

/* The routed FFN of B rows, h (B, n_embd) normed, into o (B, n_embd), as graftlm/models/moe.py's
 * moe_ffn: p = softmax(router(h)); each row's n_expert_used largest (the lower index first among
 * equals), w = p / their sum; o = the sum of w_e * down_e(act(gate_e) * up_e)(h) over them, the
 * experts in ascending order. gpt-oss's (models/gpt_oss.py's routed_ffn; gating 1, biases):
 * l = router(h) + bias, its n_expert_used largest, w = softmax(l at them); o = the sum of
 * w_e * (down_e(act(gate_e + bg_e, up_e + bu_e)) + bd_e). Each chosen expert runs once, over the
 * rows that chose it, so a batch reads an expert's weights once, whatever number of rows chose
 * it; and all the experts' products run in one parallel region, their tasks one list split over
 * the threads (an expert's products alone are too small to share: a region each, Qwen3-30B-A3B's
 * 8 experts of a token made 24 regions a layer, each starting its stream of weights cold). Where
 * the jobs split evenly over the threads (one row: 8 experts of one pair each over 2 threads),
 * each thread takes whole jobs from its pairs' inputs to their outputs, and only the mix waits
 * for all (moe_share). Each of gate_e / up_e (one [gate; up] product) and down_e adds its
 * adapters' delta, each pair at its row's scales, as the composed block's experts do (moe.py:
 * the same packed factors): the delta of a task's outputs right after them, each job's
 * (expert's) A and B read once for each run of its pairs on one adapter. */
static void moe_run(const gl_layer *L, const float *h, int64_t B, const layer_bufs *bufs,
                    float *o, gl_scratch *sc, int nth) {
    proj_run(&L->router, h, B, 1, &L->l_router, bufs->logits, sc, nth); /* with its adapters' delta */
    for (int64_t b = 0; b < B; b++) add_bias(bufs->logits + b * L->n_expert, L->router_bias, L->n_expert);
    moe_ctx c = {L, bufs, bufs->xg, bufs->xd, {bufs->xl[0], bufs->xl[1]}, 0, B * L->n_expert_used, {NULL}, nth};
    c.nj = moe_route(L, h, B, bufs);
    /* the experts' adapters: each pair's scale row, each job's plan (what a pair's row has at a
     * nonzero scale on its expert) */
    if (bufs->psc) {
        const expert_lora *on = c.xl[0].src ? &c.xl[0] : &c.xl[1];
        const int64_t ld = on->ld;
        for (int64_t r = 0; r < c.R; r++)
            memcpy(bufs->psc + r * ld, on->scales + bufs->rows[r] * ld, sizeof(float) * (size_t)ld);
        for (int p = 0; p < 2; p++)
            if (c.xl[p].src) expert_lora_plan(&c.xl[p], bufs->jobs, c.nj, bufs->psc);
    }
    c.xg.xf = bufs->gath, c.xd.xf = bufs->act; /* (what float experts read) */
    const int mode = share_mode();
    const int owners = share_owners(nth, mode), on = share_on(nth, mode);
    gl_claim claims[on ? 3 * owners : 1];
    const int64_t items[3] = {c.nj, c.nj * mm_tasks(2 * L->n_ff), c.nj * mm_tasks(L->n_embd)};
    for (int p = 0; p < 3 && on; p++) {
        c.claims[p] = claims + p * owners;
        share_init(c.claims[p], items[p], nth, mode);
    }
#pragma omp parallel num_threads(nth)
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t i0, i1;
        moe_share(&c, moe_by_jobs(bufs->jobs, c.nj, nt), me, nt);
#pragma omp barrier
        static_chunk(L->n_embd, me, nt, &i0, &i1);
        moe_mix(&c, B, i0, i1, o);
    }
}
