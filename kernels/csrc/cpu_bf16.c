/* raymoe's native CPU kernels in bfloat16 on AVX512_BF16 (built and loaded by kernels/native_library.py,
 * called through kernels/native_bf16.py).
 *
 * 1. raymoe_bf16_linear: y = x W^T (+ bias), a dense layer; y in bfloat16 or float32 (the LM head).
 * 2. raymoe_bf16_swiglu_experts: y[r] = W2_e (silu(Wg_e x[r]) * (Wu_e x[r])) for every row r of every
 *    job (e, begin, end): a layer's experts in one call.
 * 3. raymoe_bf16_decode_attention: raymoe_decode_attention (cpu_f32.c) over bfloat16 q and caches.
 * Each on AMX (raymoe_amx_*) where the CPU has it.
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
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "raymoe_constants.h" /* CHUNK_ROWS: rows per pass over an expert's weights */
#include "simd_math.h"        /* exp_ps, swiglu_ps */

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define ROWS 4 /* input rows per register block */
#define COLS 4 /* weight rows (outputs) per register block */

int raymoe_bf16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* AMX: the CPU has AMX-TILE and AMX-BF16, and Linux lets this process use the tile data (asked once). */
int raymoe_amx_supported(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
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

#define ATT_NAME raymoe_bf16_decode_attention
#define ATT_T uint16_t
#define ATT_LOAD(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define ATT_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), f32_to_bf16_ps(v))
#define ATT_TARGET BF16_TARGET
#define ATT_CONVERT 1
#include "decode_attention.inc" /* 3. raymoe_bf16_decode_attention: raymoe_decode_attention's twin */

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

/* ---- AMX ---------------------------------------------------------------------------------------
 * y^T = W x^T with W as the A operand, straight from the checkpoint's layout (16 weight rows of 32
 * bfloat16 a tile, one strided tile load), and x as the B operand in the VNNI layout (pairs of k
 * side by side per row: made once per call, x is small). Each output is a chain of TDPBF16PS over
 * k in blocks of 32 from zero: exact products, float32 sums (denormals flushed, as AMX does), so a
 * row's result never depends on the rows beside it in the B tile. */
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#define AMX_ROWS 16 /* x rows per B tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

AMX_TARGET static void amx_configure(void) { /* tiles 0-3: C (16 x 16 float32), 4: A, 5: B */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* xv[kb][r][m] = the pair x[m][32kb + 2r .. +1] (zero for m >= mb): B tiles of 16 x 64 bytes. */
static void vnni_rows(const uint16_t *x, int64_t ldx, int64_t mb, int64_t K, uint32_t *xv) {
    for (int64_t kb = 0; kb < K / 32; kb++)
        for (int64_t r = 0; r < 16; r++)
            for (int64_t m = 0; m < AMX_ROWS; m++) {
                uint32_t pair = 0;
                if (m < mb) memcpy(&pair, x + m * ldx + 32 * kb + 2 * r, sizeof pair);
                xv[(kb * 16 + r) * AMX_ROWS + m] = pair;
            }
}

/* C tile T += (16 weight rows from n + 16 T) x (the rows in xv), over all of k. (Software prefetch
 * of the 16 rows' next lines, 128 B to 1 KiB ahead, measured no faster at 1-4 rows.) */
#define AMX_TILE(T)                                                                                    \
    do {                                                                                               \
        const uint16_t *a = w + (n + 16 * T) * K;                                                      \
        _tile_zero(T);                                                                                 \
        for (int64_t kb = 0; kb < K / 32; kb++) {                                                      \
            _tile_loadd(5, xv + kb * 16 * AMX_ROWS, 64);                                               \
            _tile_loadd(4, a + 32 * kb, 2 * K);                                                        \
            _tile_dpbf16ps(T, 4, 5);                                                                   \
        }                                                                                              \
        _tile_stored(T, out + 256 * T, 64);                                                            \
    } while (0)

/* out[j][m] (float32, 16 x 16 per tile, tiles side by side) = W[n + j] . x[m], j < 16 * tiles. */
AMX_TARGET static void amx_block(const uint16_t *w, int64_t K, int64_t n, int tiles, const uint32_t *xv, float *out) {
    AMX_TILE(0);
    if (tiles > 1) AMX_TILE(1);
    if (tiles > 2) AMX_TILE(2);
    if (tiles > 3) AMX_TILE(3);
}

/* Rows m < mb of a C tile (out[j][m]: 16 outputs j by 16 rows m) into y's row m, outputs n..n+15:
 * one gather per row, plus the bias, rounded to bfloat16 or kept float32. */
AMX_TARGET static void store_rows(const float *tile, int64_t mb, const uint16_t *bias, void *y, int64_t ldy,
                                  int32_t y_f32) {
    const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    __m512 add = _mm512_setzero_ps();
    if (bias) add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16));
    for (int64_t m = 0; m < mb; m++) {
        __m512 value = _mm512_i32gather_ps(across, tile + m, 4);
        if (bias) value = _mm512_add_ps(value, add);
        if (y_f32) _mm512_storeu_ps((float *)y + m * ldy, value);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * ldy), f32_to_bf16_ps(value));
    }
}

