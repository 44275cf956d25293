/*
 * Matrix products with weights in llama.cpp's GGUF block formats, read in place (never expanded
 * to float32 in memory). Built and called by kernels/quant.py, which documents the contract.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k], x float32 [M, K], w stored as K/32 blocks per row:
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;      w = d * (q - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes nibbles; w = d * q + m
 *   Q8_0 (34 bytes): fp16 d, 32 int8;                  w = d * q
 *   F32 (128 bytes): 32 float32 (not quantized; its own float kernel, f32_matmul)
 * Nibble j of a Q4 block (byte j & 15) is element j, byte j >> 4 is element j + 16.
 *
 * Method (llama.cpp's, ggml-cpu quants.c): each 32-element block of every activation row is
 * quantized to int8 with its own scale dx = max|x| / 127; the block dot product is an integer
 * sum of u8 weight x s8 activation products, scaled in float. Every format is unpacked to
 * unsigned 8-bit u with w = dw * u + cw (Q4_0: u = q, cw = -8 dw; Q4_1: u = q, cw = m;
 * Q8_0: u = q + 128, cw = -128 dw), so one integer kernel serves all three:
 *   dot(w_b, x_b) = dw dx sum(u q_x) + cw dx sum(q_x).
 * Work: tiles of TILE_N weight rows spread over OpenMP threads; a thread unpacks its tile once
 * (L1-resident) and runs every activation row against it, so a batch of M rows reads the
 * weights from memory once. Paths: AVX512-VNNI (vpdpbusd), AVX2 (widen to 16 bits,
 * vpmaddwd), scalar; compiled in by -march=native (the build is keyed by the CPU's flags), the
 * best one run unless the caller caps it (isa argument: tests force AVX2 and scalar).
 * AVX512-VNNI at batch >= 6 (PANEL_MIN): each tile of 16 weight rows is unpacked row-interleaved
 * (unpack_tile: a register holds 4 u8 of each of the 16 rows) and every activation dword (4 int8
 * of one row, as quantize_row wrote them) is broadcast against two tiles (TILE_MICRO, 2 tiles x
 * 5 activation rows): a result row is 64-byte stores, each weight load serves 5 activation rows,
 * each activation load 2 tiles, and the float scaling runs once per block per 8 vpdpbusd.
 * There Q4_0 and Q8_0 (cw = -z dw, z = 8 or 128) fold the cw term into the integer sum:
 * dw dx (sum(u q) - z sum(q)), exact in int32 (|sum| <= 32 * 128 * 127), one FMA fewer. Fewer rows (decode at batch 1-5) skip the unpacked copy: for
 * Q4_0 and Q4_1 the gemv kernel (gemv_block_rows) runs four blocks per register straight from the file's
 * bytes, and the Q8_0 direct kernels (DIRECT) unpack each block pair in registers; both
 * prefetch the rows ahead (the weights stream from DRAM at every decode step). AVX2 (no VNNI)
 * runs 16-row activation panels for the Q4 formats with vpmaddubsw (PANEL_AVX2).
 * ISA_AVX512_ROWS keeps the earlier row kernels (4 weight rows x 1-2 activation rows on the
 * unpacked tile, MICRO) selectable for benchmarks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "simd_sums.h"

#define QK 32
#define LANES 8 /* a block's scale is repeated over 8 float lanes (one ymm of block sums) */
#define TILE_N 16
#define MAX_PARTS 8 /* weight parts stacked along N in one call */
#define FMT_Q4_0 0
#define FMT_Q4_1 1
#define FMT_Q8_0 2
#define FMT_F32 3 /* plain float32 rows (GGUF F32), "blocks" of 32 floats: f32_matmul */
#define TANDEM_OK 0
#define TANDEM_BAD_FORMAT 1
#define TANDEM_BAD_SHAPE 2
#define TANDEM_NO_MEMORY 3
/* dot-product paths, best last; the caller may cap the path (tests force AVX2 and scalar) */
#define ISA_SCALAR 0
#define ISA_AVX2 1
#define ISA_AVX512_ROWS 2 /* VNNI on row-major blocks, 4 weight x 1-2 activation rows */
#define ISA_AVX512 3      /* ISA_AVX512_ROWS plus the row-interleaved tiles (batch >= PANEL_MIN) */
#define PANEL 16
#define PANEL_MIN 6
#define PAIR 64 /* bytes of int8 activations per block pair (direct kernels) */
#define GEMV_GROUP 128 /* activation bytes per 4 blocks, gemv kernel: 64 of elements 0-15, 64 of 16-31 */

static float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        return sign ? -f : f;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int tandem_quant_block_bytes(int fmt) {
    return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : fmt == FMT_Q8_0 ? 34
           : fmt == FMT_F32 ? 4 * QK : 0;
}

/* The best path this build has: ISA_AVX512, ISA_AVX2 or ISA_SCALAR. */
int tandem_quant_max_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return ISA_AVX512;
#elif defined(__AVX2__)
    return ISA_AVX2;
#else
    return ISA_SCALAR;
#endif
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return fp16_to_f32(h);
#endif
}

/* One weight row (nb blocks at src) -> u[K] unsigned, dw[nb * LANES], cw[b * cw_stride]. */
static void unpack_row(int fmt, const uint8_t *src, int64_t nb, uint8_t *u, float *dw, float *cw,
                       int64_t cw_stride) {
    const int bytes = tandem_quant_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + b * bytes;
        const float d = half_at(blk);
        uint8_t *ub = u + b * QK;
        if (fmt == FMT_Q8_0) {
#if defined(__AVX2__)
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
            _mm256_storeu_si256((__m256i *)ub, _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
#else
            for (int j = 0; j < QK; j++) ub[j] = (uint8_t)(blk[2 + j] ^ 0x80);
#endif
            cw[b * cw_stride] = -128.0f * d;
        } else {
            const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
#if defined(__AVX2__)
            __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
            _mm_storeu_si128((__m128i *)ub, _mm_and_si128(q, mask));
            _mm_storeu_si128((__m128i *)(ub + QK / 2), _mm_and_si128(_mm_srli_epi16(q, 4), mask));
#else
            for (int j = 0; j < QK / 2; j++) {
                ub[j] = qs[j] & 0x0f;
                ub[j + QK / 2] = qs[j] >> 4;
            }
#endif
            cw[b * cw_stride] = fmt == FMT_Q4_1 ? half_at(blk + 2) : -8.0f * d;
        }
#if defined(__AVX2__)
        _mm256_storeu_ps(dw + b * LANES, _mm256_set1_ps(d));
#else
        for (int l = 0; l < LANES; l++) dw[b * LANES + l] = d;
#endif
    }
}

/* One activation row x[K] -> q[K] int8, dx[nb * LANES], sx[nb] = dx * sum(q) per block and,
 * when zq is given, zq[nb] = -z * sum(q) (the tiled path's zero-point term, Q4_0 and Q8_0). */
static void quantize_row(const float *x, int64_t nb, int8_t *q, float *dx, float *sx, int32_t *zq,
                         int32_t z) {
    int64_t b = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same arithmetic as the loop below (cvtps rounds to nearest even, as lrintf) */
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (; b < nb; b++) {
        const __m512 lo = _mm512_loadu_ps(x + b * QK), hi = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtsepi32_epi8(qhi));
        _mm256_storeu_ps(dx + b * LANES, _mm256_set1_ps(d));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        sx[b] = d * (float)sum;
        if (zq) zq[b] = -z * sum;
    }
#endif
    for (; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)lrintf(xb[j] * inv);
            q[b * QK + j] = (int8_t)v;
            sum += v;
        }
        for (int l = 0; l < LANES; l++) dx[b * LANES + l] = d;
        sx[b] = d * (float)sum;
        if (zq) zq[b] = -z * sum;
    }
}

