/* Causal attention of one row's prompt over its own keys, for the whole prefill (``model/prefill.py``), fp32 with
 * AVX-512 and OpenMP, head dimension 64:
 *   out[i, h] = sum_{j <= i} softmax_j(scale * q[i, h] . k[j, h / G]) v[j, h / G]     for positions i = first..n-1
 * Flash-style: each task takes 6 queries of one head and walks their keys 32 at a time, keeping a running maximum
 * and sum per query (the softmax rescaled as the maximum grows), so no score matrix is stored and the keys right of
 * the diagonal are never read. The keys of each key/value head are first transposed (dimension-major) so that 32
 * scores are two registers filled by broadcasting the query's dimensions. Sums run in another order than torch's
 * attention, like any change of batch size. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "vexp.h"

#define QB 6  /* queries a task: 12 score registers and 24 value-sum registers at most */
#define KB 32 /* keys a step: two 16-lane registers of scores per query */
#define NV (KB / 16)
#define HD 64 /* the head dimension this kernel is written for */

#define TARGET __attribute__((target("avx512f")))

/* e^x for 16 lanes: ``exp8`` on each half (Zen 4 runs a 512-bit operation as two halves anyway) */
TARGET static inline __m512 exp16(__m512 x) {
    __m256 lo = exp8(_mm512_castps512_ps256(x));
    __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* Queries i0 .. i0+c-1 (c <= QB) of one head: q rows qs apart (scaled), keys kt [HD][ldk] (transposed), values v
 * [n][HD] (rows vs apart), out rows os apart. */
TARGET static void task(const float *q, long qs, long i0, int c, const float *kt, long ldk, const float *v, long vs,
                        float *out, long os, float scale) {
    float qq[QB][HD], acc[QB][HD], m[QB], l[QB], p[QB][KB];
    for (int r = 0; r < QB; r++) {
        for (int d = 0; d < HD; d++) {
            qq[r][d] = r < c ? q[r * qs + d] * scale : 0.0f;
            acc[r][d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    long last = i0 + c - 1; /* the last key any of the queries sees */
    for (long j0 = 0; j0 <= last; j0 += KB) {
        __m512 s[QB][NV];
        for (int r = 0; r < QB; r++)
            for (int u = 0; u < NV; u++) s[r][u] = _mm512_setzero_ps();
        for (int d = 0; d < HD; d++) {
            __m512 kd[NV];
            for (int u = 0; u < NV; u++) kd[u] = _mm512_loadu_ps(kt + d * ldk + j0 + 16 * u);
            for (int r = 0; r < QB; r++) {
                __m512 b = _mm512_set1_ps(qq[r][d]);
                for (int u = 0; u < NV; u++) s[r][u] = _mm512_fmadd_ps(b, kd[u], s[r][u]);
            }
        }
        int nk = last - j0 + 1 < KB ? (int)(last - j0 + 1) : KB; /* keys of this step some query sees */
        for (int r = 0; r < c; r++) {
            long see = i0 + r - j0 + 1; /* query i0 + r sees keys j <= i0 + r: the first ``see`` of this step */
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int u = 0; u < NV; u++) {
                long lanes = see - 16 * u;
                __mmask16 mk = lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
                s[r][u] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mk, s[r][u]);
                top = _mm512_max_ps(top, s[r][u]);
            }
            float best = _mm512_reduce_max_ps(top);
            float mnew = best > m[r] ? best : m[r];
            float keep = m[r] == -INFINITY ? 0.0f : expf(m[r] - mnew);
            __m512 mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
            for (int u = 0; u < NV; u++) {
                __m512 e = exp16(_mm512_sub_ps(s[r][u], mv));
                sum = _mm512_add_ps(sum, e);
                _mm512_storeu_ps(p[r] + 16 * u, e);
            }
            l[r] = l[r] * keep + _mm512_reduce_add_ps(sum);
            m[r] = mnew;
            if (keep != 1.0f) {
                __m512 kv = _mm512_set1_ps(keep);
                for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(acc[r] + d, _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d), kv));
            }
        }
        for (int r = c; r < QB; r++)
            for (int j = 0; j < KB; j++) p[r][j] = 0.0f;
        __m512 o[QB][4];
        for (int r = 0; r < QB; r++)
            for (int u = 0; u < 4; u++) o[r][u] = _mm512_loadu_ps(acc[r] + 16 * u);
        for (int j = 0; j < nk; j++) {
            const float *vr = v + (j0 + j) * vs;
            __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
                   v3 = _mm512_loadu_ps(vr + 48);
            for (int r = 0; r < QB; r++) {
                __m512 w = _mm512_set1_ps(p[r][j]);
                o[r][0] = _mm512_fmadd_ps(w, v0, o[r][0]);
                o[r][1] = _mm512_fmadd_ps(w, v1, o[r][1]);
                o[r][2] = _mm512_fmadd_ps(w, v2, o[r][2]);
                o[r][3] = _mm512_fmadd_ps(w, v3, o[r][3]);
            }
        }
        for (int r = 0; r < QB; r++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc[r] + 16 * u, o[r][u]);
    }
    for (int r = 0; r < c; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(out + r * os + d, _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d), inv));
    }
}

/* q: the queries of positions first..n-1, [n - first, nh, HD] (rows qs apart, heads HD apart); k, v: the row's keys
 * and values of positions 0..n-1, [nkv][n] rows of HD (rows HD apart, heads hs apart); out like q (rows os apart).
 * Returns 0; -1 where this CPU or shape is not covered, or scratch memory could not be had (nothing written). */
int causal_attention(const float *q, long qs, const float *k, const float *v, long hs, float *out, long os,
                     long first, long n, long nh, long nkv, long dim, float scale) {
    if (dim != HD || nh % nkv || !__builtin_cpu_supports("avx512f")) return -1;
    long G = nh / nkv, ldk = (n + KB - 1) / KB * KB + KB; /* room for a whole step past the last key */
    float *kt = calloc((size_t)nkv * HD * ldk, sizeof(float));
    if (!kt) return -1;
    long tasks = (n - first + QB - 1) / QB;
    #pragma omp parallel
    {
        #pragma omp for collapse(2) schedule(static)
        for (long g = 0; g < nkv; g++)
            for (long j = 0; j < n; j++)
                for (int d = 0; d < HD; d++) kt[(g * HD + d) * ldk + j] = k[g * hs + j * HD + d];
        /* the longest tasks (last queries) first, so that the short ones fill in at the end */
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (long t = tasks - 1; t >= 0; t--)
            for (long h = 0; h < nh; h++) {
                long i0 = first + t * QB;
                int c = n - i0 < QB ? (int)(n - i0) : QB;
                task(q + (i0 - first) * qs + h * HD, qs, i0, c, kt + (h / G) * HD * ldk, ldk, v + (h / G) * hs, HD,
                     out + (i0 - first) * os + h * HD, os, scale);
            }
    }
    free(kt);
    return 0;
}