/* The rows' VNNI copies (x's, and the experts' h) a pass keeps at once: they stay in L2 while each
 * block of weights streams past them once, so up to 16 groups of 16 rows cost one pass over the
 * weights rather than one a group. */
#define AMX_PASS_BYTES (3 << 19)

static int64_t pass_groups(int64_t bytes_per_group) {
    int64_t groups = AMX_PASS_BYTES / bytes_per_group;
    return groups < 1 ? 1 : groups > 16 ? 16 : groups;
}

/* raymoe_bf16_linear's contract, on AMX (-1 on K % 32, -2 on no memory). Outputs past the last
 * whole 16 (N % 16 of them) take the AVX512_BF16 dot products: which kernel computes an output
 * depends on its index only, never on the rows in the call. */
AMX_TARGET int raymoe_amx_linear(const uint16_t *x, int64_t ldx, void *y, int64_t ldy, int32_t y_f32,
                                 const uint16_t *w, const uint16_t *bias, int64_t M, int64_t K, int64_t n0,
                                 int64_t n1) {
    if (K % 32 || K <= 0 || n0 < 0 || n1 < n0 || n0 % 16) return -1;
    const int64_t whole = n0 + (n1 - n0) / 16 * 16;
    const int64_t group_words = K / 32 * 16 * AMX_ROWS; /* one group's VNNI rows, in pairs */
    const int64_t groups = pass_groups(group_words * 4);
    uint32_t *xv = aligned_alloc(64, (size_t)(groups * group_words) * sizeof(uint32_t));
    if (!xv) return -2;
    float out[4 * 256];
    amx_configure();
    for (int64_t first = 0; first < M; first += groups * AMX_ROWS) {
        const int64_t rows = M - first < groups * AMX_ROWS ? M - first : groups * AMX_ROWS;
        for (int64_t g = 0; g * AMX_ROWS < rows; g++) {
            const int64_t mb = rows - g * AMX_ROWS < AMX_ROWS ? rows - g * AMX_ROWS : AMX_ROWS;
            vnni_rows(x + (first + g * AMX_ROWS) * ldx, ldx, mb, K, xv + g * group_words);
        }
        for (int64_t n = n0; n < whole; n += 64) {
            const int tiles = whole - n >= 64 ? 4 : (int)((whole - n) / 16);
            for (int64_t g = 0; g * AMX_ROWS < rows; g++) {
                const int64_t mb = rows - g * AMX_ROWS < AMX_ROWS ? rows - g * AMX_ROWS : AMX_ROWS;
                amx_block(w, K, n, tiles, xv + g * group_words, out);
                const int64_t row = first + g * AMX_ROWS;
                for (int t = 0; t < tiles; t++)
                    store_rows(out + 256 * t, mb, bias ? bias + n + 16 * t : NULL,
                               y_f32 ? (void *)((float *)y + row * ldy + n + 16 * t)
                                     : (void *)((uint16_t *)y + row * ldy + n + 16 * t), ldy, y_f32);
            }
        }
    }
    _tile_release();
    free(xv);
    if (whole < n1) return raymoe_bf16_linear(x, ldx, y, ldy, y_f32, w, bias, M, K, whole, n1);
    return 0;
}