/* sum_b dw_b dx_b sum(u_b q_b): the integer part of one (weight row, activation row) dot. */
static float dot_blocks(const uint8_t *u, const float *dw, const int8_t *q, const float *dx,
                        int64_t nb, int isa) {
    int64_t b = 0;
    float total = 0.0f;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc = _mm512_setzero_ps();
    if (isa < ISA_AVX512_ROWS) b = nb; /* skip this path: an empty loop, acc stays zero */
    for (; b + 2 <= nb; b += 2) {
        __m512i wi = _mm512_loadu_si512((const void *)(u + b * QK));
        __m512i xi = _mm512_loadu_si512((const void *)(q + b * QK));
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wi, xi);
        __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(dw + b * LANES), _mm512_loadu_ps(dx + b * LANES));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc);
    }
    total = _mm512_reduce_add_ps(acc);
    if (isa < ISA_AVX512_ROWS) b = 0;
#endif
#if defined(__AVX2__)
    __m256 acc8 = _mm256_setzero_ps();
    for (; isa >= ISA_AVX2 && b < nb; b++) {
        __m256i wi = _mm256_loadu_si256((const __m256i *)(u + b * QK));
        __m256i xi = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        __m256i w_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(wi));
        __m256i w_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(wi, 1));
        __m256i x_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xi));
        __m256i x_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xi, 1));
        __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
        __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(dw + b * LANES), _mm256_loadu_ps(dx + b * LANES));
        acc8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc8);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc8), _mm256_extractf128_ps(acc8, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    total += _mm_cvtss_f32(r);
#endif
    for (; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += (int32_t)u[b * QK + j] * (int32_t)q[b * QK + j];
        total += dw[b * LANES] * dx[b * LANES] * (float)s;
    }
    return total;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_MICROKERNEL 1
/*
 * 4 weight rows (u, dw with row strides K and nb * LANES) x MR activation rows (MR = 1 or 2):
 * out[i][r] = sum_b dw_rb dx_ib sum(u_rb q_ib). Two blocks per 512-bit register; an odd last
 * block is read with masks (zero upper half).
 */
#define MICRO(MR)                                                                              \
    static void micro_4x##MR(const uint8_t *u, const float *dw, int64_t K, const int8_t *q,    \
                             const float *dx, int64_t nb, float *out, int64_t ldo) {           \
        const int64_t ldw = nb * LANES;                                                        \
        __m512 acc[MR][4];                                                                     \
        for (int i = 0; i < MR; i++)                                                           \
            for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_ps();                       \
        for (int64_t b = 0; b < nb; b += 2) {                                                  \
            const __mmask64 bm = b + 2 <= nb ? ~(__mmask64)0 : (__mmask64)0xffffffffu;         \
            const __mmask16 fm = b + 2 <= nb ? (__mmask16)0xffff : (__mmask16)0x00ff;          \
            __m512i wv[4];                                                                     \
            __m512 ws[4];                                                                      \
            for (int r = 0; r < 4; r++) {                                                      \
                wv[r] = _mm512_maskz_loadu_epi8(bm, u + r * K + b * QK);                       \
                ws[r] = _mm512_maskz_loadu_ps(fm, dw + r * ldw + b * LANES);                   \
            }                                                                                  \
            for (int i = 0; i < MR; i++) {                                                     \
                __m512i xv = _mm512_maskz_loadu_epi8(bm, q + i * K + b * QK);                  \
                __m512 xs = _mm512_maskz_loadu_ps(fm, dx + i * ldw + b * LANES);               \
                for (int r = 0; r < 4; r++) {                                                  \
                    __m512i sv = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);       \
                    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(sv), xs);                      \
                    acc[i][r] = _mm512_fmadd_ps(f, ws[r], acc[i][r]);                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MR; i++)                                                           \
            _mm_storeu_ps(out + i * ldo, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));   \
    }
MICRO(1)
MICRO(2)

/*
 * Batch >= PANEL_MIN (decode at batch 6+, prefill), AVX512-VNNI: a tile of 16 weight rows is
 * unpacked once into a row-interleaved copy (unpack_tile: per block, per group g of 4
 * elements, the 16 rows' 4 u8 side by side: 64 bytes, one register), and each activation
 * dword (4 int8 of one row) is broadcast against it: one vpdpbusd = 4 elements x 16 weight
 * rows (ggml-cpu's repacked GEMM, repack.cpp, with the roles of its operands as here). The
 * 16 lanes are 16 output columns, so a result row is one 64-byte store, and the activations
 * are read as quantize_row wrote them (no interleaved copy). Per block the int32 sums are
 * scaled as everywhere else: acc += float(s) * (dw dx) + cw sx, lane by lane.
 */

/* 16 weight rows (at src, row_bytes apart; nb blocks of fmt each) -> ut [nb][8][16][4] u8,
 * dwt and cwt [nb][16] float (dw and cw per block and row). */
static void unpack_tile(int fmt, const uint8_t *src, int64_t row_bytes, int64_t nb, uint8_t *ut,
                        float *dwt, float *cwt) {
    const int bytes = tandem_quant_block_bytes(fmt), off = fmt == FMT_Q4_1 ? 4 : 2;
    const __m512i mask = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const __m512i start = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int32_t)row_bytes));
    __m512i idx[4];
    for (int j = 0; j < 4; j++) /* lane i < 8 <- dword j of row i: A0/A1 lane 4 i + j */
        idx[j] = _mm512_add_epi32(_mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16,
                                                   12, 8, 4, 0), _mm512_set1_epi32(j));
    for (int64_t b = 0; b < nb; b++) {
        for (int h = 0; h < (fmt == FMT_Q8_0 ? 2 : 1); h++) {
            __m512i a[4]; /* a[k]: rows 4k..4k+3, 16 bytes each */
            for (int k = 0; k < 4; k++) {
                __m512i v = _mm512_setzero_si512();
                for (int q = 0; q < 4; q++)
                    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(
                                                  src + (4 * k + q) * row_bytes + b * bytes + off + 16 * h)), q);
                a[k] = v;
            }
            for (int j = 0; j < 4; j++) {
                const __m512i lo = _mm512_permutex2var_epi32(a[0], idx[j], a[1]);
                const __m512i hi = _mm512_permutex2var_epi32(a[2], idx[j], a[3]);
                const __m512i v = _mm512_shuffle_i32x4(lo, hi, 0x44); /* dword j of 16 rows */
                uint8_t *dst = ut + (b * 8 + j) * 64;
                if (fmt == FMT_Q8_0) {
                    _mm512_storeu_si512(dst + h * 4 * 64, _mm512_xor_si512(v, flip));
                } else {
                    _mm512_storeu_si512(dst, _mm512_and_si512(v, mask));
                    _mm512_storeu_si512(dst + 4 * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
                }
            }
        }
        /* the fp16 d (and Q4_1's m, the next 2 bytes) of the block in every row */
        const __m512i hv = _mm512_i32gather_epi32(start, src + b * bytes, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hv));
        const __m512 c = fmt == FMT_Q4_1
            ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(hv, 16)))
            : _mm512_mul_ps(d, _mm512_set1_ps(fmt == FMT_Q8_0 ? -128.0f : -8.0f));
        _mm512_storeu_ps(dwt + b * 16, d);
        _mm512_storeu_ps(cwt + b * 16, c);
    }
}

/* out[i * ldo + 16 t + r] for MR activation rows (xq, dx, sx at row m: quantize_row's layout)
 * x NT tiles of 16 weight rows (ut, dwt, cwt for tile t at t * nb * 512, t * nb * 16; the last
 * tile's rows r where rmask is set). Each broadcast activation dword serves the NT tiles:
 * 2 x 5 (10 int32 sums, 10 float sums in registers) measured fastest, ~1.25x 1 x 8. */
