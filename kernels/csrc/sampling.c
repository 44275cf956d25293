/*
 * Random sampling of logits rows for the CPU: temperature, min-p, top-k and top-p (nucleus)
 * filtering, then one draw by inverse transform sampling, each row in a few passes over its
 * logits instead of a sort of the whole vocabulary. Built and called by kernels/sampling.py,
 * which documents the contract and holds the torch reference (services/engine/sampler.py keeps
 * the torch path for other devices).
 *
 *   tandem_sample_rows_f32    one token per row
 *   tandem_logprobs_rows_f32  a chosen token's logprob and the row's top-N, under log_softmax
 *
 * A row (logits l, vocabulary V; settings T > 0, k >= 0, 0 < p <= 1, min_p >= 0; u in [0, 1)):
 *   1. e_i = exp(l_i / T - m), m = max_j l_j / T (division by T > 0 keeps the order, so m is
 *      the largest l_j, divided); -inf and NaN logits weigh 0. min-p (Nguyen et al. 2024)
 *      zeroes e_i < min_p (p_i < min_p * p_max: the max weighs exp(0) = 1).
 *   2. top-k: the k heaviest tokens (by logit, the lower index first among equals) survive;
 *      top-p (Holtzman et al. 2020), over the top-k renormalised (vLLM's order): a token
 *      survives while the mass of those ranked before it is below p of the survivors' mass;
 *      the heaviest always survives. The ranking needs only the tokens that can make the cut:
 *      those that weigh at least CANDIDATE_WEIGHTS[0] are ranked first, lighter ones only
 *      when the cut may pass below them.
 *   3. the draw: the first token, in vocabulary order, at which the running sum of the
 *      survivors' weights exceeds u times their total. Sums are in double, in one order (in
 *      vocabulary order, 16 tokens a block, the blocks in order; the walk repeats those very
 *      additions, so it always crosses), so a row's token depends on nothing but the row and
 *      its settings: not on the other rows, their number or the thread count.
 *
 * Rows are spread over OpenMP threads; each thread has its own scratch (V floats and V
 * candidates). Built without -ffast-math (the sums keep the order written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec_math.h"

#define TANDEM_OK 0
#define TANDEM_BAD_SHAPE 2
#define TANDEM_BAD_ROW 3
#define TANDEM_BAD_SETTING 6
#define TANDEM_NO_MEMORY 7
#define BLOCK 16 /* tokens whose weights are summed together (the walk's first level) */
/* a filtered row's cut is looked for among the tokens that weigh this much at least, the
 * heaviest first: 1/16,384 of the largest weight holds a few dozen tokens at the temperatures
 * and nuclei that chats use (the built-in model's logits); 0 is every weighted token */
static const float CANDIDATE_WEIGHTS[] = {0x1p-14f, 0x1p-30f, 0x1p-60f, 0.0f};

typedef struct {
    float key; /* the logit: the ranking's order */
    int32_t index;
} candidate;

/* heaviest first; among equal logits the lower index first (a total order: qsort need not be
 * stable) */
static int by_rank(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static int by_index(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    return (x->index > y->index) - (x->index < y->index);
}

#define RADIX_FROM 512 /* candidates from which a radix sort beats qsort */
#define RADIX_BITS 11

/* A float's bits as an unsigned key that orders as the float does, reversed: the heaviest
 * first (the keys are finite or +inf: weighted tokens only). */
static inline uint32_t descending_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return ~((u & 0x80000000u) ? ~u : (u | 0x80000000u));
}

/* cand[0..n) into rank order (by_rank's), given in vocabulary order: a stable LSD radix sort
 * of the descending keys, 11 bits a pass, through tmp (n entries). */
