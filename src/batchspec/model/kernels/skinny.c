/* y = x @ w^T for a few rows of x (fp32, AVX2 + FMA): every weight row is read once from memory for all rows of x.
 * x: M x K, w: N x K, y: M x N, all row-major and contiguous.
 *
 * Every output y[m][n] is summed in the same order whatever M is and wherever the row falls in a block: eight lanes
 * over k in steps of 8, the lanes added pairwise (``hsum8``, reduce.h), then the last K % 8 products one by one. So
 * a token's logits do not depend on how many tokens share its forward (a verification block gives the bits a decode
 * step gives).
 *
 * Rows of x go in blocks of 8, then one block of the 1-7 left (with AVX-512, 4-7 rows in one block of 4, 6 or 8 and
 * 9-16 rows in one block, ``zpass``), each against a few weight rows at a time with every sum in a register: 8 x 1
 * weight row, 7 x 1, 6 x 2, 5 x 2, 4 x 2, 3 x 4, 2 x 4, 1 x 2 (at most 12 accumulators, so the x rows or the weight
 * rows of a step stay in registers too). Weight rows go to the threads in chunks of 12, so a chunk stays in L1 while
 * each block of x rows passes over it. Why few, wide blocks: a second pass over a chunk costs a good part of the
 * first, so a verification of a few drafts (a few rows) costs little more than a decode step only when its rows
 * take one pass (measured on a 2-core CPU; the figures are in docs/benchmarks.md). */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "packed.h"
#include "reduce.h"

/* Weights are prefetched this many floats ahead of the rows being read: the hardware prefetcher alone left the
 * kernel at ~9 GB/s on 8 rows; with it, ~14 GB/s. Far more (8192) wastes bandwidth past the end of each thread's
 * share of a small matrix: one row of x ran ~5% slower. */
#define AHEAD 3072
#define CHUNK 12 /* weight rows per thread task: a multiple of every block's weight rows */

/* R rows of x against the weight rows n .. n + nw - 1 (nw <= C; a short block repeats its first row, unwritten) */
#define BLOCK(NAME, R, C)                                                                                     \
    static void NAME(const float *x, const float *w, float *y, long N, long K, long n, int nw) {              \
        __m256 acc[R][C];                                                                                     \
        const float *wr[C];                                                                                   \
        for (int c = 0; c < C; c++) {                                                                         \
            wr[c] = w + (c < nw ? c : 0) * K;                                                                 \
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_setzero_ps();                                      \
        }                                                                                                     \
        long k = 0;                                                                                           \
        for (; k + 8 <= K; k += 8) {                                                                          \
            __m256 wv[C];                                                                                     \
            for (int c = 0; c < C; c++) {                                                                     \
                _mm_prefetch((const char *)(wr[c] + AHEAD + k), _MM_HINT_T0);                                 \
                wv[c] = _mm256_loadu_ps(wr[c] + k);                                                           \
            }                                                                                                 \
            for (int r = 0; r < R; r++) {                                                                     \
                __m256 t = _mm256_loadu_ps(x + r * K + k);                                                    \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], t, acc[r][c]);                 \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++)                                                                           \
            for (int c = 0; c < nw; c++) {                                                                    \
                float s = hsum8(acc[r][c]);                                                                   \
                for (long j = k; j < K; j++) s += wr[c][j] * x[r * K + j];                                    \
                y[r * N + n + c] = s;                                                                         \
            }                                                                                                 \
    }

BLOCK(rows4, 4, 2)
BLOCK(rows3, 3, 4)
BLOCK(rows2, 2, 4)
BLOCK(rows1, 1, 2)
BLOCK(rows5, 5, 2)
BLOCK(rows6, 6, 2)
BLOCK(rows7, 7, 1)
BLOCK(rows8, 8, 1)

/* Blocks of 2P rows with AVX-512 (where the CPU has it), in the same order of sums: a 16-lane register holds two rows
 * of x (``xi``: rows 2p and 2p+1, 8 columns each, interleaved once per call) against one weight row's 8 columns
 * broadcast to both halves, so each half is one 8-lane sum of the AVX2 kernel, and its hsum is the same. P pairs x C
 * weight rows: P x C sums in registers (at most 25), P + C loads per P x C products (the AVX2 block of 8: 9 loads per
 * 8 at half the width). Rows past ``nr`` are padding (zero rows of xi): not written. Measured on the model's matrices
 * from memory (2 threads): 8 rows ~0.97-0.99 of the AVX2 time (both wait on the weights), 16 rows 0.67-0.70, 32 rows
 * 0.61-0.67 as blocks of 8. */
