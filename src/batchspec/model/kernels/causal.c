/* Causal attention of one row's prompt over its own keys, for the whole prefill (``model/prefill.py``), fp32 with
 * AVX-512 and OpenMP, head dimension 64:
 *   out[i, h] = sum_{j <= i} softmax_j(scale * q[i, h] . k[j, h / G]) v[j, h / G]     for positions i = first..n-1
 * Flash-style: a block of 6 queries of one head walks its keys 32 at a time, keeping a running maximum and sum per
 * query (the softmax rescaled as the maximum grows), so no score matrix is stored and the keys right of the diagonal
 * are never read. The keys of each key/value head are first transposed (dimension-major) so that 32 scores are two
 * registers filled by broadcasting the query's dimensions. A task is a tile of 24 queries of every head of one
 * key/value head: each step of 32 keys and values (16 KB, in the first-level cache) serves all the tile's blocks in
 * turn, whose running state stays in the second-level cache; a block's arithmetic, and so its bits, are the same
 * whatever tile or thread it runs in. Sums run in another order than torch's attention, like any change of batch
 * size. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "vexp.h"

#define QB 6   /* queries a block: 12 score registers and 24 value-sum registers at most */
#define KB 32  /* keys a step: two 16-lane registers of scores per query */
#define NV (KB / 16)
#define HD 64  /* the head dimension this kernel is written for */
#define TB 4   /* blocks a tile, per head */

#define TARGET __attribute__((target("avx512f")))

/* e^x for 16 lanes: ``exp8``'s steps on 16 lanes (the same operations, so the same bits) */
TARGET static inline __m512 exp16(__m512 x) {
    __mmask16 hidden = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(~hidden, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

/* The running state of a block of c <= QB queries i0 .. i0+c-1 of one head: the scaled queries (rows past c zero),
 * the unnormalised outputs, the maximum score and the sum of exponentials so far. */
typedef struct {
    float qq[QB][HD], acc[QB][HD], m[QB], l[QB];
    long i0;
    int c;
} block_t;

TARGET static void start(block_t *b, const float *q, long qs, long i0, int c, float scale) {
    for (int r = 0; r < QB; r++) {
        for (int d = 0; d < HD; d++) {
            b->qq[r][d] = r < c ? q[r * qs + d] * scale : 0.0f;
            b->acc[r][d] = 0.0f;
        }
        b->m[r] = -INFINITY;
        b->l[r] = 0.0f;
    }
    b->i0 = i0;
    b->c = c;
}

/* The block's step over keys j0 .. j0+KB-1 (some of which it sees): keys kt [HD][ldk] (transposed), values v [n][HD]
 * (rows vs apart). */
TARGET static void step(block_t *b, long j0, const float *kt, long ldk, const float *v, long vs) {
    float p[QB][KB];
    int c = b->c;
    long last = b->i0 + c - 1; /* the last key any of the queries sees */
    __m512 s[QB][NV];
    for (int r = 0; r < QB; r++)
        for (int u = 0; u < NV; u++) s[r][u] = _mm512_setzero_ps();
    for (int d = 0; d < HD; d++) {
        __m512 kd[NV];
        for (int u = 0; u < NV; u++) kd[u] = _mm512_loadu_ps(kt + d * ldk + j0 + 16 * u);
        for (int r = 0; r < QB; r++) {
            __m512 q = _mm512_set1_ps(b->qq[r][d]);
            for (int u = 0; u < NV; u++) s[r][u] = _mm512_fmadd_ps(q, kd[u], s[r][u]);
        }
    }
    int nk = last - j0 + 1 < KB ? (int)(last - j0 + 1) : KB; /* keys of this step some query sees */
    for (int r = 0; r < c; r++) {
        long see = b->i0 + r - j0 + 1; /* query i0 + r sees keys j <= i0 + r: the first ``see`` of this step */
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int u = 0; u < NV; u++) {
            long lanes = see - 16 * u;
            __mmask16 mk = lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
            s[r][u] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mk, s[r][u]);
            top = _mm512_max_ps(top, s[r][u]);
        }
        float best = _mm512_reduce_max_ps(top);
        float mnew = best > b->m[r] ? best : b->m[r];
        float keep = b->m[r] == -INFINITY ? 0.0f : b->m[r] == mnew ? 1.0f : expf(b->m[r] - mnew); /* e^0 = 1 */
        __m512 mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
        for (int u = 0; u < NV; u++) {
            __m512 e = exp16(_mm512_sub_ps(s[r][u], mv));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(p[r] + 16 * u, e);
        }
        b->l[r] = b->l[r] * keep + _mm512_reduce_add_ps(sum);
        b->m[r] = mnew;
        if (keep != 1.0f) {
            __m512 kv = _mm512_set1_ps(keep);
            for (int d = 0; d < HD; d += 16)
                _mm512_storeu_ps(b->acc[r] + d, _mm512_mul_ps(_mm512_loadu_ps(b->acc[r] + d), kv));
        }
    }
    for (int r = c; r < QB; r++)
        for (int j = 0; j < KB; j++) p[r][j] = 0.0f;
    __m512 o[QB][4];
    for (int r = 0; r < QB; r++)
        for (int u = 0; u < 4; u++) o[r][u] = _mm512_loadu_ps(b->acc[r] + 16 * u);
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
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(b->acc[r] + 16 * u, o[r][u]);
}