static void rank_candidates(candidate *cand, candidate *tmp, int64_t n) {
    if (n < RADIX_FROM) {
        qsort(cand, (size_t)n, sizeof(candidate), by_rank);
        return;
    }
    candidate *src = cand, *dst = tmp;
    for (int shift = 0; shift < 32; shift += RADIX_BITS) {
        int64_t count[1 << RADIX_BITS] = {0};
        const uint32_t mask = (1u << RADIX_BITS) - 1;
        for (int64_t j = 0; j < n; j++) count[(descending_key(src[j].key) >> shift) & mask]++;
        int64_t at = 0;
        for (int d = 0; d < (1 << RADIX_BITS); d++) {
            const int64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t j = 0; j < n; j++)
            dst[count[(descending_key(src[j].key) >> shift) & mask]++] = src[j];
        candidate *t = src;
        src = dst, dst = t;
    }
    if (src != cand) memcpy(cand, src, (size_t)n * sizeof(candidate));
}

static float row_max(const float *l, int64_t V) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= V; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(l + i));
    m = _mm512_reduce_max_ps(acc);
#endif
    for (; i < V; i++) m = fmaxf(m, l[i]); /* fmaxf: a NaN loses */
    return m;
}

/* e_i (step 1) into e, each block's sum into bsum; returns the total (the blocks' sums in
 * order) and the number of tokens of non-zero weight in *nonzero. */
static double weights(const float *l, int64_t V, float T, float m, float min_p, float *e,
                      double *bsum, int64_t *nonzero) {
    int64_t i = 0, nz = 0;
#if defined(__AVX512F__)
    const __m512 tv = _mm512_set1_ps(T), mv = _mm512_set1_ps(m), pv = _mm512_set1_ps(min_p);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; i < V; i += 16) {
        const __mmask16 k = tandem_mask16(V - i);
        const __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(k, l + i), tv);
        /* weighs: a finite or +inf logit (not -inf, not NaN), and not below min-p */
        __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_GT_OQ) & k;
        const __m512 w = tandem_exp16(_mm512_sub_ps(x, mv));
        live &= _mm512_cmp_ps_mask(w, pv, _CMP_GE_OQ);
        _mm512_mask_storeu_ps(e + i, k, _mm512_maskz_mov_ps(live, w));
        nz += __builtin_popcount((unsigned)live);
    }
#else
    for (; i < V; i++) {
        const float x = l[i] / T;
        const float w = x > -INFINITY ? tandem_exp(x - m) : 0.0f; /* NaN: not > -inf */
        e[i] = w >= min_p ? w : 0.0f;
        nz += e[i] > 0.0f;
    }
#endif
    /* each block's sum in order, 8 blocks at a time (8 chains of additions, not one) */
    const int64_t full = V / BLOCK, blocks = (V + BLOCK - 1) / BLOCK;
    int64_t b = 0;
    for (; b + 8 <= full; b += 8) {
        double s[8] = {0.0};
        for (int j = 0; j < BLOCK; j++)
            for (int q = 0; q < 8; q++) s[q] += e[(b + q) * BLOCK + j];
        for (int q = 0; q < 8; q++) bsum[b + q] = s[q];
    }
    for (; b < blocks; b++) {
        const int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
        double s = 0.0;
        for (int64_t j = b * BLOCK; j < end; j++) s += e[j];
        bsum[b] = s;
    }
    double total = 0.0;
    for (b = 0; b < blocks; b++) total += bsum[b];
    *nonzero = nz;
    return total;
}

/* The tokens of non-zero weight at least thr into out (as candidates, in vocabulary order);
 * their count. */
static int64_t collect_above(const float *l, const float *e, int64_t V, float thr,
                             candidate *out) {
    int64_t n = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 tv = _mm512_set1_ps(thr), zero = _mm512_setzero_ps();
    int32_t ids[16];
    for (; i < V; i += 16) {
        const __mmask16 k = tandem_mask16(V - i);
        const __m512 w = _mm512_maskz_loadu_ps(k, e + i);
        const __mmask16 in = _mm512_cmp_ps_mask(w, tv, _CMP_GE_OQ)
                           & _mm512_cmp_ps_mask(w, zero, _CMP_GT_OQ) & k;
        if (!in) continue; /* most blocks */
        /* compressed in a register: the store form of vpcompressd is microcoded on Zen 4 */
        _mm512_storeu_si512(ids, _mm512_maskz_compress_epi32(in, _mm512_add_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32((int)i))));
        for (int j = 0, c = __builtin_popcount((unsigned)in); j < c; j++)
            out[n++] = (candidate){l[ids[j]], ids[j]};
    }