#define TILE_MICRO(NT, MR, ZP, NAME)                                                           \
    static void NAME(const uint8_t *ut, const float *dwt, const float *cwt, int64_t nb,        \
                     const int8_t *xq, const float *dx, const float *sx, const int32_t *zq,    \
                     float *out, int64_t ldo, __mmask16 rmask) {                               \
        const int64_t K = nb * QK;                                                             \
        __m512 acc[NT][MR];                                                                    \
        for (int t = 0; t < NT; t++)                                                           \
            for (int i = 0; i < MR; i++) acc[t][i] = _mm512_setzero_ps();                      \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            __m512i s[NT][MR];                                                                 \
            for (int t = 0; t < NT; t++)                                                       \
                for (int i = 0; i < MR; i++)                                                   \
                    s[t][i] = ZP ? _mm512_set1_epi32(zq[i * nb + b]) : _mm512_setzero_si512(); \
            for (int g = 0; g < QK / 4; g++) {                                                 \
                __m512i wv[NT];                                                                \
                for (int t = 0; t < NT; t++)                                                   \
                    wv[t] = _mm512_loadu_si512(ut + t * nb * 512 + (b * 8 + g) * 64);          \
                for (int i = 0; i < MR; i++) {                                                 \
                    int32_t x4;                                                                \
                    memcpy(&x4, xq + i * K + b * QK + 4 * g, 4);                               \
                    const __m512i xv = _mm512_set1_epi32(x4);                                  \
                    for (int t = 0; t < NT; t++)                                               \
                        s[t][i] = _mm512_dpbusd_epi32(s[t][i], wv[t], xv);                     \
                }                                                                              \
            }                                                                                  \
            for (int t = 0; t < NT; t++) {                                                     \
                const __m512 dwv = _mm512_loadu_ps(dwt + t * nb * 16 + b * 16);                \
                const __m512 cwv = ZP ? dwv : _mm512_loadu_ps(cwt + t * nb * 16 + b * 16);     \
                for (int i = 0; i < MR; i++) {                                                 \
                    const __m512 dxv = _mm512_set1_ps(dx[(i * nb + b) * LANES]);               \
                    const __m512 sc = _mm512_mul_ps(dwv, dxv);                                 \
                    acc[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t][i]), sc, acc[t][i]);   \
                    if (!ZP)                                                                   \
                        acc[t][i] =                                                            \
                            _mm512_fmadd_ps(cwv, _mm512_set1_ps(sx[i * nb + b]), acc[t][i]);   \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MR; i++) {                                                         \
            for (int t = 0; t + 1 < NT; t++) _mm512_storeu_ps(out + i * ldo + 16 * t, acc[t][i]); \
            _mm512_mask_storeu_ps(out + i * ldo + 16 * (NT - 1), rmask, acc[NT - 1][i]);       \
        }                                                                                      \
    }
TILE_MICRO(2, 5, 0, tile_2x5)
TILE_MICRO(2, 5, 1, tile_2x5_z)
TILE_MICRO(2, 4, 0, tile_2x4)
TILE_MICRO(2, 4, 1, tile_2x4_z)
TILE_MICRO(2, 3, 0, tile_2x3)
TILE_MICRO(2, 3, 1, tile_2x3_z)
TILE_MICRO(2, 2, 0, tile_2x2)
TILE_MICRO(2, 2, 1, tile_2x2_z)
TILE_MICRO(2, 1, 0, tile_2x1)
TILE_MICRO(2, 1, 1, tile_2x1_z)
TILE_MICRO(1, 8, 0, tile_1x8)
TILE_MICRO(1, 8, 1, tile_1x8_z)
TILE_MICRO(1, 4, 0, tile_1x4)
TILE_MICRO(1, 4, 1, tile_1x4_z)
TILE_MICRO(1, 2, 0, tile_1x2)
TILE_MICRO(1, 2, 1, tile_1x2_z)
TILE_MICRO(1, 1, 0, tile_1x1)
TILE_MICRO(1, 1, 1, tile_1x1_z)

typedef void (*tile_fn)(const uint8_t *, const float *, const float *, int64_t, const int8_t *,
                        const float *, const float *, const int32_t *, float *, int64_t,
                        __mmask16);

/* out[m, r] for every activation row m < M and rows r < rows of nt tiles (unpack_tile's ut,
 * dwt, cwt for tile j at j * nb * 512, j * nb * 16): tiles two at a time, each chunk of 5
 * activation rows (then 4..1) against both; a lone last tile runs chunks of 8. */
static void run_tile_rows(const uint8_t *ut, const float *dwt, const float *cwt, int64_t nt,
                          int64_t rows, const int8_t *xq, const float *dx, const float *sx,
                          const int32_t *zq, int64_t M, int64_t nb, float *out, int64_t ldo) {
    static const tile_fn pairs[2][6] = {
        {NULL, tile_2x1, tile_2x2, tile_2x3, tile_2x4, tile_2x5},
        {NULL, tile_2x1_z, tile_2x2_z, tile_2x3_z, tile_2x4_z, tile_2x5_z}};
    static const tile_fn ones[2][9] = {
        {NULL, tile_1x1, tile_1x2, tile_1x2, tile_1x4, tile_1x4, tile_1x4, tile_1x4, tile_1x8},
        {NULL, tile_1x1_z, tile_1x2_z, tile_1x2_z, tile_1x4_z, tile_1x4_z, tile_1x4_z, tile_1x4_z,
         tile_1x8_z}};
    const tile_fn *pair = pairs[zq != NULL], *one = ones[zq != NULL];
    static const int one_rows[9] = {0, 1, 2, 2, 4, 4, 4, 4, 8};
    const int64_t K = nb * QK;
    for (int64_t j = 0; j < nt;) {
        const int two = j + 2 <= nt;
        const int64_t left_r = rows - (j + two) * TILE_N;
        const __mmask16 rm = left_r >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left_r) - 1);
        for (int64_t m = 0; m < M;) {
            const int64_t left = M - m;
            const int mr = two ? (left >= 5 ? 5 : (int)left) : one_rows[left >= 8 ? 8 : left];
            (two ? pair[mr] : one[mr])(ut + j * nb * 512, dwt + j * nb * 16, cwt + j * nb * 16,
                                       nb, xq + m * K, dx + m * nb * LANES, sx + m * nb,
                                       zq ? zq + m * nb : NULL, out + m * ldo + j * TILE_N, ldo,
                                       rm);
            m += mr;
        }
        j += 1 + two;
    }
}

#define GROUP_TILES 2 /* tiles per work item of the tiled path: run_tile_rows' pairs */

/*
 * The tiled path's work, called by every thread of a parallel region (an orphaned omp for):
 * GROUP_TILES tiles of one part per item, unpacked, then run against every activation row.
 * Returns non-zero when this thread's scratch could not be allocated.
 */
static int run_tiled(int fmt, const uint8_t *const *parts, const int64_t *part_rows,
                     const int64_t *row_start, int num_parts, const int8_t *xq, const float *dx,
                     const float *sx, const int32_t *zq, int64_t M, int64_t nb, float *out,
                     int64_t ldo) {
    const int64_t span = GROUP_TILES * TILE_N, row_bytes = nb * tandem_quant_block_bytes(fmt);
    int64_t item_end[MAX_PARTS], items = 0;
    for (int p = 0; p < num_parts; p++) {
        items += (part_rows[p] + span - 1) / span;
        item_end[p] = items;
    }
    uint8_t *ut = malloc((size_t)(GROUP_TILES * nb * 512 + TILE_N * row_bytes));
    float *dwt = malloc(sizeof(float) * (size_t)(2 * GROUP_TILES * nb * 16));
    const int failed = !ut || !dwt;
    float *cwt = failed ? NULL : dwt + GROUP_TILES * nb * 16;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; it++) {
        if (failed) continue;
        int p = 0;
        while (it >= item_end[p]) p++;
        const int64_t r0 = (it - (p ? item_end[p - 1] : 0)) * span;
        const int64_t rows = part_rows[p] - r0 < span ? part_rows[p] - r0 : span;
        const int64_t nt = (rows + TILE_N - 1) / TILE_N;
        for (int64_t j = 0; j < nt; j++) {
            const uint8_t *src = parts[p] + (r0 + j * TILE_N) * row_bytes;
            if (rows - j * TILE_N < TILE_N) { /* a part's last rows: zero-padded to a tile */
                uint8_t *pad = ut + GROUP_TILES * nb * 512;
                memset(pad, 0, (size_t)(TILE_N * row_bytes));
                memcpy(pad, src, (size_t)((rows - j * TILE_N) * row_bytes));
                src = pad;
            }
            unpack_tile(fmt, src, row_bytes, nb, ut + j * nb * 512, dwt + j * nb * 16,
                        cwt + j * nb * 16);
        }
        run_tile_rows(ut, dwt, cwt, nt, rows, xq, dx, sx, zq, M, nb, out + row_start[p] + r0,
                      ldo);
    }
    free(ut);
    free(dwt);
    return failed;
}

