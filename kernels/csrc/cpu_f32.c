/* raymoe's native CPU kernels, float32 on AVX-512F (built and loaded by kernels/native_library.py,
 * called through kernels/native_cpu.py).
 *
 * 1. raymoe_swiglu_experts: y[r] = W2_e (silu(Wg_e x[r]) * (Wu_e x[r])) for every row r of
 *    every job (e, begin, end): a layer's experts in one call.
 * 2. raymoe_linear: y = x W^T (+ bias), a dense layer.
 * 3. raymoe_decode_attention: one query per sequence against its keys in a paged cache (GQA).
 * 4. raymoe_rms_norm: RMSNorm of each row, optionally after adding a residual (x + delta).
 * 5. raymoe_rope: rotary embedding of q and k heads side by side (the rotate_half layout).
 * 6. raymoe_run_rows: a worker's received rows through its experts, weighted and summed per row.
 * 7. raymoe_plan_pack: a router's plan of one MoE layer's exchange and its packed rows.
 *
 * Weights come packed once (kernels/native_cpu.py):
 *   w13: [R][I/16][D][2][16]  panel p holds gate and up columns 16p..16p+15, k-major
 *   w2:  [R][D/32][I][32]     panel q holds output columns 32q..32q+31, k-major
 *   W:   [N/32][K][32]        (a dense layer's, as w2's)
 * so each panel streams once per block of up to 8 rows, and every output element is one chain
 * of fused multiply-adds over k = 0..K-1 from zero, in that order, whatever the number of rows
 * in the call: a row's result never depends on which rows share its call. Attention likewise
 * reduces each (sequence, head) on its own, in key order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "raymoe_constants.h" /* generated from the Python side (kernels/native_library.py): CHUNK_ROWS, the
                                * row format, the statuses */

#include "simd_math.h"     /* exp_ps, swiglu_ps */

#define ROW_BLOCK 8   /* rows per register block: 2 x 8 accumulators of 16 floats */
/* CHUNK_ROWS: rows per pass over an expert's weights (the scratch holds their h) */
/* Panels are read 8 KiB ahead: at 1-8 rows the weights stream from DRAM, and the hardware
 * prefetcher alone left this kernel at ~25 GB/s where a plain read of them runs at ~45 GB/s
 * (2-vCPU EPYC of docs/BENCHMARKS.md; 4 and 16 KiB measured alike, 1-2 KiB slower). */
#define PREFETCH_FLOATS 2048
#define PREFETCH(address) do {                                                                 \
        _mm_prefetch((const char *)(address) + 4 * PREFETCH_FLOATS, _MM_HINT_T0);                  \
        _mm_prefetch((const char *)(address) + 4 * PREFETCH_FLOATS + 64, _MM_HINT_T0);             \
    } while (0)

int raymoe_native_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
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

/* y = x W^T (+ bias): x [M, K], W packed [N/32][K][32], y [M, N]. Returns -1 on N % 32. */
__attribute__((target("avx512f"))) int raymoe_linear(
    const float *x, float *y, const float *w, const float *bias, int64_t M, int64_t K, int64_t N) {
    if (N % 32 || K <= 0 || N <= 0) return -1;
    for (int64_t q = 0; q < N / 32; q++)
        for (int64_t m = 0; m < M; m += ROW_BLOCK) {
            int64_t mb = M - m < ROW_BLOCK ? M - m : ROW_BLOCK;
            DOWN[mb](x + m * K, K, w + q * 32 * K, y + m * N + 32 * q, N);
        }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n += 16)
                _mm512_storeu_ps(y + m * N + n, _mm512_add_ps(_mm512_loadu_ps(y + m * N + n), _mm512_loadu_ps(bias + n)));
    return 0;
}

#define ATT_NAME raymoe_decode_attention
#define ATT_T float
#define ATT_LOAD(p) _mm512_loadu_ps(p)
#define ATT_STORE(p, v) _mm512_storeu_ps(p, v)
#define ATT_TARGET __attribute__((target("avx512f")))
#include "decode_attention.inc"