#else
    for (; i < V; i++)
        if (e[i] >= thr && e[i] > 0.0f) out[n++] = (candidate){l[i], (int32_t)i};
#endif
    return n;
}

/* The survivors among cand[0..n) (in vocabulary order on entry; in rank order after): their
 * count, or -1 when the cut may pass below them (they are not every weighted token, and all
 * of them fit within the cut). */
static int64_t cut(const float *e, candidate *cand, candidate *tmp, int64_t n, int64_t nonzero,
                   double total, int64_t k, float p) {
    const int64_t keep = (k > 0 && k < nonzero) ? k : nonzero;
    if (keep < nonzero && n < keep) return -1; /* top-k: fewer candidates than k */
    rank_candidates(cand, tmp, n);
    double mass = total;
    if (keep < nonzero) {
        mass = 0.0;
        for (int64_t j = 0; j < keep; j++) mass += e[cand[j].index];
    }
    const int64_t m = n < keep ? n : keep;
    if (!(p < 1.0f)) return m;
    const double goal = (double)p * mass;
    double before = 0.0;
    int64_t s = 0;
    for (; s < m && (s == 0 || before < goal); s++) before += e[cand[s].index];
    return s == m && keep == nonzero && n < nonzero ? -1 : s;
}

/* Step 3 over every token: the block sums, then the block's tokens. */
static int64_t draw_all(const float *e, const double *bsum, int64_t V, double total, float u) {
    const double target = (double)u * total;
    double acc = 0.0;
    int64_t b = 0;
    for (; b * BLOCK < V; b++) {
        if (acc + bsum[b] > target) break;
        acc += bsum[b];
    }
    if (b * BLOCK >= V) b--; /* not reached: u < 1 and the same additions give the total */
    const int64_t end = (b + 1) * BLOCK < V ? (b + 1) * BLOCK : V;
    double s = 0.0;
    int64_t last = b * BLOCK;
    for (int64_t j = b * BLOCK; j < end; j++) {
        if (e[j] > 0.0f) last = j;
        s += e[j];
        if (acc + s > target) return j;
    }
    return last;
}

/* Step 3 over the survivors cand[0..n) (in rank order): a few sorted into vocabulary order;
 * many (a flat distribution) through the weights, a token surviving when it ranks no lower
 * than the last survivor. */
static int64_t draw_among(const float *l, const float *e, int64_t V, candidate *cand, int64_t n,
                          float u) {
    if (n < RADIX_FROM) {
        qsort(cand, (size_t)n, sizeof(candidate), by_index);
        double total = 0.0;
        for (int64_t j = 0; j < n; j++) total += e[cand[j].index];
        const double target = (double)u * total;
        double acc = 0.0;
        for (int64_t j = 0; j < n; j++) {
            acc += e[cand[j].index];
            if (acc > target) return cand[j].index;
        }
        return cand[n - 1].index;
    }
    const float cut = cand[n - 1].key;
    const int64_t cut_index = cand[n - 1].index;
#define SURVIVES(i) (e[i] > 0.0f && (l[i] > cut || (l[i] == cut && (i) <= cut_index)))
    double total = 0.0;
    for (int64_t i = 0; i < V; i++)
        if (SURVIVES(i)) total += e[i];
    const double target = (double)u * total;
    double acc = 0.0;
    int64_t last = cand[0].index;
    for (int64_t i = 0; i < V; i++)
        if (SURVIVES(i)) {
            last = i;
            acc += e[i];
            if (acc > target) return i;
        }
#undef SURVIVES
    return last;
}