/*
 * Small batches (M < PANEL_MIN: decode at batch 1-5), AVX512-VNNI: weight rows read straight
 * from the file's blocks, two blocks per 512-bit register, no unpacked copy (batch 1 streams
 * ~96 MB of weights a token: every pass over them counts). A Q4 pair (b, b+1) unpacks to
 * [b 0-15 | b+1 0-15 | b 16-31 | b+1 16-31] (low nibbles, then high); Q8_0 to [b | b+1]; the
 * activations are permuted to match once per call (permute_pairs). Lanes hold one block's
 * 4-element sums, so each pair is scaled by a per-lane dx (precomputed) times a blend of the two
 * blocks' d; the c_w sum(q) term is one more FMA with a per-lane sum(q) dx / 8.
 */

static void permute_pairs(int fmt, const int8_t *xq, const float *dx, const float *sx,
                          int64_t M, int64_t nb, int8_t *xp, float *dxp) {
    const int64_t np = (nb + 1) / 2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < np; j++) {
            int8_t *dst = xp + (m * np + j) * PAIR;
            float *ds = dxp + (m * np + j) * 2 * PANEL; /* 16 dx, then 16 sx / 8 */
            for (int h = 0; h < 2; h++) {
                const int64_t b = 2 * j + h;
                const int8_t *src = xq + m * nb * QK + b * QK;
                const float d = b < nb ? dx[(m * nb + b) * LANES] : 0.0f;
                const float sum = b < nb ? sx[m * nb + b] / 8.0f : 0.0f;
                for (int l = 0; l < 8; l++) {
                    const int lane = fmt == FMT_Q8_0 ? h * 8 + l : (l / 4) * 8 + h * 4 + l % 4;
                    ds[lane] = d, ds[PANEL + lane] = sum;
                }
                if (fmt == FMT_Q8_0) {
                    if (b < nb) memcpy(dst + h * QK, src, QK);
                    else memset(dst + h * QK, 0, QK);
                } else {
                    if (b < nb) {
                        memcpy(dst + h * 16, src, 16);
                        memcpy(dst + 32 + h * 16, src + 16, 16);
                    } else {
                        memset(dst + h * 16, 0, 16);
                        memset(dst + 32 + h * 16, 0, 16);
                    }
                }
            }
        }
}

static inline __attribute__((always_inline)) void load_pair(const int fmt, const uint8_t *b0,
                                                           int has1, __m512i *wv, __m512 *dwv,
                                                           __m512 *cwv) {
    const int bytes = fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34;
    const uint8_t *b1 = b0 + bytes;
    const float d0 = half_at(b0), d1 = has1 ? half_at(b1) : 0.0f;
    if (fmt == FMT_Q8_0) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b0 + 2));
        const __m256i hi =
            has1 ? _mm256_loadu_si256((const __m256i *)(b1 + 2)) : _mm256_setzero_si256();
        *wv = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                               _mm512_set1_epi8((char)0x80));
        *dwv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
        *cwv = _mm512_mul_ps(*dwv, _mm512_set1_ps(-128.0f));
    } else {
        const int off = fmt == FMT_Q4_1 ? 4 : 2;
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + off));
        const __m128i q1 =
            has1 ? _mm_loadu_si128((const __m128i *)(b1 + off)) : _mm_setzero_si128();
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
        const __m256i mask = _mm256_set1_epi8(0x0f);
        const __m256i lo = _mm256_and_si256(v, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        *wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        *dwv = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
        if (fmt == FMT_Q4_1)
            *cwv = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(half_at(b0 + 2)),
                                        _mm512_set1_ps(has1 ? half_at(b1 + 2) : 0.0f));
        else
            *cwv = _mm512_mul_ps(*dwv, _mm512_set1_ps(-8.0f));
    }
}

/* out[i * ldo] = row . activation row i, i < MR (xp, dxp: permute_pairs' layout). Two
 * accumulators per row (even and odd pairs) keep two FMA chains in flight. */
#define DIRECT(MR)                                                                             \
    static inline __attribute__((always_inline)) void direct_##MR(                            \
        const int fmt, const uint8_t *row, int64_t nb, const int8_t *xp, const float *dxp,    \
        float *out, int64_t ldo) {                                                             \
        const int bytes = fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34;                    \
        const int64_t np = (nb + 1) / 2;                                                       \
        __m512 acc[2][MR];                                                                     \
        for (int i = 0; i < MR; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps();              \
        for (int64_t j = 0; j < np; j += 2) {                                                  \
            for (int h = 0; h < 2; h++) {                                                      \
                if (h == 1 && j + 1 >= np) break;                                              \
                const int64_t jj = j + h;                                                      \
                __m512i wv;                                                                    \
                __m512 dwv, cwv;                                                               \
                load_pair(fmt, row + 2 * jj * bytes, 2 * jj + 1 < nb, &wv, &dwv, &cwv);        \
                for (int i = 0; i < MR; i++) {                                                 \
                    const __m512i xv = _mm512_loadu_si512(xp + (i * np + jj) * PAIR);          \
                    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);     \
                    const float *dp = dxp + (i * np + jj) * 2 * PANEL;                         \
                    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(dp)); \
                    acc[h][i] = _mm512_fmadd_ps(f, dwv, acc[h][i]);                            \
                    acc[h][i] = _mm512_fmadd_ps(cwv, _mm512_loadu_ps(dp + PANEL), acc[h][i]);  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < MR; i++)                                                           \
            out[i * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]));          \
    }
DIRECT(1)
DIRECT(2)
DIRECT(3)
DIRECT(4)
DIRECT(5)

/* out[m, r] for rows [0, rows) at src (row_bytes apart), every m < M (< PANEL_MIN). */
static inline __attribute__((always_inline)) void direct_rows_fmt(
    const int fmt, const uint8_t *src, int64_t row_bytes, int64_t rows, const int8_t *xp,
    const float *dxp, int64_t M, int64_t nb, float *out, int64_t ldo) {
    const int64_t np = (nb + 1) / 2;
    for (int64_t r = 0; r < rows; r++) {
        /* NOTE: as in gemv_block_rows: prefetch the next rows (the Q8_0 LM head streams) */
        for (int64_t line = 0; line < row_bytes; line += 64)
            _mm_prefetch((const char *)(src + (r + 2) * row_bytes + line), _MM_HINT_T0);
        for (int64_t m = 0; m < M;) {
            const int64_t left = M - m;
            const int8_t *x = xp + m * np * PAIR;
            const float *d = dxp + m * np * 2 * PANEL;
            float *o = out + m * ldo + r;
            if (left >= 5) direct_5(fmt, src + r * row_bytes, nb, x, d, o, ldo);
            else if (left == 4) direct_4(fmt, src + r * row_bytes, nb, x, d, o, ldo);
            else if (left == 3) direct_3(fmt, src + r * row_bytes, nb, x, d, o, ldo);
            else if (left == 2) direct_2(fmt, src + r * row_bytes, nb, x, d, o, ldo);
            else direct_1(fmt, src + r * row_bytes, nb, x, d, o, ldo);
            m += left >= 5 ? 5 : left;
        }
    }
}

/* Q8_0 only: the Q4 formats run gemv_rows (below) */
static void direct_rows(const uint8_t *src, int64_t row_bytes, int64_t rows, const int8_t *xp,
                        const float *dxp, int64_t M, int64_t nb, float *out, int64_t ldo) {
    direct_rows_fmt(FMT_Q8_0, src, row_bytes, rows, xp, dxp, M, nb, out, ldo);
}

