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
 *                           k and v straight into their KV cache slots; first, where given,
 *                           the projection's bias added (Qwen2) and each q and k head
 *                           RMS-normalised with its own weight (Qwen3's q_norm / k_norm)
 *   tandem_silu_mul_f32     out = silu(gate) * up (SwiGLU, Shazeer 2020)
 *   tandem_gelu_tanh_mul_f32  out = gelu(gate) * up, GELU's tanh form (GeGLU, Shazeer 2020;
 *                           Hendrycks & Gimpel 2016; torch's gelu(approximate="tanh"): Gemma)
 *
 * Plain C loops under `omp simd`: the build's -march=native turns them into AVX-512 or AVX2
 * code (scalar elsewhere), like the other kernels of this folder. Rows are spread over OpenMP
 * threads only when there are several (a single decode row is too small to share). A row's
 * result never depends on the other rows or the thread count: its sum of squares has one
 * order (vec_math.h's tandem_ordered_sum) and exp is one function for every element, in the
 * fused decode step and in the layer-by-layer prefill path alike (batch invariance).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec_math.h"

#define TANDEM_OK 0
#define TANDEM_BAD_SHAPE 2
#define TANDEM_BAD_POSITION 4
#define TANDEM_BAD_SLOT 5
#define MAX_HEAD_DIM 512 /* a head's staging buffer (bias, q/k norm) lives on the stack */

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
        const float ss = tandem_ordered_sum(xm, xm, D);
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

/* One q or k head x (head_dim) as the rotation reads it: x itself, or in buf with the bias b
 * added and/or RMS-normalised with weight w (x / sqrt(mean(x^2) + eps) * w, LlamaRMSNorm's
 * order, one order of sums). */
static inline const float *staged_head(const float *x, const float *b, const float *w,
                                       float eps, int64_t head_dim, float *buf) {
    if (!b && !w) return x;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) buf[d] = b ? x[d] + b[d] : x[d];
    if (w) {
        const float inv = 1.0f / sqrtf(tandem_ordered_sum(buf, buf, head_dim) / (float)head_dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) buf[d] = w[d] * (buf[d] * inv);
    }
    return buf;
}

/* n float32 values into cache elements [at, at + n): a float32 cache (kv_f16 0) or a float16
 * one (1, each rounded to nearest even: the same bits on every path, F16C's vcvtps2ph or not). */
static inline void store_kv(void *cache, int64_t at, const float *src, int64_t n, int kv_f16) {
    if (kv_f16) {
        _Float16 *d16 = (_Float16 *)cache + at;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) d16[d] = (_Float16)src[d];
    } else {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
    }
}

/* qkv [T, row_stride]: per row num_heads q heads, then num_kv_heads k heads, then v heads.
 * Writes rotated q to q_out [T, num_heads * head_dim], rotated k and plain v to the cache
 * rows slot_mapping[t] of k_cache / v_cache ([num_slots, num_kv_heads * head_dim], float32,
 * or float16 with kv_f16: each value rounded once, after the float32 arithmetic). bias
 * [(num_heads + 2 num_kv_heads) head_dim] (NULL: none) is added to the row first; q_norm,
 * k_norm [head_dim] (NULL: none) normalise each q / k head before the rotation. */
