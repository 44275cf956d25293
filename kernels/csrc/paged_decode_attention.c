/*
 * Paged attention for CPUs, one query token at a time: the decode step's queries (one per
 * sequence) and a prefill chunk's (each token of the chunk, over the cache up to itself), K/V
 * read in place from the paged cache (no gather, no padding). Built and called by
 * kernels/cpu_attention.py, which documents the contract; the layouts are those of
 * kernels/reference.py.
 *
 * Work item = (query, part of its context), every KV head: a token's K (or V) row of all KV
 * heads is contiguous in its block, so an item streams whole rows in address order, and each
 * row is read once for the whole group of query heads that shares it (grouped-query
 * attention). Two passes over the part: scores q.k into a per-thread scratch row per head,
 * then the softmax-weighted sum of V. Items are spread over OpenMP threads dynamically
 * (contexts are ragged). Source: PagedAttention (Kwon et al., SOSP 2023), section 4.1, the
 * decode kernel.
 *
 * One order of sums per query (batch invariance): a query's output depends on its own q, its
 * context length and the cache, never on the other queries of the call, its position among
 * them, the thread count, or whether it is a decode step's or a prefill chunk's (so a token's
 * KV is the same bits whether its prompt was computed in one chunk, in chunks of 7, after a
 * cached prefix, or recomputed after preemption). Hence: contexts are cut into parts by their
 * length alone (part_tokens), each dot product and sum has one order on every path (16 lanes
 * and a fixed tree: vec_math.h), and exp is the same function for every element.
 *
 * Sliding-window attention (Mistral, Phi-3): with window W > 0 a query attends to the last W
 * of its context only (Hugging Face's key > query - W); the blocks before them are never read
 * (their table entries may name freed blocks), and the parts are cut over the window alone.
 *
 * Soft-capping (Gemma 2): with softcap c > 0 each scaled score s becomes c tanh(s / c) before
 * the softmax (tandem_tanh, the same function for every element).
 *
 * Two cache element types, one code (paged_attention_kv.h, included once per type): float32
 * (tandem_paged_attention_f32) and float16 (tandem_paged_attention_f16kv, llama.cpp's default
 * cache type: half the bytes a step streams). q, scores and out are float32 in both; a float16
 * element widens to a float exactly, so the float16 copy computes the float32 copy's sums, in
 * its order, over the cache's values.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd_sums.h"
#include "vec_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define TANDEM_OK 0
#define TANDEM_BAD_BLOCK_ID 1
#define TANDEM_BAD_SEQ_LEN 2
#define TANDEM_NO_MEMORY 3
#define TANDEM_BAD_QUERY_SEQ 4

/* Contexts are cut into parts of whole blocks, attended separately (local max, sum and
 * unnormalised output) and merged, as flash-decoding's split-K (Dao et al., "Flash-Decoding
 * for long-context inference", 2023): up to MAX_PARTS parts of at least MIN_PART_TOKENS. The
 * cut depends on the context length alone (and the block size), never on the number of
 * queries or threads, so a query's result is the same in any call; a short context is one
 * part, normalised in place. */
#define MAX_PARTS 16
#define MIN_PART_TOKENS 64

/* The first token a query with len cached tokens attends to: len - window with a window. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The tokens per part of a context of len tokens. */
static int64_t part_tokens(int64_t len, int64_t block_size) {
    int64_t per = (len + MAX_PARTS - 1) / MAX_PARTS;
    per = per < MIN_PART_TOKENS ? MIN_PART_TOKENS : per;
    return (per + block_size - 1) / block_size * block_size;
}

/* sc[0..n) -> exp(sc - max) (and, when whole, divided by their sum); *max_out, *sum_out: the
 * part's max and sum for the merge. The sum is tandem_ordered_sum's (fixed order). */
static void softmax_part(float *sc, int64_t n, int whole, float *max_out, float *sum_out) {
    float max = sc[0];
    int64_t t = 0;
#if defined(__AVX512F__)
    /* the same largest value as the loop below, 16 at a time (a max has no order to keep; a
     * tie of -0 and +0 may pick either, which no difference below sees) */
    __m512 lanes = _mm512_set1_ps(max);
    for (; t < n; t += 16) {
        const __mmask16 k = tandem_mask16(n - t);
        lanes = _mm512_mask_max_ps(lanes, k, lanes, _mm512_maskz_loadu_ps(k, sc + t));
    }
    max = _mm512_reduce_max_ps(lanes);
#endif
    for (; t < n; ++t)
        max = sc[t] > max ? sc[t] : max;
    t = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(max);
    for (; t < n; t += 16) {
        const __mmask16 k = tandem_mask16(n - t);
        _mm512_mask_storeu_ps(sc + t, k, tandem_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), mv)));
    }
#endif
    for (; t < n; ++t)
        sc[t] = tandem_exp(sc[t] - max);
    const float sum = tandem_ordered_sum(sc, NULL, n);
    if (whole) {
        const float inv = 1.0f / sum;
        for (t = 0; t < n; ++t)
            sc[t] *= inv;
    }
    *max_out = max;
    *sum_out = sum;
}

/* out [num_heads, head_dim] = the merge of parts p < parts (part_out [parts][num_heads *
 * head_dim], part_max and part_sum [parts][num_heads]): sum_p e^(m_p - M) o_p /
 * sum_p e^(m_p - M) l_p, parts in order. */
static void merge_parts(int64_t parts, int64_t num_heads, int64_t head_dim,
                        const float *part_out, const float *part_max, const float *part_sum,
                        float *out) {
    const int64_t row = num_heads * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
        const float *m = part_max + h, *l = part_sum + h;
        float M = m[0];
        for (int64_t p = 1; p < parts; ++p)
            M = m[p * num_heads] > M ? m[p * num_heads] : M;
        float total = 0.0f, *oh = out + h * head_dim;
        memset(oh, 0, sizeof(float) * head_dim);
        for (int64_t p = 0; p < parts; ++p) {
            const float w = tandem_exp(m[p * num_heads] - M);
            const float *o = part_out + p * row + h * head_dim;
            total = fmaf(w, l[p * num_heads], total);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d)
                oh[d] = fmaf(w, o[d], oh[d]);
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d)
            oh[d] *= inv;
    }
}

/* The two copies of the cache-reading half: float32 K/V (tandem_paged_attention_f32) and
 * float16 K/V (tandem_paged_attention_f16kv; q, scores and out float32 as in the first). */
#define KV_T float
#define KV_SFX f32
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_ROW(k, buf, n) ((void)(buf), (k))
#define KV_ROW_FLOATS(n) 1
#define KV_PER_LINE 16
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_SFX
#undef KV_LOAD16
#undef KV_ROW
#undef KV_ROW_FLOATS
#undef KV_PER_LINE

/* n float16 elements at k widened into buf (exact). */
static inline const float *widen_f16(const _Float16 *k, float *buf, int64_t n) {
    for (int64_t d = 0; d < n; ++d)
        buf[d] = (float)k[d];
    return buf;
}

#define KV_T _Float16
#define KV_SFX f16kv
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define KV_ROW(k, buf, n) widen_f16(k, buf, n)
#define KV_ROW_FLOATS(n) (n)
#define KV_PER_LINE 32
#include "paged_attention_kv.h"