/* RMSNorm, D % 16 == 0: for each of M rows, s = x (+ delta when given, stored to sum), then
 * h = s * (1 / sqrt(mean(s^2) + eps)) * w. The sum of squares runs in 16 lanes over d in order,
 * then the lanes are added in a fixed order: a row's result never depends on the other rows.
 * The residual add is one rounding per element, as torch's add. */
__attribute__((target("avx512f"))) int raymoe_rms_norm(
    const float *x, const float *delta, const float *w, float *sum, float *h, int64_t M, int64_t D, float eps) {
    if (D % 16 || D <= 0) return -1;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float *hm = h + m * D;
        if (delta) {
            float *sm = sum + m * D;
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(sm + d, _mm512_add_ps(_mm512_loadu_ps(xm + d), _mm512_loadu_ps(delta + m * D + d)));
            xm = sm;
        }
        __m512 squares = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            __m512 v = _mm512_loadu_ps(xm + d);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)D + eps);
        __m512 factor = _mm512_set1_ps(scale);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(hm + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xm + d), factor),
                                                    _mm512_loadu_ps(w + d)));
    }
    return 0;
}

/* Rotary embedding, rotate_half layout, for T tokens of `heads` heads of size d (even):
 * x [T][heads][d] (row stride `stride` floats between tokens), cos/sin [T][d] (sin's first half
 * negated, kernels/rope.py), out [T][heads][d] contiguous:
 *   out[i] = x[i] * cos[i] + x[(i + d/2) % d] * sin[i]
 * with the two products rounded, then added: the same operations, in the same order, as torch's
 * x * cos + x.roll(d/2) * sin (this file is compiled without contraction), so the same bits. */
int raymoe_rope(const float *x, int64_t stride, const float *cos, const float *sin, float *out,
                int64_t T, int64_t heads, int64_t d) {
    if (d % 2 || d <= 0) return -1;
    const int64_t half = d / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t hd = 0; hd < heads; hd++) {
            const float *xh = x + t * stride + hd * d;
            float *oh = out + (t * heads + hd) * d;
            for (int64_t i = 0; i < half; i++) {
                float a = xh[i] * c[i], b = xh[i + half] * s[i];
                oh[i] = a + b;
            }
            for (int64_t i = half; i < d; i++) {
                float a = xh[i] * c[i], b = xh[i - half] * s[i];
                oh[i] = a + b;
            }
        }
    }
    return 0;
}

/* The order of a worker's assignments (raymoe_run_rows below; cpu_bf16.c's
 * raymoe_bf16_run_assignments): payload holds N rows of row_bytes bytes, each with k int32 local
 * slots at byte slots_at (-1: runs nowhere here), in segments (one per router, in order, seg_rows[g]
 * rows each) whose local slot s is served by pool row maps[g * S + s]. Assignments are ordered by
 * pool row, and within one by (row, position), as a stable sort of the flat positions would order
 * them. Fills where[N * k] (each (row, position)'s assignment, or -1) and jobs [P][3] (pool row,
 * first, end: each pool row's run, in pool row order), using count [2P] (zeroed) as scratch.
 * Returns the number of assignments with *n_jobs set, STATUS_SHAPE when the segments do not hold N
 * rows, STATUS_BAD_SLOT a slot or pool row out of range, STATUS_ASSIGNMENTS when the assignments
 * differ from `expected`. */
