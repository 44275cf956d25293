/*
 * exp, tanh and a fixed-order float sum shared by the C kernels of this folder (attention's
 * softmax and soft-capping, SiLU, GELU, RMSNorm). The kernels are built without -ffast-math
 * (so sums keep the order written), which also keeps gcc from vectorising expf: this exp is
 * written once for 16 lanes and once
 * for one, with the same operations in the same order, so a value's exp does not depend on
 * whether it sat in a vector or in a tail (a row's result must not depend on its length).
 *
 * exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 in two parts (Cody and Waite), e^r by
 * Cephes' expf polynomial (degree 6 on [-ln 2 / 2, ln 2 / 2]); x is clamped to
 * [-87.33, 88.72] (exp(x) within float32's normal range). About 1 ulp from expf.
 */
#ifndef TANDEM_VEC_MATH_H
#define TANDEM_VEC_MATH_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>

/* The lanes a 16-wide loop step may touch with left > 0 elements to go: all 16, or the first
 * left (the tail's mask). */
static inline __mmask16 tandem_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
#endif

#define TANDEM_EXP_LO -87.33654f
#define TANDEM_EXP_HI 88.72283f
#define TANDEM_LOG2E 1.44269504088896341f
#define TANDEM_LN2_HI 0.693359375f
#define TANDEM_LN2_LO -2.12194440e-4f
#define TANDEM_EXP_P0 1.9875691500e-4f
#define TANDEM_EXP_P1 1.3981999507e-3f
#define TANDEM_EXP_P2 8.3334519073e-3f
#define TANDEM_EXP_P3 4.1665795894e-2f
#define TANDEM_EXP_P4 1.6666665459e-1f
#define TANDEM_EXP_P5 5.0000001201e-1f

static inline float tandem_exp(float x) {
    x = fminf(fmaxf(x, TANDEM_EXP_LO), TANDEM_EXP_HI);
    const float n = nearbyintf(x * TANDEM_LOG2E);
    float r = fmaf(-n, TANDEM_LN2_HI, x);
    r = fmaf(-n, TANDEM_LN2_LO, r);
    float p = TANDEM_EXP_P0;
    p = fmaf(p, r, TANDEM_EXP_P1);
    p = fmaf(p, r, TANDEM_EXP_P2);
    p = fmaf(p, r, TANDEM_EXP_P3);
    p = fmaf(p, r, TANDEM_EXP_P4);
    p = fmaf(p, r, TANDEM_EXP_P5);
    p = fmaf(p, r * r, r) + 1.0f;
    return ldexpf(p, (int)n);
}

#if defined(__AVX512F__)
static inline __m512 tandem_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(TANDEM_EXP_LO)), _mm512_set1_ps(TANDEM_EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(TANDEM_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(TANDEM_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(TANDEM_LN2_LO), r);
    __m512 p = _mm512_set1_ps(TANDEM_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TANDEM_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TANDEM_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TANDEM_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TANDEM_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TANDEM_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* tanh(x) = 1 - 2 / (e^(2x) + 1) through tandem_exp, for GELU's tanh form and attention
 * soft-capping: one function on every path, like exp. Within a few ulp of tanhf away from 0;
 * near 0 its error is absolute (about 6e-8), where GELU adds the result to 1 and soft-capping
 * scales a small score. */
static inline float tandem_tanh(float x) {
    return 1.0f - 2.0f / (tandem_exp(x + x) + 1.0f);
}

#if defined(__AVX512F__)
static inline __m512 tandem_tanh16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = tandem_exp16(_mm512_add_ps(x, x));
    return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}
#endif

/* x[0..n) -> cap tanh(x / cap) in place (soft-capping: Gemma 2's attention scores and final
 * logits), every element through tandem_tanh16 where AVX-512 is built (the tail masked). */
static inline void tandem_softcap(float *x, int64_t n, float cap) {
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 cv = _mm512_set1_ps(cap);
    for (; t < n; t += 16) {
        const __mmask16 k = tandem_mask16(n - t);
        const __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + t), cv);
        _mm512_mask_storeu_ps(x + t, k, _mm512_mul_ps(tandem_tanh16(v), cv));
    }
#endif
    for (; t < n; ++t)
        x[t] = tandem_tanh(x[t] / cap) * cap;
}

/* sum of x[0..n) in one order: 16 lane sums (lane j: i = j mod 16, i in order), then the
 * tree ((l_j + l_{j+8}) pairs, then halves); fma_y: when given, the sum of x[i] * y[i] (one fma
 * a term) instead. The same bits on every path and for any n. */
static inline float tandem_ordered_sum(const float *x, const float *y, int64_t n) {
    float lanes[16];
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = y ? _mm512_fmadd_ps(v, _mm512_loadu_ps(y + i), acc) : _mm512_add_ps(acc, v);
    }
    if (i < n) { /* the tail: masked lanes add nothing (0 + lane, fma(0, 0, lane)) */
        const __mmask16 k = tandem_mask16(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        acc = y ? _mm512_mask3_fmadd_ps(v, _mm512_maskz_loadu_ps(k, y + i), acc, k)
                : _mm512_mask_add_ps(acc, k, acc, v);
        i = n;
    }
    _mm512_storeu_ps(lanes, acc);
#else
    for (int j = 0; j < 16; j++) lanes[j] = 0.0f;
    for (; i < n; i++) lanes[i % 16] = y ? fmaf(x[i], y[i], lanes[i % 16]) : lanes[i % 16] + x[i];
#endif
    float a[8];
    for (int j = 0; j < 8; j++) a[j] = lanes[j] + lanes[j + 8];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
#endif