/* raymoe_bf16_swiglu_experts' contract on AMX (scratch unused): per expert, its rows in passes of up
 * to 16 groups of 16 (pass_groups), each group a B tile; gate and up rows 16 at a time as A tiles
 * (two C tiles), silu(gate) * up for those 16 intermediates of a group's 16 rows at once, rounded to
 * bfloat16 straight into the VNNI layout of the down's B operand; then the down like
 * raymoe_amx_linear. -1 on D or I not multiples of 32, -2 on no memory. */
AMX_TARGET int raymoe_amx_swiglu_experts(const uint16_t *x, uint16_t *y, const uint16_t *w13, const uint16_t *w2,
                                         const int64_t *jobs, int64_t n_jobs, int64_t D, int64_t I,
                                         uint16_t *scratch) {
    (void)scratch;
    if (D % 32 || I % 32 || D <= 0 || I <= 0) return -1;
    const int64_t x_words = D / 32 * 16 * AMX_ROWS, h_halves = I / 32 * 16 * AMX_ROWS * 2;
    const int64_t groups = pass_groups(x_words * 4 + h_halves * 2);
    uint32_t *xv = aligned_alloc(64, (size_t)(groups * x_words) * sizeof(uint32_t));
    uint16_t *hv = aligned_alloc(64, (size_t)(groups * h_halves) * sizeof(uint16_t));
    if (!xv || !hv) {
        free(xv);
        free(hv);
        return -2;
    }
    float out[4 * 256];
    amx_configure();
    for (int64_t j = 0; j < n_jobs; j++) {
        const uint16_t *e13 = w13 + jobs[3 * j] * 2 * I * D, *e2 = w2 + jobs[3 * j] * D * I;
        for (int64_t first = jobs[3 * j + 1]; first < jobs[3 * j + 2]; first += groups * AMX_ROWS) {
            const int64_t rows = jobs[3 * j + 2] - first < groups * AMX_ROWS ? jobs[3 * j + 2] - first
                                                                            : groups * AMX_ROWS;
            const int64_t count = (rows + AMX_ROWS - 1) / AMX_ROWS;
            for (int64_t g = 0; g < count; g++) {
                const int64_t mb = rows - g * AMX_ROWS < AMX_ROWS ? rows - g * AMX_ROWS : AMX_ROWS;
                vnni_rows(x + (first + g * AMX_ROWS) * D, D, mb, D, xv + g * x_words);
            }
            for (int64_t i = 0; i < I; i += 16)
                for (int64_t g = 0; g < count; g++) {
                    const int64_t mb = rows - g * AMX_ROWS < AMX_ROWS ? rows - g * AMX_ROWS : AMX_ROWS;
                    const uint32_t *b = xv + g * x_words;
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int64_t kb = 0; kb < D / 32; kb++) {
                        _tile_loadd(5, b + kb * 16 * AMX_ROWS, 64);
                        _tile_loadd(4, e13 + i * D + 32 * kb, 2 * D);
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(4, e13 + (I + i) * D + 32 * kb, 2 * D);
                        _tile_dpbf16ps(1, 4, 5);
                    }
                    _tile_stored(0, out, 64);       /* gate[c][m], c < 16 intermediates, m < 16 rows */
                    _tile_stored(1, out + 256, 64); /* up */
                    for (int64_t c = 0; c < 16; c++) {
                        const int64_t at = i + c; /* h[m][at] for the group's 16 rows m at once */
                        uint16_t h[16];
                        _mm256_storeu_si256((__m256i *)h, f32_to_bf16_ps(swiglu_ps(
                                                              _mm512_loadu_ps(out + 16 * c), _mm512_loadu_ps(out + 256 + 16 * c))));
                        uint16_t *pair = hv + g * h_halves + ((at / 32 * 16 + at % 32 / 2) * AMX_ROWS) * 2 + at % 2;
                        for (int64_t m = 0; m < AMX_ROWS; m++) pair[2 * m] = m < mb ? h[m] : 0;
                    }
                }
            for (int64_t d = 0; d < D; d += 64) {
                const int tiles = D - d >= 64 ? 4 : (int)((D - d) / 16);
                for (int64_t g = 0; g < count; g++) {
                    const int64_t mb = rows - g * AMX_ROWS < AMX_ROWS ? rows - g * AMX_ROWS : AMX_ROWS;
                    amx_block(e2, I, d, tiles, (const uint32_t *)(hv + g * h_halves), out);
                    for (int t = 0; t < tiles; t++)
                        store_rows(out + 256 * t, mb, NULL, y + (first + g * AMX_ROWS) * D + d + 16 * t, D, 0);
                }
            }
        }
    }
    _tile_release();
    free(xv);
    free(hv);
    return 0;
}

