/*
 * Horizontal sums shared by the C kernels of this folder (each is built on its own by
 * kernels/cpu_attention.py's build_shared_library, whose cache key covers this header).
 */
#ifndef TANDEM_SIMD_SUMS_H
#define TANDEM_SIMD_SUMS_H
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

/* Sum of each of 4 float vectors -> one __m128 {sum a, sum b, sum c, sum d}. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif
#endif