/* The block's outputs, rows os apart. */
TARGET static void finish(const block_t *b, float *out, long os) {
    for (int r = 0; r < b->c; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / b->l[r]);
        for (int d = 0; d < HD; d += 16)
            _mm512_storeu_ps(out + r * os + d, _mm512_mul_ps(_mm512_loadu_ps(b->acc[r] + d), inv));
    }
}

/* q: the queries of positions first..n-1, [n - first, nh, HD] (rows qs apart, heads HD apart); k, v: the row's keys
 * and values of positions 0..n-1, [nkv][n] rows of HD (rows HD apart, heads hs apart); out like q (rows os apart).
 * Returns 0; -1 where this CPU or shape is not covered, or scratch memory could not be had (nothing written). */
int causal_attention(const float *q, long qs, const float *k, const float *v, long hs, float *out, long os,
                     long first, long n, long nh, long nkv, long dim, float scale) {
    if (dim != HD || nh % nkv || !__builtin_cpu_supports("avx512f")) return -1;
    long G = nh / nkv, ldk = (n + KB - 1) / KB * KB + KB; /* room for a whole step past the last key */
    long tile = TB * QB, tiles = (n - first + tile - 1) / tile, threads = omp_get_max_threads();
    float *kt = calloc((size_t)nkv * HD * ldk, sizeof(float));
    block_t *scratch = malloc((size_t)threads * G * TB * sizeof(block_t));
    if (!kt || !scratch) {
        free(kt);
        free(scratch);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    {
        block_t *bs = scratch + omp_get_thread_num() * G * TB;
        #pragma omp for collapse(2) schedule(static)
        for (long g = 0; g < nkv; g++)
            for (long j = 0; j < n; j++)
                for (int d = 0; d < HD; d++) kt[(g * HD + d) * ldk + j] = k[g * hs + j * HD + d];
        /* the longest tasks (last queries) first, so that the short ones fill in at the end */
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (long t = tiles - 1; t >= 0; t--)
            for (long g = 0; g < nkv; g++) {
                long lo = first + t * tile, hi = lo + tile < n ? lo + tile : n, nb = (hi - lo + QB - 1) / QB;
                const float *kg = kt + g * HD * ldk, *vg = v + g * hs;
                for (long h = 0; h < G; h++)
                    for (long i = 0; i < nb; i++) {
                        long i0 = lo + i * QB;
                        start(bs + h * TB + i, q + (i0 - first) * qs + (g * G + h) * HD, qs, i0,
                              hi - i0 < QB ? (int)(hi - i0) : QB, scale);
                    }
                for (long j0 = 0; j0 < hi; j0 += KB)
                    for (long h = 0; h < G; h++)
                        for (long i = 0; i < nb; i++) {
                            block_t *b = bs + h * TB + i;
                            if (j0 < b->i0 + b->c) step(b, j0, kg, ldk, vg, HD);
                        }
                for (long h = 0; h < G; h++)
                    for (long i = 0; i < nb; i++) {
                        block_t *b = bs + h * TB + i;
                        finish(b, out + (b->i0 - first) * os + (g * G + h) * HD, os);
                    }
            }
    }
    free(kt);
    free(scratch);
    return 0;
}
