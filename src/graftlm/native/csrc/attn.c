/* RMS norm, RoPE, a prompt's keys and values into the KV cache, and the gated activation of the
 * feed-forward block: the float32 pieces of a decoder layer (attention: attn_decode*.c for decode
 * steps, attn_prompt.c for prompts). */
#include "graftlm.h"

/* ---------------------------------------------------------------- norms, RoPE, attention */

/* o = o * c + p * v */
static inline void scale_axpy(float *o, float c, float p, const float *v, int64_t n) {
    const __m256 cv = _mm256_set1_ps(c), pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_mul_ps(cv, _mm256_loadu_ps(o + i))));
    for (; i < n; i++) o[i] = o[i] * c + p * v[i];
}

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w over rows of n values: each square in float, their
 * sum in double, as ggml (in 8 lanes: one chain of n dependent adds made short rows of heads,
 * qwen3's QK-norm, cost as much as the long ones). */
void gl_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y,
                 int nth) {
#pragma omp parallel for num_threads(nth) schedule(static) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i), sq = _mm256_mul_ps(v, v);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
        double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
        for (i = 0; i < n; i++) yr[i] = (xr[i] * scale) * w[i];
    }
}

/* Rotate the first rot values of one head (adjacent pairs, or halves when neox). */
static inline void rope_head(const float *x, float *o, int64_t d, int64_t rot, const float *cs,
                             const float *sn, int neox) {
    const int64_t half = rot / 2;
    if (neox) {
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            o[i] = a * cs[i] - b * sn[i];
            o[i + half] = b * cs[i] + a * sn[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            const float a = x[2 * i], b = x[2 * i + 1];
            o[2 * i] = a * cs[i] - b * sn[i];
            o[2 * i + 1] = a * sn[i] + b * cs[i];
        }
    }
    for (int64_t i = rot; i < d; i++) o[i] = x[i];
}

/* RoPE for N rows of H heads of D values (a prompt's q or k): row i at x + i * rs, its heads D
 * apart, rotated at position pos[i] (first rot values of each head), into out (N, H, D).
 * The tables have n_pos rows: -1 (nothing written) when a position is outside them. */
int gl_rope(const float *x, int64_t N, int64_t rs, int64_t H, int64_t D, const int64_t *pos,
            const float *cos_t, const float *sin_t, int64_t n_pos, int64_t rot, int neox,
            float *out, int nth) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < N; i++)
        if (pos[i] < 0 || pos[i] >= n_pos) return -1;
#pragma omp parallel for num_threads(nth) schedule(static) if (N * H * D > 65536)
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < H; h++)
            rope_head(x + i * rs + h * D, out + (i * H + h) * D, D, rot, cos_t + pos[i] * half,
                      sin_t + pos[i] * half, neox);
    return 0;
}

/* A prompt step's keys (which 0) or values (1) into the paged cache: x (B, T, n_head_kv, D), row
 * (b, t) at x + (b * T + t) * rs with its heads D apart, at slot slots[b] and position
 * starts[b] + t, each row rounded as kv_store rounds it (torch's rounding: the same bits as
 * KVCache.write). Positions past the table (a padding row's, which KVCache.write clamps to its
 * last position) are not written: nothing reads them. */
void gl_kv_write(const gl_kv *kv, int64_t which, const float *x, int64_t rs, const int64_t *slots,
                 const int64_t *starts, int64_t B, int64_t T, int64_t D, int nth) {
    const int64_t H = kv->n_head_kv, end = kv->max_blocks * kv->block;
    void *base = which ? kv->v : kv->k;
#pragma omp parallel for num_threads(nth) schedule(static) if (B * T * H * D > 65536)
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t b = bt / T, p = starts[b] + bt % T;
        for (int64_t h = 0; p < end && h < H; h++) {
            if (which == 0)
                key_store(kv, slots[b], h, p, x + bt * rs + h * D, D);
            else
                kv_store(kv_at(kv, base, slots[b], h, p, D), x + bt * rs + h * D, D, kv->type);
        }
    }
}

/* ---------------------------------------------------------------- gates */

/* Rows [b0, b1) of gl_gated, on the calling thread. */
static void gated_rows(const float *gu, int64_t b0, int64_t b1, int64_t ff, int64_t act, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 c0 = _mm256_set1_ps(0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
    for (int64_t b = b0; b < b1; b++) {
        const float *g = gu + b * 2 * ff, *u = g + ff;
        float *a = out + b * ff;
        int64_t j = 0;
        for (; j + 8 <= ff; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            __m256 v;
            if (act == 0) { /* g / (1 + e^-g) */
                v = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            } else if (act == 2) { /* gpt-oss: g = min(g, 7) / (1 + e^(-1.702 g)), times clamp(u) + 1 */
                const __m256 gc = _mm256_min_ps(gv, _mm256_set1_ps(7.0f));
                const __m256 uc = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(u + j), _mm256_set1_ps(-7.0f)), _mm256_set1_ps(7.0f));
                v = _mm256_div_ps(gc, _mm256_add_ps(one, exp256(_mm256_mul_ps(_mm256_set1_ps(-1.702f), gc))));
                _mm256_storeu_ps(a + j, _mm256_mul_ps(v, _mm256_add_ps(uc, one)));
                continue;
            } else { /* g/2 (1 + tanh(z)) = g / (1 + e^-2z), z = c0 (g + c1 g^3): no cancellation */
                const __m256 z = _mm256_mul_ps(c0, _mm256_add_ps(gv, _mm256_mul_ps(c1, _mm256_mul_ps(gv, _mm256_mul_ps(gv, gv)))));
                const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), z));
                v = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            }
            _mm256_storeu_ps(a + j, _mm256_mul_ps(v, _mm256_loadu_ps(u + j)));
        }
        for (; j < ff; j++) {
            if (act == 2) {
                const float gc = g[j] < 7.0f ? g[j] : 7.0f, uc = u[j] < -7.0f ? -7.0f : u[j] > 7.0f ? 7.0f : u[j];
                a[j] = gc / (1.0f + expf(-1.702f * gc)) * (uc + 1.0f);
                continue;
            }
            const float x = g[j];
            const float v = act == 0 ? x / (1.0f + expf(-x))
                                     : x / (1.0f + expf(-2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x)));
            a[j] = v * u[j];
        }
    }
}

/* Rows of [gate | up] (2 ff values each) -> act(gate) * up, (B, ff). act 0: SiLU, 1: GELU-tanh,
 * 2: gpt-oss's clamped SwiGLU (min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1)). */
void gl_gated(const float *gu, int64_t B, int64_t ff, int64_t act, float *out, int nth) {
    if (B * ff <= 65536) {
        gated_rows(gu, 0, B, ff, act, out);
        return;
    }
#pragma omp parallel num_threads(nth)
    {
        int64_t b0, b1;
        static_chunk(B, omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        gated_rows(gu, b0, b1, ff, act, out);
    }
}
