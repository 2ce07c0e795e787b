/* y = x @ w^T for a few rows of x (fp32, AVX2 + FMA): every weight row is read once from memory for all rows of x.
 * x: M x K, w: N x K, y: M x N, all row-major and contiguous.
 *
 * Every output y[m][n] is summed in the same order whatever M is and wherever the row falls in a block: eight lanes
 * over k in steps of 8, the lanes added pairwise (hsum), then the last K % 8 products one by one. So a token's
 * logits do not depend on how many tokens share its forward (a verification block gives the bits a decode step
 * gives).
 *
 * Rows of x go in blocks of 8, then one block of the 1-7 left (with AVX-512, 5-7 left after full blocks fill a block
 * of 8: PAD), each against a few weight rows at a time with every sum in a register: 8 x 1 weight row, 7 x 1, 6 x 2, 5
 * x 2, 4 x 2, 3 x 4, 2 x 4, 1 x 2 (at most 12 accumulators, so the x rows or the weight rows of a step stay in
 * registers too). Weight rows go to the threads in chunks of 12, so a chunk stays in L1 while each block of x rows
 * passes over it. Blocks were of 4 rows before: 5-8 rows then passed twice over each chunk, and the second pass cost
 * ~0.2-0.45 of a one-row pass from memory (the model at batch 1, a 700-token context, memory slow: a 5-token
 * verification 1.18-1.19 plain steps, 8 tokens 1.42-1.60; in one block 1.03-1.10 and 1.20-1.22); 8 rows (a decode step
 * at batch 8) took 24 ms where two blocks of 4 took 28-29.5, and 9-64 rows of the model's matrices 0.88-0.92 of the
 * time. Before that, 2 and 3 rows ran as 2 and 3 single rows, each against 2 weight rows: 3 rows then cost ~30% more
 * than 1 and ~10% more than 4. With memory slow (this machine's bandwidth varies by ~30% over minutes) most widths
 * wait on the weights alike. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* Weights are prefetched this many floats ahead of the rows being read: the hardware prefetcher alone left the
 * kernel at ~9 GB/s on 8 rows; with it, ~14 GB/s. Far more (8192) wastes bandwidth past the end of each thread's
 * share of a small matrix: one row of x ran ~5% slower. */
#define AHEAD 3072
#define CHUNK 12 /* weight rows per thread task: a multiple of every block's weight rows */
/* With AVX-512, PAD-7 rows left after full blocks go through a block of 8 filled with zero rows (their outputs not
 * written): a later pass over a chunk already in L1 costs less as one AVX-512 block than as the AVX2 block of those
 * rows (SmolLM2-135M's matrices, 2 threads, paired runs: 13-15 rows 0.76-0.97 of the time; 12 and 20 rows 0.90-1.01,
 * 9-11 rows 1.01-1.18, and 4-7 rows alone, read from memory, 1.04-1.26: not filled). A whole forward at batch 8
 * verifying 5-7 drafts cost 1.52-1.71 decode steps, more than one verifying 8 (1.44); filled, 1.53-1.56 against
 * 1.59. */
#define PAD 5

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

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
                float s = hsum(acc[r][c]);                                                                    \
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

/* Blocks of 8 rows with AVX-512 (where the CPU has it), in the same order of sums: a 16-lane register holds two rows
 * of x (``xi``: rows 2p and 2p+1, 8 columns each, interleaved once per call) against one weight row's 8 columns
 * broadcast to both halves, so each half is one 8-lane sum of the AVX2 kernel, and its hsum is the same. 4 pairs x 6
 * weight rows: 24 sums in registers, 10 loads per 24 products (the AVX2 block of 8: 9 loads per 8 at half the
 * width). Measured on the model's matrices from memory (2 threads): 8 rows ~0.97-0.99 of the AVX2 time (both wait on
 * the weights), 16 rows 0.67-0.70, 32 rows 0.61-0.67. */