/* ---- a worker's received rows, in one call (cpu_exchange.c's raymoe_worker_layer) ---------------
 * raymoe_run_rows' (cpu_f32.c) twin for bfloat16 rows, whose combine is per assignment
 * (kernels/comm/wire.py::RowFormat.per_assignment): payload [N][row_bytes], each row D bfloat16
 * activations, k int32 local slots (-1: none here), k float32 gate weights (unused here: the router
 * weighs). Segment g (seg_rows[g] rows, one router's) maps slot s to pool row maps[g * S + s].
 * The assignments in cpu_f32.c's raymoe_order_assignments order: each one's input row gathered
 * there, every pool row's run through raymoe_bf16_swiglu_experts (or AMX's, `amx`) as one job, and
 * the outputs to out [A][D] bfloat16 in (row, position) order: engine/experts.py::run_assignments'
 * jobs and order, so its bits. Returns the number of assignments, or raymoe_run_rows' statuses. */
int64_t raymoe_order_assignments(const uint8_t *payload, int64_t N, int64_t row_bytes, int64_t slots_at, int64_t k,
                                 const int64_t *maps, const int64_t *seg_rows, int64_t segments, int64_t S,
                                 int64_t P, int64_t expected, int64_t *count, int64_t *where, int64_t *jobs,
                                 int64_t *n_jobs);

int64_t raymoe_bf16_run_assignments(const uint8_t *payload, int64_t N, int64_t row_bytes, int64_t D, int64_t I,
                                    int64_t k, const int64_t *maps, const int64_t *seg_rows, int64_t segments,
                                    int64_t S, const uint16_t *w13, const uint16_t *w2, int64_t P, int64_t expected,
                                    int64_t amx, uint16_t *out) {
    const int64_t slots_at = 2 * D;
    if (D % 32 || I % 32 || D <= 0 || I <= 0 || k <= 0 || row_bytes != ROW_BYTES_OF(2, D, k))
        return STATUS_SHAPE;
    int64_t *count = calloc((size_t)(2 * P + 1), sizeof(int64_t));
    int64_t *where = malloc(sizeof(int64_t) * (size_t)(N * k + 1)); /* (row, position) -> assignment, or -1 */
    int64_t *jobs = malloc(sizeof(int64_t) * (size_t)(3 * P + 1));
    if (!count || !where || !jobs) { free(count); free(where); free(jobs); return STATUS_MEMORY_ROWS; }
    int64_t n_jobs = 0;
    const int64_t total = raymoe_order_assignments(payload, N, row_bytes, slots_at, k, maps, seg_rows, segments, S, P,
                                                   expected, count, where, jobs, &n_jobs);
    if (total < 0) { free(count); free(where); free(jobs); return total; }
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)((total ? total : 1) * D));
    uint16_t *y = malloc(sizeof(uint16_t) * (size_t)((total ? total : 1) * D));
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)(CHUNK_ROWS * I));
    if (!x || !y || !scratch) {
        free(count); free(where); free(jobs); free(x); free(y); free(scratch); return STATUS_MEMORY_ROWS;
    }
    for (int64_t flat = 0; flat < N * k; flat++)
        if (where[flat] >= 0) memcpy(x + where[flat] * D, payload + (flat / k) * row_bytes, sizeof(uint16_t) * (size_t)D);
    int status = total ? (amx ? raymoe_amx_swiglu_experts(x, y, w13, w2, jobs, n_jobs, D, I, scratch)
                              : raymoe_bf16_swiglu_experts(x, y, w13, w2, jobs, n_jobs, D, I, scratch))
                       : 0;
    if (status == 0) {
        int64_t next = 0;
        for (int64_t flat = 0; flat < N * k; flat++)
            if (where[flat] >= 0) memcpy(out + (next++) * D, y + where[flat] * D, sizeof(uint16_t) * (size_t)D);
    }
    free(count); free(where); free(jobs); free(x); free(y); free(scratch);
    if (status == -2) return STATUS_MEMORY_ROWS;
    return status ? STATUS_SHAPE : total;
}