int tandem_rope_write_kv_f32(const float *qkv, float *q_out, int64_t T, int64_t row_stride,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             const int64_t *positions, const float *cos, const float *sin,
                             int64_t max_positions, void *k_cache, void *v_cache,
                             const int64_t *slot_mapping, int64_t num_slots, const float *bias,
                             const float *q_norm, const float *k_norm, float norm_eps,
                             int num_threads, int kv_f16) {
    if (T < 0 || head_dim <= 0 || head_dim % 2 || num_heads <= 0 || num_kv_heads <= 0
        || row_stride < (num_heads + 2 * num_kv_heads) * head_dim
        || ((bias || q_norm || k_norm || kv_f16) && head_dim > MAX_HEAD_DIM))
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
        const int64_t kv_row = slot_mapping[t] * kv_width;
        float buf[MAX_HEAD_DIM], rot[MAX_HEAD_DIM];
        for (int64_t hd = 0; hd < num_heads; hd++) {
            const int64_t at = hd * head_dim;
            rotate_head(staged_head(row + at, bias ? bias + at : NULL, q_norm, norm_eps,
                                    head_dim, buf),
                        q_out + t * q_width + at, c, s, half);
        }
        for (int64_t hd = 0; hd < num_kv_heads; hd++) {
            const int64_t at = q_width + hd * head_dim, to = kv_row + hd * head_dim;
            const float *k = staged_head(row + at, bias ? bias + at : NULL, k_norm, norm_eps,
                                         head_dim, buf);
            /* a float32 cache takes the rotation in place, a float16 one rounded from rot */
            rotate_head(k, kv_f16 ? rot : (float *)k_cache + to, c, s, half);
            if (kv_f16) store_kv(k_cache, to, rot, head_dim, 1);
        }
        const float *v = row + q_width + kv_width;
        for (int64_t hd = 0; hd < num_kv_heads; hd++) {
            const int64_t at = hd * head_dim;
            if (bias) {
                const float *vb = bias + q_width + kv_width + at;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) buf[d] = v[at + d] + vb[d];
            }
            store_kv(v_cache, kv_row + at, bias ? buf : v + at, head_dim, kv_f16);
        }
    }
    return TANDEM_OK;
}

enum { ACT_SILU, ACT_GELU_TANH }; /* the gated MLP's activation */
#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

/* act(x) of one element and of 16, the same operations in the same order (a value's result does
 * not depend on whether it sat in a vector or in a tail). SiLU: x / (1 + e^-x); GELU's tanh
 * form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). */
static inline float act1(float x, int act) {
    if (act == ACT_GELU_TANH)
        return 0.5f * x * (1.0f + tandem_tanh(GELU_BETA * (x + GELU_KAPPA * (x * x * x))));
    return x / (1.0f + tandem_exp(-x));
}

#if defined(__AVX512F__)
static inline __m512 act16(__m512 x, int act) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (act == ACT_GELU_TANH) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 inner = _mm512_mul_ps(
            _mm512_set1_ps(GELU_BETA), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), cube)));
        return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                             _mm512_add_ps(one, tandem_tanh16(inner)));
    }
    return _mm512_div_ps(x, _mm512_add_ps(one, tandem_exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#endif

/* out = act(gate) * up, rows of gate_up = [gate | up]. */
static int gated_mul(const float *gate_up, float *out, int64_t M, int64_t F, int num_threads,
                     int act) {
    if (M < 0 || F <= 0) return TANDEM_BAD_SHAPE;
#pragma omp parallel for num_threads(num_threads) if (M > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * F, *u = g + F;
        float *o = out + m * F;
        int64_t f = 0;
#if defined(__AVX512F__)
        for (; f < F; f += 16) { /* the tail masked: every element through act16 */
            const __mmask16 k = tandem_mask16(F - f);
            _mm512_mask_storeu_ps(o + f, k, _mm512_mul_ps(act16(_mm512_maskz_loadu_ps(k, g + f), act),
                                                          _mm512_maskz_loadu_ps(k, u + f)));
        }
#endif
        for (; f < F; f++) o[f] = act1(g[f], act) * u[f];
    }
    return TANDEM_OK;
}

int tandem_silu_mul_f32(const float *gate_up, float *out, int64_t M, int64_t F,
                        int num_threads) {
    return gated_mul(gate_up, out, M, F, num_threads, ACT_SILU);
}

int tandem_gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t M, int64_t F,
                             int num_threads) {
    return gated_mul(gate_up, out, M, F, num_threads, ACT_GELU_TANH);
}

/* x [M, N] -> softcap tanh(x / softcap) in place, rows over the threads (Gemma 2's final
 * logits; the torch form took 1.9 ms a step for 8 rows of 49,152 on one thread). */
int tandem_softcap_f32(float *x, int64_t M, int64_t N, float softcap, int num_threads) {
    if (M < 0 || N <= 0 || !(softcap > 0.0f)) return TANDEM_BAD_SHAPE;
#pragma omp parallel for num_threads(num_threads) if (M > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) tandem_softcap(x + m * N, N, softcap);
    return TANDEM_OK;
}

/* ---- the decode step's layer loop (tandem_decode_layers_f32) ---- */