#define ZC 6
__attribute__((target("avx512f,avx512dq"))) static void rows8z(const float *xi, const float *x, const float *w,
                                                               float *y, long N, long K, long n, int nw, long nr) {
    __m512 acc[4][ZC];
    const float *wr[ZC];
    for (int c = 0; c < ZC; c++) {
        wr[c] = w + (c < nw ? c : 0) * K;
        for (int p = 0; p < 4; p++) acc[p][c] = _mm512_setzero_ps();
    }
    long k = 0, K8 = K / 8;
    for (; k + 8 <= K; k += 8) {
        __m512 xv[4];
        for (int p = 0; p < 4; p++) xv[p] = _mm512_loadu_ps(xi + (p * K8 + k / 8) * 16);
        for (int c = 0; c < ZC; c++) {
            _mm_prefetch((const char *)(wr[c] + AHEAD + k), _MM_HINT_T0);
            __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps(wr[c] + k));
            for (int p = 0; p < 4; p++) acc[p][c] = _mm512_fmadd_ps(wv, xv[p], acc[p][c]);
        }
    }
    for (int p = 0; p < 4; p++)
        for (int c = 0; c < nw; c++)
            for (int h = 0; h < 2; h++) {
                long r = 2 * p + h;
                if (r >= nr) continue; /* a padding row of a block filled up to 8 */
                float s = hsum(h ? _mm512_extractf32x8_ps(acc[p][c], 1) : _mm512_castps512_ps256(acc[p][c]));
                for (long j = k; j < K; j++) s += wr[c][j] * x[r * K + j];
                y[r * N + n + c] = s;
            }
}

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

/* Rows 2p, 2p+1 of x's first M - M % 8 rows interleaved for the AVX-512 blocks into xi; with ``fill``, the last
 * M % 8 rows too when there are at least PAD of them, as a block filled up to 8 with zero rows (xi then holds M
 * rounded up to 8 rows x K floats). Returns the rows xi covers (written or padding), 0 (xi unused) where those
 * blocks do not run. */
long skinny_interleave(const float *x, float *xi, long M, long K, int fill) {
    long m8 = M - M % 8, K8 = K / 8, mz = fill && m8 && M % 8 >= PAD ? m8 + 8 : m8;
    if (!mz || !has_avx512()) return 0;
    for (long m = 0; m < mz; m += 2)
        for (long k8 = 0; k8 < K8; k8++)
            for (long h = 0; h < 2; h++) {
                float *to = xi + ((m / 2) * K8 + k8) * 16 + h * 8;
                if (m + h < M)
                    memcpy(to, x + (m + h) * K + k8 * 8, 8 * sizeof(float));
                else
                    memset(to, 0, 8 * sizeof(float));
            }
    return mz;
}

/* y[:, n0:n1] = x @ w[n0:n1]^T on the calling thread (xi: from ``skinny_interleave``, covering mz rows; or NULL) */
void skinny_rows(const float *x, const float *xi, long mz, const float *w, float *y, long M, long N, long K, long n0,
                 long n1) {
    long m8 = xi ? mz : M - M % 8, K8 = K / 8, rest = M > m8 ? M - m8 : 0;
    const float *xr = x + m8 * K;
    float *yr = y + m8 * N;
    for (long m = 0; m < m8; m += 8) {
        if (xi)
            for (long n = n0; n < n1; n += ZC)
                rows8z(xi + (m / 2) * K8 * 16, x + m * K, w + n * K, y + m * N, N, K, n,
                       n1 - n < ZC ? (int)(n1 - n) : ZC, M - m < 8 ? M - m : 8);
        else
            PASS(rows8, 1, x + m * K, y + m * N);
    }
    switch (rest) {
        case 7: PASS(rows7, 1, xr, yr); break;
        case 6: PASS(rows6, 2, xr, yr); break;
        case 5: PASS(rows5, 2, xr, yr); break;
        case 4: PASS(rows4, 2, xr, yr); break;
        case 3: PASS(rows3, 4, xr, yr); break;
        case 2: PASS(rows2, 4, xr, yr); break;
        case 1: PASS(rows1, 2, xr, yr); break;
    }
}

void skinny_linear(const float *x, const float *w, float *y, long M, long N, long K) {
    long mz = 0, m8 = (M + 7) / 8 * 8;
    float *xi = M >= 8 ? malloc(sizeof(float) * m8 * K) : NULL;
    if (xi && !(mz = skinny_interleave(x, xi, M, K, 1))) {
        free(xi);
        xi = NULL;  /* the AVX2 blocks */
    }
    #pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += CHUNK)
        skinny_rows(x, xi, mz, w, y, M, N, K, n0, n0 + CHUNK < N ? n0 + CHUNK : N);
    free(xi);
}
