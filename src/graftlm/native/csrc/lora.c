/* The LoRA delta, and one projection: the base product and the delta of its adapters in one
 * parallel region (proj_run), which every product of the library runs. */
#include "graftlm.h"

/* ---------------------------------------------------------------- LoRA delta */

/* The LoRA delta of one projection for M rows of x (rows r*T .. r*T+T-1 share scale row r):
 *   y[i] += sum_c (s[i / T, c] * dot(A[c], x[i])) * B[:, c]
 * A (R, n_in) and B as float32, or as bfloat16 when bf (float32 arithmetic either way); B is
 * stored by column, padded to whole blocks of 32 outputs: Bb[c * nb * 32 + o] = B[o, c] (zero
 * past n_out, nb = ceil(n_out / 32)), so the blocks of a column that one thread adds are one
 * contiguous range (see lora_ranges); in bfloat16 each 16 outputs o .. o + 15 are stored as the
 * pairs (o + u, o + 8 + u), u = 0 .. 7 (ops.lora_block); s (M / T, R) the per-row scale of each rank
 * column (a column at scale 0 costs that row nothing); span (R, 2): outputs [lo, hi) outside which
 * column c is zero (its part of a stacked projection). y rows are ldy floats apart.
 * (The dot of A's rows with x: graftlm.h's dot_f32, or dot_kv of type 2 for bfloat16.) */

/* Each scale row's columns with a nonzero scale (s (S, R)): rows on different adapters walk only
 * their own. */
static void lora_columns(const float *s, int64_t S, int64_t R, int64_t *cols, int64_t *cnt) {
    for (int64_t i = 0; i < S; i++) {
        int64_t k = 0;
        for (int64_t c = 0; c < R; c++)
            if (s[i * R + c] != 0.0f) cols[i * R + k++] = c;
        cnt[i] = k;
    }
}

/* xa = s * (A[c] . x), 0 without computing where the scale is 0. */
static inline float lora_dot(const float *x, int64_t n_in, const void *A, int bf, float sc, int64_t c) {
    if (sc == 0.0f) return 0.0f;
    return sc * (bf ? dot_kv(x, (const uint16_t *)A + c * n_in, n_in, 2) : dot_f32((const float *)A + c * n_in, x, n_in));
}

/* w[0..3] = the 32 outputs of one column's block of B at b, as float32 (bf16: see lora_block's
 * pairs, 16 outputs a load widened with a shift and a mask). */
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

/* y[jb * 32 ..][:32] += sum over the listed columns c of xa[c] * B[block jb, c], 32 outputs held in
 * registers; columns whose B is zero on this block (span) are skipped. */
static void lora_b_block(float *yi, const float *xa, const int64_t *cols, int64_t cnt, const void *Bb,
                         int bf, const int64_t *span, int64_t jb, int64_t n_out) {
    const int64_t j = jb * 32, nb = (n_out + 31) / 32;
    float tail[32];
    float *yo = j + 32 <= n_out ? yi + j : tail;
    if (yo == tail) {
        memset(tail, 0, sizeof(tail));
        memcpy(tail, yi + j, sizeof(float) * (size_t)(n_out - j));
    }
    __m256 y0 = _mm256_loadu_ps(yo), y1 = _mm256_loadu_ps(yo + 8);
    __m256 y2 = _mm256_loadu_ps(yo + 16), y3 = _mm256_loadu_ps(yo + 24);
    for (int64_t t = 0; t < cnt; t++) {
        const int64_t c = cols[t];
        if (j >= span[2 * c + 1] || j + 32 <= span[2 * c]) continue;
        const __m256 av8 = _mm256_set1_ps(xa[c]);
        __m256 w[4];
        b_widen((const char *)Bb + (c * nb + jb) * 32 * (bf ? 2 : 4), bf, w);
        y0 = _mm256_fmadd_ps(av8, w[0], y0);
        y1 = _mm256_fmadd_ps(av8, w[1], y1);
        y2 = _mm256_fmadd_ps(av8, w[2], y2);
        y3 = _mm256_fmadd_ps(av8, w[3], y3);
    }
    _mm256_storeu_ps(yo, y0);
    _mm256_storeu_ps(yo + 8, y1);
    _mm256_storeu_ps(yo + 16, y2);
    _mm256_storeu_ps(yo + 24, y3);
    if (yo == tail) memcpy(yi + j, tail, sizeof(float) * (size_t)(n_out - j));
}

