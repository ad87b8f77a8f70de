/* raymoe's native CPU kernels in bfloat16 on AVX512_BF16 (built and loaded by kernels/native_library.py,
 * called through kernels/native_bf16.py).
 *
 * 1. raymoe_bf16_linear: y = x W^T (+ bias), a dense layer; y in bfloat16 or float32 (the LM head).
 * 2. raymoe_bf16_swiglu_experts: y[r] = W2_e (silu(Wg_e x[r]) * (Wu_e x[r])) for every row r of every
 *    job (e, begin, end): a layer's experts in one call.
 *
 * Weights are read where they lie, in the checkpoint's [out, in] layout: nothing is packed, so no
 * copy of any weight is made (a bfloat16 deployment holds each weight once). Each output element
 * is the dot product of an input row and a weight row, both bfloat16, taken 32 elements at a time
 * by VDPBF16PS into 16 float32 lanes in k order from zero, then the lanes are added by one fixed
 * tree (_mm512_reduce_add_ps): exact products, float32 sums, one rounding to bfloat16 at the end
 * (round to nearest even, as torch rounds). Whatever the number of rows in a call, a row's result
 * is the same bits: placement, replicas and batching cannot change it.
 *
 * Blocks of ROWS x COLS outputs keep their ROWS * COLS accumulators in registers; each weight row
 * streams once per block of rows, the next block's rows are prefetched meanwhile. K (the reduced
 * size) must be a multiple of 32, the experts' I a multiple of 16.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "raymoe_constants.h" /* CHUNK_ROWS: rows per pass over an expert's weights */
#include "simd_math.h"        /* swiglu_ps */

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define ROWS 4 /* input rows per register block */
#define COLS 4 /* weight rows (outputs) per register block */

int raymoe_bf16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t f32_to_bf16(float value) { /* round to nearest even; NaN stays NaN (torch's rule) */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

BF16_TARGET static inline __m256i f32_to_bf16_ps(__m512 value) { /* 16 lanes of f32_to_bf16 */
    __m512i bits = _mm512_castps_si512(value);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(rounded);
}

/* s[m * COLS + n] = x[m] . w[n] over k < K, for m < MB rows of x (stride ldx) and n < NB rows of w
 * (stride ldw), the next rows of w (COLS rows on) prefetched meanwhile. */
#define DOT_BLOCK(MB, NB)                                                                              \
    BF16_TARGET static void dot_##MB##_##NB(const uint16_t *x, int64_t ldx, const uint16_t *w,         \
                                            int64_t ldw, int64_t K, float *s) {                        \
        __m512 acc[MB][NB];                                                                            \
        _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++)                                           \
            _Pragma("GCC unroll 4") for (int n = 0; n < NB; n++) acc[m][n] = _mm512_setzero_ps();      \
        for (int64_t k = 0; k < K; k += 32) {                                                          \
            __m512bh wv[NB];                                                                           \
            _Pragma("GCC unroll 4") for (int n = 0; n < NB; n++) {                                     \
                _mm_prefetch((const char *)(w + (n + COLS) * ldw + k), _MM_HINT_T0);                   \
                wv[n] = (__m512bh)_mm512_loadu_si512(w + n * ldw + k);                                 \
            }                                                                                          \
            _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++) {                                     \
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);                           \
                _Pragma("GCC unroll 4") for (int n = 0; n < NB; n++)                                   \
                    acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);                                \
            }                                                                                          \
        }                                                                                              \
        _Pragma("GCC unroll 4") for (int m = 0; m < MB; m++)                                           \
            _Pragma("GCC unroll 4") for (int n = 0; n < NB; n++)                                       \
                s[m * COLS + n] = _mm512_reduce_add_ps(acc[m][n]);                                     \
    }

DOT_BLOCK(1, 4) DOT_BLOCK(2, 4) DOT_BLOCK(3, 4) DOT_BLOCK(4, 4)
DOT_BLOCK(1, 1) DOT_BLOCK(2, 1) DOT_BLOCK(3, 1) DOT_BLOCK(4, 1)

typedef void (*dot_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, float *);
static const dot_fn DOT4[ROWS + 1] = {0, dot_1_4, dot_2_4, dot_3_4, dot_4_4};
static const dot_fn DOT1[ROWS + 1] = {0, dot_1_1, dot_2_1, dot_3_1, dot_4_1};

/* s[m * COLS + n] for m < mb, n < nb (nb <= COLS): the dot products of one block. */
BF16_TARGET static void dot_block(const uint16_t *x, int64_t ldx, int64_t mb, const uint16_t *w, int64_t ldw,
                                  int64_t nb, int64_t K, float *s) {
    if (nb == COLS) {
        DOT4[mb](x, ldx, w, ldw, K, s);
        return;
    }
    for (int64_t n = 0; n < nb; n++) DOT1[mb](x, ldx, w + n * ldw, ldw, K, s + n);
}

