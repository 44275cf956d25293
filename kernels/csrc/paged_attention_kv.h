/*
 * The half of csrc/paged_decode_attention.c that reads the cache: included there once per KV
 * cache element type, with
 *   KV_T               the element type (float, _Float16)
 *   KV_SFX             the suffix of this copy's names (f32, f16kv)
 *   KV_LOAD16(p)       16 elements at p as an __m512 of floats (AVX-512 builds)
 *   KV_ROW(k, buf, n)  n elements at k as const float * (buf: KV_ROW_FLOATS(n) floats of room)
 *   KV_PER_LINE        elements per 64-byte cache line
 * Queries, scores and outputs are float32 in both; a half element widens exactly to a float, so
 * the sums are the float32 copy's, in the same order, over the cache's values.
 */
#ifndef KV_FN
#define KV_CAT2(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_FN(name) KV_CAT(name, KV_SFX)
#endif

/* The tokens [t0, t0 + *n) of [t0, t_end) that lie in one block: returns the row of token t0
 * (every KV head) in cache, and in *next the first row of the following block when the range
 * goes on (else NULL). Walking block by block keeps the division out of the per-token loop. */
static inline const KV_T *KV_FN(block_run)(const KV_T *cache, const int64_t *table, int64_t t0,
                                     int64_t t_end, int64_t block_size, int64_t token_stride,
                                     int64_t *n, const KV_T **next) {
    const int64_t blk = t0 / block_size, off = t0 - blk * block_size;
    const int64_t block_stride = block_size * token_stride;
    *n = t_end - t0 < block_size - off ? t_end - t0 : block_size - off;
    *next = t0 + *n < t_end ? cache + table[blk + 1] * block_stride : NULL;
    return cache + table[blk] * block_stride + off * token_stride;
}

/* Prefetch row i of the next block (K/V stream from DRAM at every decode step and blocks lie
 * anywhere in the cache: the hardware prefetcher cannot guess the next one). A row per token
 * keeps the prefetches spread out instead of a burst that fills the miss queue. */
static inline void KV_FN(prefetch_row)(const KV_T *next, int64_t i, int64_t token_stride) {
    if (next)
        for (int64_t d = 0; d < token_stride; d += KV_PER_LINE) /* one 64-byte line */
            __builtin_prefetch(next + i * token_stride + d);
}

/* The two passes over the tokens [t_begin, t_end) of one sequence, every head (query head h
 * reads KV head h / group; q and os are [num_heads, head_dim]):
 *   score:  scores[h * stride + t - t_begin] = scale * q[h] . K[t]
 *   weigh:  os[h] = sum over t of scores[h * stride + t - t_begin] V[t]
 */
typedef void (*KV_FN(score_fn))(const float *q, const KV_T *k_cache, const int64_t *table,
                         int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t t_begin,
                         int64_t t_end, int64_t block_size, float scale, float *scores,
                         int64_t stride);
typedef void (*KV_FN(weigh_fn))(const KV_T *v_cache, const int64_t *table, int64_t num_kv_heads,
                         int64_t group, int64_t head_dim, int64_t t_begin, int64_t t_end,
                         int64_t block_size, const float *scores, int64_t stride, float *os);

/* Any shape, plain loops (vectorised over head_dim by the compiler); the same sums as the
 * AVX-512 passes below, in the same order. */
static void KV_FN(score_range)(const float *q, const KV_T *k_cache, const int64_t *table,
                        int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t t_begin,
                        int64_t t_end, int64_t block_size, float scale, float *scores,
                        int64_t stride) {
    const int64_t token_stride = num_kv_heads * head_dim, num_heads = num_kv_heads * group;
    float row[KV_ROW_FLOATS(head_dim)]; /* a K row in float32 when KV_T is not */
    for (int64_t t0 = t_begin, n; t0 < t_end; t0 += n) {
        const KV_T *next;
        const KV_T *kb = KV_FN(block_run)(k_cache, table, t0, t_end, block_size, token_stride,
                                          &n, &next);
        for (int64_t i = 0; i < n; ++i) {
            KV_FN(prefetch_row)(next, i, token_stride);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *qh = q + h * head_dim;
                const KV_T *k = kb + i * token_stride + (h / group) * head_dim;
                /* the AVX-512 passes' order (16 lanes over head_dim, hsum4's tree) */
                scores[h * stride + t0 - t_begin + i] =
                    tandem_ordered_sum(qh, KV_ROW(k, row, head_dim), head_dim) * scale;
            }
        }
    }
}

