/* The greedy token of y = x @ w^T for a q8_0 weight (an output head) without computing every output exactly: the
 * token the argmax of ``packed.c``'s outputs gives, bit for bit, from fewer operations and one sequential read.
 *
 * Each row of x is split into two 8-bit digits, x~ = se * (256 * h + l) (h in [-127, 127], l in [-128, 127],
 * se = max|x| / (127 * 256)), and every output is first *scored* with integer dot products (AVX-512 VNNI: four
 * byte products a lane and instruction, exact in int32):
 *
 *     A_i = sum_j w_ij x~_j = se * (sum_b d_ib sum_j q_ibj (256 (h_j + 128) + (l_j + 128)) - 32896 * T_i)
 *
 * (the digits offset by 128 so that they are unsigned bytes; T_i = sum_j w_ij). The exact output y_i (the fp32
 * kernel's, with its rounding) is within B_i of A_i:
 *
 *     |y_i - A_i| <= B_i = R_i * (rmax + SLACK * max|x|),   R_i = sum_j |w_ij|,  rmax = max_j |x_j - x~_j| (<= se/2)
 *
 * the first term the digits' error, the second every rounding of both sums: the fp32 kernel's (K / 8 fused
 * multiply-adds a lane and 3 adds: <= (K / 8 + 3)u sum_j |w_ij x_j|) and the score's (an int32 -> fp32 conversion,
 * at most K / 32 multiply-adds a lane, the hsum and the last steps: <= (K / 32 + 30)u R_i max|x|), u = 2^-24; SLACK
 * is 2.7x their sum (2e-5 at the default model's K = 576). So
 * every output with A_i + B_i below t = max_i (A_i - B_i) is strictly below some output's exact value, and the
 * argmax (the first maximum on ties) is among the *candidates*, the others, whose exact values ``packed.c`` computes
 * (the bits a whole forward gives them). On the default model's states there are 1-4 candidates a row.
 *
 * Why: the default model's head is 49152 x 576 q8_0 weights, ~20% of a batch-1 decode step. The fp32 kernel spends
 * ~5 vector operations a 16 weights expanding codes; scoring takes ~5 a 32 weights and row of x, and reads each
 * weight row as one sequential stream (several interleaved rows streamed ~1.5x slower from memory on Zen 4).
 * Returns -1 (the caller computes every output) where this cannot be done: no AVX-512 VNNI, x not finite or all
 * zero, more than MAX_CANDIDATES candidates in a row. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed.h"
#include "reduce.h"

#define SLACK(K) (2.7 * ((K) / 8 + (K) / 32 + 33) * 0x1p-24) /* 2.7x the rounding bound above */
#define MAX_CANDIDATES 512  /* more in one row: a degenerate x; every output is computed instead */
#define MAX_ROWS 8          /* rows of x at most, scored in one pass over the weights (the counts at which it runs,
                             * by CPU: weights.GREEDY_ROWS) */
#define AHEAD_ROWS 7        /* weight rows prefetched ahead (~4 KB of codes): 1.3-1.6x faster from memory than 3.5 */
/* independent sums a row of x, of two blocks each: one sum of one block at a time waited on its multiply-adds
 * (Gemma 3 270M's head, 262144 x 640, from memory, 1 row: 2 sums 0.85x the time, 3 0.89x, 4 0.90x; 2 rows 0.87x, 4
 * rows 0.94x; the default model's head 0.65-0.69x) */
#define CHAINS 2
#define STORE_MARGIN 4e-7f  /* the candidate test in fp32: >= 6u of its terms (A_i stored in fp32, one product, two sums) */

static int has_vnni(void) {
    static int ok = -1;
    if (ok < 0)
        ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    return ok;
}

int q8_argmax_supported(void) { return has_vnni(); }

/* T_i = sum_j w_ij and R_i = sum_j |w_ij| (rounded up) of a q8_0 weight, once per weight (in double: exact) */
void q8_row_sums(const packed_t *w, long N, long K, float *T, float *R) {
    const int8_t *q = (const int8_t *)w->q;
    const float *d = (const float *)w->d;
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) {
        double t = 0, r = 0;
        for (long b = 0; b < K / 32; b++) {
            long st = 0, sa = 0;
            for (int j = 0; j < 32; j++) st += q[i * K + 32 * b + j], sa += labs((long)q[i * K + 32 * b + j]);
            t += (double)d[i * (K / 32) + b] * st;
            r += fabs((double)d[i * (K / 32) + b]) * sa;
        }
        float rf = (float)r;
        T[i] = (float)t;
        R[i] = (double)rf < r ? nextafterf(rf, INFINITY) : rf;
    }
}

static inline double clamp(double v, double lo, double hi) { return v < lo ? lo : v > hi ? hi : v; }

