/*
 * Matrix products with weights in llama.cpp's GGUF block formats, read in place (never expanded
 * to float32 in memory). Built and called by kernels/quant.py, which documents the contract.
 *
 * out[m, n] = sum_k x[m, k] * w[n, k], x float32 [M, K], w stored as K/32 blocks per row:
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;      w = d * (q - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes nibbles; w = d * q + m
 *   Q8_0 (34 bytes): fp16 d, 32 int8;                  w = d * q
 *   F32 (128 bytes): 32 float32 (not quantized; its own float kernels, f32_matmul)
 * Nibble j of a Q4 block (byte j & 15) is element j, byte j >> 4 is element j + 16.
 * Q4_1X16 is Q4_1 with each tile of 16 rows rearranged (kernels/quant.py repacks it at load):
 * per block, the nibble bytes 4k..4k+3 of the 16 rows side by side (4 x 64 bytes, k = 0..3),
 * then the 16 rows' fp16 d, then their fp16 m: 320 bytes, as many as 16 file blocks, so a
 * tile starts where it did. The decode kernel reads it with plain loads (no gathers, no
 * transposes: a lane is a row, as in ggml-cpu's repacked GEMV); the same values and float steps
 * as Q4_1, so the same bits. Parts must have a multiple of 16 rows.
 * Q8_0X16 is Q8_0 tiled the same way: per block, the int8 bytes 4g..4g+3 of the 16 rows side by
 * side (8 x 64 bytes, g = 0..7), then the 16 rows' fp16 d: 544 bytes, 16 file blocks. A block
 * is 8 registers whose lanes are rows, read with plain loads at every batch (q8_0x16_rows16:
 * no transposes, no unpacked copy); the same values and float steps as Q8_0, so the same bits.
 *
 * Method (llama.cpp's, ggml-cpu quants.c): each 32-element block of every activation row is
 * quantized to int8 with its own scale dx = max|x| / 127; the block dot product is an integer
 * sum of u8 weight x s8 activation products, scaled in float. Every format is unpacked to
 * unsigned 8-bit u with w = dw * u + cw (Q4_0: u = q, cw = -8 dw; Q4_1: u = q, cw = m;
 * Q8_0: u = q + 128, cw = -128 dw).
 *
 * One order of sums per output, whatever the path (batch invariance): an output is the same
 * float32 bits whether its activation row came alone, among 3 or 500 others, at any position,
 * on any number of threads, and on the AVX512-VNNI, AVX2 or scalar path (the "Defeating
 * Nondeterminism in LLM Inference" recipe, Thinking Machines 2025: every kernel reduces a row
 * in one fixed order). Per output, with S_b = sum(u q) over block b (int32, exact) and
 * sq_b = sum(q):
 *   Q4_1:        acc = fma(S_b, dw_b dx_b, acc); acc = fma(cw_b, dx_b sq_b, acc)   b = 0, 1, ...
 *   Q4_0, Q8_0:  acc = fma(S_b - z sq_b, dw_b dx_b, acc)  (cw = -z dw folded into the integer
 *                sum, exact in int32: |sum| <= 32 * 255 * 127; z = 8 or 128)
 *   F32:         16 lane sums (lane j: k = j mod 16, k in order, one fma each), then one tree
 *                (tree16 below, hsum4's order).
 * Integer sums may be formed in any order (exact); only the float steps above are ordered.
 * This file is built without -ffast-math so the compiler keeps that order.
 *
 * Work: tiles of TILE_N weight rows spread over OpenMP threads; each output is computed by
 * one thread. Paths: AVX512-VNNI (vpdpbusd), AVX2 (widen to 16 bits, vpmaddwd), scalar;
 * compiled in by -march=native (the build is keyed by the CPU's flags), the best one run
 * unless the caller caps it (isa argument: tests force AVX2 and scalar).
 * - AVX512-VNNI, batch >= 6 (TILED_MIN_Q4; Q8_0 from 10): each tile of 16 weight rows is unpacked
 *   row-interleaved (unpack_tile: a register holds 4 u8 of each of the 16 rows) and every
 *   activation dword (4 int8 of one row) is broadcast against two tiles (TILE_MICRO, 2 tiles x
 *   5 activation rows): a lane is an output column, so the block loop is the order above.
 * - AVX512-VNNI, smaller batches (decode): no unpacked copy (batch 1 streams ~96 MB of weights a
 *   token). Per 16 weight rows, each row's bytes (4 Q4 blocks, or 2 Q8_0 blocks, a register)
 *   meet the activations in one or two vpdpbusd; the 16 rows' partial sums are transposed into
 *   registers whose lanes are the 16 rows (transpose_sums4 / transpose_sums2: integer adds and
 *   shuffles), and the float steps run per block with lanes = rows, as the tiled path does.
 * - AVX512-VNNI, Q4_1X16 and Q8_0X16 at every batch: a tile block is already registers whose
 *   lanes are the 16 rows, multiplied as loaded (q4_1x16_rows16, q8_0x16_rows16), up to 6
 *   activation rows a pass (X16_MR; passes split evenly) while the tile stays in L1, two integer
 *   sums per row in flight. Against unpack_tile + TILE_MICRO on the same tiles (python -m
 *   scripts.bench_quant --kernel --paths avx512_vnni, 1 thread, AMD EPYC; o + gate/up + down of
 *   the built-in model, 5 rows a pass and one sum a row): 413 -> 357 us at 16 rows, 1,349 ->
 *   1,302 us at 64.
 * - AVX2: 16-row activation panels for the Q4 formats with vpmaddubsw (PANEL_AVX2); the other
 *   rows and Q8_0 form each block's integer sum with vpmaddwd, then the float steps in order.
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
#include "vec_math.h"

#define QK 32
#define TILE_N 16
#define MAX_PARTS 8 /* weight parts stacked along N in one call */
#define FMT_Q4_0 0
#define FMT_Q4_1 1
#define FMT_Q8_0 2
#define FMT_F32 3 /* plain float32 rows (GGUF F32), "blocks" of 32 floats: f32_matmul */
#define FMT_Q4_1X16 4 /* Q4_1 in 16-row tiles (above) */
#define FMT_Q8_0X16 5 /* Q8_0 in 16-row tiles (above) */
#define X16_BLOCK 320 /* bytes of one block of a 16-row Q4_1X16 tile */
#define X16Q8_BLOCK 544 /* bytes of one block of a 16-row Q8_0X16 tile */
#define TANDEM_OK 0
#define TANDEM_BAD_FORMAT 1
#define TANDEM_BAD_SHAPE 2
#define TANDEM_NO_MEMORY 3
/* dot-product paths, best last; the caller may cap the path (tests force AVX2 and scalar) */
#define ISA_SCALAR 0
#define ISA_AVX2 1
#define ISA_AVX512 2
#define PANEL 16
#define PANEL_MIN 6 /* activation rows from which the AVX2 panels run */
/* activation rows from which the AVX-512 tiles run (fewer: q4_rows16 / q8_rows16); measured,
 * kernel alone: the LM head's Q8_0 rows kernel beats unpacking its 49,152 rows up to ~10 */
#define TILED_MIN_Q4 6
#define TILED_MIN_Q8 10
#define GEMV_GROUP 128 /* activation bytes per 4 Q4 blocks, row kernel: 64 of elements 0-15, 64 of 16-31 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define HAVE_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif

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

