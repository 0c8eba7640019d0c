/* Work claimed by a region's threads as they go: the decode products (proj.c) and the routed
 * experts (moe.c). Included by graftlm.h where it stood (static: one unit). */
#ifndef GRAFTLM_SHARE_H
#define GRAFTLM_SHARE_H

/* Work claimed as it goes (the decode products and the routed experts: proj.c, moe.c). Each of
 * nt threads owns its static_chunk of n items and takes them from the front, `step` at a time (its
 * stream of weights as the static split reads it); a thread whose own are all taken takes `step`
 * at a time from the back of the thread with the most left. On a VM that deschedules a vCPU for
 * milliseconds, a fixed half held the whole step at the next barrier until that thread came back
 * and did the rest of its half; now the others take that rest and only its claim in hand waits.
 * Each item goes to exactly one thread, and what an item computes does not depend on which: the
 * results are the static split's, bit for bit. gl_dynamic (gl_set_dynamic; GRAFTLM_DYNAMIC=0 read
 * once at load) 0 keeps the static split, its twin: one claim of a thread's whole share. 2 and 3
 * are drills for the tests, claims of one item: 2 gives all the items to thread 0, which the
 * others steal from; 3 to an owner the team does not have, from which all steal (as a team
 * smaller than asked for leaves its missing threads' shares). */
static int gl_dynamic = 1;
static int64_t gl_stolen __attribute__((aligned(64))); /* (a line of its own) items taken from another's share since load (gl_stolen_items) */

typedef struct { /* one owner's items left: [next, end) as (end << 32) | next, a line of its own */
    uint64_t span;
    int mode, owners; /* the region's gl_dynamic and share_owners, as share_init found them */
    char pad[48];
} __attribute__((aligned(64))) gl_claim;

/* gl_dynamic as a region reads it: once, before it (gl_set_dynamic beside a running region
 * changes the next region's mode, never the sizes of this one's claims). */
static inline int share_mode(void) { return __atomic_load_n(&gl_dynamic, __ATOMIC_RELAXED); }

/* Whether a region asked for nth threads claims its items: not on one thread (nothing to share;
 * the drills excepted). */
static inline int share_on(int nth, int mode) { return mode >= 2 || (mode == 1 && nth > 1); }

/* The owners of a region asked for nth threads: nth, and the drill's absent one. */
static inline int share_owners(int nth, int mode) { return nth + (mode == 3); }

/* Owner i's items [*a, *b) of n, of share_owners(nth, mode). */
static inline void share_owned(int64_t n, int i, int nth, int mode, int64_t *a, int64_t *b) {
    const int owners = share_owners(nth, mode);
    if (mode < 2) {
        static_chunk(n, i, owners, a, b);
        return;
    }
    const int all = mode == 2 ? 0 : owners - 1;
    *a = 0, *b = i == all ? n : 0;
}

/* The owners' shares of n items before a region asked for nth threads (share_owners(nth, mode)
 * claims). A team smaller than nth leaves its missing threads' shares to the others' stealing. */
static inline void share_init(gl_claim *c, int64_t n, int nth, int mode) {
    const int owners = share_owners(nth, mode);
    for (int i = 0; i < owners; i++) {
        int64_t a, b;
        share_owned(n, i, nth, mode, &a, &b);
        c[i].mode = mode, c[i].owners = owners;
        __atomic_store_n(&c[i].span, (uint64_t)b << 32 | (uint64_t)a, __ATOMIC_RELAXED);
    }
}

/* One thread's way through the items (share_begin, then share_take until it returns 0). */
typedef struct {
    gl_claim *c;          /* the owners' (n_own of them), or NULL: the static split */
    int64_t step, lo, hi; /* [lo, hi): its own share, as it starts */
    int n_own, me, own;   /* own: some of its own share may be left */
} share_walk;

/* Thread me of a team of nt, asked for nth, over claims c (NULL: the static split of n). */
static inline share_walk share_begin(gl_claim *c, int nth, int64_t n, int me, int nt, int64_t step) {
    share_walk s = {c, c && c[0].mode >= 2 ? 1 : step < 1 ? 1 : step, 0, 0, c ? c[0].owners : nt, me, 1};
    if (c)
        share_owned(n, me, nth, c[0].mode, &s.lo, &s.hi);
    else
        static_chunk(n, me, nt, &s.lo, &s.hi);
    return s;
}

/* The next items [*a, *b) for the walk: 1 from its own share (in order), 2 stolen, 0 none left. */
static inline int share_take(share_walk *s, int64_t *a, int64_t *b) {
    if (!s->c) { /* the static split: its share in one claim */
        *a = s->lo, *b = s->hi;
        const int any = s->own && s->lo < s->hi;
        s->own = 0;
        return any;
    }
    if (s->own) {
        const uint64_t v = __atomic_fetch_add(&s->c[s->me].span, (uint64_t)s->step, __ATOMIC_RELAXED);
        const int64_t lo = (uint32_t)v, hi = (int64_t)(v >> 32);
        if (lo < hi) {
            *a = lo, *b = lo + s->step < hi ? lo + s->step : hi;
            return 1;
        }
        s->own = 0;
    }
    for (;;) { /* the back of the owner with the most left */
        int v = -1;
        int64_t most = 0;
        for (int i = 0; i < s->n_own; i++) {
            const uint64_t w = __atomic_load_n(&s->c[i].span, __ATOMIC_RELAXED);
            const int64_t left = (int64_t)(w >> 32) - (int64_t)(uint32_t)w;
            if (i != s->me && left > most) most = left, v = i;
        }
        if (v < 0) return 0;
        uint64_t w = __atomic_load_n(&s->c[v].span, __ATOMIC_RELAXED);
        for (int64_t lo = (uint32_t)w, hi = (int64_t)(w >> 32); lo < hi; lo = (uint32_t)w, hi = (int64_t)(w >> 32)) {
            const int64_t take = hi - lo < s->step ? hi - lo : s->step;
            if (__atomic_compare_exchange_n(&s->c[v].span, &w, (uint64_t)(hi - take) << 32 | (uint64_t)lo, 1,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *a = hi - take, *b = hi;
                __atomic_fetch_add(&gl_stolen, take, __ATOMIC_RELAXED);
                return 2;
            }
        }
    }
}

/* Product tasks a claim: ~64 KiB of w's weights (32-128 KiB: a claim's stream is long enough for
 * the prefetchers, short enough that a descheduled thread holds little). A task's 32 rows take
 * about per32 bytes each 32 of their k values, by the weight's kind. */
static inline int64_t share_step(const gl_weight *w) {
    static const int64_t per32[7] = {20, 34, 20, 26, 64, 17, 10};
    const int64_t b = w->kind == 4 && w->half == 2 ? 128 : w->kind >= 0 && w->kind < 7 ? per32[w->kind] : 20;
    const int64_t task = 32 * (w->k / 32 > 0 ? w->k / 32 : 1) * b;
    const int64_t step = (65536 + task / 2) / task;
    return step < 1 ? 1 : step;
}

#endif