int64_t raymoe_order_assignments(const uint8_t *payload, int64_t N, int64_t row_bytes, int64_t slots_at, int64_t k,
                                 const int64_t *maps, const int64_t *seg_rows, int64_t segments, int64_t S,
                                 int64_t P, int64_t expected, int64_t *count, int64_t *where, int64_t *jobs,
                                 int64_t *n_jobs) {
    int64_t *start = count + P;
    /* Pass 1: each (row, position)'s pool row, counted. */
    int64_t n = 0, total = 0;
    for (int64_t g = 0; g < segments; g++)
        for (int64_t r = 0; r < seg_rows[g]; r++, n++) {
            if (n >= N) return STATUS_SHAPE;
            const int32_t *slots = (const int32_t *)(payload + n * row_bytes + slots_at);
            for (int64_t p = 0; p < k; p++) {
                int64_t pool = -1;
                if (slots[p] >= 0) {
                    if (slots[p] >= S) return STATUS_BAD_SLOT;
                    pool = maps[g * S + slots[p]];
                    if (pool < 0 || pool >= P) return STATUS_BAD_SLOT;
                    count[pool]++;
                    total++;
                }
                where[n * k + p] = pool;
            }
        }
    if (n != N) return STATUS_SHAPE;
    if (total != expected) return STATUS_ASSIGNMENTS;
    /* Pass 2: each pool row's run, then each (row, position)'s place in it. */
    int64_t offset = 0;
    *n_jobs = 0;
    for (int64_t pool = 0; pool < P; pool++) {
        start[pool] = offset;
        if (count[pool]) {
            jobs[3 * *n_jobs] = pool;
            jobs[3 * *n_jobs + 1] = offset;
            jobs[3 * *n_jobs + 2] = offset + count[pool];
            (*n_jobs)++;
        }
        offset += count[pool];
    }
    for (int64_t flat = 0; flat < N * k; flat++)
        if (where[flat] >= 0) where[flat] = start[where[flat]]++;
    return total;
}

/* A worker's received rows through its experts (engine/experts.py::run_rows, in one call).
 * payload: N rows of row_bytes bytes each: D floats, then k int32 local slots (-1: runs
 * nowhere here), then k float32 gate weights. Rows come in segments (one per router, in order,
 * seg_rows[g] rows each); maps[g][s] is the pool row that serves local slot s for segment g.
 * Assignments are ordered as raymoe_order_assignments orders them; each pool row's run goes
 * through the experts kernel above; then out[n] = sum over positions p in order of (y * w) from
 * zero, each product and each sum rounded: the arithmetic of the torch path, so the same bits.
 * w13/w2 packed as for raymoe_swiglu_experts; P pool rows. Returns the number of assignments,
 * STATUS_SHAPE on a shape it does not take, STATUS_MEMORY_ROWS out of memory, STATUS_BAD_SLOT a
 * slot or pool row out of range, STATUS_ASSIGNMENTS when the assignments differ from `expected`. */
__attribute__((target("avx512f"))) int64_t raymoe_run_rows(
    const uint8_t *payload, int64_t N, int64_t row_bytes, int64_t D, int64_t I, int64_t k,
    const int64_t *maps, const int64_t *seg_rows, int64_t segments, int64_t S,
    const float *w13, const float *w2, int64_t P, int64_t expected, float *out) {
    if (D % 32 || I % 16 || D <= 0 || I <= 0 || k <= 0 || row_bytes != ROW_BYTES(D, k)) return STATUS_SHAPE;
    int64_t *count = calloc((size_t)(2 * P + 1), sizeof(int64_t));
    int64_t *where = malloc(sizeof(int64_t) * (size_t)(N * k + 1)); /* (row, position) -> assignment, or -1 */
    int64_t *jobs = malloc(sizeof(int64_t) * (size_t)(3 * P + 1));
    if (!count || !where || !jobs) { free(count); free(where); free(jobs); return STATUS_MEMORY_ROWS; }
    int64_t n_jobs = 0;
    const int64_t total = raymoe_order_assignments(payload, N, row_bytes, ROW_SLOTS_AT(D), k, maps, seg_rows, segments,
                                                   S, P, expected, count, where, jobs, &n_jobs);
    if (total < 0) { free(count); free(where); free(jobs); return total; }
    float *x = malloc(sizeof(float) * (size_t)((total ? total : 1) * D));
    float *y = malloc(sizeof(float) * (size_t)((total ? total : 1) * D));
    float *scratch = malloc(sizeof(float) * (size_t)(CHUNK_ROWS * I));
    if (!x || !y || !scratch) {
        free(count); free(where); free(jobs); free(x); free(y); free(scratch); return STATUS_MEMORY_ROWS;
    }
    for (int64_t flat = 0; flat < N * k; flat++) {
        const int64_t a = where[flat];
        if (a < 0) continue;
        const float *row = (const float *)(payload + (flat / k) * row_bytes);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(x + a * D + d, _mm512_loadu_ps(row + d));
    }
    int status = raymoe_swiglu_experts(x, y, w13, w2, jobs, n_jobs, D, I, scratch);
    if (status == 0) {
        /* Pass 3: each row's weighted outputs, summed in position order from zero. */
        for (int64_t row = 0; row < N; row++) {
            const float *weights = (const float *)(payload + row * row_bytes + ROW_SLOTS_AT(D) + SLOT_BYTES * k);
            float *o = out + row * D;
            for (int64_t d = 0; d < D; d += 16) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t p = 0; p < k; p++) {
                    int64_t a = where[row * k + p]; /* (after pass 2: its assignment, or -1) */
                    __m512 term = a < 0 ? _mm512_setzero_ps()  /* a position that ran nowhere adds zero */
                                        : _mm512_mul_ps(_mm512_loadu_ps(y + a * D + d), _mm512_set1_ps(weights[p]));
                    acc = _mm512_add_ps(acc, term);
                }
                _mm512_storeu_ps(o + d, acc);
            }
        }
    }
    free(count); free(where); free(jobs); free(x); free(y); free(scratch);
    return status == 0 ? total : STATUS_SHAPE;
}

