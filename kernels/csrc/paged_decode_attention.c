/*
 * Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
 * paged cache (no gather, no padding). Built and called by kernels/cpu_attention.py, which
 * documents the contract; the layouts are those of kernels/reference.py.
 *
 * Work item = (sequence, KV head): the item's group of query heads (grouped-query attention)
 * shares every K/V row it reads, so each row is loaded from memory once per step. Two passes
 * over the context: scores q.k for the whole context into a per-thread scratch row, then the
 * softmax-weighted sum of V. Items are spread over OpenMP threads dynamically (contexts are
 * ragged); with few items, contexts are also cut into parts (split-K, below). Source:
 * PagedAttention (Kwon et al., SOSP 2023), section 4.1, the decode kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TANDEM_OK 0
#define TANDEM_BAD_BLOCK_ID 1
#define TANDEM_BAD_SEQ_LEN 2
#define TANDEM_NO_MEMORY 3

/* Prefetch one KV head's rows of a block: rows token_stride floats apart, head_dim each. */
static inline void prefetch_rows(const float *row, int64_t rows, int64_t token_stride,
                                 int64_t head_dim) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; d += 16) /* 16 floats: one 64-byte line */
            __builtin_prefetch(row + r * token_stride + d);
}

/* The tokens [t0, t0 + *n) of [t0, t_end) that lie in one block: returns their first row of
 * KV head kv_head in cache; prefetches that head's rows of the next block when the range goes
 * on (K/V stream from DRAM at every decode step: -20 to -40% time at 300-1000 tokens). Walking
 * block by block keeps the division out of the per-token loop. */
static inline const float *block_run(const float *cache, const int64_t *table, int64_t kv_head,
                                     int64_t t0, int64_t t_end, int64_t head_dim,
                                     int64_t block_size, int64_t token_stride,
                                     int64_t block_stride, int64_t *n) {
    const int64_t blk = t0 / block_size, off = t0 - blk * block_size;
    *n = t_end - t0 < block_size - off ? t_end - t0 : block_size - off;
    if (t0 + *n < t_end)
        prefetch_rows(cache + table[blk + 1] * block_stride + kv_head * head_dim, block_size,
                      token_stride, head_dim);
    return cache + table[blk] * block_stride + kv_head * head_dim + off * token_stride;
}

/* Few work items (batch 1-5 with 3 KV heads) leave threads idle: each item's context is then
 * cut into up to MAX_PARTS parts of whole blocks, attended separately (local max, sum and
 * unnormalised output) and merged, as flash-decoding's split-K (Dao et al., "Flash-Decoding
 * for long-context inference", 2023). The cut depends on the context only, never on the
 * thread count, so a row's result is the same on any number of threads. */
#define SPLIT_BELOW_ITEMS 16
#define MAX_PARTS 16
#define MIN_PART_TOKENS 64

/* Scores of query heads qs[0..group) against K rows [t_begin, t_end) of one KV head, scaled,
 * into scores[g * stride + t - t_begin]; returns nothing. */
static void score_range(const float *qs, const float *k_cache, const int64_t *table,
                        int64_t kv_head, int64_t t_begin, int64_t t_end, int64_t group,
                        int64_t head_dim, int64_t block_size, int64_t token_stride,
                        int64_t block_stride, float scale, float *scores, int64_t stride) {
    for (int64_t t0 = t_begin, n; t0 < t_end; t0 += n) {
        const float *kb = block_run(k_cache, table, kv_head, t0, t_end, head_dim, block_size,
                                    token_stride, block_stride, &n);
        for (int64_t i = 0; i < n; ++i) {
            const float *k = kb + i * token_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = qs + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d)
                    dot += qg[d] * k[d];
                scores[g * stride + t0 - t_begin + i] = dot * scale;
            }
        }
    }
}

/* os[g] = sum over t in [t_begin, t_end) of p[g][t] V[t] (os zeroed first), p read from
 * scores as score_range wrote them. */
static void weigh_values(const float *v_cache, const int64_t *table, int64_t kv_head,
                         int64_t t_begin, int64_t t_end, int64_t group, int64_t head_dim,
                         int64_t block_size, int64_t token_stride, int64_t block_stride,
                         const float *scores, int64_t stride, float *os) {
    memset(os, 0, sizeof(float) * group * head_dim);
    for (int64_t t0 = t_begin, n; t0 < t_end; t0 += n) {
        const float *vb = block_run(v_cache, table, kv_head, t0, t_end, head_dim, block_size,
                                    token_stride, block_stride, &n);
        for (int64_t i = 0; i < n; ++i) {
            const float *v = vb + i * token_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * stride + t0 - t_begin + i];
                float *og = os + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d)
                    og[d] += p * v[d];
            }
        }
    }
}

/* The parts of a context of len tokens: whole blocks each, at least MIN_PART_TOKENS, at most
 * MAX_PARTS of them; 1 when the items alone fill the threads. */
static int64_t part_tokens(int64_t len, int64_t items, int64_t block_size) {
    if (items >= SPLIT_BELOW_ITEMS) return len;
    int64_t per = (len + MAX_PARTS - 1) / MAX_PARTS;
    per = per < MIN_PART_TOKENS ? MIN_PART_TOKENS : per;
    return (per + block_size - 1) / block_size * block_size;
}