/* The file format a tiled format rearranges (itself for the file formats). */
static inline int file_fmt(int fmt) {
    return fmt == FMT_Q4_1X16 ? FMT_Q4_1 : fmt == FMT_Q8_0X16 ? FMT_Q8_0 : fmt;
}

static inline int is_x16(int fmt) { return fmt == FMT_Q4_1X16 || fmt == FMT_Q8_0X16; }

int tandem_quant_block_bytes(int fmt) {
    fmt = file_fmt(fmt);
    return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : fmt == FMT_Q8_0 ? 34
           : fmt == FMT_F32 ? 4 * QK : 0;
}

/* The best path this build has: ISA_AVX512, ISA_AVX2 or ISA_SCALAR. */
int tandem_quant_max_isa(void) {
#if defined(HAVE_VNNI)
    return ISA_AVX512;
#elif defined(HAVE_AVX2)
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

/* The zero point folded into the integer sums: 8 (Q4_0), 128 (Q8_0), 0 (Q4_1: cw is a float). */
static inline int32_t zero_point(int fmt) {
    fmt = file_fmt(fmt);
    return fmt == FMT_Q8_0 ? 128 : fmt == FMT_Q4_0 ? 8 : 0;
}

/* One weight row (nb blocks at src) -> u[K] unsigned, dw[nb], cw[b * cw_stride]. */
static void unpack_row(int fmt, const uint8_t *src, int64_t nb, uint8_t *u, float *dw, float *cw,
                       int64_t cw_stride) {
    const int bytes = tandem_quant_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + b * bytes;
        const float d = half_at(blk);
        uint8_t *ub = u + b * QK;
        if (fmt == FMT_Q8_0) {
#if defined(__AVX2__)
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
            _mm256_storeu_si256((__m256i *)ub, _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
#else
            for (int j = 0; j < QK; j++) ub[j] = (uint8_t)(blk[2 + j] ^ 0x80);
#endif
            cw[b * cw_stride] = -128.0f * d;
        } else {
            const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
#if defined(__AVX2__)
            const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
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
        dw[b] = d;
    }
}

/* Row r's block b of a Q4_1X16 or Q8_0X16 tile -> the bytes of its file block: the block's
 * fp16 fields (head bytes: d, and Q4_1's m), then its quant bytes, whose dword g lies in the
 * tile's 64-byte group g and each field in a 32-byte group after them, lane r. */
static void x16_block(int fmt, const uint8_t *tile, int r, int64_t b, uint8_t *blk) {
    const int bytes = tandem_quant_block_bytes(fmt), head = fmt == FMT_Q4_1X16 ? 4 : 2;
    const int quants = bytes - head;
    const uint8_t *t = tile + b * TILE_N * bytes;
    for (int f = 0; f < head / 2; f++) memcpy(blk + 2 * f, t + TILE_N * quants + 32 * f + 2 * r, 2);
    for (int g = 0; g < quants / 4; g++) memcpy(blk + head + 4 * g, t + 64 * g + 4 * r, 4);
}

/* A tile of fmt -> its 16 rows in the file layout (rows: 16 x nb blocks of file_fmt). */
static void x16_tile_rows(int fmt, const uint8_t *tile, int64_t nb, uint8_t *rows) {
    const int bytes = tandem_quant_block_bytes(fmt);
    for (int r = 0; r < TILE_N; r++)
        for (int64_t b = 0; b < nb; b++) x16_block(fmt, tile, r, b, rows + (r * nb + b) * bytes);
}

/* One activation row x[K] -> q[K] int8, dx[nb], sx[nb] = dx * sum(q) and zq[nb] = -z * sum(q)
 * per block (zq: the zero-point term of Q4_0 and Q8_0, z = zero_point). */
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
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        dx[b] = d;
        sx[b] = d * (float)sum;
        zq[b] = -z * sum;
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
        dx[b] = d;
        sx[b] = d * (float)sum;
        zq[b] = -z * sum;
    }
}

/* ---- the float steps of one output (every path's order; the AVX2 and scalar rows) ---- */

/* sum(u q) of every block of one (weight row, activation row) pair into S[nb] (exact). */
static void block_sums(const uint8_t *u, const int8_t *q, int64_t nb, int32_t *S, int isa) {
    int64_t b = 0;
#if defined(HAVE_AVX2)
    for (; isa >= ISA_AVX2 && b < nb; b++) {
        const __m256i wi = _mm256_loadu_si256((const __m256i *)(u + b * QK));
        const __m256i xi = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        const __m256i w_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(wi));
        const __m256i w_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(wi, 1));
        const __m256i x_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xi));
        const __m256i x_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xi, 1));
        __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
        S[b] = _mm_cvtsi128_si32(h);
    }
#endif
    (void)isa;
    for (; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += (int32_t)u[b * QK + j] * (int32_t)q[b * QK + j];
        S[b] = s;
    }
}

/* out[r] for the tile's rows r < rows (<= TILE_N) and one activation row, from the block sums
 * S [rows][nb], in the order of the header: the weight rows' dw [rows][nb] and cw [nb][TILE_N],
 * the activation row's dx, sx, zq [nb]; zp: Q4_0 / Q8_0's form. The loop over rows is inside,
 * so each step is one vector FMA across them (the compiler vectorises fmaf with FMA). */
static void ordered_rows(const int32_t *S, const float *dw, const float *cw, int64_t rows,
                         const float *dx, const float *sx, const int32_t *zq, int64_t nb, int zp,
                         float *out) {
    float acc[TILE_N] = {0};
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = 0; r < TILE_N; r++) {
            const float sc = dw[(r < rows ? r : 0) * nb + b] * dx[b];
            if (zp) {
                acc[r] = fmaf((float)(S[(r < rows ? r : 0) * nb + b] + zq[b]), sc, acc[r]);
            } else {
                acc[r] = fmaf((float)S[(r < rows ? r : 0) * nb + b], sc, acc[r]);
                acc[r] = fmaf(cw[b * TILE_N + r], sx[b], acc[r]);
            }
        }
    for (int64_t r = 0; r < rows; r++) out[r] = acc[r];
}

#if defined(HAVE_AVX2)
/*
 * The 16-row panels on AVX2 (no VNNI), Q4 formats only (u <= 15, so vpmaddubsw's int16 pair
 * sums, at most 2 * 15 * 127, add up over a block's 8 groups without saturating: <= 30480):
 * each half panel (8 rows) is one ymm; vpmaddubsw per 4 weights x 8 rows, one vpmaddwd per
 * block. NR weight rows x both halves; res[h][r][lane]: rows h * 8 + lane of the panel. ZP:
 * Q4_0's form (the zero point joins the integer sum), else Q4_1's.
 */
#define PANEL_AVX2(NR, ZP, NAME)                                                               \
    static void NAME(const uint8_t *u, const float *dw, const float *cw, int64_t K,            \
                     const uint8_t *xt, const float *dxt, const int32_t *zt, int64_t nb,       \
                     float *res) {                                                             \
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
                const __m256i zv = _mm256_loadu_si256((const __m256i *)(zt + b * PANEL + h * 8)); \
                for (int r = 0; r < NR; r++) {                                                 \
                    __m256i si = _mm256_madd_epi16(s[h][r], ones);                             \
                    if (ZP) si = _mm256_add_epi32(si, zv);                                     \
                    const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(dw[r * nb + b]), dxv);      \
                    acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), sc, acc[h][r]);        \
                    if (!ZP)                                                                   \
                        acc[h][r] = _mm256_fmadd_ps(_mm256_set1_ps(cw[b * TILE_N + r]), sxv,   \
                                                    acc[h][r]);                                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int h = 0; h < 2; h++)                                                            \
            for (int r = 0; r < NR; r++) _mm256_storeu_ps(res + (r * 2 + h) * 8, acc[h][r]);   \
    }