/* A decoder layer's attention block for a step of decodes only, in one call: the five calls
 * engine/model.py makes one by one (kernels/attention_block.py), in the same order on the same
 * buffers, so the same bits:
 *   s1, h1 = rms_norm(x (+ delta), in_norm)           raymoe_rms_norm
 *   qkv = h1 Wqkv^T (+ bias)                           raymoe_linear   [T][H*d + 2*Hkv*d]
 *   qk = rope(q and k heads of qkv)                    raymoe_rope     [T][H + Hkv][d]
 *   k and v rows into the paged caches at slot_mapping (a copy)
 *   att = decode attention of q over the caches        raymoe_decode_attention (rows, slots, counts)
 *   o = att Wo^T                                       raymoe_linear
 *   sum, h = rms_norm(s1 + o, post_norm)               raymoe_rms_norm
 * dims: T, D, H, Hkv, d, Kc (keys in a row of `slots`); scalars: eps, scale. scratch: floats
 * 3*T*D + T*(H + 2*Hkv)*d + T*(H + Hkv)*d + 2*T*H*d. x [T][D], delta [T][D] or NULL, caches
 * [slots][Hkv][d]. Returns 0, or the first failing kernel's status. */
int raymoe_attention_block(
    const float *x, const float *delta, const float *in_norm, const float *qkv_w, const float *qkv_bias,
    const float *o_w, const float *post_norm, const float *cos, const float *sin, float *k_cache, float *v_cache,
    const int64_t *slot_mapping, const int64_t *rows, const int64_t *slots, const int64_t *counts, float *sum,
    float *h, float *scratch, const int64_t *dims, const float *scalars) {
    const int64_t T = dims[0], D = dims[1], H = dims[2], Hkv = dims[3], d = dims[4], Kc = dims[5];
    const int64_t Nq = (H + 2 * Hkv) * d, kv = Hkv * d;
    const float eps = scalars[0], scale = scalars[1];
    if (T <= 0) return -1;
    float *s1 = scratch, *h1 = s1 + T * D, *qkv = h1 + T * D, *qk = qkv + T * Nq, *q = qk + T * (H + Hkv) * d;
    float *att = q + T * H * d, *o = att + T * H * d;
    int status = raymoe_rms_norm(x, delta, in_norm, s1, h1, T, D, eps);
    const float *stream = delta ? s1 : x;
    if (!status) status = raymoe_linear(h1, qkv, qkv_w, qkv_bias, T, D, Nq);
    if (!status) status = raymoe_rope(qkv, Nq, cos, sin, qk, T, H + Hkv, d);
    if (status) return status;
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slot_mapping[t] * kv, qk + t * (H + Hkv) * d + H * d, sizeof(float) * (size_t)kv);
        memcpy(v_cache + slot_mapping[t] * kv, qkv + t * Nq + (H + Hkv) * d, sizeof(float) * (size_t)kv);
        memcpy(q + t * H * d, qk + t * (H + Hkv) * d, sizeof(float) * (size_t)(H * d));
    }
    status = raymoe_decode_attention(q, k_cache, v_cache, rows, slots, counts, att, T, H, Hkv, d, d, Kc, scale);
    if (!status) status = raymoe_linear(att, o, o_w, NULL, T, H * d, D);
    if (!status) status = raymoe_rms_norm(stream, o, post_norm, sum, h, T, D, eps);
    return status;
}