static void KV_FN(weigh_values)(const KV_T *v_cache, const int64_t *table, int64_t num_kv_heads,
                         int64_t group, int64_t head_dim, int64_t t_begin, int64_t t_end,
                         int64_t block_size, const float *scores, int64_t stride, float *os) {
    const int64_t token_stride = num_kv_heads * head_dim, num_heads = num_kv_heads * group;
    memset(os, 0, sizeof(float) * (size_t)(num_heads * head_dim));
    for (int64_t t0 = t_begin, n; t0 < t_end; t0 += n) {
        const KV_T *next;
        const KV_T *vb = KV_FN(block_run)(v_cache, table, t0, t_end, block_size, token_stride,
                                          &n, &next);
        for (int64_t i = 0; i < n; ++i) {
            KV_FN(prefetch_row)(next, i, token_stride);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float p = scores[h * stride + t0 - t_begin + i];
                const KV_T *v = vb + i * token_stride + (h / group) * head_dim;
                float *oh = os + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d)
                    oh[d] = fmaf(p, (float)v[d], oh[d]); /* one fma a term, as the AVX-512 passes */
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/*
 * The same passes with AVX-512 intrinsics for G query heads per KV head and head_dim = 16 C.
 * The plain loops end each dot product in its own horizontal sum and load and store every
 * output row again for each token (a store-to-load chain through L1): 3x slower with the
 * context in cache. Here, block by block and KV head by KV head, the group's queries stay in
 * registers and a token's G dot products share one horizontal sum of four vectors (hsum4); the
 * weighted V sum keeps the group's G x C accumulators in registers over a block. The same
 * sums in the same order as the plain loops (head_dim = 16 C: lane j sums d = j mod 16).
 */

#define AVX512_PASSES(G, C)                                                                    \
    static void KV_FN(score_##G##x##C)(const float *q, const KV_T *k_cache, const int64_t *table,  \
                                int64_t num_kv_heads, int64_t group, int64_t head_dim,         \
                                int64_t t_begin, int64_t t_end, int64_t block_size,            \
                                float scale, float *scores, int64_t stride) {                   \
        const int64_t token_stride = num_kv_heads * 16 * C;                                    \
        const __m128 sv = _mm_set1_ps(scale);                                                  \
        (void)group, (void)head_dim;                                                           \
        for (int64_t t0 = t_begin, n; t0 < t_end; t0 += n) {                                   \
            const KV_T *next;                                                                 \
            const KV_T *kb = KV_FN(block_run)(k_cache, table, t0, t_end, block_size, token_stride, \
                                        &n, &next);                                            \
            for (int64_t kh = 0; kh < num_kv_heads; ++kh) {                                    \
                __m512 qv[G][C];                                                               \
                for (int g = 0; g < G; ++g)                                                    \
                    for (int c = 0; c < C; ++c)                                                \
                        qv[g][c] = _mm512_loadu_ps(q + ((kh * G + g) * C + c) * 16);           \
                float *dst = scores + kh * G * stride + t0 - t_begin;                          \
                for (int64_t i = 0; i < n; ++i) {                                              \
                    if (kh == 0) KV_FN(prefetch_row)(next, i, token_stride);                       \
                    const KV_T *k = kb + i * token_stride + kh * 16 * C;                      \
                    __m512 kv[C];                                                              \
                    for (int c = 0; c < C; ++c) kv[c] = KV_LOAD16(k + 16 * c);           \
                    for (int g0 = 0; g0 < G; g0 += 4) {                                        \
                        __m512 acc[4];                                                         \
                        for (int j = 0; j < 4; ++j) {                                          \
                            acc[j] = _mm512_setzero_ps();                                      \
                            if (g0 + j < G)                                                    \
                                for (int c = 0; c < C; ++c)                                    \
                                    acc[j] = _mm512_fmadd_ps(qv[g0 + j][c], kv[c], acc[j]);    \
                        }                                                                      \
                        float four[4];                                                         \
                        _mm_storeu_ps(four, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]),  \
                                                       sv));                                   \
                        for (int j = 0; j < 4 && g0 + j < G; ++j)                              \
                            dst[(g0 + j) * stride + i] = four[j];                              \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void KV_FN(weigh_##G##x##C)(const KV_T *v_cache, const int64_t *table,                  \
                                int64_t num_kv_heads, int64_t group, int64_t head_dim,         \
                                int64_t t_begin, int64_t t_end, int64_t block_size,            \
                                const float *scores, int64_t stride, float *os) {              \
        const int64_t token_stride = num_kv_heads * 16 * C;                                    \
        (void)group, (void)head_dim;                                                           \
        memset(os, 0, sizeof(float) * (size_t)(num_kv_heads * G * C * 16));                    \
        for (int64_t t0 = t_begin, n; t0 < t_end; t0 += n) {                                   \
            const KV_T *next;                                                                 \
            const KV_T *vb = KV_FN(block_run)(v_cache, table, t0, t_end, block_size, token_stride, \
                                        &n, &next);                                            \
            for (int64_t kh = 0; kh < num_kv_heads; ++kh) {                                    \
                float *o = os + kh * G * C * 16;                                               \
                const float *p = scores + kh * G * stride + t0 - t_begin;                      \
                __m512 acc[G][C];                                                              \
                for (int g = 0; g < G; ++g)                                                    \
                    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(o + (g * C + c) * 16); \
                for (int64_t i = 0; i < n; ++i) {                                              \
                    if (kh == 0) KV_FN(prefetch_row)(next, i, token_stride);                       \
                    const KV_T *v = vb + i * token_stride + kh * 16 * C;                      \
                    __m512 vv[C];                                                              \
                    for (int c = 0; c < C; ++c) vv[c] = KV_LOAD16(v + 16 * c);           \
                    for (int g = 0; g < G; ++g) {                                              \
                        const __m512 pg = _mm512_set1_ps(p[g * stride + i]);                   \
                        for (int c = 0; c < C; ++c)                                            \
                            acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);                 \
                    }                                                                          \
                }                                                                              \
                for (int g = 0; g < G; ++g)                                                    \
                    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + (g * C + c) * 16, acc[g][c]); \
            }                                                                                  \
        }                                                                                      \
    }

/* (group, head_dim / 16) pairs with G x C <= 24 accumulators: head_dim 32, 64, 128 */
AVX512_PASSES(1, 2)
AVX512_PASSES(1, 4)
AVX512_PASSES(1, 8)
AVX512_PASSES(2, 2)
AVX512_PASSES(2, 4)
AVX512_PASSES(2, 8)
AVX512_PASSES(3, 2)
AVX512_PASSES(3, 4)
AVX512_PASSES(3, 8)
AVX512_PASSES(4, 2)
AVX512_PASSES(4, 4)
AVX512_PASSES(8, 2)
#define SHAPE(G, C) {G, 16 * C, KV_FN(score_##G##x##C), KV_FN(weigh_##G##x##C)}
static const struct {
    int64_t group, head_dim;
    KV_FN(score_fn) score;
    KV_FN(weigh_fn) weigh;
} KV_FN(AVX512_SHAPES)[] = {
    SHAPE(1, 2), SHAPE(1, 4), SHAPE(1, 8), SHAPE(2, 2), SHAPE(2, 4), SHAPE(2, 8),
    SHAPE(3, 2), SHAPE(3, 4), SHAPE(3, 8), SHAPE(4, 2), SHAPE(4, 4), SHAPE(8, 2)};
#endif

/* The passes for this shape: AVX-512 where compiled in and instantiated, else the loops. */
static void KV_FN(choose_passes)(int64_t group, int64_t head_dim, KV_FN(score_fn) *score,
                                 KV_FN(weigh_fn) *weigh) {
    *score = KV_FN(score_range);
    *weigh = KV_FN(weigh_values);
    (void)group, (void)head_dim;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (size_t i = 0; i < sizeof(KV_FN(AVX512_SHAPES)) / sizeof(KV_FN(AVX512_SHAPES)[0]); ++i)
        if (KV_FN(AVX512_SHAPES)[i].group == group
            && KV_FN(AVX512_SHAPES)[i].head_dim == head_dim) {
            *score = KV_FN(AVX512_SHAPES)[i].score;
            *weigh = KV_FN(AVX512_SHAPES)[i].weigh;
        }
#endif
}

/* One part [t_begin, t_end) of query i's context: scores, softmax, the weighted V sum into
 * dst ([num_heads, head_dim]); whole (the part is the context): normalised in place, else the
 * part's max and sum per head into part_max, part_sum [num_heads]. */
static void KV_FN(attend_part)(const float *q, const KV_T *k_cache, const KV_T *v_cache,
                        const int64_t *table, int64_t num_kv_heads, int64_t group,
                        int64_t head_dim, int64_t t_begin, int64_t t_end, int64_t block_size,
                        float scale, float softcap, KV_FN(score_fn) score, KV_FN(weigh_fn) weigh,
                        float *scores, int whole, float *dst, float *part_max, float *part_sum) {
    const int64_t n = t_end - t_begin, num_heads = num_kv_heads * group;
    score(q, k_cache, table, num_kv_heads, group, head_dim, t_begin, t_end, block_size, scale,
          scores, n);
    for (int64_t h = 0; h < num_heads; ++h) {
        float max, sum;
        if (softcap > 0.0f)
            tandem_softcap(scores + h * n, n, softcap);
        softmax_part(scores + h * n, n, whole, &max, &sum);
        if (!whole) {
            part_max[h] = max;
            part_sum[h] = sum;
        }
    }
    weigh(v_cache, table, num_kv_heads, group, head_dim, t_begin, t_end, block_size, scores, n,
          dst);
}

int KV_FN(tandem_paged_attention)(
    const float *q,              /* [num_queries, num_heads, head_dim] */
    const KV_T *k_cache,         /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const KV_T *v_cache,         /* same as k_cache */
    const int64_t *block_tables, /* [num_seqs, max_blocks] */
    const int64_t *query_seq,    /* [num_queries]: each query's row of block_tables; NULL: i */
    const int64_t *seq_lens,     /* [num_queries]: cached tokens each query attends to */
    float *out,                  /* [num_queries, num_heads, head_dim] */
    float *scratch,              /* [num_threads, num_heads, max_seq_len] */
    int64_t num_queries, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
    int64_t max_seq_len, int64_t window, float scale, float softcap, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads, row = num_heads * head_dim;

    /* Validate first: a bad block id must not become an out-of-bounds read. A prefill chunk's
     * queries follow each other: their sequence's blocks are checked once. */
    for (int64_t i = 0, prev = -1, checked = 0; i < num_queries; ++i) {
        const int64_t len = seq_lens[i], s = query_seq ? query_seq[i] : i;
        if (s < 0 || s >= num_seqs)
            return TANDEM_BAD_QUERY_SEQ;
        if (len < 1 || len > max_seq_len || len > max_blocks * block_size)
            return TANDEM_BAD_SEQ_LEN;
        const int64_t *table = block_tables + s * max_blocks, used = (len + block_size - 1) / block_size;
        for (int64_t b = s == prev ? checked : 0; b < used; ++b)
            if (table[b] < 0 || table[b] >= num_blocks)
                return TANDEM_BAD_BLOCK_ID;
        checked = s == prev && checked > used ? checked : used;
        prev = s;
    }
    KV_FN(score_fn) score;
    KV_FN(weigh_fn) weigh;
    KV_FN(choose_passes)(group, head_dim, &score, &weigh);

    int64_t max_parts = 1;
    for (int64_t i = 0; i < num_queries; ++i) {
        const int64_t ctx = seq_lens[i] - window_start(seq_lens[i], window);
        const int64_t per = part_tokens(ctx, block_size), parts = (ctx + per - 1) / per;
        max_parts = parts > max_parts ? parts : max_parts;
    }
    /* Work items: with few queries, (query, part) pairs, so the threads share a long context
     * (parts kept in shared buffers, merged after a barrier); with enough queries to keep the
     * threads busy, whole queries (a thread's parts in its own small buffers). Which does not
     * change a result: a part is computed and the parts merged by the same code either way. */
    const int split = max_parts > 1 && num_queries < 4 * (int64_t)num_threads;
    const int64_t shared = split ? num_queries * max_parts : 0;
    float *part_out = shared ? malloc(sizeof(float) * (size_t)(shared * (row + 2 * num_heads)))
                             : NULL;
    if (shared && !part_out)
        return TANDEM_NO_MEMORY;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#ifdef _OPENMP
        float *scores = scratch + (int64_t)omp_get_thread_num() * num_heads * max_seq_len;
#else
        float *scores = scratch;
#endif
        /* a whole query's parts: [max_parts][row] outputs, then max and sum [max_parts][heads] */
        float *own = !split && max_parts > 1
            ? malloc(sizeof(float) * (size_t)(max_parts * (row + 2 * num_heads))) : NULL;
        float *po = split ? part_out : own;
        float *pm = po ? po + (split ? shared : max_parts) * row : NULL;
        float *ps = pm ? pm + (split ? shared : max_parts) * num_heads : NULL;
        if (!split && max_parts > 1 && !own)
            failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = 0; work < (split ? shared : num_queries); ++work) {
            if (failed)
                continue;
            const int64_t i = split ? work / max_parts : work;
            const int64_t len = seq_lens[i], lo = window_start(len, window);
            const int64_t per = part_tokens(len - lo, block_size);
            const int64_t parts = (len - lo + per - 1) / per;
            const int64_t *table = block_tables + (query_seq ? query_seq[i] : i) * max_blocks;
            const int64_t first = split ? work % max_parts : 0, last = split ? first + 1 : parts;
            for (int64_t part = first; part < last && part < parts; ++part) {
                const int64_t t_begin = lo + part * per;
                const int64_t t_end = t_begin + per < len ? t_begin + per : len;
                const int64_t slot = split ? work : part; /* this part's row of po, pm, ps */
                KV_FN(attend_part)(q + i * row, k_cache, v_cache, table, num_kv_heads, group,
                                   head_dim, t_begin, t_end, block_size, scale, softcap, score,
                                   weigh, scores, parts == 1,
                                   parts == 1 ? out + i * row : po + slot * row,
                                   parts == 1 ? NULL : pm + slot * num_heads,
                                   parts == 1 ? NULL : ps + slot * num_heads);
            }
            if (!split && parts > 1)
                merge_parts(parts, num_heads, head_dim, po, pm, ps, out + i * row);
        }
        if (split) {
            /* merge the parts (after the loop's barrier), as a whole query's are above */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_queries; ++i) {
                const int64_t ctx = seq_lens[i] - window_start(seq_lens[i], window);
                const int64_t per = part_tokens(ctx, block_size);
                const int64_t parts = (ctx + per - 1) / per;
                if (parts > 1)
                    merge_parts(parts, num_heads, head_dim, po + i * max_parts * row,
                                pm + i * max_parts * num_heads, ps + i * max_parts * num_heads,
                                out + i * row);
            }
        }
        free(own);
    }
    free(part_out);
    return failed ? TANDEM_NO_MEMORY : TANDEM_OK;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#undef AVX512_PASSES
#undef SHAPE
#endif