PANEL_AVX2(2, 0, panel2_2)
PANEL_AVX2(1, 0, panel2_1)
PANEL_AVX2(2, 1, panel2_2_z)
PANEL_AVX2(1, 1, panel2_1_z)

/* Every panel against the tile's rows (u, dw, cw as unpack_row writes them), two at a time. */
static void run_panels_avx2(const uint8_t *u, const float *dw, const float *cw, int64_t rows,
                            const uint8_t *xt, const float *dxt, const int32_t *zt,
                            int64_t panels, int64_t M, int64_t K, int64_t nb, int zp, float *out,
                            int64_t ldo) {
    float res[2 * PANEL];
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *xp = xt + p * nb * QK * PANEL;
        const float *dp = dxt + p * nb * 2 * PANEL;
        const int32_t *zp_ = zt + p * nb * PANEL;
        for (int64_t r0 = 0; r0 < rows;) {
            const int nr = rows - r0 >= 2 ? 2 : 1;
            const uint8_t *ur = u + r0 * K;
            const float *dr = dw + r0 * nb, *cr = cw + r0;
            if (zp) (nr == 2 ? panel2_2_z : panel2_1_z)(ur, dr, cr, K, xp, dp, zp_, nb, res);
            else (nr == 2 ? panel2_2 : panel2_1)(ur, dr, cr, K, xp, dp, zp_, nb, res);
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

/* Activation rows served by the AVX2 16-row panels (Q4 formats): whole panels, plus a padded
 * last one when it holds at least PANEL_MIN rows (fewer run through the row loop). */
static int64_t panel_rows(int64_t M, int isa, int fmt) {
    const int64_t mp = M % PANEL >= PANEL_MIN ? M : M - M % PANEL;
#if defined(HAVE_AVX2)
    if (isa == ISA_AVX2 && file_fmt(fmt) != FMT_Q8_0) return mp;
#endif
    (void)mp, (void)isa, (void)fmt;
    return 0;
}

/* Rows [0, mp) of xq/dx/sx/zq interleaved into 16-row panels (PANEL_AVX2's layout): xt
 * [panels][nb][8 groups][16 rows][4], dxt [panels][nb][dx x 16, sx x 16], zt
 * [panels][nb][16]; pad rows 0. */
static void interleave_panels(const int8_t *xq, const float *dx, const float *sx,
                              const int32_t *zq, int64_t mp, int64_t M, int64_t nb, uint8_t *xt,
                              float *dxt, int32_t *zt) {
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
                dxt[(p * nb + b) * 2 * PANEL + l] = m < M ? dx[m * nb + b] : 0.0f;
                dxt[(p * nb + b) * 2 * PANEL + PANEL + l] = m < M ? sx[m * nb + b] : 0.0f;
                zt[(p * nb + b) * PANEL + l] = m < M ? zq[m * nb + b] : 0;
            }
}

/* out[m, r] for the tile's rows (u, dw, cw: row strides K, nb, 1 with cw [nb][TILE_N]), every
 * activation row m: AVX2 panels where they apply, the ordered row loop for the rest. */
static void run_tile(const uint8_t *u, const float *dw, const float *cw, int64_t rows,
                     const int8_t *xq, const float *dx, const float *sx, const int32_t *zq,
                     const uint8_t *xt, const float *dxt, const int32_t *zt, int64_t M,
                     int64_t K, int64_t nb, float *out, int64_t ldo, int isa, int fmt,
                     int32_t *S) {
    const int zp = zero_point(fmt) != 0;
    const int64_t mp = panel_rows(M, isa, fmt);
#if defined(HAVE_AVX2)
    if (mp > 0)
        run_panels_avx2(u, dw, cw, rows, xt, dxt, zt, (mp + PANEL - 1) / PANEL, M, K, nb, zp, out,
                        ldo);
#endif
    (void)xt, (void)dxt, (void)zt;
    for (int64_t m = mp; m < M; m++) {
        for (int64_t r = 0; r < rows; r++) block_sums(u + r * K, xq + m * K, nb, S + r * nb, isa);
        ordered_rows(S, dw, cw, rows, dx + m * nb, sx + m * nb, zq + m * nb, nb, zp,
                     out + m * ldo);
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

#if defined(HAVE_VNNI)
/*
 * Batch >= TILED_MIN_Q4 (decode at batch 6+, prefill), AVX512-VNNI: a tile of 16 weight rows is
 * unpacked once into a row-interleaved copy (unpack_tile: per block, per group g of 4
 * elements, the 16 rows' 4 u8 side by side: 64 bytes, one register), and each activation
 * dword (4 int8 of one row) is broadcast against it: one vpdpbusd = 4 elements x 16 weight
 * rows (ggml-cpu's repacked GEMM, repack.cpp, with the roles of its operands as here). The
 * 16 lanes are 16 output columns, so a result row is one 64-byte store, and the activations
 * are read as quantize_row wrote them (no interleaved copy).
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

/* out[i * ldo + 16 t + r] for MR activation rows (xq, dx, sx, zq at row m: quantize_row's
 * layout) x NT tiles of 16 weight rows (ut, dwt, cwt for tile t at t * nb * 512, t * nb * 16;
 * the last tile's rows r where rmask is set). Each broadcast activation dword serves the NT
 * tiles: 2 x 5 (10 int32 sums, 10 float sums in registers) measured fastest, ~1.25x 1 x 8. */
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
                    const __m512 dxv = _mm512_set1_ps(dx[i * nb + b]);                         \
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
                          const int32_t *zq, int zp, int64_t M, int64_t nb, float *out,
                          int64_t ldo) {
    static const tile_fn pairs[2][6] = {
        {NULL, tile_2x1, tile_2x2, tile_2x3, tile_2x4, tile_2x5},
        {NULL, tile_2x1_z, tile_2x2_z, tile_2x3_z, tile_2x4_z, tile_2x5_z}};
    static const tile_fn ones[2][9] = {
        {NULL, tile_1x1, tile_1x2, tile_1x2, tile_1x4, tile_1x4, tile_1x4, tile_1x4, tile_1x8},
        {NULL, tile_1x1_z, tile_1x2_z, tile_1x2_z, tile_1x4_z, tile_1x4_z, tile_1x4_z, tile_1x4_z,
         tile_1x8_z}};
    const tile_fn *pair = pairs[zp], *one = ones[zp];
    static const int one_rows[9] = {0, 1, 2, 2, 4, 4, 4, 4, 8};
    const int64_t K = nb * QK;
    for (int64_t j = 0; j < nt;) {
        const int two = j + 2 <= nt;
        const int64_t left_r = rows - (j + two) * TILE_N;
        const __mmask16 rm = tandem_mask16(left_r);
        for (int64_t m = 0; m < M;) {
            const int64_t left = M - m;
            const int mr = two ? (left >= 5 ? 5 : (int)left) : one_rows[left >= 8 ? 8 : left];
            (two ? pair[mr] : one[mr])(ut + j * nb * 512, dwt + j * nb * 16, cwt + j * nb * 16,
                                       nb, xq + m * K, dx + m * nb, sx + m * nb, zq + m * nb,
                                       out + m * ldo + j * TILE_N, ldo, rm);
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
#pragma omp for schedule(static) nowait /* the region's join follows */
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
        run_tile_rows(ut, dwt, cwt, nt, rows, xq, dx, sx, zq, zero_point(fmt) != 0, M, nb,
                      out + row_start[p] + r0, ldo);
    }
    free(ut);
    free(dwt);
    return failed;
}

/*
 * Batch 1-5 (decode), AVX512-VNNI: 16 weight rows read straight from the file's blocks, one
 * register per row and chunk (4 Q4 blocks: their 16 nibble bytes in the four 128-bit lanes;
 * 2 Q8_0 blocks: their 32 bytes in the two halves). One or two vpdpbusd leave each block's
 * integer sum in 4 (Q4) or 8 (Q8_0) dwords of the row's register; transpose_sums4/2 add those
 * and turn the 16 row registers into one register per block whose lanes are the 16 rows. The
 * float steps then run per block, lanes = rows, exactly as the tiled path's: the blocks' d
 * (and Q4_1's m) come from one gather per block for the 16 rows.
 */

/* R[r]: row r's register, 128-bit lane j holding 4 partial sums of block j -> T[j]: block j's
 * sums of the 16 rows (lane r). Integer adds: exact in any order. */
static inline __attribute__((always_inline)) void transpose_sums4(const __m512i *R, __m512i *T) {
    __m512i P[8], Q[4];
    for (int i = 0; i < 8; i++) /* lane j: [r0 d0+d2, r1 d0+d2, r0 d1+d3, r1 d1+d3] */
        P[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(R[2 * i], R[2 * i + 1]),
                                _mm512_unpackhi_epi32(R[2 * i], R[2 * i + 1]));
    for (int k = 0; k < 4; k++) /* lane j: the sums of rows 4k .. 4k + 3 */
        Q[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(P[2 * k], P[2 * k + 1]),
                                _mm512_unpackhi_epi64(P[2 * k], P[2 * k + 1]));
    const __m512i X0 = _mm512_shuffle_i32x4(Q[0], Q[1], 0x44), X1 = _mm512_shuffle_i32x4(Q[0], Q[1], 0xEE);
    const __m512i X2 = _mm512_shuffle_i32x4(Q[2], Q[3], 0x44), X3 = _mm512_shuffle_i32x4(Q[2], Q[3], 0xEE);
    T[0] = _mm512_shuffle_i32x4(X0, X2, 0x88);
    T[1] = _mm512_shuffle_i32x4(X0, X2, 0xDD);
    T[2] = _mm512_shuffle_i32x4(X1, X3, 0x88);
    T[3] = _mm512_shuffle_i32x4(X1, X3, 0xDD);
}

/* R[r]: row r's register, lanes 0-1 (128-bit) 8 partial sums of block 0, lanes 2-3 of block
 * 1 -> T[0], T[1]: each block's sums of the 16 rows (lane r). */
static inline __attribute__((always_inline)) void transpose_sums2(const __m512i *R, __m512i *T) {
    __m512i P[8], Q[4];
    for (int i = 0; i < 8; i++)
        P[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(R[2 * i], R[2 * i + 1]),
                                _mm512_unpackhi_epi32(R[2 * i], R[2 * i + 1]));
    for (int k = 0; k < 4; k++) /* lane j: 4 rows' sums of that lane's 4 dwords */
        Q[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(P[2 * k], P[2 * k + 1]),
                                _mm512_unpackhi_epi64(P[2 * k], P[2 * k + 1]));
    /* [Q0 b, Q0 b+1, Q1 b, Q1 b+1], the same for rows 8-15 */
    const __m512i Z0 = _mm512_add_epi32(_mm512_shuffle_i32x4(Q[0], Q[1], 0x88),
                                        _mm512_shuffle_i32x4(Q[0], Q[1], 0xDD));
    const __m512i Z1 = _mm512_add_epi32(_mm512_shuffle_i32x4(Q[2], Q[3], 0x88),
                                        _mm512_shuffle_i32x4(Q[2], Q[3], 0xDD));
    T[0] = _mm512_shuffle_i32x4(Z0, Z1, 0x88);
    T[1] = _mm512_shuffle_i32x4(Z0, Z1, 0xDD);
}

/* Rows of xq -> xg [M, ceil(nb / 4) * GEMV_GROUP] int8 (per 4 blocks: elements 0-15 of each,
 * then 16-31 of each), zero-padded: the Q4 row kernel's activation layout. */
static void gemv_layout(const int8_t *xq, int64_t M, int64_t nb, int8_t *xg) {
    const int64_t ng = (nb + 3) / 4;
    for (int64_t m = 0; m < M; m++) {
        int8_t *g = xg + m * ng * GEMV_GROUP;
        memset(g, 0, (size_t)(ng * GEMV_GROUP));
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *src = xq + (m * nb + b) * QK;
            int8_t *dst = g + (b / 4) * GEMV_GROUP + (b % 4) * 16;
            memcpy(dst, src, 16);
            memcpy(dst + 64, src + 16, 16);
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

/* Prefetch this chunk's share of the next tile (16 rows: one contiguous block at ahead): the
 * bytes [from, from + n) of a row are that fraction of the tile, so the chunks of a tile fetch
 * the next one in address order (the weights stream from DRAM at every decode step; 16 row
 * streams at once, or a prefetch per row, read much slower: measured 1.7x at the LM head). */
static inline __attribute__((always_inline)) void prefetch_rows(const uint8_t *ahead,
                                                                int64_t row_bytes, int64_t from,
                                                                int64_t n) {
    const int64_t start = from * TILE_N, end = (from + n) * TILE_N, tile = TILE_N * row_bytes;
    for (int64_t line = start & ~(int64_t)63; line < end && line < tile; line += 64)
        _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
}

/* One chunk of 4 Q4_1 blocks (80 bytes per row) of 16 weight rows at blk (row_bytes apart),
 * against MR (<= 5) activation rows (xg: this chunk's group of row 0, rows ng groups apart; dx,
 * sx: this chunk's blocks of row 0, rows nb apart; mask and nibbles: q4_rows16's nibble mask and
 * Q4_1 nibble-dword index), added to acc[MR] in the header's order. Each
 * row's 80 bytes are loaded once for all MR rows; the blocks' d and m come out of the same
 * loads (each block's header dword moved to its 128-bit lane, then transpose_sums4, whose
 * integer adds of zeros leave the bits as they are) instead of one gather per block: the same
 * values, so the same float steps and the same bits as the gather form. Measured, kernel alone
 * (`python -m scripts.bench_quant --kernel --batches 1,4`, AMD EPYC, AVX-512 VNNI): 12-20% faster
 * than the gather form at 4 rows, 5-10% slower at 1 (its 16 row registers spill), so batch 1
 * keeps the gathers. */
static inline __attribute__((always_inline)) void q4_1_chunk16(
    const uint8_t *blk, int64_t row_bytes, const int MR, const int8_t *xg, int64_t ng,
    const float *dx, const float *sx, int64_t nb, __m512i mask, __m512i nibbles, __m512 *acc) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i headers = _mm512_set_epi32(0, 0, 0, 15, 0, 0, 0, 10, 0, 0, 0, 5, 0, 0, 0, 0);
    __m512i W[16], H[16], T[4];
    for (int r = 0; r < 16; r++) {
        const uint8_t *row = blk + r * row_bytes;
        const __m512i lo = _mm512_loadu_si512(row);
        const __m512i hi = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(row + 64)));
        W[r] = _mm512_permutex2var_epi32(lo, nibbles, hi);
        H[r] = _mm512_maskz_permutexvar_epi32(0x1111, headers, lo);
    }
    transpose_sums4(H, T);
    __m512 d[4], mw[4];
    for (int j = 0; j < 4; j++) {
        d[j] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(T[j]));
        mw[j] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(T[j], 16)));
    }
    for (int i = 0; i < MR; i++) {
        const int8_t *x = xg + i * ng * GEMV_GROUP;
        const __m512i xlo = _mm512_loadu_si512(x), xhi = _mm512_loadu_si512(x + 64);
        __m512i R[16];
        for (int r = 0; r < 16; r++) {
            const __m512i s = _mm512_dpbusd_epi32(zero, _mm512_and_si512(W[r], mask), xlo);
            R[r] = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(W[r], 4), mask), xhi);
        }
        transpose_sums4(R, T);
        for (int j = 0; j < 4; j++) {
            const int64_t b = i * nb + j;
            const __m512 sc = _mm512_mul_ps(d[j], _mm512_set1_ps(dx[b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T[j]), sc, acc[i]);
            acc[i] = _mm512_fmadd_ps(mw[j], _mm512_set1_ps(sx[b]), acc[i]);
        }
    }
}

