/* SIMD math shared by raymoe's native CPU kernels (kernels/csrc/cpu_f32.c, cpu_bf16.c): included by
 * both, so float32 and bfloat16 experts compute SiLU with the same instructions. */
#ifndef RAYMOE_SIMD_MATH_H
#define RAYMOE_SIMD_MATH_H
#include <immintrin.h>

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

#endif