/*
 * Batch 1-5 on the Q4 formats ("gemv"): four blocks per register. The 16 nibble bytes of
 * blocks b..b+3 fill the four 128-bit lanes; the low nibbles (elements 0-15 of each block) and
 * the high nibbles (16-31) meet activations laid out the same way (gemv_layout), so two
 * vpdpbusd leave each block's integer sum in its lane's four dwords, and one permute spreads
 * the blocks' d_w dx to those lanes. The fp16 scales of 16 blocks come in one gather (d and m
 * share a dword in Q4_1) and the c_w dx sum(q) term is one FMA per 16 blocks with the
 * activations' block sums: about 3 instructions per block where the pair kernels above need
 * ~12 (the scales' scalar conversions and blends). Same integer sums and float terms.
 */

/* Rows of xq/dx/sx -> xg [M, ceil(nb / 4) * GEMV_GROUP] int8, dxg and sxg [M, ceil(nb / 16)
 * * 16] float (dx and dx sum(q) per block), zero-padded. */
static void gemv_layout(const int8_t *xq, const float *dx, const float *sx, int64_t M,
                        int64_t nb, int8_t *xg, float *dxg, float *sxg) {
    const int64_t ng = (nb + 3) / 4, nc = (nb + 15) / 16;
    for (int64_t m = 0; m < M; m++) {
        int8_t *g = xg + m * ng * GEMV_GROUP;
        memset(g, 0, (size_t)(ng * GEMV_GROUP));
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *src = xq + (m * nb + b) * QK;
            int8_t *dst = g + (b / 4) * GEMV_GROUP + (b % 4) * 16;
            memcpy(dst, src, 16);
            memcpy(dst + 64, src + 16, 16);
        }
        float *d = dxg + m * nc * 16, *s = sxg + m * nc * 16;
        for (int64_t b = 0; b < nc * 16; b++) {
            d[b] = b < nb ? dx[(m * nb + b) * LANES] : 0.0f;
            s[b] = b < nb ? sx[m * nb + b] : 0.0f;
        }
    }
}

/* The nibble bytes of blocks b..b+3 of a row (those < nb; the rest zero), one per lane. */
static inline __attribute__((always_inline)) __m512i gemv_load4(const uint8_t *blk, int bytes,
                                                                int64_t have) {
    const __m128i z = _mm_setzero_si128();
    __m512i w = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)blk));
    w = _mm512_inserti32x4(w, have > 1 ? _mm_loadu_si128((const __m128i *)(blk + bytes)) : z, 1);
    w = _mm512_inserti32x4(w, have > 2 ? _mm_loadu_si128((const __m128i *)(blk + 2 * bytes)) : z,
                           2);
    return _mm512_inserti32x4(
        w, have > 3 ? _mm_loadu_si128((const __m128i *)(blk + 3 * bytes)) : z, 3);
}

/* out[r] = weight row r (R rows, row_bytes apart, nb blocks each) . one activation row in
 * gemv_layout; R rows share each activation load and one final horizontal sum (R = 4). */
static inline __attribute__((always_inline)) void gemv_block_rows(
    const int fmt, const int R, const uint8_t *rows, int64_t row_bytes, int64_t nb,
    const int8_t *xg, const float *dxg, const float *sxg, float *out) {
    const int bytes = fmt == FMT_Q4_0 ? 18 : 20, off = fmt == FMT_Q4_1 ? 4 : 2;
    const __m512i mask = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(bytes));
    const __m512i lane_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i nibbles_q4_1 =
        _mm512_set_epi32(19, 18, 17, 16, 14, 13, 12, 11, 9, 8, 7, 6, 4, 3, 2, 1);
    __m512 acc[4], scale[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 16) {
        const int64_t left = nb - c;
        const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 dx = _mm512_loadu_ps(dxg + c), sx = _mm512_loadu_ps(sxg + c);
        for (int r = 0; r < R; r++) {
            /* NOTE: software prefetch of the next R rows' chunk: 20-28% less time at batch 1
             * with the weights streaming from DRAM (the hardware prefetcher alone lags) */
            const char *ahead = (const char *)(rows + (r + R) * row_bytes + c * bytes);
            for (int line = 0; line < 16 * bytes; line += 64)
                _mm_prefetch(ahead + line, _MM_HINT_T0);
            const __m512i v =
                _mm512_mask_i32gather_epi32(zero, k, offsets, rows + r * row_bytes + c * bytes, 1);
            const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
            const __m512 cw = fmt == FMT_Q4_1
                ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)))
                : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
            scale[r] = _mm512_mul_ps(d, dx);
            acc[r] = _mm512_fmadd_ps(cw, sx, acc[r]);
        }
        const int64_t groups = left >= 16 ? 4 : (left + 3) / 4;
        for (int64_t q = 0; q < groups; q++) {
            const int8_t *x = xg + (c / 4 + q) * GEMV_GROUP;
            const __m512i xlo = _mm512_loadu_si512(x), xhi = _mm512_loadu_si512(x + 64);
            const __m512i idx = _mm512_add_epi32(lane_block, _mm512_set1_epi32((int)(4 * q)));
            for (int r = 0; r < R; r++) {
                const uint8_t *blk = rows + r * row_bytes + (c + 4 * q) * bytes;
                __m512i w;
                if (fmt == FMT_Q4_1 && left - 4 * q >= 4) {
                    /* 4 Q4_1 blocks = 80 bytes; their nibbles start at dwords 1, 6, 11, 16 */
                    const __m512i lo = _mm512_loadu_si512(blk);
                    const __m512i hi =
                        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk + 64)));
                    w = _mm512_permutex2var_epi32(lo, nibbles_q4_1, hi);
                } else {
                    w = gemv_load4(blk + off, bytes, left - 4 * q);
                }
                __m512i s = _mm512_dpbusd_epi32(zero, _mm512_and_si512(w, mask), xlo);
                s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(w, 4), mask), xhi);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_permutexvar_ps(idx, scale[r]), acc[r]);
            }
        }
    }
    if (R == 4)
        _mm_storeu_ps(out, hsum4(acc[0], acc[1], acc[2], acc[3]));
    else
        for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* out[m * ldo + r] for rows [0, rows) at src (row_bytes apart), every m < M. */
static void gemv_rows(int fmt, const uint8_t *src, int64_t row_bytes, int64_t rows,
                      const int8_t *xg, const float *dxg, const float *sxg, int64_t M,
                      int64_t nb, float *out, int64_t ldo) {
    const int64_t ng = (nb + 3) / 4, nc = (nb + 15) / 16;
    /* weight rows outer: a group of 4 rows stays in L1 for every activation row */
    for (int64_t r = 0; r < rows;) {
        const int R = rows - r >= 4 ? 4 : 1;
        for (int64_t m = 0; m < M; m++) {
            const int8_t *x = xg + m * ng * GEMV_GROUP;
            const float *d = dxg + m * nc * 16, *s = sxg + m * nc * 16;
            float *o = out + m * ldo + r;
            const uint8_t *w = src + r * row_bytes;
            if (fmt == FMT_Q4_1 && R == 4)
                gemv_block_rows(FMT_Q4_1, 4, w, row_bytes, nb, x, d, s, o);
            else if (fmt == FMT_Q4_1)
                gemv_block_rows(FMT_Q4_1, 1, w, row_bytes, nb, x, d, s, o);
            else if (R == 4)
                gemv_block_rows(FMT_Q4_0, 4, w, row_bytes, nb, x, d, s, o);
            else
                gemv_block_rows(FMT_Q4_0, 1, w, row_bytes, nb, x, d, s, o);
        }
        r += R;
    }
}
#endif

#if defined(__AVX2__)
/*
 * The 16-row panels on AVX2 (no VNNI), Q4 formats only (u <= 15, so vpmaddubsw's int16 pair
 * sums, at most 2 * 15 * 127, add up over a block's 8 groups without saturating: <= 30480):
 * each half panel (8 rows) is one ymm; vpmaddubsw per 4 weights x 8 rows, one vpmaddwd per
 * block. NR weight rows x both halves; res[h][r][lane]: rows h * 8 + lane of the panel.
 */
