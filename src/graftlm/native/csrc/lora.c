/* The LoRA delta, and one projection: the base product and the delta of its adapters in one
 * parallel region (proj_run), which every product of the library runs. */
#include "graftlm.h"

/* ---------------------------------------------------------------- LoRA delta */

/* The LoRA delta of one projection for M rows of x (rows r*T .. r*T+T-1 share scale row r):
 *   y[i] += sum_j s[i / T, j] * B_j (A_j x[i])
 * over the adapters j attached to the projection (l->slot), each packed once, when it was read
 * (graftlm/lora/packed.py), never in a step:
 *  - A (r, n_in) as float32 or bfloat16 (l->bf), or as an s8 weight (Q8_0 codes and scales, as
 *    gl_pack_s8 lays them): then A . x is the base products' integer dots on their int8 x;
 *  - B in parts, each the columns of the rank whose B reaches the same 32-output blocks [lo, hi)
 *    (one target of a stacked projection: an adapter on q, k and v has three), stored block by
 *    block with each block's columns in turn: one task of 32 outputs reads one contiguous range
 *    of each part (a part of 16 columns in bfloat16: 16 lines), and consecutive tasks the
 *    ranges after it. In bfloat16 each 16
 *    outputs o .. o + 15 are the pairs (o + u, o + 8 + u), u = 0 .. 7 (a load widens with a shift
 *    and a mask). Columns that are zero in B are in no part.
 * s comes from the batch's scale table as it is (row i's scale of slot j: scales[i * ld + id]):
 * an adapter at scale 0 on a row costs that row nothing, and one at 0 on every row costs nothing.
 * A call first lists each scale row's adapters (lora_plan), then computes s * A . x of the rows
 * of each adapter, each adapter's A read once for all its rows (av, the active adapters' columns
 * side by side), then adds each row's parts of B to the outputs of every few tasks (proj_run). */

/* Row i's scale of slot j. */
static inline float lora_scale(const gl_lora_site *l, int64_t i, int64_t j) {
    const int64_t id = l->slot[j].id;
    return id < l->ld ? l->scales[i * l->ld + id] : 0.0f;
}

/* What a call's rows need: for each of the S scale rows the slots at a nonzero scale (js: S rows
 * of n, cnt: how many), where each active slot's columns start in av (off; -1: no row's), and
 * av's width U (the active slots' ranks summed) and their parts (P). */
typedef struct {
    int64_t *js, *cnt, *off;
    int64_t U, P;
} lora_plan;

/* U and P of a call (0: no row has an adapter) without listing anything: what lora_list makes
 * them, for a counter of the call's buffers (proj_bytes). */
static int64_t lora_width(const gl_lora_site *l, int64_t S, int64_t *parts) {
    int64_t U = 0, P = 0;
    for (int64_t j = 0; l != NULL && j < l->n; j++)
        for (int64_t i = 0; i < S; i++)
            if (lora_scale(l, i, j) != 0.0f) {
                U += l->slot[j].r, P += l->slot[j].n_parts;
                break;
            }
    if (parts) *parts = P;
    return U;
}

static void lora_list(const gl_lora_site *l, int64_t S, lora_plan *p) {
    const int64_t n = l->n;
    p->U = p->P = 0;
    for (int64_t j = 0; j < n; j++) p->off[j] = -1;
    for (int64_t i = 0; i < S; i++) {
        int64_t k = 0;
        for (int64_t j = 0; j < n; j++)
            if (lora_scale(l, i, j) != 0.0f) {
                p->js[i * n + k++] = j;
                if (p->off[j] < 0) p->off[j] = p->U, p->U += l->slot[j].r, p->P += l->slot[j].n_parts;
            }
        p->cnt[i] = k;
    }
}

/* s * (A[c] . x) for one column of a float32 or bfloat16 A. */
static inline float lora_dot(const float *x, int64_t n_in, const void *A, int bf, float sc, int64_t c) {
    return sc * (bf ? dot_kv(x, (const uint16_t *)A + c * n_in, n_in, 2) : dot_f32((const float *)A + c * n_in, x, n_in));
}