typedef int (*quant_matmul_fn)(const float *x, const uint8_t *const *parts,
                               const int64_t *part_rows, int num_parts, float *out, int64_t M,
                               int64_t K, int64_t ldo, int fmt, int num_threads, int isa);
typedef int (*attention_fn)(const float *q, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables, const int64_t *query_seq,
                            const int64_t *seq_lens, float *out, float *scratch,
                            int64_t num_queries, int64_t num_seqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                            int64_t block_size, int64_t max_blocks, int64_t max_seq_len,
                            int64_t window, float scale, float softcap, int num_threads);

/* One layer's addresses, in this order (kernels/decode_ops.py LAYER_FIELDS): input norm
 * weight, the norm weight before the MLP, then for q/k/v, o, gate/up and down: the parts
 * array, the part_rows array and the number of parts; then the layer's k_cache and v_cache;
 * the q/k/v bias, q_norm and k_norm weights (0: none), the attention's sliding window (0:
 * none); the norms of the attention's and the MLP's outputs (Gemma's post-attention and
 * post-feedforward norms; 0: none); the layer's rotary cos and sin tables. */
enum { L_W_IN, L_W_POST, L_QKV, L_O = L_QKV + 3, L_GU = L_O + 3, L_DOWN = L_GU + 3,
       L_K = L_DOWN + 3, L_V, L_QKV_BIAS, L_Q_NORM, L_K_NORM, L_WINDOW, L_W_ATTN_OUT,
       L_W_MLP_OUT, L_COS, L_SIN, LAYER_FIELDS };

/* Errors: this file's codes as they are; the matmul's + 10; the attention's + 20. */
#define MATMUL(f, in, out, n, k)                                                               \
    do {                                                                                       \
        const int rc_ = matmul(in, (const uint8_t *const *)(intptr_t)L[f],                     \
                               (const int64_t *)(intptr_t)L[f + 1], (int)L[f + 2], out, T, k,  \
                               n, fmt, num_threads, isa);                                      \
        if (rc_) return 10 + rc_;                                                              \
    } while (0)

/*
 * Every decoder layer of a decode step (T sequences of one token each) and the final norm:
 * per layer x += y; h = rmsnorm(x) w_in; qkv = h Wqkv; rope + KV write; a = attention;
 * o = a Wo [o = rmsnorm(o) w_attn_out]; x += o; h = rmsnorm(x) w_post; gu = h Wgu;
 * m = act(g) u; y = m Wdown [y = rmsnorm(y) w_mlp_out]. One call instead of eight per layer
 * from Python. Buffers (float32, caller-owned): x [T, hidden] (the embeddings in, the residual
 * stream after), h, o, down [T, hidden], qkv [T, (heads + 2 kv_heads) head_dim], q, a [T,
 * heads * head_dim], gu [T, 2 ffn], act [T, ffn], out [T, hidden]. activation: ACT_SILU or
 * ACT_GELU_TANH; softcap: the attention's (0: none); kv_f16: the KV cache holds float16 (the
 * attention function then reads float16: tandem_paged_attention_f16kv).
 */