#define PANEL_AVX2(NR)                                                                         \
    static void panel2_##NR(const uint8_t *u, const float *dw, const float *cw, int64_t K,     \
                            const uint8_t *xt, const float *dxt, int64_t nb, float *res) {    \
        const int64_t ldw = nb * LANES;                                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        __m256 acc[2][NR];                                                                     \
        for (int h = 0; h < 2; h++)                                                            \
            for (int r = 0; r < NR; r++) acc[h][r] = _mm256_setzero_ps();                      \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            __m256i s[2][NR];                                                                  \
            for (int h = 0; h < 2; h++)                                                        \
                for (int r = 0; r < NR; r++) s[h][r] = _mm256_setzero_si256();                 \
            for (int g = 0; g < QK / 4; g++) {                                                 \
                const uint8_t *xg = xt + (b * 8 + g) * 64;                                     \
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xg);                    \
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xg + 32));            \
                for (int r = 0; r < NR; r++) {                                                 \
                    int32_t w4;                                                                \
                    memcpy(&w4, u + r * K + b * QK + 4 * g, 4);                                \
                    const __m256i wv = _mm256_set1_epi32(w4);                                  \
                    s[0][r] = _mm256_add_epi16(s[0][r], _mm256_maddubs_epi16(wv, x0));         \
                    s[1][r] = _mm256_add_epi16(s[1][r], _mm256_maddubs_epi16(wv, x1));         \
                }                                                                              \
            }                                                                                  \
            for (int h = 0; h < 2; h++) {                                                      \
                const float *dp = dxt + b * 2 * PANEL + h * 8;                                 \
                const __m256 dxv = _mm256_loadu_ps(dp), sxv = _mm256_loadu_ps(dp + PANEL);     \
                for (int r = 0; r < NR; r++) {                                                 \
                    const __m256 si = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[h][r], ones));    \
                    const __m256 sc = _mm256_mul_ps(dxv, _mm256_set1_ps(dw[r * ldw + b * LANES])); \
                    acc[h][r] = _mm256_fmadd_ps(si, sc, acc[h][r]);                            \
                    const __m256 cv = _mm256_set1_ps(cw[b * TILE_N + r]);                      \
                    acc[h][r] = _mm256_fmadd_ps(sxv, cv, acc[h][r]);                           \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int h = 0; h < 2; h++)                                                            \
            for (int r = 0; r < NR; r++) _mm256_storeu_ps(res + (r * 2 + h) * 8, acc[h][r]);   \
    }
PANEL_AVX2(2)
PANEL_AVX2(1)

/* run_panels on AVX2: every panel, weight rows two at a time. */
static void run_panels_avx2(const uint8_t *u, const float *dw, const float *cw, int64_t rows,
                            const uint8_t *xt, const float *dxt, int64_t panels, int64_t M,
                            int64_t K, int64_t nb, float *out, int64_t ldo) {
    float res[2 * PANEL];
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *xp = xt + p * nb * QK * PANEL;
        const float *dp = dxt + p * nb * 2 * PANEL;
        for (int64_t r0 = 0; r0 < rows;) {
            const int nr = rows - r0 >= 2 ? 2 : 1;
            if (nr == 2) panel2_2(u + r0 * K, dw + r0 * nb * LANES, cw + r0, K, xp, dp, nb, res);
            else panel2_1(u + r0 * K, dw + r0 * nb * LANES, cw + r0, K, xp, dp, nb, res);
            for (int r = 0; r < nr; r++)
                for (int l = 0; l < PANEL; l++) {
                    const int64_t m = p * PANEL + l;
                    if (m < M) out[m * ldo + r0 + r] = res[r * PANEL + l];
                }
            r0 += nr;
        }
    }
}
#endif

/* Activation rows served by the 16-row panels: whole panels, plus a padded last one when it
 * holds at least PANEL_MIN rows (fewer run through the row kernels). */
static int64_t panel_rows(int64_t M, int isa, int fmt) {
    const int64_t mp = M % PANEL >= PANEL_MIN ? M : M - M % PANEL;
#if defined(__AVX2__)
    if (isa == ISA_AVX2 && fmt != FMT_Q8_0) return mp;
#endif
    (void)mp, (void)isa, (void)fmt;
    return 0;
}

/* out[m, r] for the tile's rows (u, dw, cw: row strides K, nb * LANES, nb), every m. */
static void run_tile(const uint8_t *u, const float *dw, const float *cw, int64_t rows,
                     const int8_t *xq, const float *dx, const float *sx, const uint8_t *xt,
                     const float *dxt, int64_t M, int64_t K, int64_t nb, float *out, int64_t ldo,
                     int isa, int fmt) {
    int64_t r0 = 0, mp = panel_rows(M, isa, fmt);
#if defined(__AVX2__)
    if (mp > 0 && isa == ISA_AVX2)
        run_panels_avx2(u, dw, cw, rows, xt, dxt, (mp + PANEL - 1) / PANEL, M, K, nb, out, ldo);
#endif
#ifdef HAVE_MICROKERNEL
    float tmp[2 * 4];
    for (; isa >= ISA_AVX512_ROWS && r0 + 4 <= rows; r0 += 4) {
        const uint8_t *ur = u + r0 * K;
        const float *dwr = dw + r0 * nb * LANES;
        int64_t m = mp;
        for (; m + 2 <= M; m += 2) {
            micro_4x2(ur, dwr, K, xq + m * K, dx + m * nb * LANES, nb, tmp, 4);
            for (int i = 0; i < 2; i++)
                for (int r = 0; r < 4; r++) out[(m + i) * ldo + r0 + r] = tmp[i * 4 + r];
        }
        for (; m < M; m++) {
            micro_4x1(ur, dwr, K, xq + m * K, dx + m * nb * LANES, nb, tmp, 4);
            for (int r = 0; r < 4; r++) out[m * ldo + r0 + r] = tmp[r];
        }
    }
#endif
    for (int64_t m = mp; m < M; m++)
        for (int64_t r = r0; r < rows; r++)
            out[m * ldo + r] = dot_blocks(u + r * K, dw + r * nb * LANES, xq + m * K,
                                          dx + m * nb * LANES, nb, isa);
    for (int64_t m = mp; m < M; m++) { /* cw is [nb, TILE_N]: this loop runs across rows */
        float acc[TILE_N] = {0};
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < TILE_N; r++) acc[r] += sx[m * nb + b] * cw[b * TILE_N + r];
        for (int64_t r = 0; r < rows; r++) out[m * ldo + r] += acc[r];
    }
}

/* Rows [0, mp) of xq/dx interleaved into 16-row panels (PANEL_AVX2's layout); pad rows 0. */
static void interleave_panels(const int8_t *xq, const float *dx, const float *sx, int64_t mp,
                              int64_t M, int64_t nb, uint8_t *xt, float *dxt) {
    const int64_t panels = (mp + PANEL - 1) / PANEL, K = nb * QK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < PANEL; l++) {
                const int64_t m = p * PANEL + l;
                uint8_t *dst = xt + p * nb * QK * PANEL + b * QK * PANEL + l * 4;
                for (int g = 0; g < QK / 4; g++) {
                    if (m < M) memcpy(dst + g * PANEL * 4, xq + m * K + b * QK + g * 4, 4);
                    else memset(dst + g * PANEL * 4, 0, 4);
                }
                dxt[(p * nb + b) * 2 * PANEL + l] = m < M ? dx[(m * nb + b) * LANES] : 0.0f;
                dxt[(p * nb + b) * 2 * PANEL + PANEL + l] = m < M ? sx[m * nb + b] : 0.0f;
            }
}

/* Tile t of the parts (tile_end: cumulative tile counts): its part, first row and row count. */
static inline int64_t locate_tile(int64_t t, const int64_t *tile_end, const int64_t *part_rows,
                                  int *part, int64_t *r0) {
    int p = 0;
    while (t >= tile_end[p]) p++;
    *part = p;
    *r0 = (t - (p ? tile_end[p - 1] : 0)) * TILE_N;
    return part_rows[p] - *r0 < TILE_N ? part_rows[p] - *r0 : TILE_N;
}

