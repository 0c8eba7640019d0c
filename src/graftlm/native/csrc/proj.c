/* One projection: the base product and the delta of its adapters in one parallel region (proj_run,
 * which every product of the library runs), its tasks claimed as the threads go, and the entry
 * points gl_proj and gl_lora (graftlm.c includes it after lora.c and lora_xa.c). */
#include "graftlm.h"

/* Walks ranges of memory one cache line at a time, asking for `upto` lines in all. */
typedef struct {
    const char *const *at;
    const int64_t *len;
    int nr, r;
    int64_t off, done;
} line_walk;

static inline void prefetch_upto(line_walk *w, int64_t upto) {
    for (; w->done < upto && w->r < w->nr; w->done++) {
        _mm_prefetch(w->at[w->r] + w->off, _MM_HINT_T0);
        w->off += 64;
        if (w->off >= w->len[w->r]) w->r++, w->off = 0;
    }
}

#define LORA_CHUNK (1 << 18) /* bytes of outputs the many-row delta takes at a time (a chunk of tasks) */

/* Which delta path proj_run takes: one row (each thread its own columns, no barrier; P bounds
 * its stack arrays), or many rows. */
static inline int proj_one_row(int64_t U, int64_t P, int64_t M) {
    return U > 0 && M == 1 && P <= 1024;
}

/* proj_run's buffers, carved from s: x quantized (for the base product and the integer dots of
 * A), and with an adapter on some row the plan's lists (S rows of n slots, their counts, each
 * slot's offset in av), with many rows their s * A . x (av, M x U) and two[i]: rows i and i + 1
 * pair up (lora_b_two). */
typedef struct {
    xbuf xb;
    uint16_t *xbf; /* x in bfloat16 for the AMX tiles (amx.c), or NULL */
    uint16_t *avb; /* with them and many rows: s * A . x in bfloat16 (lora_av_tiles) */
    void *cols;    /* and av's columns where their parts keep them (lora_col) */
    float *av;
    lora_plan plan;
    char *two;
} proj_bufs;

static proj_bufs proj_take(const gl_weight *w, const gl_lora_site *l, int64_t M, int64_t T,
                           gl_scratch *s) {
    const int64_t S = M / T, n = l != NULL ? l->n : 0, i8 = (int64_t)sizeof(int64_t);
    proj_bufs b = {0};
    /* the plan first: its lists are what the rest is sized by (a counter, with no memory to list
     * into, counts the same widths with lora_width) */
    int64_t U = 0, P = 0;
    if (n > 0) {
        b.plan.js = scratch_take(s, i8 * S * n);
        b.plan.cnt = scratch_take(s, i8 * S);
        b.plan.off = scratch_take(s, i8 * n);
        if (b.plan.js) {
            lora_list(l, S, &b.plan);
            U = b.plan.U, P = b.plan.P;
        } else {
            U = lora_width(l, S, &P);
        }
    }
    const int has = U > 0, many = has && !proj_one_row(U, P, M);
    int aq = 0; /* some slot's A . x takes the integer dots */
    for (int64_t j = 0; has && j < n; j++) aq |= l->slot[j].aq != NULL;
    /* the base product, or some of its outputs, on the VNNI kernels (not a float weight's) */
    int vnni = w->q != NULL && w->kind != 4;
#if GL_AMX
    if (amx_serves(w, M)) {
        b.xbf = scratch_take(s, (M + 31) / 32 * 32 * w->k * 2);
        if (many) {
            b.avb = scratch_take(s, (M + 31) / 32 * 32 * (U + 31) / 32 * 32 * 2);
            b.cols = scratch_take(s, (int64_t)sizeof(lora_col) * U);
        }
        vnni = w->n % 32 != 0; /* the last task's outputs: not a whole tile pair */
    }
#endif
    if (vnni || aq) b.xb = xbuf_take(s, M, w->k, w->kind == 1 || w->kind == 6 || aq);
    if (many) {
        b.av = scratch_take(s, (int64_t)sizeof(float) * M * U);
        b.two = scratch_take(s, M);
    }
    return b;
}

/* The scratch proj_run takes for these rows. */
static int64_t proj_bytes(const gl_weight *w, const gl_lora_site *l, int64_t M, int64_t T) {
    gl_scratch count = SCRATCH_COUNTER;
    proj_take(w, l, M, T, &count);
    return count.used;
}

/* What proj_run's threads share: the product, its buffers, the plan of its adapters' delta, and
 * the tasks' owners (claims; NULL: the static split). rows: x's rows a pass over the tasks. */
typedef struct {
    const gl_weight *w;
    const gl_lora_site *l;
    const float *x;
    float *y;
    const proj_bufs *b;
    const xbuf *xb;
    const lora_plan *pl;
    gl_claim *claims;
    int64_t M, T, rows, step;
    int one, many, base, nth;
} proj_ctx;