static int64_t sample_row(const float *l, int64_t V, float T, int64_t k, float p, float min_p,
                          float u, float *e, double *bsum, candidate *cand, candidate *tmp) {
    const float top = row_max(l, V);
    if (!(top > -INFINITY)) return 0; /* nothing weighs: every logit -inf or NaN */
    int64_t nonzero;
    const double total = weights(l, V, T, top / T, min_p, e, bsum, &nonzero);
    if (!((k > 0 && k < nonzero) || p < 1.0f)) return draw_all(e, bsum, V, total, u);
    /* the heavy tokens settle the cut in most rows; lighter ones join only when it may pass
     * below them */
    int64_t s = -1;
    for (int c = 0; s < 0; c++)
        s = cut(e, cand, tmp, collect_above(l, e, V, CANDIDATE_WEIGHTS[c], cand), nonzero, total,
                k, p);
    return draw_among(l, e, V, cand, s, u);
}

/* A thread's scratch: a row's weights and block sums, and `more` bytes for the caller; ok is
 * false when an allocation failed (the thread still meets its loop's barrier). */
typedef struct {
    float *e;
    double *bsum;
    void *more;
    int ok;
} scratch;

static scratch scratch_open(int64_t V, size_t more) {
    scratch s = {malloc((size_t)V * sizeof(float)),
                 malloc((size_t)((V + BLOCK - 1) / BLOCK) * sizeof(double)), malloc(more), 0};
    s.ok = s.e && s.bsum && s.more;
    return s;
}

static void scratch_close(scratch *s) { free(s->e), free(s->bsum), free(s->more); }

/* logits [num_logits, V] float32 (rows contiguous); rows [R]: the row of logits each draw
 * reads; temperature, top_p, min_p, uniforms [R] float32; top_k [R] int64 (0: off); out [R]
 * int64. Returns TANDEM_BAD_SHAPE (V outside 1..2^31-1), TANDEM_BAD_ROW (a row outside the
 * logits), TANDEM_BAD_SETTING (T <= 0, p or min_p outside (0, 1] or [0, 1], k < 0, u outside
 * [0, 1)), TANDEM_NO_MEMORY; nothing is written to out unless every setting is valid. */
int tandem_sample_rows_f32(const float *logits, int64_t num_logits, int64_t V,
                           const int64_t *rows, int64_t R, const float *temperature,
                           const int64_t *top_k, const float *top_p, const float *min_p,
                           const float *uniforms, int64_t *out, int num_threads) {
    if (V <= 0 || V > INT32_MAX || R < 0 || num_logits < 0) return TANDEM_BAD_SHAPE;
    for (int64_t r = 0; r < R; r++) {
        if (rows[r] < 0 || rows[r] >= num_logits) return TANDEM_BAD_ROW;
        if (!(temperature[r] > 0.0f) || !(top_p[r] > 0.0f && top_p[r] <= 1.0f)
            || !(min_p[r] >= 0.0f && min_p[r] <= 1.0f) || top_k[r] < 0
            || !(uniforms[r] >= 0.0f && uniforms[r] < 1.0f))
            return TANDEM_BAD_SETTING;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (R > 1) reduction(| : failed)
    {
        scratch t = scratch_open(V, (size_t)V * 2 * sizeof(candidate)); /* ranks, and a sort's */
        candidate *cand = t.more;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) { /* every thread meets the loop (its barrier) */
            if (t.ok)
                out[r] = sample_row(logits + rows[r] * V, V, temperature[r], top_k[r], top_p[r],
                                    min_p[r], uniforms[r], t.e, t.bsum, cand, cand + V);
            else
                failed = 1;
        }
        scratch_close(&t);
    }
    return failed ? TANDEM_NO_MEMORY : TANDEM_OK;
}

/* Insert (v, i) into the n-entry top list (heaviest first; an equal logit already there stays
 * ahead: it has the lower index), keeping at most cap entries; returns the new count. */
static int64_t top_insert(float *val, int64_t *idx, int64_t n, int64_t cap, float v, int64_t i) {
    int64_t j = n < cap ? n : cap - 1;
    while (j > 0 && val[j - 1] < v) {
        val[j] = val[j - 1], idx[j] = idx[j - 1];
        j--;
    }
    val[j] = v, idx[j] = i;
    return n < cap ? n + 1 : cap;
}