/*
 * F32 weights (fmt FMT_F32): the rows are float32 as the file stores them, so nothing is
 * quantized; the activations multiply them in float32 with float32 sums. Two kernels:
 * - One or two activation rows (decode at batch 1-2): the weights stream from DRAM, 4 bytes
 *   each, so the job is keeping the memory busy: each thread reads its rows in address order,
 *   one row at a time (f32_dot, ggml-cpu's ggml_vec_dot_f32 arithmetic: 16 lane sums, then a
 *   tree). A core streams one row at 24-28 GB/s, 4 interleaved rows at 13-15 (measured).
 * - From 3 rows (F32_PANEL_MIN; measured, whole model at batch 3-16: as fast as the row kernel
 *   at 3-4, up to 1.5x faster above; at 2 the panel's 16 lanes cost more than the stream):
 *   the activations are transposed once into panels of 16 rows ([K][16], zero padded), and
 *   each weight element is broadcast against a panel's 16 lanes (f32_panel_micro: up to 16
 *   weight rows x 16 activation rows in 16 registers, one FMA per 2 loads), the layout of
 *   BLIS-style GEMM micro-kernels (Van Zee and van de Geijn, "BLIS", ACM TOMS 41(3), 2015).
 *   Activation panels are taken F32_MCHUNK rows at a time, so a chunk stays in L2 while every
 *   weight tile meets it. Each output sums k in order, one FMA a step, whatever the batch.
 *   The AVX2 and scalar paths run the same panels with a plain-C micro-kernel of 4 weight
 *   rows (f32_panel_micro_c), vectorized by the compiler.
 */
#define F32_PANEL_MIN 3
#define F32_MCHUNK 64

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* w row . x row (K floats each, K % 16 == 0). */
static inline float f32_dot(const float *w, const float *x, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), acc);
    return _mm512_reduce_add_ps(acc);
}

/* res[r][l] = w row r . activation row l of the panel xt ([K][16]), r < R (R <= 16); when
 * ahead is given, one cache line of it is prefetched a step (16 rows: K lines, the next tile). */
static inline __attribute__((always_inline)) void f32_panel_micro(const int R, const float *w,
                                                                  int64_t K, const float *xt,
                                                                  float *res, const float *ahead) {
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        /* NOTE: 16 interleaved row streams from DRAM read slowly (the F32 comment above);
         * the next tile is one contiguous block, fetched ahead in order */
        if (ahead) _mm_prefetch((const char *)(ahead + k * 16), _MM_HINT_T1);
        const __m512 xv = _mm512_loadu_ps(xt + k * 16);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * K + k]), xv, acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(res + r * 16, acc[r]);
}
#endif

/* x rows [16 p, 16 p + 16) (those < M; the rest zero) -> xt [K][16], for p < panels. */
static void f32_transpose_panel(const float *x, int64_t M, int64_t K, int64_t p, float *xt) {
    const int64_t m0 = 16 * p, have = M - m0 < 16 ? M - m0 : 16;
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        float block[16][16]; /* [row][k]: 16 rows' 16 floats, then read column-wise */
        for (int l = 0; l < 16; l++)
            for (int j = 0; j < 16; j++) block[l][j] = l < have ? x[(m0 + l) * K + k0 + j] : 0.0f;
        for (int j = 0; j < 16; j++)
            for (int l = 0; l < 16; l++) xt[(k0 + j) * 16 + l] = block[l][j];
    }
}

/* f32_panel_micro without intrinsics (the AVX2 and scalar paths): GCC/Clang vector types of 8
 * floats (one ymm on AVX2, two xmm on SSE2), R <= 4 weight rows x the panel's 16 lanes in 8
 * registers. The same sums, k in order. */
typedef float f32x8 __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) void f32_panel_micro_c(const int R, const float *w,
                                                                    int64_t K, const float *xt,
                                                                    float *res) {
    f32x8 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (f32x8){0};
    for (int64_t k = 0; k < K; k++) {
        f32x8 x0, x1;
        memcpy(&x0, xt + k * 16, sizeof(x0));
        memcpy(&x1, xt + k * 16 + 8, sizeof(x1));
        for (int r = 0; r < R; r++) {
            const float wv = w[r * K + k];
            acc[r][0] += wv * x0;
            acc[r][1] += wv * x1;
        }
    }
    for (int r = 0; r < R; r++) memcpy(res + r * 16, acc[r], sizeof(acc[r]));
}

/* out[m * ldo + r] for the rows (<= 16) of a weight tile at w and the activation rows
 * [0, M) of the panels at xt (M <= F32_MCHUNK). */
static void f32_panel_tile(const float *w, int64_t rows, const float *xt, int64_t M, int64_t K,
                           float *out, int64_t ldo, int isa) {
    float res[16 * 16];
    int simd = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    simd = isa >= ISA_AVX512_ROWS;
#endif
    (void)isa;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const float *panel = xt + m0 * K;
        for (int64_t r = 0; r < rows;) {
            const int64_t left = rows - r;
            const int R = simd && left >= 16 ? 16 : simd && left >= 8 ? 8 : left >= 4 ? 4 : 1;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
            const float *ahead = m0 == 0 ? w + TILE_N * K : NULL; /* past a part: harmless */
            if (simd && R == 16) f32_panel_micro(16, w + r * K, K, panel, res, ahead);
            else if (simd && R == 8) f32_panel_micro(8, w + r * K, K, panel, res, NULL);
            else if (simd && R == 4) f32_panel_micro(4, w + r * K, K, panel, res, NULL);
            else if (simd) f32_panel_micro(1, w + r * K, K, panel, res, NULL);
#endif
            if (!simd && R == 4) f32_panel_micro_c(4, w + r * K, K, panel, res);
            else if (!simd) f32_panel_micro_c(1, w + r * K, K, panel, res);
            const int64_t have = M - m0 < 16 ? M - m0 : 16;
            for (int64_t l = 0; l < have; l++)
                for (int j = 0; j < R; j++) out[(m0 + l) * ldo + r + j] = res[j * 16 + l];
            r += R;
        }
    }
}

/* out[m * ldo + r] for weight rows [0, rows) at w and activation rows [0, M) at x, for
 * M < F32_PANEL_MIN: f32_dot on the AVX-512 paths, plain loops on the others. */
static void f32_rows(const float *w, int64_t rows, const float *x, int64_t M, int64_t K,
                     float *out, int64_t ldo, int isa) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (isa >= ISA_AVX512_ROWS) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t m = 0; m < M; m++) out[m * ldo + r] = f32_dot(w + r * K, x + m * K, K);
        return;
    }
#endif
    (void)isa;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t m = 0; m < M; m++) {
            float acc[16] = {0};
            for (int64_t k = 0; k < K; k += 16)
                for (int j = 0; j < 16; j++) acc[j] += w[r * K + k + j] * x[m * K + k + j];
            float total = 0.0f;
            for (int j = 0; j < 16; j++) total += acc[j];
            out[m * ldo + r] = total;
        }
}

/* tandem_quant_matmul_f32 for F32 weights: tiles of TILE_N rows over the threads. */
static int f32_matmul(const float *x, const uint8_t *const *parts, const int64_t *part_rows,
                      const int64_t *tile_end, const int64_t *row_start, int64_t tiles,
                      float *out, int64_t M, int64_t K, int64_t ldo, int num_threads, int isa) {
    const int panels = M >= F32_PANEL_MIN;
    const int64_t num_panels = (M + 15) / 16;
    float *xt = panels ? malloc(sizeof(float) * (size_t)(num_panels * 16 * K)) : NULL;
    if (panels && !xt) return TANDEM_NO_MEMORY;
#pragma omp parallel num_threads(num_threads)
    {
        if (panels) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++)
                f32_transpose_panel(x, M, K, p, xt + p * 16 * K);
            for (int64_t m0 = 0; m0 < M; m0 += F32_MCHUNK) {
                const int64_t mc = M - m0 < F32_MCHUNK ? M - m0 : F32_MCHUNK;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < tiles; t++) {
                    int p;
                    int64_t r0;
                    const int64_t rows = locate_tile(t, tile_end, part_rows, &p, &r0);
                    f32_panel_tile((const float *)parts[p] + r0 * K, rows, xt + m0 * K, mc, K,
                                   out + m0 * ldo + row_start[p] + r0, ldo, isa);
                }
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                int p;
                int64_t r0;
                const int64_t rows = locate_tile(t, tile_end, part_rows, &p, &r0);
                f32_rows((const float *)parts[p] + r0 * K, rows, x, M, K,
                         out + row_start[p] + r0, ldo, isa);
            }
        }
    }
    free(xt);
    return TANDEM_OK;
}