/* Rows [ra, rb)'s delta on tasks [tc, te)'s outputs, row by row (many rows: their s * A . x in
 * av): each row reads a run of its parts' blocks in order while those outputs are in cache. */
static void proj_delta(const proj_ctx *c, int64_t ra, int64_t rb, int64_t tc, int64_t te) {
    const lora_plan *pl = c->pl;
    const gl_lora_site *l = c->l;
    const int64_t n = c->w->n, U = pl->U, ns = l->n, T = c->T;
    const float *av = c->b->av;
    float *y = c->y;
    for (int64_t i = ra; i < rb; i++) {
        const int64_t *ji = pl->js + (i / T) * ns, ci = pl->cnt[i / T];
        if (ci == 0) continue;
        const int pair = c->b->two[i] && i + 1 < rb; /* rows on the same adapters */
        for (int64_t u = tc; u < te; u++) {
#if GL_AMX
            if (c->b->xbf && amx_task_whole(c->w, u)) continue; /* base and delta: done */
#endif
            if (pair && u * 32 + 32 <= n) {
                lora_b_two(y + i * n, y + (i + 1) * n, av + i * U, av + (i + 1) * U, ji, ci, l, pl->off, u);
            } else {
                lora_b_block(y + i * n, av + i * U, ji, ci, l, pl->off, u, n);
                if (pair) lora_b_block(y + (i + 1) * n, av + (i + 1) * U, ji, ci, l, pl->off, u, n);
            }
        }
        i += pair;
    }
}

/* The tasks a thread did whose one-row delta is still to add (it comes after them all): ranges
 * in the order taken, a claim that continues the last one merged into it (its own share's, and a
 * run stolen from the back of one owner, are one range each). */
#ifndef PROJ_RANGES /* (a test builds it with 1: every range flushed) */
#define PROJ_RANGES 16
#endif
typedef struct {
    int64_t a[PROJ_RANGES], b[PROJ_RANGES];
    int n;
} task_ranges;

/* One row: the dots (into xa) of the columns the blocks of `done` need (those of the parts that
 * reach any block from the first range's start to the last's end), then the delta of B on those
 * blocks' outputs; done emptied. */
static void proj_one_delta(const proj_ctx *c, task_ranges *done, float *xa) {
    if (done->n == 0) return;
    const lora_plan *pl = c->pl;
    int64_t lo = done->a[0], hi = done->b[0];
    for (int r = 1; r < done->n; r++) {
        lo = done->a[r] < lo ? done->a[r] : lo;
        hi = done->b[r] > hi ? done->b[r] : hi;
    }
    lora_one_row(c->l, pl, c->xb, c->x, c->w->k, lo, hi, 1, xa, NULL, NULL, NULL);
    for (int r = 0; r < done->n; r++)
        for (int64_t t = done->a[r]; t < done->b[r]; t++)
            lora_b_block(c->y, xa, pl->js, pl->cnt[0], c->l, pl->off, t, c->w->n);
    done->n = 0;
}

static void ranges_add(task_ranges *r, int64_t a, int64_t b) {
    if (r->n > 0 && (r->b[r->n - 1] == a || r->a[r->n - 1] == b)) {
        r->a[r->n - 1] = a < r->a[r->n - 1] ? a : r->a[r->n - 1];
        r->b[r->n - 1] = b > r->b[r->n - 1] ? b : r->b[r->n - 1];
    } else {
        r->a[r->n] = a, r->b[r->n++] = b;
    }
}

/* One pass of rows [ra, rb) over the tasks the thread takes: the base product of each, the
 * adapter lines of its own share asked for as it goes (walk, first pass), and with many rows the
 * delta of every few tasks in a row (LORA_CHUNK bytes of outputs); one row's tasks listed in
 * done (its delta added here only when the list is full: claims stolen here and there). */
static void proj_pass(const proj_ctx *c, share_walk *s, int64_t ra, int64_t rb, line_walk *walk,
                      int64_t lines, task_ranges *done, float *xa) {
    const gl_weight *w = c->w;
    const int64_t t0 = s->lo, t1 = s->hi, M = c->M;
    const int64_t chunk = (LORA_CHUNK / (128 * (rb - ra))) > 1 ? LORA_CHUNK / (128 * (rb - ra)) : 1;
    int64_t a, e, tc = 0, te = 0; /* the tasks whose delta is still to add: [tc, te) */
    int got;
    while ((got = share_take(s, &a, &e))) {
        if (c->many && te != a) {
            proj_delta(c, ra, rb, tc, te);
            tc = a;
        }
        for (int64_t t = a; t < e; t++) {
            if (ra == 0 && got == 1) prefetch_upto(walk, lines * (t - t0 + 1) / (t1 - t0));
#if GL_AMX
            const int tiles = c->b->xbf && amx_task_whole(w, t); /* base and delta: done */
#else
            const int tiles = 0;
#endif
            if (c->base && !tiles) mm_task(w, c->xb, M, ra, rb, t, c->y);
            te = t + 1;
            if (c->many && te - tc >= chunk) {
                proj_delta(c, ra, rb, tc, te);
                tc = te;
            }
        }
        if (c->one) {
            if (done->n == PROJ_RANGES) proj_one_delta(c, done, xa);
            ranges_add(done, a, e);
        }
    }
    if (c->many) proj_delta(c, ra, rb, tc, te);
}

