/* The horizontal sum of the kernels' 8-lane accumulators (``skinny.c``, ``packed.c``, ``argmax.c``), included by
 * each: one order for all. An output's bits depend on this order, so the fp32 kernel, the packed kernels and the
 * fast argmax agree only while they share it: (l0+l4, l1+l5, l2+l6, l3+l7), then (0+2, 1+3), then 0+1. */
#ifndef BATCHSPEC_REDUCE_H
#define BATCHSPEC_REDUCE_H
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#endif