/*
 * out [M, N] (row stride ldo) = x [M, K] @ w^T, where w is num_parts matrices stacked along N
 * (part p: part_rows[p] rows of K / 32 blocks of format fmt at parts[p]; fused q/k/v or
 * gate/up without copying them together). Returns TANDEM_OK, or an error code before writing
 * anything.
 */
int tandem_quant_matmul_f32(const float *x, const uint8_t *const *parts, const int64_t *part_rows,
                            int num_parts, float *out, int64_t M, int64_t K, int64_t ldo, int fmt,
                            int num_threads, int isa) {
    const int bytes = tandem_quant_block_bytes(fmt);
    if (bytes == 0) return TANDEM_BAD_FORMAT;
    if (isa < ISA_SCALAR || isa > tandem_quant_max_isa()) isa = tandem_quant_max_isa();
    if (num_parts < 1 || num_parts > MAX_PARTS) return TANDEM_BAD_SHAPE;
    int64_t tile_end[MAX_PARTS], row_start[MAX_PARTS], N = 0, tiles = 0;
    for (int p = 0; p < num_parts; p++) {
        if (part_rows[p] < 0) return TANDEM_BAD_SHAPE;
        row_start[p] = N;
        N += part_rows[p];
        tiles += (part_rows[p] + TILE_N - 1) / TILE_N;
        tile_end[p] = tiles;
    }
    if (K <= 0 || K % QK != 0 || M < 0 || ldo < N) return TANDEM_BAD_SHAPE;
    if (M == 0 || N == 0) return TANDEM_OK;
    if (fmt == FMT_F32)
        return f32_matmul(x, parts, part_rows, tile_end, row_start, tiles, out, M, K,
                          ldo, num_threads, isa);
    const int64_t nb = K / QK, row_bytes = nb * bytes, mp = panel_rows(M, isa, fmt);
    const int64_t np = (nb + 1) / 2;
    const int64_t padded = (mp + PANEL - 1) / PANEL * PANEL;
    const int direct = isa >= ISA_AVX512 && M < PANEL_MIN;
    const int tiled = isa >= ISA_AVX512 && M >= PANEL_MIN; /* unpack_tile + run_tile_rows */
    const int gemv = direct && fmt != FMT_Q8_0; /* direct Q4: the 4-block kernel */
    const int64_t ng = (nb + 3) / 4, nc = (nb + 15) / 16;
    int8_t *xp = direct ? malloc((size_t)(M * (gemv ? ng * GEMV_GROUP : np * PAIR))) : NULL;
    float *dxp = direct ? malloc(sizeof(float) * (size_t)(M * (gemv ? 2 * nc * 16
                                                                   : np * 2 * PANEL))) : NULL;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb * LANES));
    float *sx = malloc(sizeof(float) * (size_t)(M * nb));
    /* Q4_0 / Q8_0 on the tiled path: cw = -z dw, so the cw term joins the integer sum */
    const int32_t zp = fmt == FMT_Q8_0 ? 128 : fmt == FMT_Q4_0 ? 8 : 0;
    int32_t *zq = tiled && zp ? malloc(sizeof(int32_t) * (size_t)(M * nb)) : NULL;
    uint8_t *xt = padded ? malloc((size_t)(padded * K)) : NULL;
    float *dxt = padded ? malloc(sizeof(float) * (size_t)(padded * nb * 2)) : NULL;
    int failed = !xq || !dx || !sx || (padded && (!xt || !dxt)) || (direct && (!xp || !dxp))
                 || (tiled && zp && !zq);
    if (failed) goto done;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, nb, xq + m * K, dx + m * nb * LANES, sx + m * nb,
                         zq ? zq + m * nb : NULL, zp);
#pragma omp single
        {
            if (padded) interleave_panels(xq, dx, sx, mp, M, nb, xt, dxt);
#ifdef HAVE_MICROKERNEL
            if (gemv) gemv_layout(xq, dx, sx, M, nb, xp, dxp, dxp + M * nc * 16);
            else if (direct) permute_pairs(fmt, xq, dx, sx, M, nb, xp, dxp);
#endif
        }
#ifdef HAVE_MICROKERNEL
        if (tiled) failed |= run_tiled(fmt, parts, part_rows, row_start, num_parts, xq, dx, sx, zq,
                                       M, nb, out, ldo);
#endif
        uint8_t *u = tiled ? NULL : malloc((size_t)(TILE_N * K));
        float *dw = tiled ? NULL : malloc(sizeof(float) * (size_t)(TILE_N * nb * LANES));
        float *cw = tiled ? NULL : malloc(sizeof(float) * (size_t)(TILE_N * nb));
        if (!tiled && (!u || !dw || !cw)) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (tiled ? 0 : tiles); t++) {
            if (!u || !dw || !cw) continue;
            int p;
            int64_t r0;
            const int64_t rows = locate_tile(t, tile_end, part_rows, &p, &r0);
            const uint8_t *src = parts[p] + r0 * row_bytes;
#ifdef HAVE_MICROKERNEL
            if (gemv) {
                gemv_rows(fmt, src, row_bytes, rows, xp, dxp, dxp + M * nc * 16, M, nb,
                          out + row_start[p] + r0, ldo);
                continue;
            }
            if (direct) {
                direct_rows(src, row_bytes, rows, xp, dxp, M, nb, out + row_start[p] + r0,
                            ldo);
                continue;
            }
#endif
            if (rows < TILE_N) memset(cw, 0, sizeof(float) * (size_t)(TILE_N * nb));
            for (int64_t r = 0; r < rows; r++)
                unpack_row(fmt, src + r * row_bytes, nb, u + r * K, dw + r * nb * LANES, cw + r,
                           TILE_N);
            run_tile(u, dw, cw, rows, xq, dx, sx, xt, dxt, M, K, nb, out + row_start[p] + r0, ldo,
                     isa, fmt);
        }
        free(u);
        free(dw);
        free(cw);
    }
done:
    free(xp);
    free(dxp);
    free(xt);
    free(dxt);
    free(xq);
    free(dx);
    free(sx);
    free(zq);
    return failed ? TANDEM_NO_MEMORY : TANDEM_OK;
}

/* out [R, K] float32 = rows ids[R] of w [N, K] dequantized (embedding lookup, tests). */
int tandem_quant_dequantize_rows(const uint8_t *w, const int64_t *ids, float *out, int64_t R,
                                 int64_t N, int64_t K, int fmt) {
    const int bytes = tandem_quant_block_bytes(fmt);
    if (bytes == 0) return TANDEM_BAD_FORMAT;
    if (K <= 0 || K % QK != 0) return TANDEM_BAD_SHAPE;
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0 || ids[r] >= N) return TANDEM_BAD_SHAPE;
    if (fmt == FMT_F32) {
        for (int64_t r = 0; r < R; r++) memcpy(out + r * K, w + ids[r] * K * 4, sizeof(float) * K);
        return TANDEM_OK;
    }
    const int64_t nb = K / QK;
    uint8_t u[QK];
    float dw[LANES], cw;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = w + ids[r] * nb * bytes;
        for (int64_t b = 0; b < nb; b++) {
            unpack_row(fmt, row + b * bytes, 1, u, dw, &cw, 1);
            /* the file's own arithmetic (as gguf-py dequantizes), not dw * u + cw */
            const int zero = fmt == FMT_Q8_0 ? 128 : fmt == FMT_Q4_0 ? 8 : 0;
            const float add = fmt == FMT_Q4_1 ? cw : 0.0f;
            for (int j = 0; j < QK; j++)
                out[r * K + b * QK + j] = dw[0] * (float)((int)u[j] - zero) + add;
        }
    }
    return TANDEM_OK;
}