/* y = x W^T (+ bias): x [M, K] (row stride ldx), W [N, K] as the checkpoint holds it, bias [N] or
 * NULL, all bfloat16; y [M, N] (row stride ldy) in float32 when y_f32, else bfloat16. The outputs
 * n0 <= n < n1 only (a caller may split N over threads). Returns -1 on K % 32. */
BF16_TARGET int raymoe_bf16_linear(const uint16_t *x, int64_t ldx, void *y, int64_t ldy, int32_t y_f32,
                                   const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t n0,
                                   int64_t n1) {
    if (K % 32 || K <= 0 || n0 < 0 || n1 < n0) return -1;
    float s[ROWS * COLS];
    /* rows in chunks that stay in L2 while the weights stream past them once per chunk */
    const int64_t chunk = 64;
    for (int64_t first = 0; first < M; first += chunk) {
        const int64_t rows = M - first < chunk ? M - first : chunk;
        for (int64_t n = n0; n < n1; n += COLS) {
            const int64_t nb = n1 - n < COLS ? n1 - n : COLS;
            for (int64_t m = 0; m < rows; m += ROWS) {
                const int64_t mb = rows - m < ROWS ? rows - m : ROWS;
                dot_block(x + (first + m) * ldx, ldx, mb, w + n * K, K, nb, K, s);
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t j = 0; j < nb; j++) {
                        float value = s[i * COLS + j];
                        if (bias) value += bf16_to_f32(bias[n + j]);
                        const int64_t at = (first + m + i) * ldy + n + j;
                        if (y_f32) ((float *)y)[at] = value;
                        else ((uint16_t *)y)[at] = f32_to_bf16(value);
                    }
            }
        }
    }
    return 0;
}

/* jobs: [n_jobs][3] = (stacked expert, first row, end row) into x and y ([rows, D] each, bfloat16);
 * w13 [R][2I][D] (gate rows, then up rows) and w2 [R][D][I] as the checkpoint holds them.
 * scratch: CHUNK_ROWS * I bfloat16 (the rows' silu(gate) * up, rounded to bfloat16 as a bfloat16
 * model's activations are). Returns 0, or -1 on a shape it does not take. */
BF16_TARGET int raymoe_bf16_swiglu_experts(const uint16_t *x, uint16_t *y, const uint16_t *w13,
                                           const uint16_t *w2, const int64_t *jobs, int64_t n_jobs, int64_t D,
                                           int64_t I, uint16_t *scratch) {
    if (D % 32 || I % 32 || D <= 0 || I <= 0) return -1;
    const int64_t w13_stride = 2 * I * D, w2_stride = D * I;
    float gate[ROWS * COLS * 4], up[ROWS * COLS * 4], s[ROWS * COLS];
    for (int64_t j = 0; j < n_jobs; j++) {
        const uint16_t *e13 = w13 + jobs[3 * j] * w13_stride, *e2 = w2 + jobs[3 * j] * w2_stride;
        for (int64_t first = jobs[3 * j + 1]; first < jobs[3 * j + 2]; first += CHUNK_ROWS) {
            int64_t rows = jobs[3 * j + 2] - first;
            if (rows > CHUNK_ROWS) rows = CHUNK_ROWS;
            /* h = silu(gate) * up, 16 intermediates (4 blocks of COLS) at a time */
            for (int64_t i = 0; i < I; i += 16)
                for (int64_t m = 0; m < rows; m += ROWS) {
                    const int64_t mb = rows - m < ROWS ? rows - m : ROWS;
                    for (int64_t q = 0; q < 4; q++) {
                        dot_block(x + (first + m) * D, D, mb, e13 + (i + COLS * q) * D, D, COLS, D, s);
                        for (int64_t r = 0; r < mb; r++)
                            for (int64_t c = 0; c < COLS; c++) gate[r * 16 + COLS * q + c] = s[r * COLS + c];
                        dot_block(x + (first + m) * D, D, mb, e13 + (I + i + COLS * q) * D, D, COLS, D, s);
                        for (int64_t r = 0; r < mb; r++)
                            for (int64_t c = 0; c < COLS; c++) up[r * 16 + COLS * q + c] = s[r * COLS + c];
                    }
                    for (int64_t r = 0; r < mb; r++)
                        _mm256_storeu_si256((__m256i *)(scratch + (m + r) * I + i),
                                            f32_to_bf16_ps(swiglu_ps(_mm512_loadu_ps(gate + r * 16),
                                                                     _mm512_loadu_ps(up + r * 16))));
                }
            /* y = h W2^T */
            for (int64_t d = 0; d < D; d += COLS)
                for (int64_t m = 0; m < rows; m += ROWS) {
                    const int64_t mb = rows - m < ROWS ? rows - m : ROWS;
                    dot_block(scratch + m * I, I, mb, e2 + d * I, I, COLS, I, s);
                    for (int64_t r = 0; r < mb; r++)
                        for (int64_t c = 0; c < COLS; c++) y[(first + m + r) * D + d + c] = f32_to_bf16(s[r * COLS + c]);
                }
        }
    }
    return 0;
}
