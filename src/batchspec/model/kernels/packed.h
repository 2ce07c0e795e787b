/* A weight kept in a narrower exact format (``packed.c``), as the kernels that read it see it (``packed.c``,
 * ``argmax.c``, ``layer.c``), and the entry points they call across files (an fp32 weight, kind W_F32, goes through
 * ``skinny.c``). Included by every file that defines or calls them, so that the compiler checks they agree. */
#ifndef BATCHSPEC_PACKED_H
#define BATCHSPEC_PACKED_H

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_Q8_0 = 3, W_Q4_0 = 4, W_Q4_1 = 5, W_Q4_K = 6, W_Q5_K = 7, W_Q6_K = 8 };

/* one weight [N, K]: ``q`` the codes (floats for f32; int32 words as above for the block formats; uint16 bits for
 * bf16 / f16; ggml's super-blocks of 256 weights, as a GGUF file stores them, for the K-quants), ``d`` and ``m`` the
 * blocks' scales and offsets [N, K/32] (fp32 holding fp16 values; none for the K-quants, whose blocks carry them) */
typedef struct {
    long kind;
    const void *q, *d, *m;
} packed_t;

/* rows n0 .. n1 - 1 of y = x @ w^T (y [M, N]) with the bits ``packed_linears`` gives them, in the calling thread */
void packed_rows(const float *x, const packed_t *w, float *y, long M, long N, long K, long n0, long n1);
void packed_linears(const float *x, const packed_t *w, float *const *ys, const long *Ns, int count, long M, long K,
                    float **xi);

int skinny_avx512(int on);
float *skinny_scratch(const float *x, long M, long K);
long skinny_interleave(const float *x, float *xi, long M, long K, int fill);
void skinny_pairs(const float *x, float *xi, long M, long rows, long K);
void skinny_rows(const float *x, const float *xi, int fill, const float *w, float *y, long M, long N, long K, long n0,
                 long n1);

#endif
