/* The LoRA delta: its layouts, the plan of a call's slots, and the blocks of B it adds (on AMX
 * tiles too). The s * A . x it takes: lora_xa.c; the projection that runs it: proj.c. */
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