/* w[0..3] = 32 outputs of one column of a part at b, as float32 (bf16: the pairs above, 16
 * outputs a load widened with a shift and a mask). */
static inline __attribute__((always_inline)) void b_widen(const char *b, int bf, __m256 w[4]) {
    if (bf) {
        const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)b), v1 = _mm256_loadu_si256((const __m256i *)(b + 32));
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(v0, hi16));
        w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        w[3] = _mm256_castsi256_ps(_mm256_and_si256(v1, hi16));
    } else {
        for (int u = 0; u < 4; u++) w[u] = _mm256_loadu_ps((const float *)b + 8 * u);
    }
}

/* Part p's columns at block jb (p reaches it), one after another: 32 values each. */
static inline const char *part_block(const gl_lora_part *p, int64_t jb, int64_t es) {
    return (const char *)p->b + (jb - p->lo) * p->r * 32 * es;
}

/* y[jb * 32 ..][:32] += the delta of block jb of the row's listed slots (js, cnt), xa the row's
 * s * A . x (a row of av, each slot's columns from off[j]), 32 outputs held in registers. */
static void lora_b_block(float *yi, const float *xa, const int64_t *js, int64_t cnt, const gl_lora_site *l,
                         const int64_t *off, int64_t jb, int64_t n_out) {
    const int64_t j = jb * 32, es = l->bf ? 2 : 4;
    float tail[32];
    float *yo = j + 32 <= n_out ? yi + j : tail;
    if (yo == tail) {
        memset(tail, 0, sizeof(tail));
        memcpy(tail, yi + j, sizeof(float) * (size_t)(n_out - j));
    }
    __m256 y0 = _mm256_loadu_ps(yo), y1 = _mm256_loadu_ps(yo + 8);
    __m256 y2 = _mm256_loadu_ps(yo + 16), y3 = _mm256_loadu_ps(yo + 24);
    for (int64_t t = 0; t < cnt; t++) {
        const gl_lora_slot *sl = l->slot + js[t];
        const float *xs = xa + off[js[t]];
        for (int64_t q = 0; q < sl->n_parts; q++) {
            const gl_lora_part *p = sl->parts + q;
            if (jb < p->lo || jb >= p->hi) continue;
            const char *b = part_block(p, jb, es);
            for (int64_t c = 0; c < p->r; c++) {
                const __m256 av8 = _mm256_set1_ps(xs[p->c0 + c]);
                __m256 w[4];
                b_widen(b + c * 32 * es, (int)l->bf, w);
                y0 = _mm256_fmadd_ps(av8, w[0], y0);
                y1 = _mm256_fmadd_ps(av8, w[1], y1);
                y2 = _mm256_fmadd_ps(av8, w[2], y2);
                y3 = _mm256_fmadd_ps(av8, w[3], y3);
            }
        }
    }
    _mm256_storeu_ps(yo, y0);
    _mm256_storeu_ps(yo + 8, y1);
    _mm256_storeu_ps(yo + 16, y2);
    _mm256_storeu_ps(yo + 24, y3);
    if (yo == tail) memcpy(yi + j, tail, sizeof(float) * (size_t)(n_out - j));
}

/* Two rows whose scale rows list the same slots (ya, yb: their outputs; xa, xb: their rows of
 * av): the delta of block jb to both, each block of B widened once for the two. A whole block. */