/* one row of x as two digits of unsigned bytes (offset 128); returns rmax + SLACK * max|x| (B_i / R_i), or -1 */
static double digits(const float *x, long K, uint8_t *hi, uint8_t *lo, double *se_out) {
    float m = 0.0f;
    for (long j = 0; j < K; j++) {
        if (!isfinite(x[j])) return -1;
        m = fabsf(x[j]) > m ? fabsf(x[j]) : m;
    }
    if (m == 0.0f) return -1;
    double sx = (double)m / 127, se = sx / 256, rmax = 0;
    for (long j = 0; j < K; j++) {
        double h = clamp(nearbyint(x[j] / sx), -127, 127);
        double l = clamp(nearbyint((x[j] - h * sx) / se), -128, 127);
        double r = fabs(x[j] - se * (256 * h + l));
        rmax = r > rmax ? r : rmax;
        hi[j] = (uint8_t)(h + 128), lo[j] = (uint8_t)(l + 128);
    }
    *se_out = se;
    return rmax * (1 + 1e-9) + SLACK((double)K) * m;
}

/* the score of 32 weights (ymm) or of two blocks of 32 (zmm, their scales ``dv`` side by side) against row r of x */
#define BLOCK_SCORE(W, LOAD, wq, dv, acc, r, at)                                                              \
    do {                                                                                                      \
        __m##W##i h = LOAD(hi + (r) * K + (at)), l = LOAD(lo + (r) * K + (at));                               \
        __m##W##i v = _mm##W##_dpbusd_epi32(_mm##W##_setzero_si##W(), h, wq);                                  \
        v = _mm##W##_dpbusd_epi32(_mm##W##_slli_epi32(v, 8), l, wq);                                          \
        acc = _mm##W##_fmadd_ps(_mm##W##_cvtepi32_ps(v), dv, acc);                                            \
    } while (0)
#define LOAD512(p) _mm512_loadu_si512((const void *)(p))
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))

/* A_i into A[r * N + i] for R rows of x and weight rows n0 .. n1 - 1, one weight row at a time; top[r]: the largest
 * A_i - B_i seen. Two blocks a 16-lane register, in CHAINS sums a row of x (the blocks left over in 8 lanes): a
 * score's roundings are fewer than one sum of 8 lanes would make (the bound above holds) */
#define SCORE(NAME, R)                                                                                        \
    __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni"))) static void NAME(              \
        const uint8_t *hi, const uint8_t *lo, const int8_t *q, const float *d, const float *T, const float *Rs, \
        const double *se, const double *c, float *A, double *top, long N, long K, long n0, long n1) {        \
        for (long i = n0; i < n1; i++) {                                                                      \
            const int8_t *row = q + i * K;                                                                    \
            const float *dr = d + i * (K / 32);                                                               \
            _mm_prefetch((const char *)(dr + AHEAD_ROWS * (K / 32)), _MM_HINT_T0);                            \
            __m512 acc[R][CHAINS];                                                                            \
            __m256 a8[R];                                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) for (int u = 0; u < CHAINS; u++)              \
                acc[r][u] = _mm512_setzero_ps();                                                              \
            long b = 0;                                                                                       \
            for (; b + 2 * CHAINS <= K / 32; b += 2 * CHAINS)                                                 \
                for (int u = 0; u < CHAINS; u++) {                                                            \
                    long e = b + 2 * u;                                                                       \
                    _mm_prefetch((const char *)(row + AHEAD_ROWS * K + 32 * e), _MM_HINT_T0);                 \
                    __m512i wq = LOAD512(row + 32 * e);                                                       \
                    __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(dr[e]), _mm256_set1_ps(dr[e + 1]), 1);      \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                       \
                        BLOCK_SCORE(512, LOAD512, wq, dv, acc[r][u], r, 32 * e);                              \
                }                                                                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                for (int u = 1; u < CHAINS; u++) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);             \
                a8[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][0]), _mm512_extractf32x8_ps(acc[r][0], 1)); \
            }                                                                                                 \
            for (; b < K / 32; b++) {                                                                         \
                __m256i wq = LOAD256(row + 32 * b);                                                           \
                __m256 dv = _mm256_broadcast_ss(dr + b);                                                      \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                           \
                    BLOCK_SCORE(256, LOAD256, wq, dv, a8[r], r, 32 * b);                                      \
            }                                                                                                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                double a = se[r] * ((double)hsum8(a8[r]) - 32896.0 * T[i]);                                   \
                A[r * N + i] = (float)a;                                                                      \
                a -= Rs[i] * c[r];                                                                            \
                top[r] = a > top[r] ? a : top[r];                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
SCORE(score_1, 1)
SCORE(score_2, 2)
SCORE(score_3, 3)
SCORE(score_4, 4)
SCORE(score_5, 5)
SCORE(score_6, 6)
SCORE(score_7, 7)
SCORE(score_8, 8)

typedef void (*score_t)(const uint8_t *, const uint8_t *, const int8_t *, const float *, const float *, const float *,
                        const double *, const double *, float *, double *, long, long, long, long);