/* out[m * ldo + r] (r where rmask is set) for 16 Q4 rows at src (row_bytes apart) and MR (<= 5)
 * activation rows (xg: gemv_layout; dx, sx, zq: quantize_row's, row stride nb). */
static inline __attribute__((always_inline)) void q4_rows16(
    const int fmt, const int MR, const uint8_t *src, int64_t row_bytes, int64_t nb,
    const int8_t *xg, const float *dx, const float *sx, const int32_t *zq, float *out,
    int64_t ldo, __mmask16 rmask, const uint8_t *ahead) {
    const int bytes = fmt == FMT_Q4_0 ? 18 : 20, off = fmt == FMT_Q4_1 ? 4 : 2;
    const int64_t ng = (nb + 3) / 4;
    const __m512i mask = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    const __m512i rows_at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int32_t)row_bytes));
    const __m512i nibbles_q4_1 =
        _mm512_set_epi32(19, 18, 17, 16, 14, 13, 12, 11, 9, 8, 7, 6, 4, 3, 2, 1);
    __m512 acc[5];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 4) {
        const int64_t have = nb - c < 4 ? nb - c : 4;
        if (ahead) prefetch_rows(ahead, row_bytes, c * bytes, 4 * bytes);
        __m512 d[4], mw[4];
        if (fmt == FMT_Q4_1 && have == 4 && MR >= 2) { /* batch 1: the gathers measured faster */
            q4_1_chunk16(src + c * bytes, row_bytes, MR, xg + (c / 4) * GEMV_GROUP, ng, dx + c,
                         sx + c, nb, mask, nibbles_q4_1, acc);
            continue;
        }
        for (int j = 0; j < have; j++) {
            const __m512i v = _mm512_i32gather_epi32(rows_at, src + (c + j) * bytes, 1);
            d[j] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
            mw[j] = fmt == FMT_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)))
                                    : d[j];
        }
        for (int i = 0; i < MR; i++) {
            const int8_t *x = xg + (i * ng + c / 4) * GEMV_GROUP;
            const __m512i xlo = _mm512_loadu_si512(x), xhi = _mm512_loadu_si512(x + 64);
            __m512i R[16], T[4];
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = src + r * row_bytes + c * bytes;
                __m512i w;
                if (fmt == FMT_Q4_1 && have == 4) {
                    /* 4 Q4_1 blocks = 80 bytes; their nibbles start at dwords 1, 6, 11, 16 */
                    const __m512i lo = _mm512_loadu_si512(blk);
                    const __m512i hi =
                        _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk + 64)));
                    w = _mm512_permutex2var_epi32(lo, nibbles_q4_1, hi);
                } else {
                    w = gemv_load4(blk + off, bytes, have);
                }
                const __m512i s = _mm512_dpbusd_epi32(zero, _mm512_and_si512(w, mask), xlo);
                R[r] = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(w, 4), mask), xhi);
            }
            transpose_sums4(R, T);
            for (int j = 0; j < have; j++) {
                const int64_t b = i * nb + c + j;
                __m512i S = T[j];
                if (fmt == FMT_Q4_0) S = _mm512_add_epi32(S, _mm512_set1_epi32(zq[b]));
                const __m512 sc = _mm512_mul_ps(d[j], _mm512_set1_ps(dx[b]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sc, acc[i]);
                if (fmt == FMT_Q4_1) acc[i] = _mm512_fmadd_ps(mw[j], _mm512_set1_ps(sx[b]), acc[i]);
            }
        }
    }
    for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(out + i * ldo, rmask, acc[i]);
}