static void lora_b_two(float *ya, float *yb, const float *xa, const float *xb, const int64_t *js, int64_t cnt,
                       const gl_lora_site *l, const int64_t *off, int64_t jb) {
    const int64_t j = jb * 32, es = l->bf ? 2 : 4;
    ya += j, yb += j;
    __m256 a0 = _mm256_loadu_ps(ya), a1 = _mm256_loadu_ps(ya + 8), a2 = _mm256_loadu_ps(ya + 16), a3 = _mm256_loadu_ps(ya + 24);
    __m256 c0 = _mm256_loadu_ps(yb), c1 = _mm256_loadu_ps(yb + 8), c2 = _mm256_loadu_ps(yb + 16), c3 = _mm256_loadu_ps(yb + 24);
    for (int64_t t = 0; t < cnt; t++) {
        const gl_lora_slot *sl = l->slot + js[t];
        const float *sa = xa + off[js[t]], *sb = xb + off[js[t]];
        for (int64_t q = 0; q < sl->n_parts; q++) {
            const gl_lora_part *p = sl->parts + q;
            if (jb < p->lo || jb >= p->hi) continue;
            const char *b = part_block(p, jb, es);
            for (int64_t c = 0; c < p->r; c++) {
                __m256 w[4];
                b_widen(b + c * 32 * es, (int)l->bf, w);
                const __m256 ka = _mm256_set1_ps(sa[p->c0 + c]), kb = _mm256_set1_ps(sb[p->c0 + c]);
                a0 = _mm256_fmadd_ps(ka, w[0], a0), c0 = _mm256_fmadd_ps(kb, w[0], c0);
                a1 = _mm256_fmadd_ps(ka, w[1], a1), c1 = _mm256_fmadd_ps(kb, w[1], c1);
                a2 = _mm256_fmadd_ps(ka, w[2], a2), c2 = _mm256_fmadd_ps(kb, w[2], c2);
                a3 = _mm256_fmadd_ps(ka, w[3], a3), c3 = _mm256_fmadd_ps(kb, w[3], c3);
            }
        }
    }
    _mm256_storeu_ps(ya, a0), _mm256_storeu_ps(ya + 8, a1), _mm256_storeu_ps(ya + 16, a2), _mm256_storeu_ps(ya + 24, a3);
    _mm256_storeu_ps(yb, c0), _mm256_storeu_ps(yb + 8, c1), _mm256_storeu_ps(yb + 16, c2), _mm256_storeu_ps(yb + 24, c3);
}

#if GL_AMX
/* The LoRA delta on AMX tiles (amx.c), for a product that runs there: s * A . x of each row (av)
 * in bfloat16 as values past k, against B as their weights, summed with the base product's.
 * cols: av's U columns, each where its part keeps it (b: its values at block lo, stride bytes
 * from one block to the next; NULL: zero in B). */
typedef struct {
    const char *b;
    int64_t lo, hi, stride;
} lora_col;

typedef struct {
    const lora_col *cols;
    int64_t U, bf;
} lora_tiles;

/* av's columns as lora_col, in av's order. */
static void lora_tile_cols(const gl_lora_site *l, const lora_plan *p, lora_col *cols) {
    const int64_t es = l->bf ? 2 : 4;
    for (int64_t j = 0; j < l->n; j++) {
        if (p->off[j] < 0) continue;
        const gl_lora_slot *sl = l->slot + j;
        for (int64_t c = 0; c < sl->r; c++) cols[p->off[j] + c] = (lora_col){NULL, 0, 0, 0};
        for (int64_t q = 0; q < sl->n_parts; q++) {
            const gl_lora_part *pt = sl->parts + q;
            for (int64_t c = 0; c < pt->r; c++)
                cols[p->off[j] + pt->c0 + c] = (lora_col){(const char *)pt->b + c * 32 * es, pt->lo, pt->hi, pt->r * 32 * es};
        }
    }
}

/* Task t's tiles of B: its 32 outputs of each column, two columns a tile row, in blocks of 32
 * columns (zero past U and outside a column's blocks). */
static void lora_b_tiles(const void *ctx, int64_t t, uint16_t *out) {
    const lora_tiles *lt = (const lora_tiles *)ctx;
    const int64_t U = lt->U, blocks = (U + 31) / 32;
    for (int64_t c = 0; c < blocks * 32; c += 2) {
        __m256 w0[4], w1[4];
        for (int u = 0; u < 4; u++) w0[u] = w1[u] = _mm256_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const lora_col *k = c + h < U ? lt->cols + c + h : NULL;
            if (k && k->b && t >= k->lo && t < k->hi) b_widen(k->b + (t - k->lo) * k->stride, (int)lt->bf, h ? w1 : w0);
        }
        for (int h = 0; h < 2; h++) {
            uint16_t *row = out + (h * blocks + c / 32) * 512 + (c % 32) / 2 * 32;
            _mm512_store_si512(row, amx_pair_row(cat_ps(w0[2 * h], w0[2 * h + 1]), cat_ps(w1[2 * h], w1[2 * h + 1])));
        }
    }
}