/* The num_top highest logits of a row (ties: the lower index first; -inf ones last, in index
 * order, when fewer are finite), into val/idx; NaN logits are never among them. */
static void top_logits(const float *l, int64_t V, int64_t num_top, float *val, int64_t *idx) {
    int64_t n = 0, i = 0;
    float floor_v = -INFINITY; /* a logit must beat it to enter (once the list is full) */
#if defined(__AVX512F__)
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(l + i);
        unsigned in = _mm512_cmp_ps_mask(v, _mm512_set1_ps(floor_v), _CMP_GT_OQ);
        for (; in; in &= in - 1) { /* most blocks: none, once the list holds its heaviest */
            const int64_t j = i + __builtin_ctz(in);
            if (!(l[j] > floor_v)) continue; /* the floor rose within this block */
            n = top_insert(val, idx, n, num_top, l[j], j);
            if (n == num_top) floor_v = val[n - 1];
        }
    }
#endif
    for (; i < V; i++)
        if (l[i] > floor_v) {
            n = top_insert(val, idx, n, num_top, l[i], i);
            if (n == num_top) floor_v = val[n - 1];
        }
    for (i = 0; n < num_top && i < V; i++) /* fewer finite logits than asked: -inf ones */
        if (l[i] == -INFINITY) val[n] = l[i], idx[n++] = i;
    for (i = 0; n < num_top && i < V; i++) /* and then NaN ones */
        if (l[i] != l[i]) val[n] = l[i], idx[n++] = i;
}

/* logits [num_logits, V] float32 (rows contiguous); rows, chosen [R] int64 (each draw's row and
 * token); out_chosen [R] float32: log p(chosen) under log_softmax of the row; top_ids [R,
 * num_top] int64, top_logprobs [R, num_top] float32: the num_top most likely tokens, most likely
 * first (ties: the lower id first; -inf, then NaN logits last). log_softmax: l_i - (m + log
 * Z), Z the sum of exp(l_j - m) as the draw sums its weights (float64, one order), so a row's
 * values depend on it alone.
 * Returns TANDEM_BAD_SHAPE (V outside 1..2^31-1, num_top outside 0..V), TANDEM_BAD_ROW (a row
 * or a chosen token out of range), TANDEM_NO_MEMORY. */
int tandem_logprobs_rows_f32(const float *logits, int64_t num_logits, int64_t V,
                             const int64_t *rows, int64_t R, const int64_t *chosen,
                             int64_t num_top, float *out_chosen, int64_t *top_ids,
                             float *top_logprobs, int num_threads) {
    if (V <= 0 || V > INT32_MAX || R < 0 || num_logits < 0 || num_top < 0 || num_top > V)
        return TANDEM_BAD_SHAPE;
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= num_logits || chosen[r] < 0 || chosen[r] >= V)
            return TANDEM_BAD_ROW;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (R > 1) reduction(| : failed)
    {
        scratch t = scratch_open(V, (size_t)(num_top + 1) * sizeof(float));
        float *e = t.e, *val = t.more;
        double *bsum = t.bsum;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            if (!t.ok) {
                failed = 1;
                continue;
            }
            const float *l = logits + rows[r] * V;
            const float top = row_max(l, V);
            int64_t nonzero;
            const double lse = top > -INFINITY
                ? (double)top + log(weights(l, V, 1.0f, top, 0.0f, e, bsum, &nonzero))
                : NAN; /* nothing finite: every logprob is NaN, as log_softmax gives */
            out_chosen[r] = (float)((double)l[chosen[r]] - lse);
            int64_t *ids = top_ids + r * num_top;
            float *lps = top_logprobs + r * num_top;
            if (num_top) top_logits(l, V, num_top, val, ids);
            for (int64_t j = 0; j < num_top; j++) lps[j] = (float)((double)val[j] - lse);
        }
        scratch_close(&t);
    }
    return failed ? TANDEM_NO_MEMORY : TANDEM_OK;
}