int tandem_paged_decode_attention_f32(
    const float *q,              /* [num_seqs, num_heads, head_dim] */
    const float *k_cache,        /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const float *v_cache,        /* same as k_cache */
    const int64_t *block_tables, /* [num_seqs, max_blocks] */
    const int64_t *seq_lens,     /* [num_seqs] */
    float *out,                  /* [num_seqs, num_heads, head_dim] */
    float *scratch,              /* [num_threads, num_heads / num_kv_heads, max_seq_len] */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t num_blocks, int64_t block_size, int64_t max_blocks, int64_t max_seq_len,
    float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;

    /* Validate first: a bad block id must not become an out-of-bounds read. */
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = seq_lens[s];
        if (len < 1 || len > max_seq_len || len > max_blocks * block_size)
            return TANDEM_BAD_SEQ_LEN;
        const int64_t *table = block_tables + s * max_blocks;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
            if (table[b] < 0 || table[b] >= num_blocks)
                return TANDEM_BAD_BLOCK_ID;
    }

    const int64_t items = num_seqs * num_kv_heads;
    int64_t max_parts = 1;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t per = part_tokens(seq_lens[s], items, block_size);
        const int64_t parts = (seq_lens[s] + per - 1) / per;
        max_parts = parts > max_parts ? parts : max_parts;
    }
    /* split: per (item, part) the unnormalised output [group, head_dim], max and sum [group] */
    float *part_out = NULL, *part_max = NULL, *part_sum = NULL;
    if (max_parts > 1) {
        part_out = malloc(sizeof(float) * (size_t)(items * max_parts * group * head_dim));
        part_max = malloc(sizeof(float) * (size_t)(items * max_parts * group));
        part_sum = malloc(sizeof(float) * (size_t)(items * max_parts * group));
        if (!part_out || !part_max || !part_sum) {
            free(part_out);
            free(part_max);
            free(part_sum);
            return TANDEM_NO_MEMORY;
        }
    }

#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        float *scores = scratch + (int64_t)omp_get_thread_num() * group * max_seq_len;
#else
        float *scores = scratch;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = 0; work < items * max_parts; ++work) {
            const int64_t item = work / max_parts, part = work % max_parts;
            const int64_t s = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t len = seq_lens[s], per = part_tokens(len, items, block_size);
            const int64_t t_begin = part * per;
            if (t_begin >= len) continue;  /* a shorter sequence than the longest: no such part */
            const int64_t t_end = t_begin + per < len ? t_begin + per : len, n = t_end - t_begin;
            const int64_t *table = block_tables + s * max_blocks;
            /* this item's query heads are contiguous: kv_head * group ... + group - 1 */
            const float *qs = q + (s * num_heads + kv_head * group) * head_dim;
            score_range(qs, k_cache, table, kv_head, t_begin, t_end, group, head_dim, block_size,
                        token_stride, block_stride, scale, scores, n);
            const int whole = n == len;  /* one part: normalise here, as the unsplit kernel */
            for (int64_t g = 0; g < group; ++g) {
                float *row = scores + g * n;
                float max = row[0];
                for (int64_t t = 1; t < n; ++t)
                    max = row[t] > max ? row[t] : max;
                float sum = 0.0f;
                for (int64_t t = 0; t < n; ++t) {
                    row[t] = expf(row[t] - max);
                    sum += row[t];
                }
                if (whole) {
                    const float inv = 1.0f / sum;
                    for (int64_t t = 0; t < n; ++t)
                        row[t] *= inv;
                } else {
                    part_max[(item * max_parts + part) * group + g] = max;
                    part_sum[(item * max_parts + part) * group + g] = sum;
                }
            }
            float *os = whole ? out + (s * num_heads + kv_head * group) * head_dim
                              : part_out + (item * max_parts + part) * group * head_dim;
            weigh_values(v_cache, table, kv_head, t_begin, t_end, group, head_dim, block_size,
                         token_stride, block_stride, scores, n, os);
        }
        if (max_parts > 1) {
            /* merge the parts (after the loop's barrier): out = sum_p e^(m_p - M) o_p /
             * sum_p e^(m_p - M) l_p, parts in order */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; ++item) {
                const int64_t s = item / num_kv_heads, kv_head = item % num_kv_heads;
                const int64_t len = seq_lens[s], per = part_tokens(len, items, block_size);
                const int64_t parts = (len + per - 1) / per;
                if (parts == 1) continue;  /* written in place above */
                float *os = out + (s * num_heads + kv_head * group) * head_dim;
                for (int64_t g = 0; g < group; ++g) {
                    const float *m = part_max + item * max_parts * group + g;
                    const float *l = part_sum + item * max_parts * group + g;
                    float M = m[0];
                    for (int64_t p = 1; p < parts; ++p)
                        M = m[p * group] > M ? m[p * group] : M;
                    float total = 0.0f, *og = os + g * head_dim;
                    memset(og, 0, sizeof(float) * head_dim);
                    for (int64_t p = 0; p < parts; ++p) {
                        const float w = expf(m[p * group] - M);
                        const float *o = part_out + ((item * max_parts + p) * group + g) * head_dim;
                        total += w * l[p * group];
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d)
                            og[d] += w * o[d];
                    }
                    const float inv = 1.0f / total;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d)
                        og[d] *= inv;
                }
            }
        }
    }
    free(part_out);
    free(part_max);
    free(part_sum);
    return TANDEM_OK;
}
