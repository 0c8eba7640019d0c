/* The s * A . x of a projection's adapters: many rows' integer or float dots, and one row's
 * columns a thread's blocks need (a part of the LoRA delta; graftlm.c includes it after lora.c). */
#include "graftlm.h"

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