/* Two rows whose scale rows list the same columns (ya, yb: their outputs; xa, xb: their s * A . x):
 * the delta of block jb to both, each block of B widened once for the two rows. A whole block. */
static void lora_b_two(float *ya, float *yb, const float *xa, const float *xb, const int64_t *cols,
                       int64_t cnt, const void *Bb, int bf, const int64_t *span, int64_t jb, int64_t n_out) {
    const int64_t j = jb * 32, nb = (n_out + 31) / 32, es = bf ? 2 : 4, cs = nb * 32 * es;
    const char *b0 = (const char *)Bb + jb * 32 * es;
    ya += j, yb += j;
    __m256 a0 = _mm256_loadu_ps(ya), a1 = _mm256_loadu_ps(ya + 8), a2 = _mm256_loadu_ps(ya + 16), a3 = _mm256_loadu_ps(ya + 24);
    __m256 c0 = _mm256_loadu_ps(yb), c1 = _mm256_loadu_ps(yb + 8), c2 = _mm256_loadu_ps(yb + 16), c3 = _mm256_loadu_ps(yb + 24);
    for (int64_t t = 0; t < cnt; t++) {
        const int64_t c = cols[t];
        if (j >= span[2 * c + 1] || j + 32 <= span[2 * c]) continue;
        __m256 w[4];
        b_widen(b0 + c * cs, bf, w);
        const __m256 ka = _mm256_set1_ps(xa[c]), kb = _mm256_set1_ps(xb[c]);
        a0 = _mm256_fmadd_ps(ka, w[0], a0), c0 = _mm256_fmadd_ps(kb, w[0], c0);
        a1 = _mm256_fmadd_ps(ka, w[1], a1), c1 = _mm256_fmadd_ps(kb, w[1], c1);
        a2 = _mm256_fmadd_ps(ka, w[2], a2), c2 = _mm256_fmadd_ps(kb, w[2], c2);
        a3 = _mm256_fmadd_ps(ka, w[3], a3), c3 = _mm256_fmadd_ps(kb, w[3], c3);
    }
    _mm256_storeu_ps(ya, a0), _mm256_storeu_ps(ya + 8, a1), _mm256_storeu_ps(ya + 16, a2), _mm256_storeu_ps(ya + 24, a3);
    _mm256_storeu_ps(yb, c0), _mm256_storeu_ps(yb + 8, c1), _mm256_storeu_ps(yb + 16, c2), _mm256_storeu_ps(yb + 24, c3);
}

#if GL_AMX
/* The LoRA delta on AMX tiles (amx.c), for a product that runs there: s * A . x of each row (av)
 * in bfloat16 as values past k, against B as their weights, summed with the base product's. */
typedef struct {
    const gl_lora_site *l;
    int64_t n;
} lora_tiles;

/* Task t's tiles of B: its 32 outputs of each column, two columns a tile row, in blocks of 32
 * columns (zero past the rank). */