/* Block b (bytes long) of the next tile at ahead (NULL: none) into L2: the tiles of a row kernel
 * stream in address order, and a thread's next tile is the next in memory. At every batch, in
 * the first pass over a tile. Intel Xeon VM (AVX-512 VNNI, 300 MiB L3), python -m
 * scripts.bench_floor alternated with the tree that prefetched from 4 rows only: batch-1 TPOT
 * 4.18 / 3.19 / 3.71 ms against 4.33 / 7.02 / 5.68 at 2 threads, 6.95 / 5.75 / 6.23 against
 * 10.39 / 12.38 / 10.95 at 1. (An AMD EPYC VM once measured a batch-1 step 5% faster with no
 * prefetch than with an L1 one; this L2 one was not measured there.) */
#define X16_MR 6 /* activation rows a pass of the X16 kernels: 2 x 6 integer sums, 6 float sums */
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *ahead, int64_t b,
                                                                 int bytes) {
    if (ahead)
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(ahead + b * bytes + line), _MM_HINT_T1);
}

/* out[i * ldo + r] for a Q4_1X16 tile (16 rows, nb blocks) and MR (<= 6) activation rows (xq:
 * quantize_row's int8 rows, K apart; dx, sx: row stride nb). Per block: 4 loads give the 16
 * rows' nibbles (lane = row), 8 vpdpbusd against broadcast activation dwords leave each row's
 * integer sum in its lane, and the float steps run in the header's order, as q4_rows16's. No
 * gathers and no transposes: measured 3.1-3.3x q4_rows16 at batch 1 on weights in cache, 2.3x
 * on 14 MB (AMD EPYC, AVX-512 VNNI, one thread; the same bits).
 * Two integer sums per row (low nibbles, high nibbles), added at the block's end (exact, so the
 * same bits): vpdpbusd's latency (5 cycles on Intel Sapphire Rapids, two issued a cycle) wants
 * about ten chains in flight, and one chain per row left 5 rows at half that. */