/* One thread of proj_run's region (me of nt). */
static void proj_thread(const proj_ctx *c, int me, int nt) {
    const gl_weight *w = c->w;
    const gl_lora_site *l = c->l;
    const lora_plan *pl = c->pl;
    const int64_t n = w->n, k = w->k, tasks = mm_tasks(n), M = c->M, U = pl->U, P = pl->P;
    const int one = c->one;
    share_walk s = share_begin(c->claims, c->nth, tasks, me, nt, c->step);
    const int64_t t0 = s.lo, t1 = s.hi; /* its own share */
    int64_t len[one ? 3 * P + 1 : 1];
    float xa[one ? U : 1];
    const char *at[one ? 3 * P + 1 : 1];
    int nr = 0;
    if (one) lora_one_row(l, pl, c->xb, c->x, k, t0, t1, 0, xa, at, len, &nr);
    line_walk walk = {at, len, nr, 0, 0, 0};
    int64_t lines = 0;
    for (int i = 0; i < walk.nr; i++) lines += (len[i] + 63) / 64;
    if (c->many) { /* the threads split the rows: quantized, then their dots, then all wait */
        const xbuf *xb = c->xb;
        int64_t i0, i1, kb = k / 32;
        static_chunk(M, me, nt, &i0, &i1);
        if (xb->xq) quantize_blocks(c->x, i0 * kb, i1 * kb, xb->xq, xb->xu, xb->xd, xb->xs, xb->xs16);
        lora_xa_rows(l, pl, xb, c->x, i0, i1, c->T, k, c->b->av);
#pragma omp barrier
    }
#if GL_AMX
    if (c->b->xbf) { /* the product first, all of it, in chunks of k (amx_tasks); the delta with it */
        const lora_tiles lt = {(const lora_col *)c->b->cols, U, l ? l->bf : 0};
        const amx_extra ex = {c->b->avb, (U + 31) / 32, lora_b_tiles, &lt};
        if (c->many) {
            int64_t i0, i1;
            static_chunk((M + 31) / 32 * 32, me, nt, &i0, &i1);
            lora_av_tiles(c->b->av, M, U, i0, i1, c->b->avb);
#pragma omp barrier
        }
        if (t1 > t0) {
            amx_begin();
            amx_tasks(w, c->b->xbf, M, t0, t1, c->many ? &ex : NULL, c->y);
            _tile_release();
        }
    }
#endif
    task_ranges done = {{0}, {0}, 0};
    for (int64_t ra = 0; ra < M; ra += c->rows) { /* (claims: one pass) */
        const int64_t rb = M - ra < c->rows ? M : ra + c->rows;
        share_walk p = ra == 0 ? s : share_begin(NULL, c->nth, tasks, me, nt, c->step);
        proj_pass(c, &p, ra, rb, &walk, lines, &done, xa);
    }
    if (one) proj_one_delta(c, &done, xa);
}

/* y (M, n) = x (M, k) @ W.T, plus the delta of l's adapters (T tokens a scale row) where a row
 * has any at a nonzero scale: one parallel region.
 *  1. The threads compute the base outputs (tasks of 32 outputs, one block of B each), each
 *     its static share in order, then (claims, gl_dynamic) what is left of the others' from
 *     their back (share_take). At one token a row each asks for the adapter lines its own share
 *     will read, spread over those tasks: the factors are small scattered reads that miss every
 *     cache after a layer of base weights has streamed through (in one burst, the prefetches
 *     were dropped; ahead of the base product, evicted by it).
 *  2. One row: after its tasks, each thread computes the dots of the columns the blocks it did
 *     need (some twice, across the two threads, but no barrier) and adds B's delta to those
 *     outputs, still in cache. More rows: first the threads split the rows' dots (each active
 *     adapter's A read once for each run of rows on it) and meet at a barrier; then each adds
 *     B's delta to every few tasks' outputs right after computing them (at 512 rows a task's
 *     outputs are 64 KB: added later, they came back from memory).
 * Apart, the base product and the delta took three more barriers and one more fork. Claims only
 * in one pass over the tasks and off the AMX tiles (a decode step's products); passes and tiles
 * keep the static split. */