/* A router's plan and packed rows for one MoE layer (moe/exchange_plan.py's rules, in one call):
 * ids [T][k] int64 logical experts, weights [T][k] float32, kept [T][k] uint8 or NULL (all kept),
 * log2phy [E][R] int64 physical slots of each expert's replicas, logcnt [E] their number;
 * S slots per worker, W workers. The i-th kept assignment of expert e in (token, position) order
 * goes to replica i % logcnt[e]; each token is sent once to each worker that runs any of its
 * assignments, rows worker-major and tokens ascending within a worker; a row carries the
 * token's D activations (hidden [T][D] float32), then at each position the local slot there
 * (-1: another worker's, or dropped) and the gate weight (0 there).
 * Outputs: slot [T][k] physical slots (-1 dropped), send_counts [W], slot_counts [W*S],
 * row_token [T*W at most], packed [N][ROW_BYTES(D, k)] bytes (room for T*W rows). Returns N, or -1 on an
 * expert, replica or slot out of range. */
int64_t raymoe_plan_pack(
    const int64_t *ids, const float *weights, const uint8_t *kept, const int64_t *log2phy, const int64_t *logcnt,
    int64_t T, int64_t k, int64_t E, int64_t R, int64_t S, int64_t W, const float *hidden, int64_t D,
    int64_t *slot, int64_t *send_counts, int64_t *slot_counts, int64_t *row_token, uint8_t *packed) {
    int64_t *seen = calloc((size_t)E + 1, sizeof(int64_t));
    if (!seen) return -2;
    for (int64_t w = 0; w < W; w++) send_counts[w] = 0;
    for (int64_t s = 0; s < W * S; s++) slot_counts[s] = 0;
    for (int64_t a = 0; a < T * k; a++) {
        int64_t e = ids[a];
        if (e < 0 || e >= E) { free(seen); return -1; }
        if (kept && !kept[a]) { slot[a] = -1; continue; }
        int64_t replicas = logcnt[e] > 0 ? logcnt[e] : 1;
        int64_t replica = R == 1 ? 0 : seen[e]++ % replicas;
        if (replica >= R) { free(seen); return -1; }
        int64_t s = log2phy[e * R + replica];
        if (s >= W * S) { free(seen); return -1; }
        slot[a] = s;
        if (s >= 0) slot_counts[s]++;
    }
    free(seen);
    const int64_t row_bytes = ROW_BYTES(D, k);
    int64_t n = 0;
    for (int64_t w = 0; w < W; w++)
        for (int64_t t = 0; t < T; t++) {
            int any = 0;
            for (int64_t p = 0; p < k; p++) {
                int64_t s = slot[t * k + p];
                if (s >= 0 && s / S == w) { any = 1; break; }
            }
            if (!any) continue;
            uint8_t *row = packed + n * row_bytes;
            const float *h = hidden + t * D;
            float *activations = (float *)row;
            for (int64_t d = 0; d < D; d++) activations[d] = h[d];
            int32_t *local = (int32_t *)(row + ROW_SLOTS_AT(D));
            float *gate = (float *)(row + ROW_SLOTS_AT(D) + SLOT_BYTES * k);
            for (int64_t p = 0; p < k; p++) {
                int64_t s = slot[t * k + p];
                int mine = s >= 0 && s / S == w;
                local[p] = mine ? (int32_t)(s % S) : -1;
                gate[p] = mine ? weights[t * k + p] : 0.0f;
            }
            row_token[n++] = t;
            send_counts[w]++;
        }
    return n;
}