#define ZBLOCK(NAME, P, C)                                                                                    \
    __attribute__((target("avx512f,avx512dq"))) static void NAME(const float *xi, const float *x, const float *w, \
                                                                 float *y, long N, long K, long n, int nw, long nr) { \
        __m512 acc[P][C];                                                                                     \
        const float *wr[C];                                                                                   \
        for (int c = 0; c < C; c++) {                                                                         \
            wr[c] = w + (c < nw ? c : 0) * K;                                                                 \
            for (int p = 0; p < P; p++) acc[p][c] = _mm512_setzero_ps();                                      \
        }                                                                                                     \
        long k = 0, K8 = K / 8;                                                                               \
        for (; k + 8 <= K; k += 8) {                                                                          \
            __m512 wv[C];                                                                                     \
            for (int c = 0; c < C; c++) {                                                                     \
                _mm_prefetch((const char *)(wr[c] + AHEAD + k), _MM_HINT_T0);                                 \
                wv[c] = _mm512_broadcast_f32x8(_mm256_loadu_ps(wr[c] + k));                                   \
            }                                                                                                 \
            for (int p = 0; p < P; p++) {                                                                     \
                __m512 xv = _mm512_loadu_ps(xi + (p * K8 + k / 8) * 16);                                      \
                for (int c = 0; c < C; c++) acc[p][c] = _mm512_fmadd_ps(wv[c], xv, acc[p][c]);                \
            }                                                                                                 \
        }                                                                                                     \
        for (int p = 0; p < P; p++)                                                                           \
            for (int c = 0; c < nw; c++)                                                                      \
                for (int h = 0; h < 2; h++) {                                                                 \
                    long r = 2 * p + h;                                                                       \
                    if (r >= nr) continue;                                                                    \
                    float s = hsum8(h ? _mm512_extractf32x8_ps(acc[p][c], 1) : _mm512_castps512_ps256(acc[p][c])); \
                    for (long j = k; j < K; j++) s += wr[c][j] * x[r * K + j];                                \
                    y[r * N + n + c] = s;                                                                     \
                }                                                                                             \
    }

ZBLOCK(rows4z, 2, 6)
ZBLOCK(rows6z, 3, 6)
ZBLOCK(rows8z, 4, 6)
ZBLOCK(rows10z, 5, 4)
ZBLOCK(rows12z, 6, 4)
ZBLOCK(rows14z, 7, 3)
ZBLOCK(rows16z, 8, 3)

static int use_avx512 = -1;  /* -1: not asked yet */

static int has_avx512(void) {
    if (use_avx512 < 0) use_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return use_avx512;
}

/* Turn the AVX-512 blocks off (0) or back on where the CPU has them (1), or only ask (-1); returns whether they are
 * used. For tests: both paths give the same bits. */
int skinny_avx512(int on) {
    if (on >= 0) {
        use_avx512 = -1;
        use_avx512 = on && has_avx512();
    }
    return has_avx512();
}

/* one block of rows of x against weight rows n0 .. n1 - 1 (direct calls: inlined) */
#define PASS(F, C, X, Y)                                                                                     \
    for (long n = n0; n < n1; n += C) F(X, w + n * K, Y, N, K, n, n1 - n < C ? (int)(n1 - n) : C)

/* The rows of the AVX-512 pass over x's rows m .. M - 1, or 0: the rows left go to the AVX2 blocks. With ``fill``,
 * 4-16 rows go in one pass (rounded up to even with a zero row), more in blocks of 8 until 16 or fewer are left
 * (1-3 rows stay with the AVX2 blocks: as fast there, as the weights' reads bound them):
 * with 8 rows a pass waits on the weights from memory, and up to 16 rows cost little more, where a second pass over a
 * chunk, even from L1, costs a good part of the first (measured: 9-15 rows in one pass took 0.69-0.96 of the time of
 * blocks of 8 and the rest). Past 16 rows, a first pass of 16 gained nothing. Without ``fill``, full blocks of 8 only
 * (xi holds no padding). */