static inline __attribute__((always_inline)) void q4_1x16_rows16(
    const int MR, const uint8_t *tile, int64_t nb, const int8_t *xq, const float *dx,
    const float *sx, float *out, int64_t ldo, const uint8_t *ahead) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const int64_t K = nb * QK;
    __m512 acc[6];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * X16_BLOCK;
        prefetch_block(ahead, b, X16_BLOCK);
        __m512i lo[4], hi[4];
        for (int k = 0; k < 4; k++) {
            const __m512i w = _mm512_loadu_si512(blk + 64 * k);
            lo[k] = _mm512_and_si512(w, mask);
            hi[k] = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
        __m512i SL[6], SH[6];
        for (int i = 0; i < MR; i++) SL[i] = SH[i] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < MR; i++) {
                const int8_t *x = xq + i * K + b * QK;
                int32_t xl, xh;
                memcpy(&xl, x + 4 * k, 4);
                memcpy(&xh, x + 16 + 4 * k, 4);
                SL[i] = _mm512_dpbusd_epi32(SL[i], lo[k], _mm512_set1_epi32(xl));
                SH[i] = _mm512_dpbusd_epi32(SH[i], hi[k], _mm512_set1_epi32(xh));
            }
        for (int i = 0; i < MR; i++) {
            const int64_t bi = i * nb + b;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(SL[i], SH[i])),
                                     _mm512_mul_ps(d, _mm512_set1_ps(dx[bi])), acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[bi]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(out + i * ldo, acc[i]);
}

/* The same for a Q8_0X16 tile: per block, 8 registers of int8 (lanes = rows) flipped to u8, the
 * zero point's term starting each block's integer sum (as the tiled path's _z kernels). */
static inline __attribute__((always_inline)) void q8_0x16_rows16(
    const int MR, const uint8_t *tile, int64_t nb, const int8_t *xq, const float *dx,
    const int32_t *zq, float *out, int64_t ldo, const uint8_t *ahead) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t K = nb * QK;
    __m512 acc[6];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * X16Q8_BLOCK;
        prefetch_block(ahead, b, X16Q8_BLOCK);
        __m512i SA[6], SB[6]; /* even and odd dword groups: two chains a row, as Q4_1X16's */
        for (int i = 0; i < MR; i++) {
            SA[i] = _mm512_set1_epi32(zq[i * nb + b]);
            SB[i] = _mm512_setzero_si512();
        }
        for (int g = 0; g < 8; g += 2) {
            const __m512i wa = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * g), flip);
            const __m512i wb = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * g + 64), flip);
            for (int i = 0; i < MR; i++) {
                int32_t xa, xb;
                memcpy(&xa, xq + i * K + b * QK + 4 * g, 4);
                memcpy(&xb, xq + i * K + b * QK + 4 * g + 4, 4);
                SA[i] = _mm512_dpbusd_epi32(SA[i], wa, _mm512_set1_epi32(xa));
                SB[i] = _mm512_dpbusd_epi32(SB[i], wb, _mm512_set1_epi32(xb));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512)));
        for (int i = 0; i < MR; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(SA[i], SB[i])),
                                     _mm512_mul_ps(d, _mm512_set1_ps(dx[i * nb + b])), acc[i]);
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(out + i * ldo, acc[i]);
}

/* The same for 16 Q8_0 rows, two blocks a chunk (xq: quantize_row's int8 rows, K apart). */
static inline __attribute__((always_inline)) void q8_rows16(
    const int MR, const uint8_t *src, int64_t row_bytes, int64_t nb, const int8_t *xq,
    const float *dx, const int32_t *zq, float *out, int64_t ldo, __mmask16 rmask,
    const uint8_t *ahead) {
    const int bytes = 34;
    const int64_t K = nb * QK;
    const __m512i zero = _mm512_setzero_si512(), flip = _mm512_set1_epi8((char)0x80);
    const __m512i rows_at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int32_t)row_bytes));
    __m512 acc[5];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nb; c += 2) {
        const int have = nb - c < 2 ? 1 : 2;
        if (ahead) prefetch_rows(ahead, row_bytes, c * bytes, 2 * bytes);
        __m512 d[2];
        for (int j = 0; j < have; j++)
            d[j] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                _mm512_i32gather_epi32(rows_at, src + (c + j) * bytes, 1)));
        for (int i = 0; i < MR; i++) {
            const int8_t *x = xq + i * K + c * QK;
            const __m512i xv = have == 2 ? _mm512_loadu_si512(x)
                                         : _mm512_maskz_loadu_epi8(0xffffffffull, x);
            __m512i R[16], T[2];
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = src + r * row_bytes + c * bytes;
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 2));
                const __m256i hi = have == 2 ? _mm256_loadu_si256((const __m256i *)(blk + bytes + 2))
                                             : _mm256_setzero_si256();
                const __m512i w = _mm512_xor_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
                R[r] = _mm512_dpbusd_epi32(zero, w, xv);
            }
            transpose_sums2(R, T);
            for (int j = 0; j < have; j++) {
                const int64_t b = i * nb + c + j;
                const __m512i S = _mm512_add_epi32(T[j], _mm512_set1_epi32(zq[b]));
                const __m512 sc = _mm512_mul_ps(d[j], _mm512_set1_ps(dx[b]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sc, acc[i]);
            }
        }
    }
    for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(out + i * ldo, rmask, acc[i]);
}

/* out[m * ldo + r] for a tile of rows (<= 16) at src and every activation row m < M;
 * pad: scratch of 16 rows for a part's last, partial tile (read zero-padded). */
static void rows_tile(int fmt, const uint8_t *src, int64_t row_bytes, int64_t rows,
                      const uint8_t *ahead, int64_t nb, const int8_t *xq, const int8_t *xg,
                      const float *dx, const float *sx, const int32_t *zq, int64_t M, float *out,
                      int64_t ldo, uint8_t *pad) {
    if (is_x16(fmt)) { /* whole tiles only (the caller checked) */
        const int64_t K = nb * QK;
        for (int64_t m = 0; m < M;) {
            const int64_t passes = (M - m + X16_MR - 1) / X16_MR; /* even passes: no 1-row tail */
            const int mr = (int)((M - m + passes - 1) / passes);
            const uint8_t *a = m == 0 ? ahead : NULL; /* the first pass streams the tile in */
#define X16_ROWS(MR_)                                                                          \
    case MR_:                                                                                  \
        if (fmt == FMT_Q8_0X16)                                                                \
            q8_0x16_rows16(MR_, src, nb, xq + m * K, dx + m * nb, zq + m * nb, out + m * ldo, ldo, a); \
        else                                                                                   \
            q4_1x16_rows16(MR_, src, nb, xq + m * K, dx + m * nb, sx + m * nb, out + m * ldo, ldo, a); \
        break;
            switch (mr) {
                X16_ROWS(1)
                X16_ROWS(2)
                X16_ROWS(3)
                X16_ROWS(4)
                X16_ROWS(5)
                X16_ROWS(6)
            }
#undef X16_ROWS
            m += mr;
        }
        return;
    }
    if (rows < TILE_N) {
        memset(pad, 0, (size_t)(TILE_N * row_bytes));
        memcpy(pad, src, (size_t)(rows * row_bytes));
        src = pad;
    }
    const __mmask16 rm = tandem_mask16(rows);
    const int64_t K = nb * QK, ng = (nb + 3) / 4;
    for (int64_t m = 0; m < M;) {
        const int mr = M - m >= 5 ? 5 : (int)(M - m);
        const float *d = dx + m * nb, *s = sx + m * nb;
        const int32_t *z = zq + m * nb;
        float *o = out + m * ldo;
        const uint8_t *a = m == 0 ? ahead : NULL; /* the first pass streams the rows in */
#define Q_ROWS(MR_)                                                                            \
    case MR_:                                                                                  \
        if (fmt == FMT_Q4_1)                                                                   \
            q4_rows16(FMT_Q4_1, MR_, src, row_bytes, nb, xg + m * ng * GEMV_GROUP, d, s, z, o, \
                      ldo, rm, a);                                                             \
        else if (fmt == FMT_Q4_0)                                                              \
            q4_rows16(FMT_Q4_0, MR_, src, row_bytes, nb, xg + m * ng * GEMV_GROUP, d, s, z, o, \
                      ldo, rm, a);                                                             \
        else                                                                                   \
            q8_rows16(MR_, src, row_bytes, nb, xq + m * K, d, z, o, ldo, rm, a);               \
        break;
        switch (mr) {
            Q_ROWS(1)
            Q_ROWS(2)
            Q_ROWS(3)
            Q_ROWS(4)
            Q_ROWS(5)
        }
#undef Q_ROWS
        m += mr;
    }
}
#endif