static void lora_b_tiles(const void *ctx, int64_t t, uint16_t *out) {
    const gl_lora_site *l = ((const lora_tiles *)ctx)->l;
    const int64_t n = ((const lora_tiles *)ctx)->n, R = l->r, nb = (n + 31) / 32, blocks = (R + 31) / 32;
    const int64_t es = l->bf ? 2 : 4;
    for (int64_t c = 0; c < blocks * 32; c += 2) {
        __m256 w0[4], w1[4];
        for (int u = 0; u < 4; u++) w0[u] = w1[u] = _mm256_setzero_ps();
        if (c < R) b_widen((const char *)l->bb + (c * nb + t) * 32 * es, (int)l->bf, w0);
        if (c + 1 < R) b_widen((const char *)l->bb + ((c + 1) * nb + t) * 32 * es, (int)l->bf, w1);
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

/* Whether rows i and i + 1 (T tokens a scale row) list the same columns: lora_b_two can take them. */
static int lora_same_cols(const int64_t *cols, const int64_t *cnt, int64_t R, int64_t T, int64_t i) {
    const int64_t s = i / T, u = (i + 1) / T;
    return s == u || (cnt[s] == cnt[u] && memcmp(cols + s * R, cols + u * R, sizeof(int64_t) * (size_t)cnt[s]) == 0);
}

/* ---------------------------------------------------------------- one projection */

/* [start, end) of n iterations for thread tid of nt under schedule(static), as libgomp splits them. */
static inline void static_chunk(int64_t n, int tid, int nt, int64_t *start, int64_t *end) {
    const int64_t q = n / nt, r = n % nt;
    *start = tid * q + (tid < r ? tid : r);
    *end = *start + q + (tid < r);
}

/* xa[i * r + 8 g + u] = A[8 g + u] . x[i] for rows [r0, r1) of x and group g (8 columns) of l's
 * int8 A. */
static void lora_dots_s8(const gl_lora_site *l, const xbuf *xb, int64_t k, int64_t r0, int64_t r1,
                         int64_t g, float *xa) {
    const int64_t kb = k / 32, R = l->r, nv = R - g * 8 < 8 ? R - g * 8 : 8;
    const int8_t *qg = (const int8_t *)l->aq + g * kb * 256;
    const void *sg = (const char *)l->a_scales + g * kb * 8 * (l->a_half ? 2 : 4);
    for (int64_t i = r0; i < r1; i += MT) {
        const int rows = r1 - i < MT ? (int)(r1 - i) : MT;
        const int8_t *xt = xb->xq + i * k;
        const uint8_t *ut = xb->xu ? xb->xu + i * k : NULL;
        const float *dt = xb->xd + i * kb;
        float *yo = xa + i * R + g * 8;
#define S8H(RR) s8_group(qg, sg, 1, 0, kb, xt, ut, dt, RR, yo, R, nv)
#define S8F(RR) s8_group(qg, sg, 0, 0, kb, xt, ut, dt, RR, yo, R, nv)
        if (l->a_half) {
            WITH_ROWS(rows, S8H)
        } else {
            WITH_ROWS(rows, S8F)
        }
#undef S8H
#undef S8F
    }
}

/* av (M, R) = s * (A . x) for the rows of x (rows r*T .. r*T+T-1 share scale row r), the
 * threads of the enclosing parallel region splitting the rows; ends at a barrier. With l->aq,
 * the integer dots of the decode layer's products (proj_run) on xb, x quantized. */
static void lora_xa_rows(const gl_lora_site *l, const xbuf *xb, const float *x, int64_t M,
                         int64_t T, int64_t n_in, float *av) {
    const int64_t R = l->r;
    if (l->aq) {
        int64_t i0, i1;
        static_chunk(M, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
        for (int64_t g = 0; g < (R + 7) / 8; g++) lora_dots_s8(l, xb, n_in, i0, i1, g, av);
        for (int64_t ic = i0 * R; ic < i1 * R; ic++) av[ic] *= l->scales[(ic / R / T) * R + ic % R];
#pragma omp barrier
    } else { /* each read of A serves one (row, column) */
#pragma omp for schedule(static)
        for (int64_t ic = 0; ic < M * R; ic++) {
            const int64_t i = ic / R, c = ic % R;
            av[ic] = lora_dot(x + i * n_in, n_in, l->a, (int)l->bf, l->scales[(i / T) * R + c], c);
        }
    }
}

/* At one token a row, the columns thread tid of nt needs: those with a nonzero scale whose B
 * reaches its static share [b0, b1) of the 32-output blocks. */
static int lora_needed(const gl_lora_site *l, int64_t b0, int64_t b1, int64_t *cols) {
    int k = 0;
    for (int64_t c = 0; c < l->r; c++)
        if (l->scales[c] != 0.0f && b0 * 32 < l->span[2 * c + 1] && b1 * 32 > l->span[2 * c]) cols[k++] = c;
    return k;
}

/* The memory those columns' factors occupy, as at most 3 nc contiguous ranges (start, bytes):
 * their rows of A (or their groups of the int8 A), and for each its blocks of B in [b0, b1) that
 * its span reaches. */
static int lora_ranges(const gl_lora_site *l, int64_t n_in, int64_t n_out, const int64_t *cols,
                       int nc, int64_t b0, int64_t b1, const char **at, int64_t *len) {
    const int64_t es = l->bf ? 2 : 4, nb = (n_out + 31) / 32, row = n_in * es;
    int nr = 0;
    if (l->aq) { /* the groups of 8 rows of the int8 A holding them, codes and scales */
        const int64_t kb = n_in / 32, ss = l->a_half ? 2 : 4;
        for (int i = 0; i < nc; i++) {
            const int64_t g = cols[i] / 8;
            if (i > 0 && cols[i - 1] / 8 == g) continue;
            at[nr] = (const char *)l->aq + g * kb * 256, len[nr++] = kb * 256;
            at[nr] = (const char *)l->a_scales + g * kb * 8 * ss, len[nr++] = kb * 8 * ss;
        }
    }
    for (int i = 0; i < nc && !l->aq; i++) { /* rows of A, merged where the columns are consecutive */
        if (nr > 0 && at[nr - 1] + len[nr - 1] == (const char *)l->a + cols[i] * row) {
            len[nr - 1] += row;
        } else {
            at[nr] = (const char *)l->a + cols[i] * row;
            len[nr++] = row;
        }
    }
    for (int i = 0; i < nc; i++) {
        const int64_t c = cols[i], lo = l->span[2 * c] / 32, hi = (l->span[2 * c + 1] + 31) / 32;
        const int64_t j0 = b0 > lo ? b0 : lo, j1 = b1 < hi ? b1 : hi;
        if (j0 < j1) {
            at[nr] = (const char *)l->bb + (c * nb + j0) * 32 * es;
            len[nr++] = (j1 - j0) * 32 * es;
        }
    }
    return nr;
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

/* Which delta path proj_run takes: one row (each thread its own columns, no barrier; R bounds its
 * stack arrays), or many rows. */
static inline int proj_one_row(const gl_lora_site *l, int64_t M) {
    return l != NULL && l->a != NULL && M == 1 && l->r <= 1024;
}

/* proj_run's buffers, carved from s: x quantized (for the base product and the integer dots of
 * A), and with many rows their s * A . x (M, R), each scale row's columns (S, R) and their counts
 * (S), and two[i]: rows i and i + 1 pair up (lora_b_two). */
typedef struct {
    xbuf xb;
    uint16_t *xbf; /* x in bfloat16 for the AMX tiles (amx.c), or NULL */
    uint16_t *avb; /* with them and many rows: s * A . x in bfloat16 (lora_av_tiles) */
    float *av;
    int64_t *cols, *cnt;
    char *two;
} proj_bufs;

static proj_bufs proj_take(const gl_weight *w, const gl_lora_site *l, int64_t M, int64_t T,
                           gl_scratch *s) {
    const int has = l != NULL && l->a != NULL;
    const int64_t R = has ? l->r : 0, S = M / T;
    proj_bufs b = {0};
    int vnni = w->q != NULL; /* the base product, or some of its outputs, on the VNNI kernels */
#if GL_AMX
    if (amx_serves(w, M)) {
        b.xbf = scratch_take(s, (M + 31) / 32 * 32 * w->k * 2);
        if (has && !proj_one_row(l, M)) b.avb = scratch_take(s, (M + 31) / 32 * 32 * (R + 31) / 32 * 32 * 2);
        vnni = w->n % 32 != 0; /* the last task's outputs: not a whole tile pair */
    }
#endif
    if (vnni || (has && l->aq)) b.xb = xbuf_take(s, M, w->k, w->kind == 1 || (has && l->aq));
    if (has && !proj_one_row(l, M)) {
        b.av = scratch_take(s, (int64_t)sizeof(float) * M * R);
        b.cols = scratch_take(s, (int64_t)sizeof(int64_t) * S * R);
        b.cnt = scratch_take(s, (int64_t)sizeof(int64_t) * S);
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

/* y (M, n) = x (M, k) @ W.T, plus the delta of l's adapters (T tokens a scale row:
 * l->scales (M / T, R)) unless l is NULL or l->a is: one parallel region.
 *  1. Each thread computes its static share of the base outputs (tasks of 32 outputs, one block
 *     of B each). At one token a row it asks for the adapter lines it will read, spread over
 *     those tasks: the factors are small scattered reads that miss every cache after a layer of
 *     base weights has streamed through (in one burst, the prefetches were dropped; ahead of
 *     the base product, evicted by it).
 *  2. One row: after its tasks, each thread computes the dots of the columns its own blocks
 *     need (some twice, across the two threads, but no barrier) and adds B's delta to its
 *     outputs, still in cache. More rows: first the threads split all the rows' dots and meet at
 *     a barrier; then each adds B's delta to every task's outputs right after computing them
 *     (at 512 rows a task's outputs are 64 KB: added later, they came back from memory).
 * Apart, the base product and the delta took three more barriers and one more fork. */
static void proj_run(const gl_weight *w, const float *x, int64_t M, int64_t T, const gl_lora_site *l,
                     float *y, gl_scratch *sc, int nth) {
    _Static_assert(GT * 8 == 32, "a product task covers one 32-output block of B");
    const int64_t n = w->n, k = w->k, tasks = ((n + 7) / 8 + GT - 1) / GT;
    const int has = l != NULL && l->a != NULL;
    const int64_t R = has ? l->r : 0;
    const int one = proj_one_row(l, M);
    const int many = has && !one;
    const int64_t S = M / T; /* scale rows: T tokens each */
    const int64_t mark = sc->used;
    const proj_bufs b = proj_take(w, l, M, T, sc);
    /* Rows a pass over the tasks: every task reads all of x's rows of a pass, so a pass holds
     * about 512 KiB of them (a core's L2 keeps them across the tasks; the weights are read again
     * each pass). Llama-1B's ffn_down (k = 8192) at 512 rows: 4 MiB of x, read from L3 by every
     * 32 outputs, had the Q6_K product at 434 GOP/s; in passes of 96 rows, 590. On the AMX tiles
     * (b.xbf), one pass: a task's weights are dequantized once for all the rows. */
    const int64_t rows = M * k <= (1 << 19) || b.xbf ? M : ((1 << 19) / k + RC - 1) / RC * RC;
    if (one) { /* the spans and scales lora_needed reads first: cold after the last product */
        for (int64_t off = 0; off < R * 16; off += 64) _mm_prefetch((const char *)l->span + off, _MM_HINT_T0);
        for (int64_t off = 0; off < R * 4; off += 64) _mm_prefetch((const char *)l->scales + off, _MM_HINT_T0);
    }
    const int base = w->q != NULL; /* no weight: the delta alone, added to y (gl_lora) */
    const xbuf xb = b.xb;
    if (xb.xq) quantize_x(x, M, k, xb.xq, xb.xu, xb.xd, xb.xs, xb.xs16, nth);
#if GL_AMX
    if (b.xbf) amx_x(x, M, k, b.xbf, nth);
#endif
    float *av = b.av;
    int64_t *cols = b.cols, *cnt = b.cnt;
    char *two = b.two;
    if (many) {
        lora_columns(l->scales, S, R, cols, cnt);
        for (int64_t i = 0; i < M; i++) two[i] = i + 1 < M && lora_same_cols(cols, cnt, R, T, i);
    }
#pragma omp parallel num_threads(nth)
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t t0, t1;
        static_chunk(tasks, me, nt, &t0, &t1);
        int64_t mine[one ? R : 1], len[one ? 3 * R : 1];
        float xa[one ? R : 1];
        const char *at[one ? 3 * R : 1];
        const int nc = one ? lora_needed(l, t0, t1, mine) : 0;
        line_walk walk = {at, len, one ? lora_ranges(l, k, n, mine, nc, t0, t1, at, len) : 0, 0, 0, 0};
        int64_t lines = 0;
        for (int i = 0; i < walk.nr; i++) lines += (len[i] + 63) / 64;
        if (many) lora_xa_rows(l, &xb, x, M, T, k, av); /* the threads split the rows' dots */
#if GL_AMX
        if (b.xbf) { /* the product first, all of it, in chunks of k (amx_tasks); the delta with it */
            const lora_tiles lt = {l, n};
            const amx_extra ex = {b.avb, (R + 31) / 32, lora_b_tiles, &lt};
            if (many) {
                int64_t i0, i1;
                static_chunk((M + 31) / 32 * 32, me, nt, &i0, &i1);
                lora_av_tiles(av, M, R, i0, i1, b.avb);
#pragma omp barrier
            }
            if (t1 > t0) {
                amx_begin();
                amx_tasks(w, b.xbf, M, t0, t1, many ? &ex : NULL, y);
                _tile_release();
            }
        }
#endif
        for (int64_t ra = 0; ra < M; ra += rows) {
            const int64_t rb = M - ra < rows ? M : ra + rows;
            for (int64_t t = t0; t < t1; t++) {
                if (ra == 0) prefetch_upto(&walk, lines * (t - t0 + 1) / (t1 - t0));
                const int tiles = b.xbf && amx_task_whole(w, t); /* base and delta: done */
                if (base && !tiles) mm_task(w, &xb, M, ra, rb, t, y);
                for (int64_t i = ra; many && !tiles && i < rb; i++) { /* the task's outputs, while still in cache */
                    const int64_t *ci = cols + (i / T) * R;
                    if (two[i] && i + 1 < rb && t * 32 + 32 <= n) { /* rows on the same adapters: a pair */
                        lora_b_two(y + i * n, y + (i + 1) * n, av + i * R, av + (i + 1) * R, ci, cnt[i / T], l->bb, (int)l->bf, l->span, t, n);
                        i++;
                    } else {
                        lora_b_block(y + i * n, av + i * R, ci, cnt[i / T], l->bb, (int)l->bf, l->span, t, n);
                    }
                }
            }
        }
        if (one) {
            if (l->aq) { /* each group of 8 columns holding one of them, then the scales */
                for (int i = 0; i < nc; i++)
                    if (i == 0 || mine[i - 1] / 8 != mine[i] / 8) lora_dots_s8(l, &xb, k, 0, 1, mine[i] / 8, xa);
                for (int i = 0; i < nc; i++) xa[mine[i]] *= l->scales[mine[i]];
            } else {
                for (int i = 0; i < nc; i++) xa[mine[i]] = lora_dot(x, k, l->a, (int)l->bf, l->scales[mine[i]], mine[i]);
            }
            for (int64_t t = t0; t < t1; t++)
                lora_b_block(y, xa, mine, nc, l->bb, (int)l->bf, l->span, t, n);
        }
    }
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