/* Rows [i0, i1) of av (M, R) -> avb (rows padded to 32, R padded to 32) in bfloat16, zeros past
 * M and R. */
static void lora_av_tiles(const float *av, int64_t M, int64_t R, int64_t i0, int64_t i1, uint16_t *avb) {
    const int64_t ld = (R + 31) / 32 * 32;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t c = 0; c < ld; c += 32) {
            const int64_t left = i < M ? R - c : 0;
            const __mmask16 m0 = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 m1 = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const __m512 a = _mm512_maskz_loadu_ps(m0, av + i * R + c), b = _mm512_maskz_loadu_ps(m1, av + i * R + c + 16);
            _mm512_store_si512(avb + i * ld + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
}
#endif

/* Whether rows i and i + 1 (T tokens a scale row) list the same slots: lora_b_two can take them. */
static int lora_same_slots(const lora_plan *p, int64_t n, int64_t T, int64_t i) {
    const int64_t s = i / T, u = (i + 1) / T;
    return s == u || (p->cnt[s] == p->cnt[u] && memcmp(p->js + s * n, p->js + u * n, sizeof(int64_t) * (size_t)p->cnt[s]) == 0);
}

/* ---------------------------------------------------------------- one projection */

/* xa[i * ld + 8 g + u] = A[8 g + u] . x[i] for rows [r0, r1) of x and group g (8 columns) of
 * slot sl's int8 A. */
static void lora_dots_s8(const gl_lora_slot *sl, const xbuf *xb, int64_t k, int64_t r0, int64_t r1,
                         int64_t g, float *xa, int64_t ld) {
    const int64_t kb = k / 32, nv = sl->r - g * 8 < 8 ? sl->r - g * 8 : 8;
    const int8_t *qg = (const int8_t *)sl->aq + g * kb * 256;
    const void *sg = (const char *)sl->a_scales + g * kb * 8 * (sl->a_half ? 2 : 4);
    for (int64_t i = r0; i < r1; i += MT) {
        const int rows = r1 - i < MT ? (int)(r1 - i) : MT;
        const int8_t *xt = xb->xq + i * k;
        const uint8_t *ut = xb->xu ? xb->xu + i * k : NULL;
        const float *dt = xb->xd + i * kb;
        float *yo = xa + i * ld + g * 8;
#define S8H(RR) s8_group(qg, sg, 1, 0, kb, xt, ut, dt, RR, yo, ld, nv)
#define S8F(RR) s8_group(qg, sg, 0, 0, kb, xt, ut, dt, RR, yo, ld, nv)
        if (sl->a_half) {
            WITH_ROWS(rows, S8H)
        } else {
            WITH_ROWS(rows, S8F)
        }
#undef S8H
#undef S8F
    }
}

/* Slot j's s * A . x for rows [a, e) of x (every one at a nonzero scale), into av (U wide, the
 * slot's columns from p->off[j]): an int8 A's groups over the rows at once (its codes read once
 * for up to MT rows), a float A a row at a time. */
static void lora_slot_rows(const gl_lora_site *l, const lora_plan *p, int64_t j, const xbuf *xb,
                           const float *x, int64_t T, int64_t k, int64_t a, int64_t e, float *av) {
    const gl_lora_slot *sl = l->slot + j;
    float *xs = av + p->off[j];
    if (sl->aq)
        for (int64_t g = 0; g < (sl->r + 7) / 8; g++) lora_dots_s8(sl, xb, k, a, e, g, xs, p->U);
    for (int64_t i = a; i < e; i++) {
        const float sc = lora_scale(l, i / T, j);
        for (int64_t c = 0; c < sl->r; c++)
            xs[i * p->U + c] = sl->aq ? sc * xs[i * p->U + c] : lora_dot(x + i * k, k, sl->a, (int)l->bf, sc, c);
    }
}

/* av (M, U) = s * (A . x) for rows [i0, i1) of x (rows r*T .. r*T+T-1 share scale row r): the
 * calling thread's share; each active slot takes the runs of consecutive rows that use it (the
 * engine orders a batch's rows by adapter), so its A is read once a run. */
static void lora_xa_rows(const gl_lora_site *l, const lora_plan *p, const xbuf *xb, const float *x,
                         int64_t i0, int64_t i1, int64_t T, int64_t k, float *av) {
    for (int64_t j = 0; j < l->n; j++) {
        if (p->off[j] < 0) continue;
        for (int64_t a = i0; a < i1;) {
            if (lora_scale(l, a / T, j) == 0.0f) {
                a++;
                continue;
            }
            int64_t e = a + 1;
            while (e < i1 && lora_scale(l, e / T, j) != 0.0f) e++;
            lora_slot_rows(l, p, j, xb, x, T, k, a, e, av);
            a = e;
        }
    }
}

/* One row, the thread's blocks [b0, b1): the s * A . x (into xa, av's one row) of the columns of
 * the parts that reach them (an int8 A's groups holding them), the parts of the row's slots in
 * turn; and (at, len: at most 3 P ranges, counted in *nr) the memory those columns' factors
 * occupy, for the thread to prefetch while it computes its share of the base product: a part's
 * rows (or groups) of A and its blocks of B in [b0, b1), each one contiguous range. `dots`: 0
 * lists the ranges, 1 computes. */
static void lora_one_row(const gl_lora_site *l, const lora_plan *p, const xbuf *xb, const float *x,
                         int64_t k, int64_t b0, int64_t b1, int dots, float *xa, const char **at,
                         int64_t *len, int *nr) {
    const int64_t es = l->bf ? 2 : 4, kb = k / 32;
    for (int64_t t = 0; t < p->cnt[0]; t++) {
        const int64_t j = p->js[t];
        const gl_lora_slot *sl = l->slot + j;
        const float sc = lora_scale(l, 0, j);
        float *xs = xa + p->off[j];
        int64_t done = -1; /* the last group of an int8 A computed */
        for (int64_t q = 0; q < sl->n_parts; q++) {
            const gl_lora_part *pt = sl->parts + q;
            const int64_t j0 = b0 > pt->lo ? b0 : pt->lo, j1 = b1 < pt->hi ? b1 : pt->hi;
            if (j0 >= j1) continue;
            const int64_t g0 = pt->c0 / 8, g1 = (pt->c0 + pt->r - 1) / 8;
            if (!dots) {
                if (sl->aq) {
                    const int64_t ss = sl->a_half ? 2 : 4;
                    at[*nr] = (const char *)sl->aq + g0 * kb * 256, len[(*nr)++] = (g1 - g0 + 1) * kb * 256;
                    at[*nr] = (const char *)sl->a_scales + g0 * kb * 8 * ss, len[(*nr)++] = (g1 - g0 + 1) * kb * 8 * ss;
                } else {
                    at[*nr] = (const char *)sl->a + pt->c0 * k * es, len[(*nr)++] = pt->r * k * es;
                }
                at[*nr] = part_block(pt, j0, es), len[(*nr)++] = (j1 - j0) * pt->r * 32 * es;
                continue;
            }
            if (sl->aq) {
                for (int64_t g = g0 > done + 1 ? g0 : done + 1; g <= g1; g++) lora_dots_s8(sl, xb, k, 0, 1, g, xs, 0);
                done = g1;
                for (int64_t c = pt->c0; c < pt->c0 + pt->r; c++) xs[c] *= sc;
            } else {
                for (int64_t c = pt->c0; c < pt->c0 + pt->r; c++) xs[c] = lora_dot(x, k, sl->a, (int)l->bf, sc, c);
            }
        }
    }
}

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
#define PROJ_RANGES 16
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
    const int dyn = share_on(nth) && rows >= M && !b.xbf;
    gl_claim claims[dyn ? share_owners(nth) : 1];
    if (dyn) share_init(claims, tasks, nth);
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
    gl_dynamic = on >= 0 && on <= 3 ? (int)on : 1;
    return old;
}

int64_t gl_stolen_items(void) { return __atomic_load_n(&gl_stolen, __ATOMIC_RELAXED); }