int tandem_decode_layers_f32(
    const int64_t *layers, int64_t num_layers, float *x, float *h, float *qkv, float *q,
    float *a, float *o, float *gu, float *act, float *down, float *out, const float *final_norm,
    int64_t T, int64_t hidden, int64_t ffn, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, float eps, const int64_t *positions, int64_t max_positions,
    const int64_t *slot_mapping, int64_t num_blocks, int64_t block_size,
    const int64_t *block_tables, const int64_t *seq_lens, int64_t max_blocks,
    int64_t max_seq_len, float *scratch, float scale, float softcap, int activation, int fmt,
    int isa, int num_threads, quant_matmul_fn matmul, attention_fn attention, int kv_f16) {
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
    const int64_t q_width = num_heads * head_dim;
    const float *residual = NULL;
    int rc;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *L = layers + l * LAYER_FIELDS;
        void *k_cache = (void *)(intptr_t)L[L_K], *v_cache = (void *)(intptr_t)L[L_V];
        rc = tandem_add_rmsnorm_f32(x, residual, (const float *)(intptr_t)L[L_W_IN], h, T,
                                    hidden, eps, num_threads);
        if (rc) return rc;
        MATMUL(L_QKV, h, qkv, qkv_width, hidden);
        rc = tandem_rope_write_kv_f32(qkv, q, T, qkv_width, num_heads, num_kv_heads, head_dim,
                                      positions, (const float *)(intptr_t)L[L_COS],
                                      (const float *)(intptr_t)L[L_SIN], max_positions,
                                      k_cache, v_cache,
                                      slot_mapping, num_blocks * block_size,
                                      (const float *)(intptr_t)L[L_QKV_BIAS],
                                      (const float *)(intptr_t)L[L_Q_NORM],
                                      (const float *)(intptr_t)L[L_K_NORM], eps, num_threads,
                                      kv_f16);
        if (rc) return rc;
        rc = attention(q, k_cache, v_cache, block_tables, NULL, seq_lens, a, scratch, T, T,
                       num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks,
                       max_seq_len, L[L_WINDOW], scale, softcap, num_threads);
        if (rc) return 20 + rc;
        MATMUL(L_O, a, o, hidden, q_width);
        if (L[L_W_ATTN_OUT]) { /* in place: the norm reads a row whole before writing it */
            rc = tandem_add_rmsnorm_f32(o, NULL, (const float *)(intptr_t)L[L_W_ATTN_OUT], o, T,
                                        hidden, eps, num_threads);
            if (rc) return rc;
        }
        rc = tandem_add_rmsnorm_f32(x, o, (const float *)(intptr_t)L[L_W_POST], h, T, hidden,
                                    eps, num_threads);
        if (rc) return rc;
        MATMUL(L_GU, h, gu, 2 * ffn, hidden);
        rc = gated_mul(gu, act, T, ffn, num_threads, activation);
        if (rc) return rc;
        MATMUL(L_DOWN, act, down, hidden, ffn);
        if (L[L_W_MLP_OUT]) {
            rc = tandem_add_rmsnorm_f32(down, NULL, (const float *)(intptr_t)L[L_W_MLP_OUT], down,
                                        T, hidden, eps, num_threads);
            if (rc) return rc;
        }
        residual = down;
    }
    return tandem_add_rmsnorm_f32(x, residual, final_norm, out, T, hidden, eps, num_threads);
}

/* The first index of the largest of row[0..N) (no NaN in the row). */
static int64_t argmax_finite(const float *row, int64_t N) {
    int64_t i = 0, best_i = 0;
    float best = row[0];
#if defined(__AVX512F__)
    if (N >= 16) { /* per lane: the largest value and its first index, then across lanes */
        __m512 bv = _mm512_loadu_ps(row);
        __m512i bi = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        __m512i idx = bi;
        const __m512i step = _mm512_set1_epi32(16);
        for (i = 16; i + 16 <= N && i < INT32_MAX - 16; i += 16) {
            idx = _mm512_add_epi32(idx, step);
            const __m512 v = _mm512_loadu_ps(row + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
            bv = _mm512_mask_mov_ps(bv, gt, v);
            bi = _mm512_mask_mov_epi32(bi, gt, idx);
        }
        best = _mm512_reduce_max_ps(bv);
        const __mmask16 at = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(at, bi);
    }
#endif
    for (; i < N; i++)
        if (row[i] > best) best = row[i], best_i = i;
    return best_i;
}

/* out[m] = the first index of row m's largest value (torch.argmax's answer: a NaN counts as
 * the largest, so the first NaN wins). NaNs are found first, with integer tests; the float
 * compares of argmax_finite then see none. */
int tandem_argmax_rows_f32(const float *x, int64_t M, int64_t N, int64_t *out,
                           int num_threads) {
    if (M < 0 || N <= 0) return TANDEM_BAD_SHAPE;
#pragma omp parallel for num_threads(num_threads) if (M > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *bits = (const uint32_t *)(x + m * N);
        int nan = 0;
#pragma omp simd reduction(| : nan)
        for (int64_t i = 0; i < N; i++) nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        int64_t first = 0;
        if (nan)
            while ((bits[first] & 0x7fffffffu) <= 0x7f800000u) first++;
        else
            first = argmax_finite(x + m * N, N);
        out[m] = first;
    }
    return TANDEM_OK;
}