static long zpass(long M, long m, int fill) {
    long left = M - m;
    if (!fill) return left >= 8 ? 8 : 0;
    return left > 16 ? 8 : left >= 4 ? (left + 1) / 2 * 2 : 0;
}

/* Rows 2p, 2p+1 of x interleaved for the AVX-512 blocks into xi (``zpass``'s blocks; with ``fill``, room for M
 * rounded up to 8 rows, the padding a zero row). Returns the rows xi covers, 0 (xi unused) where those blocks do not
 * run. */
long skinny_interleave(const float *x, float *xi, long M, long K, int fill) {
    long mz = 0;
    for (long w; (w = zpass(M, mz, fill)); mz += w) {}
    if (!mz || !has_avx512()) return 0;
    skinny_pairs(x, xi, M, mz, K);
    return mz;
}

/* The first ``rows`` (even) rows of x [M, K] in pairs into xi: rows 2p and 2p+1, 8 columns each, interleaved (rows
 * past M zero), the layout of the AVX-512 blocks here and of attention's scores (``layer.c``). */
void skinny_pairs(const float *x, float *xi, long M, long rows, long K) {
    long K8 = K / 8;
    for (long m = 0; m < rows; m += 2)
        for (long k8 = 0; k8 < K8; k8++)
            for (long h = 0; h < 2; h++) {
                float *to = xi + ((m / 2) * K8 + k8) * 16 + h * 8;
                if (m + h < M)
                    memcpy(to, x + (m + h) * K + k8 * 8, 8 * sizeof(float));
                else
                    memset(to, 0, 8 * sizeof(float));
            }
}

#define ZPASS(F, C)                                                                                          \
    for (long n = n0; n < n1; n += C)                                                                        \
    F(xi + (m / 2) * K8 * 16, x + m * K, w + n * K, y + m * N, N, K, n, n1 - n < C ? (int)(n1 - n) : C, M - m)

/* y[:, n0:n1] = x @ w[n0:n1]^T on the calling thread (xi: from ``skinny_interleave`` with the same ``fill``, or
 * NULL) */
void skinny_rows(const float *x, const float *xi, int fill, const float *w, float *y, long M, long N, long K, long n0,
                 long n1) {
    long m = 0, K8 = K / 8;
    if (xi)
        for (long rows; m < M && (rows = zpass(M, m, fill)); m += rows) switch (rows) {
                case 16: ZPASS(rows16z, 3); break;
                case 14: ZPASS(rows14z, 3); break;
                case 12: ZPASS(rows12z, 4); break;
                case 10: ZPASS(rows10z, 4); break;
                case 6: ZPASS(rows6z, 6); break;
                case 4: ZPASS(rows4z, 6); break;
                default: ZPASS(rows8z, 6); break;
            }
    else
        for (; m + 8 <= M; m += 8) PASS(rows8, 1, x + m * K, y + m * N);
    const float *xr = x + m * K;
    float *yr = y + m * N;
    switch (M > m ? M - m : 0) {
        case 7: PASS(rows7, 1, xr, yr); break;
        case 6: PASS(rows6, 2, xr, yr); break;
        case 5: PASS(rows5, 2, xr, yr); break;
        case 4: PASS(rows4, 2, xr, yr); break;
        case 3: PASS(rows3, 4, xr, yr); break;
        case 2: PASS(rows2, 4, xr, yr); break;
        case 1: PASS(rows1, 2, xr, yr); break;
    }
}

/* x [M, K] interleaved for the AVX-512 blocks with ``fill`` (freed by the caller), or NULL where the AVX2 blocks
 * take every row (or the memory could not be had: they give the same bits) */
float *skinny_scratch(const float *x, long M, long K) {
    float *xi = M >= 4 ? malloc(sizeof(float) * ((M + 7) / 8 * 8) * K) : NULL;  /* what xi may cover */
    if (xi && !skinny_interleave(x, xi, M, K, 1)) {
        free(xi);
        xi = NULL;
    }
    return xi;
}

void skinny_linear(const float *x, const float *w, float *y, long M, long N, long K) {
    float *xi = skinny_scratch(x, M, K);
    #pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += CHUNK)
        skinny_rows(x, xi, 1, w, y, M, N, K, n0, n0 + CHUNK < N ? n0 + CHUNK : N);
    free(xi);
}