static void proj_run(const gl_weight *w, const float *x, int64_t M, int64_t T, const gl_lora_site *l,
                     float *y, gl_scratch *sc, int nth) {
    _Static_assert(GT * 8 == 32, "a product task covers one 32-output block of B");
    const int64_t k = w->k, tasks = mm_tasks(w->n);
    const int64_t mark = sc->used;
    const proj_bufs b = proj_take(w, l, M, T, sc);
    const lora_plan pl = b.plan; /* listed by proj_take */
    const int64_t U = pl.U, P = pl.P, ns = pl.js ? l->n : 0;
    const int one = proj_one_row(U, P, M);
    const int many = U > 0 && !one;
    /* Rows a pass over the tasks: every task reads all of x's rows of a pass, so a pass holds
     * about 512 KiB of them (a core's L2 keeps them across the tasks; the weights are read again
     * each pass). Llama-1B's ffn_down (k = 8192) at 512 rows: 4 MiB of x, read from L3 by every
     * 32 outputs, had the Q6_K product at 434 GOP/s; in passes of 96 rows, 590. On the AMX tiles
     * (b.xbf), one pass: a task's weights are dequantized once for all the rows. */
    const int64_t rows = M * k <= (1 << 19) || b.xbf ? M : ((1 << 19) / k + RC - 1) / RC * RC;
    xbuf xb = b.xb;
    xb.xf = x; /* (a float weight reads x as it is) */
    /* x quantized; with many rows and adapters by the threads of the region below, each its own
     * rows, whose dots of A it takes next (one barrier for both, and no region of its own) */
    if (xb.xq && !many) quantize_x(x, M, k, xb.xq, xb.xu, xb.xd, xb.xs, xb.xs16, nth);
#if GL_AMX
    if (b.xbf) amx_x(x, M, k, b.xbf, nth);
    if (b.cols) lora_tile_cols(l, &pl, (lora_col *)b.cols);
#endif
    if (many)
        for (int64_t i = 0; i < M; i++) b.two[i] = i + 1 < M && lora_same_slots(&pl, ns, T, i);
    const int mode = share_mode();
    const int dyn = share_on(nth, mode) && rows >= M && !b.xbf;
    gl_claim claims[dyn ? share_owners(nth, mode) : 1];
    if (dyn) share_init(claims, tasks, nth, mode);
    const proj_ctx c = {w, l, x, y, &b, &xb, &pl, dyn ? claims : NULL, M, T, rows, share_step(w),
                        one, many, w->q != NULL /* no weight: the delta alone (gl_lora) */, nth};
#pragma omp parallel num_threads(nth)
    proj_thread(&c, omp_get_thread_num(), omp_get_num_threads());
    sc->used = mark;
}

/* proj_run for a call from Python: its buffers in one allocation, freed at the end. */
static void proj_alone(const gl_weight *w, const float *x, int64_t M, int64_t T,
                       const gl_lora_site *l, float *y, int nth) {
    gl_scratch own, *sc = scratch_open(NULL, &own, proj_bytes(w, l, M, T));
    proj_run(w, x, M, T, l, y, sc, nth);
    scratch_close(sc, &own);
}

/* y (M, n) = x (M, k) @ W.T plus the LoRA delta of l (scales (M / T, R): T tokens a scale row),
 * in one pass: the PyTorch blocks' projections (prompts, batched rows) as the decode layer
 * runs its own. */
void gl_proj(const gl_weight *w, const gl_lora_site *l, const float *x, int64_t M, int64_t T,
             float *y, int nth) {
    proj_alone(w, x, M, T, l, y, nth);
}

/* y (M, n_out) += the LoRA delta of l alone (see the LoRA delta's section), for a product of n_in
 * inputs that ran elsewhere: proj_run with no base weight. A . x takes the integer dots when l
 * has aq. */
void gl_lora(const gl_lora_site *l, int64_t n_in, int64_t n_out, const float *x, int64_t M,
             int64_t T, float *y, int nth) {
    const gl_weight none = {-1, 0, 32, 0, n_out, n_in, NULL, NULL, NULL};
    proj_alone(&none, x, M, T, l, y, nth);
}

/* Whether the decode products and the routed experts claim their work as they go (1) or keep the
 * static split (0, their twin), or a drill of the tests (2, 3): graftlm.h's gl_dynamic. Returns
 * the value it replaces. */
int64_t gl_set_dynamic(int64_t on) {
    const int64_t old = gl_dynamic;
    __atomic_store_n(&gl_dynamic, on >= 0 && on <= 3 ? (int)on : 1, __ATOMIC_RELAXED);
    return old;
}

int64_t gl_stolen_items(void) { return __atomic_load_n(&gl_stolen, __ATOMIC_RELAXED); }