static const score_t SCORES[MAX_ROWS + 1] = {0, score_1, score_2, score_3, score_4, score_5, score_6, score_7, score_8};

/* Of weight rows n0 .. n1 - 1 of row r, the candidates' exact outputs (written over their scores) and the first
 * largest: *best and *arg (-1: none); returns how many candidates, or MAX_CANDIDATES + 1 when there are more. */
__attribute__((target("avx512f"))) static long candidates(const float *x, const packed_t *w, const float *R, float *A,
                                                          long N, long K, long n0, long n1, double c, double t,
                                                          float *best, long *arg) {
    /* A_i + B_i >= t in fp32, erring towards candidates: c rounded up, t down, a margin for the sums' roundings */
    float cf = (float)c, tf = (float)t;
    if ((double)cf < c) cf = nextafterf(cf, INFINITY);
    if ((double)tf > t) tf = nextafterf(tf, -INFINITY);
    const __m512 cv = _mm512_set1_ps(cf), tv = _mm512_set1_ps(tf), mv = _mm512_set1_ps(STORE_MARGIN);
    long count = 0;
    *arg = -1;
    for (long i = n0; i < n1; i += 16) {
        __mmask16 in = i + 16 <= n1 ? 0xFFFF : (__mmask16)((1u << (n1 - i)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(in, A + i), rc = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, R + i), cv);
        __m512 hi = _mm512_add_ps(_mm512_add_ps(a, rc), _mm512_mul_ps(_mm512_add_ps(_mm512_abs_ps(a), rc), mv));
        unsigned m = _mm512_mask_cmp_ps_mask(in, hi, tv, _CMP_GE_OQ);
        while (m) {
            long j = i + __builtin_ctz(m);
            m &= m - 1;
            if (++count > MAX_CANDIDATES) return count;
            packed_rows(x, w, A, 1, N, K, j, j + 1);
            if (*arg < 0 || A[j] > *best) *best = A[j], *arg = j;
        }
    }
    return count;
}

/* tokens[r] = argmax_i y[r][i] for x [M, K] and a q8_0 weight [N, K] (K a multiple of 32), with ``T`` and ``R`` from
 * ``q8_row_sums`` and ``A`` scratch for M x N floats. Returns 0, or -1 (tokens unspecified) where every output must
 * be computed instead. */
int q8_argmax(const float *x, const packed_t *w, const float *T, const float *R, long M, long N, long K, float *A,
              int64_t *tokens) {
    if (!has_vnni() || w->kind != W_Q8_0 || K % 32 || M < 1 || M > MAX_ROWS) return -1;
    int threads = omp_get_max_threads(), failed = 0;
    uint8_t *hi = malloc(2 * M * K);
    double *se = malloc(M * sizeof(double)), *c = malloc(M * sizeof(double));
    double *top = malloc((size_t)threads * M * sizeof(double));
    float *best = malloc((size_t)threads * M * sizeof(float));
    long *arg = malloc((size_t)threads * M * sizeof(long)), *count = calloc((size_t)threads * M, sizeof(long));
    if (!hi || !se || !c || !top || !best || !arg || !count) failed = 1;
    for (long u = 0; u < (long)threads * M && !failed; u++) top[u] = -INFINITY, arg[u] = -1;
    for (long r = 0; r < M && !failed; r++)
        if ((c[r] = digits(x + r * K, K, hi + r * K, hi + (M + r) * K, &se[r])) < 0) failed = 1;
    if (failed) goto out;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long per = (N + nt - 1) / nt, n0 = t * per < N ? t * per : N, n1 = n0 + per < N ? n0 + per : N;
        SCORES[M](hi, hi + M * K, (const int8_t *)w->q, (const float *)w->d, T, R, se, c, A, top + t * M, N, K, n0, n1);
        #pragma omp barrier
        for (long r = 0; r < M; r++) {
            double th = -INFINITY;
            for (int u = 0; u < nt; u++) th = top[u * M + r] > th ? top[u * M + r] : th;
            count[t * M + r] = candidates(x + r * K, w, R, A + r * N, N, K, n0, n1, c[r], th, &best[t * M + r],
                                          &arg[t * M + r]);
        }
    }
    for (long r = 0; r < M && !failed; r++) {
        float b = -INFINITY;
        long a = -1, n = 0;
        for (int u = 0; u < threads; u++) {  /* threads in order of their rows: the first maximum stays */
            n += count[u * M + r];
            if (arg[u * M + r] >= 0 && (a < 0 || best[u * M + r] > b)) b = best[u * M + r], a = arg[u * M + r];
        }
        if (a < 0 || n > MAX_CANDIDATES || !isfinite(b)) failed = 1;
        tokens[r] = a;
    }
out:
    free(hi), free(se), free(c), free(top), free(best), free(arg), free(count);
    return failed ? -1 : 0;
}
