/*
 * Small per-layer operations of the Llama decoder fused into single calls, for the CPU decode
 * step where each torch op costs more in dispatch than in arithmetic (batch 1: ~4,000 torch
 * ops per step). Built and called by kernels/decode_ops.py, which documents the contracts; the
 * torch references are there too.
 *
 *   tandem_add_rmsnorm_f32  x += y (optional); h = w * (x / sqrt(mean(x^2) + eps))
 *                           (RMSNorm: Zhang & Sennrich 2019; Hugging Face LlamaRMSNorm order)
 *   tandem_rope_write_kv_f32  rotate the q and k heads of a fused q/k/v row (RoFormer, Su et
 *                           al. 2021; Hugging Face's rotate-half layout): q to its own buffer,
 *                           k and v straight into their KV cache slots
 *   tandem_silu_mul_f32     out = silu(gate) * up (SwiGLU, Shazeer 2020)
 *
 * Plain C loops under `omp simd`: the build's -march=native turns them into AVX-512 or AVX2
 * code (scalar elsewhere), like the other kernels of this folder. Rows are spread over OpenMP
 * threads only when there are several (a single decode row is too small to share).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TANDEM_OK 0
#define TANDEM_BAD_SHAPE 2
#define TANDEM_BAD_POSITION 4
#define TANDEM_BAD_SLOT 5

int tandem_add_rmsnorm_f32(float *x, const float *y, const float *w, float *h, int64_t M,
                           int64_t D, float eps, int num_threads) {
    if (M < 0 || D <= 0) return TANDEM_BAD_SHAPE;
#pragma omp parallel for num_threads(num_threads) if (M > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *xm = x + m * D;
        float *hm = h + m * D;
        if (y) {
            const float *ym = y + m * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) xm[d] += ym[d];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; d++) ss += xm[d] * xm[d];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; d++) hm[d] = w[d] * (xm[d] * inv);
    }
    return TANDEM_OK;
}

/* One head: dst[i] = x[i] cos[i] - x[i + half] sin[i], dst[i + half] = x[i + half]
 * cos[i + half] + x[i] sin[i + half] (cos/sin rows hold each frequency twice). */
static inline void rotate_head(const float *x, float *dst, const float *cos, const float *sin,
                               int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        dst[i] = a * cos[i] - b * sin[i];
        dst[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* qkv [T, row_stride]: per row num_heads q heads, then num_kv_heads k heads, then v heads.
 * Writes rotated q to q_out [T, num_heads * head_dim], rotated k and plain v to the cache
 * rows slot_mapping[t] of k_cache / v_cache ([num_slots, num_kv_heads * head_dim]). */
int tandem_rope_write_kv_f32(const float *qkv, float *q_out, int64_t T, int64_t row_stride,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             const int64_t *positions, const float *cos, const float *sin,
                             int64_t max_positions, float *k_cache, float *v_cache,
                             const int64_t *slot_mapping, int64_t num_slots, int num_threads) {
    if (T < 0 || head_dim <= 0 || head_dim % 2 || num_heads <= 0 || num_kv_heads <= 0
        || row_stride < (num_heads + 2 * num_kv_heads) * head_dim)
        return TANDEM_BAD_SHAPE;
    for (int64_t t = 0; t < T; t++) { /* validate first: no access out of bounds */
        if (positions[t] < 0 || positions[t] >= max_positions) return TANDEM_BAD_POSITION;
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return TANDEM_BAD_SLOT;
    }
    const int64_t half = head_dim / 2, q_width = num_heads * head_dim;
    const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (T > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * row_stride;
        const float *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        float *k_dst = k_cache + slot_mapping[t] * kv_width;
        for (int64_t hd = 0; hd < num_heads; hd++)
            rotate_head(row + hd * head_dim, q_out + t * q_width + hd * head_dim, c, s, half);
        for (int64_t hd = 0; hd < num_kv_heads; hd++)
            rotate_head(row + q_width + hd * head_dim, k_dst + hd * head_dim, c, s, half);
        memcpy(v_cache + slot_mapping[t] * kv_width, row + q_width + kv_width,
               sizeof(float) * (size_t)kv_width);
    }
    return TANDEM_OK;
}

int tandem_silu_mul_f32(const float *gate_up, float *out, int64_t M, int64_t F,
                        int num_threads) {
    if (M < 0 || F <= 0) return TANDEM_BAD_SHAPE;
#pragma omp parallel for num_threads(num_threads) if (M > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * F, *u = g + F;
        float *o = out + m * F;
#pragma omp simd
        for (int64_t f = 0; f < F; f++) {
            /* NOTE: -g capped below expf's overflow: -ffast-math's reciprocal of inf is NaN */
            o[f] = g[f] / (1.0f + expf(fminf(-g[f], 80.0f))) * u[f];
        }
    }
    return TANDEM_OK;
}
