/* SwiGLU experts in float32 for decode-sized row counts, AVX-512F (see kernels/native_experts.py).
 *
 * y[r] = W2_e (silu(Wg_e x[r]) * (Wu_e x[r])) for every row r of every job (e, begin, end).
 *
 * Weights come packed once per stack (kernels/native_experts.py):
 *   w13: [R][I/16][D][2][16]  panel p holds gate and up columns 16p..16p+15, k-major
 *   w2:  [R][D/32][I][32]     panel q holds output columns 32q..32q+31, k-major
 * so each panel streams once per block of up to 8 rows, and every output element is one chain
 * of fused multiply-adds over k = 0..K-1 from zero, in that order, whatever the number of rows
 * in the call: a row's result never depends on which rows share its call.
 */
#include <immintrin.h>
#include <stdint.h>

#define ROW_BLOCK 8   /* rows per register block: 2 x 8 accumulators of 16 floats */
#define CHUNK_ROWS 32 /* rows per pass over an expert's weights (the scratch holds their h) */
/* Panels are read 8 KiB ahead: at 1-8 rows the weights stream from DRAM, and the hardware
 * prefetcher alone left this kernel at ~25 GB/s where a plain read of them runs at ~45 GB/s
 * (2-vCPU EPYC of docs/BENCHMARKS.md; 4 and 16 KiB measured alike, 1-2 KiB slower). */
#define PREFETCH_FLOATS 2048
#define PREFETCH(address) do {                                                                 \
        _mm_prefetch((const char *)(address) + 4 * PREFETCH_FLOATS, _MM_HINT_T0);                  \
        _mm_prefetch((const char *)(address) + 4 * PREFETCH_FLOATS + 64, _MM_HINT_T0);             \
    } while (0)

int raymoe_swiglu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

__attribute__((target("avx512f"))) static inline __m512 exp_ps(__m512 x) {
    /* exp(x): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-7 polynomial (Cephes' expf). */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f"))) static inline __m512 swiglu_ps(__m512 gate, __m512 up) {
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    return _mm512_mul_ps(_mm512_mul_ps(gate, sig), up);
}

/* h[m, 16p..16p+15] for rows m < mb of x (stride D), one w13 panel. */
#define GATE_UP_BLOCK(MB)                                                                          \
    __attribute__((target("avx512f"))) static void gate_up_##MB(                                 \
        const float *x, int64_t D, const float *panel, float *h, int64_t I) {                    \
        __m512 g[MB], u[MB];                                                                       \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                     \
            g[m] = _mm512_setzero_ps();                                                            \
            u[m] = _mm512_setzero_ps();                                                            \
        }                                                                                          \
        for (int64_t k = 0; k < D; k++) {                                                          \
            PREFETCH(panel + 32 * k);                                                              \
            __m512 wg = _mm512_loadu_ps(panel + 32 * k);                                           \
            __m512 wu = _mm512_loadu_ps(panel + 32 * k + 16);                                      \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                 \
                __m512 xm = _mm512_set1_ps(x[m * D + k]);                                          \
                g[m] = _mm512_fmadd_ps(xm, wg, g[m]);                                              \
                u[m] = _mm512_fmadd_ps(xm, wu, u[m]);                                              \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++)                                       \
            _mm512_storeu_ps(h + m * I, swiglu_ps(g[m], u[m]));                                    \
    }

/* y[m, 32q..32q+31] for rows m < mb of h (stride I), one w2 panel. */
#define DOWN_BLOCK(MB)                                                                             \
    __attribute__((target("avx512f"))) static void down_##MB(                                    \
        const float *h, int64_t I, const float *panel, float *y, int64_t D) {                    \
        __m512 a[MB], b[MB];                                                                       \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                     \
            a[m] = _mm512_setzero_ps();                                                            \
            b[m] = _mm512_setzero_ps();                                                            \
        }                                                                                          \
        for (int64_t k = 0; k < I; k++) {                                                          \
            PREFETCH(panel + 32 * k);                                                              \
            __m512 wa = _mm512_loadu_ps(panel + 32 * k);                                           \
            __m512 wb = _mm512_loadu_ps(panel + 32 * k + 16);                                      \
            _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                 \
                __m512 hm = _mm512_set1_ps(h[m * I + k]);                                          \
                a[m] = _mm512_fmadd_ps(hm, wa, a[m]);                                              \
                b[m] = _mm512_fmadd_ps(hm, wb, b[m]);                                              \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; m++) {                                     \
            _mm512_storeu_ps(y + m * D, a[m]);                                                     \
            _mm512_storeu_ps(y + m * D + 16, b[m]);                                                \
        }                                                                                          \
    }

GATE_UP_BLOCK(1) GATE_UP_BLOCK(2) GATE_UP_BLOCK(3) GATE_UP_BLOCK(4)
GATE_UP_BLOCK(5) GATE_UP_BLOCK(6) GATE_UP_BLOCK(7) GATE_UP_BLOCK(8)
DOWN_BLOCK(1) DOWN_BLOCK(2) DOWN_BLOCK(3) DOWN_BLOCK(4)
DOWN_BLOCK(5) DOWN_BLOCK(6) DOWN_BLOCK(7) DOWN_BLOCK(8)

typedef void (*gate_up_fn)(const float *, int64_t, const float *, float *, int64_t);
typedef void (*down_fn)(const float *, int64_t, const float *, float *, int64_t);
static const gate_up_fn GATE_UP[ROW_BLOCK + 1] = {0, gate_up_1, gate_up_2, gate_up_3, gate_up_4,
                                                  gate_up_5, gate_up_6, gate_up_7, gate_up_8};
static const down_fn DOWN[ROW_BLOCK + 1] = {0, down_1, down_2, down_3, down_4,
                                            down_5, down_6, down_7, down_8};

/* jobs: [n_jobs][3] = (stacked expert, first row, end row) into x and y ([rows, D] each).
 * scratch: CHUNK_ROWS * I floats. Returns 0, or -1 on a shape it does not take. */
__attribute__((target("avx512f"))) int raymoe_swiglu_experts(
    const float *x, float *y, const float *w13, const float *w2, const int64_t *jobs, int64_t n_jobs,
    int64_t D, int64_t I, float *scratch) {
    if (D % 32 || I % 16 || D <= 0 || I <= 0) return -1;
    const int64_t w13_stride = 2 * I * D, w2_stride = D * I;
    for (int64_t j = 0; j < n_jobs; j++) {
        const float *e13 = w13 + jobs[3 * j] * w13_stride, *e2 = w2 + jobs[3 * j] * w2_stride;
        for (int64_t first = jobs[3 * j + 1]; first < jobs[3 * j + 2]; first += CHUNK_ROWS) {
            int64_t rows = jobs[3 * j + 2] - first;
            if (rows > CHUNK_ROWS) rows = CHUNK_ROWS;
            for (int64_t p = 0; p < I / 16; p++)
                for (int64_t m = 0; m < rows; m += ROW_BLOCK) {
                    int64_t mb = rows - m < ROW_BLOCK ? rows - m : ROW_BLOCK;
                    GATE_UP[mb](x + (first + m) * D, D, e13 + p * 32 * D, scratch + m * I + 16 * p, I);
                }
            for (int64_t q = 0; q < D / 32; q++)
                for (int64_t m = 0; m < rows; m += ROW_BLOCK) {
                    int64_t mb = rows - m < ROW_BLOCK ? rows - m : ROW_BLOCK;
                    DOWN[mb](scratch + m * I, I, e2 + q * 32 * I, y + (first + m) * D + 32 * q, D);
                }
        }
    }
    return 0;
}