/*
 * F32 weights (fmt FMT_F32): the rows are float32 as the file stores them, so nothing is
 * quantized; the activations multiply them in float32 with float32 sums, in one order per
 * output (header): 16 lane sums over k = j mod 16, then tree16 (ggml-cpu's ggml_vec_dot_f32
 * arithmetic, with a fixed tree). Two shapes of the same sums:
 * - One or two activation rows (decode at batch 1-2): the weights stream from DRAM, 4 bytes
 *   each, so each thread reads its rows in address order, one row at a time (a core streams
 *   one row at 24-28 GB/s, 4 interleaved rows at 13-15: measured), and four rows share one
 *   horizontal sum (hsum4).
 * - From 3 rows (F32_PANEL_MIN): 4 weight rows x 4 activation rows of lane sums in registers
 *   (f32_dots), one load per 4 FMAs, F32_MCHUNK activation rows at a time so they stay in L2
 *   while every weight row of the tile meets them; the next tile is prefetched in order.
 */
#define F32_PANEL_MIN 3
#define F32_MCHUNK 64

/* The 16 lane sums' tree: (x_i + x_{i+8}), then pairs, then halves (hsum4's order). */
static inline float tree16(const float *x) {
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = x[i] + x[i + 8];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* out[m * ldo + r] = weight row r . activation row m for r < R, m < MR (<= 4 each); when
 * ahead is given (R rows of the next tile), R lines of it are prefetched a step, in order. */
static inline __attribute__((always_inline)) void f32_dots(const int R, const int MR,
                                                           const float *w, const float *x,
                                                           int64_t K, float *out, int64_t ldo,
                                                           const float *ahead) {
    __m512 acc[4][4];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[4];
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(w + r * K + k);
        if (ahead) /* the next tile's same R rows: one contiguous block, read in order */
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(ahead + R * k + 16 * r), _MM_HINT_T1);
        for (int m = 0; m < MR; m++) {
            __m512 xv = _mm512_loadu_ps(x + m * K + k);
            /* NOTE: keeps xv in a register: gcc otherwise folds the load into each of the R
             * FMAs, and 5 loads per 4 FMAs bound the loop (2.4x slower, measured) */
            __asm__("" : "+v"(xv));
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    const __m512 z = _mm512_setzero_ps();
    for (int m = 0; m < MR; m++) {
        float four[4];
        _mm_storeu_ps(four, hsum4(acc[m][0], R > 1 ? acc[m][1] : z, R > 2 ? acc[m][2] : z,
                                  R > 3 ? acc[m][3] : z));
        for (int r = 0; r < R; r++) out[m * ldo + r] = four[r];
    }
}

/* One weight row's 16 lane sums against MR (<= 2) activation rows. */
static inline __attribute__((always_inline)) void f32_row_lanes(const int MR, const float *w,
                                                                const float *x, int64_t K,
                                                                __m512 *acc) {
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(w + k);
        for (int m = 0; m < MR; m++)
            acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
}
#endif

/* One (weight row, activation row) pair's 16 lane sums, without AVX-512. */
static void f32_lanes_c(const float *w, const float *x, int64_t K, float *lanes) {
#if defined(HAVE_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    }
    _mm256_storeu_ps(lanes, a0);
    _mm256_storeu_ps(lanes + 8, a1);
#else
    for (int j = 0; j < 16; j++) lanes[j] = 0.0f;
    for (int64_t k = 0; k < K; k += 16)
        for (int j = 0; j < 16; j++) lanes[j] = fmaf(w[k + j], x[k + j], lanes[j]);
#endif
}

/* out[m * ldo + r] for weight rows [0, rows) at w and activation rows [0, M) at x. */
static void f32_tile(const float *w, int64_t rows, const float *x, int64_t M, int64_t K,
                     float *out, int64_t ldo, const float *ahead, int isa) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (isa >= ISA_AVX512 && M < F32_PANEL_MIN) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) { /* rows one at a time, hsum4 per four */
            const int R = rows - r0 >= 4 ? 4 : (int)(rows - r0);
            __m512 acc[4][2];
            const __m512 z = _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                if (M == 1) f32_row_lanes(1, w + (r0 + r) * K, x, K, acc[r]);
                else f32_row_lanes(2, w + (r0 + r) * K, x, K, acc[r]);
            }
            for (int64_t m = 0; m < M; m++) {
                float four[4];
                _mm_storeu_ps(four, hsum4(acc[0][m], R > 1 ? acc[1][m] : z,
                                          R > 2 ? acc[2][m] : z, R > 3 ? acc[3][m] : z));
                for (int r = 0; r < R; r++) out[m * ldo + r0 + r] = four[r];
            }
        }
        return;
    }
    if (isa >= ISA_AVX512) {
        for (int64_t m0 = 0; m0 < M; m0 += F32_MCHUNK) {
            const int64_t mc = M - m0 < F32_MCHUNK ? M - m0 : F32_MCHUNK;
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const int R = rows - r0 >= 4 ? 4 : (int)(rows - r0);
                const float *wr = w + r0 * K, *a = m0 == 0 ? ahead + r0 * K : NULL;
                for (int64_t m = m0; m < m0 + mc; m += 4) {
                    const int MR = m0 + mc - m >= 4 ? 4 : (int)(m0 + mc - m);
                    float *o = out + m * ldo + r0;
                    const float *xm = x + m * K, *am = m == m0 ? a : NULL;
#define F32_DOTS(R_, MR_) if (R == R_ && MR == MR_) f32_dots(R_, MR_, wr, xm, K, o, ldo, am);
                    F32_DOTS(4, 4) F32_DOTS(4, 3) F32_DOTS(4, 2) F32_DOTS(4, 1)
                    F32_DOTS(3, 4) F32_DOTS(3, 3) F32_DOTS(3, 2) F32_DOTS(3, 1)
                    F32_DOTS(2, 4) F32_DOTS(2, 3) F32_DOTS(2, 2) F32_DOTS(2, 1)
                    F32_DOTS(1, 4) F32_DOTS(1, 3) F32_DOTS(1, 2) F32_DOTS(1, 1)
#undef F32_DOTS
                }
            }
        }
        return;
    }
#endif
    (void)isa, (void)ahead;
    float lanes[16];
    for (int64_t m0 = 0; m0 < M; m0 += F32_MCHUNK) {
        const int64_t mc = M - m0 < F32_MCHUNK ? M - m0 : F32_MCHUNK;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t m = m0; m < m0 + mc; m++) {
                f32_lanes_c(w + r * K, x + m * K, K, lanes);
                out[m * ldo + r] = tree16(lanes);
            }
    }
}

/* tandem_quant_matmul_f32 for F32 weights: tiles of TILE_N rows over the threads. */
static int f32_matmul(const float *x, const uint8_t *const *parts, const int64_t *part_rows,
                      const int64_t *tile_end, const int64_t *row_start, int64_t tiles,
                      float *out, int64_t M, int64_t K, int64_t ldo, int num_threads, int isa) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int p;
        int64_t r0;
        const int64_t rows = locate_tile(t, tile_end, part_rows, &p, &r0);
        const float *w = (const float *)parts[p] + r0 * K;
        /* NOTE: past a part's end the prefetch reads nothing it needs: harmless */
        f32_tile(w, rows, x, M, K, out + row_start[p] + r0, ldo, w + TILE_N * K, isa);
    }
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
    for (int p = 0; p < num_parts; p++)
        if (is_x16(fmt) && part_rows[p] % TILE_N != 0) return TANDEM_BAD_SHAPE;
    if (M == 0 || N == 0) return TANDEM_OK;
    if (fmt == FMT_F32)
        return f32_matmul(x, parts, part_rows, tile_end, row_start, tiles, out, M, K,
                          ldo, num_threads, isa);
    const int64_t nb = K / QK, row_bytes = nb * bytes, mp = panel_rows(M, isa, fmt);
    const int64_t padded = (mp + PANEL - 1) / PANEL * PANEL;
    /* tiles of 16 rows: their row kernels at every batch (a tile block is already the
     * registers the kernel multiplies; unpacking it for the tiled kernel costs more than
     * reading it from L1 once per pass of up to X16_MR activation rows) */
    const int64_t tiled_min = fmt == FMT_Q8_0 ? TILED_MIN_Q8 : is_x16(fmt) ? INT64_MAX
                              : TILED_MIN_Q4;
    const int rows16 = isa >= ISA_AVX512 && M < tiled_min; /* rows_tile's row kernels */
    const int tiled = isa >= ISA_AVX512 && M >= tiled_min; /* unpack_tile + run_tile_rows */
    const int xg_needed = rows16 && fmt != FMT_Q8_0 && !is_x16(fmt);
    /* the AVX2 and scalar paths read tiles as the file's rows, rearranged into scratch */
    const int ufmt = file_fmt(fmt);
    const int64_t ng = (nb + 3) / 4;
    int8_t *xg = xg_needed ? malloc((size_t)(M * ng * GEMV_GROUP)) : NULL;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb));
    float *sx = malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *zq = malloc(sizeof(int32_t) * (size_t)(M * nb));
    uint8_t *xt = padded ? malloc((size_t)(padded * K)) : NULL;
    float *dxt = padded ? malloc(sizeof(float) * (size_t)(padded * nb * 2)) : NULL;
    int32_t *zt = padded ? malloc(sizeof(int32_t) * (size_t)(padded * nb)) : NULL;
    int failed = !xq || !dx || !sx || !zq || (padded && (!xt || !dxt || !zt))
                 || (xg_needed && !xg);
    if (failed) goto done;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, nb, xq + m * K, dx + m * nb, sx + m * nb, zq + m * nb,
                         zero_point(fmt));
        /* NOTE: every barrier is a wait for the slowest thread (a preempted one stalls the team
         * at each): a single only when it has work, and the tile loop's end is the region's */
        if (padded || xg_needed) {
#pragma omp single
            {
                if (padded) interleave_panels(xq, dx, sx, zq, mp, M, nb, xt, dxt, zt);
#if defined(HAVE_VNNI)
                if (xg_needed) gemv_layout(xq, M, nb, xg);
#endif
            }
        }
#if defined(HAVE_VNNI)
        if (tiled) failed |= run_tiled(fmt, parts, part_rows, row_start, num_parts, xq, dx, sx, zq,
                                       M, nb, out, ldo);
#endif
        /* scratch of the row paths: a padded tile (rows16), or the unpacked tile and sums */
        uint8_t *u = tiled ? NULL : malloc((size_t)(TILE_N * (rows16 ? row_bytes : K + row_bytes)));
        float *dw = tiled || rows16 ? NULL : malloc(sizeof(float) * (size_t)(TILE_N * nb * 2));
        int32_t *S = tiled || rows16 ? NULL : malloc(sizeof(int32_t) * (size_t)(TILE_N * nb));
        const int ready = tiled || (u && (rows16 || (dw && S)));
        if (!ready) failed = 1;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < (tiled ? 0 : tiles); t++) {
            if (!ready) continue;
            int p;
            int64_t r0;
            const int64_t rows = locate_tile(t, tile_end, part_rows, &p, &r0);
            const uint8_t *src = parts[p] + r0 * row_bytes;
#if defined(HAVE_VNNI)
            if (rows16) {
                rows_tile(fmt, src, row_bytes, rows, src + TILE_N * row_bytes, nb, xq, xg, dx, sx,
                          zq, M, out + row_start[p] + r0, ldo, u);
                continue;
            }
#endif
            float *cw = dw + TILE_N * nb;
            if (rows < TILE_N) memset(cw, 0, sizeof(float) * (size_t)(TILE_N * nb));
            if (is_x16(fmt)) { /* after u's TILE_N * K bytes */
                x16_tile_rows(fmt, src, nb, u + TILE_N * K);
                src = u + TILE_N * K;
            }
            for (int64_t r = 0; r < rows; r++)
                unpack_row(ufmt, src + r * row_bytes, nb, u + r * K, dw + r * nb, cw + r, TILE_N);
            run_tile(u, dw, cw, rows, xq, dx, sx, zq, xt, dxt, zt, M, K, nb,
                     out + row_start[p] + r0, ldo, isa, ufmt, S);
        }
        free(u);
        free(dw);
        free(S);
    }
done:
    free(xg);
    free(xt);
    free(dxt);
    free(zt);
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
    const int x16 = is_x16(fmt), ufmt = file_fmt(fmt);
    if (x16 && N % TILE_N != 0) return TANDEM_BAD_SHAPE;
    uint8_t u[QK], blk[34];
    float dw, cw;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = w + ids[r] * nb * bytes;
        for (int64_t b = 0; b < nb; b++) {
            if (x16) /* tile ids[r] / 16 starts where its first row would */
                x16_block(fmt, w + (ids[r] / TILE_N) * TILE_N * nb * bytes, (int)(ids[r] % TILE_N),
                          b, blk);
            unpack_row(ufmt, x16 ? blk : row + b * bytes, 1, u, &dw, &cw, 1);
            /* the file's own arithmetic (as gguf-py dequantizes), not dw * u + cw */
            const int zero = zero_point(ufmt);
            const float add = ufmt == FMT_Q4_1 ? cw : 0.0f;
            for (int j = 0; j < QK; j++)
                out[r * K + b * QK + j] = dw * (float)((int)u[j] - zero) + add;
        }
    }
    return TANDEM_OK;
}
