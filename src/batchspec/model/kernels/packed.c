/* Linear layers over weights kept in a narrower format that holds their fp32 values exactly (``model/weights.py``).
 *
 * A weight is expanded, a chunk of rows at a time, to the very fp32 values it stands for, into a small buffer that
 * stays in cache; the chunk then goes through skinny.c's kernel as if it had been read from memory in fp32. So every
 * output has the bits of the fp32 path (same values, same order of sums), while a step reads 2-7x fewer bytes from
 * memory. Block formats hold 32 consecutive weights of a row with one scale (and offset), as GGUF's do:
 *   bf16:  w = bits << 16
 *   f16:   w = (float) h
 *   q8_0:  w = d * q             q int8, d fp16
 *   q4_0:  w = d * (q - 8)       q 4 bits, d fp16
 *   q4_1:  w = d * q + m         q 4 bits, d and m fp16
 * gguf's dequantiser computes d * q and then adds m, two roundings in fp32; d has 11 significant bits and |q| < 2^8,
 * so d * q is exact in fp32 and one fused multiply-add (a single rounding of d * q + m) gives the same bits.
 * 4-bit blocks are 16 bytes: byte j holds weight j (low nibble) and weight j + 16 (high nibble), GGUF's order. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void skinny_linear(const float *x, const float *w, float *y, long M, long N, long K);
void skinny_rows(const float *x, const float *xi, int fill, const float *w, float *y, long M, long N, long K, long n0,
                 long n1);
long skinny_interleave(const float *x, float *xi, long M, long K, int fill);

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_Q8_0 = 3, W_Q4_0 = 4, W_Q4_1 = 5 };

/* one weight [N, K]: ``q`` the codes (floats for f32), ``d`` and ``m`` the blocks' fp16 scales and offsets [N, K/32] */
typedef struct {
    long kind;
    const void *q, *d, *m;
} packed_t;

#define CHUNK 12 /* weight rows expanded at a time: skinny.c's chunk (a multiple of every block's weight rows) */

static inline __m256 nibbles(__m128i b, int part) { /* weights 8 * part .. 8 * part + 7 of a 4-bit block */
    __m128i v = part < 2 ? _mm_and_si128(b, _mm_set1_epi8(0x0F)) : _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    if (part & 1) v = _mm_srli_si128(v, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

/* rows n0 .. n1 - 1 of ``w`` as fp32 into out [n1 - n0, K] (K a multiple of 32 for the block formats) */
static void expand_rows(const packed_t *w, long K, long n0, long n1, float *out) {
    long nb = K / 32, count = (n1 - n0) * K;
    switch (w->kind) {
        case W_BF16: {
            const uint16_t *q = (const uint16_t *)w->q + n0 * K;
            for (long j = 0; j + 8 <= count; j += 8)
                _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(
                                              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(q + j))), 16)));
            for (long j = count / 8 * 8; j < count; j++) ((uint32_t *)out)[j] = (uint32_t)q[j] << 16;
            break;
        }
        case W_F16: {
            const uint16_t *q = (const uint16_t *)w->q + n0 * K;
            for (long j = 0; j + 8 <= count; j += 8)
                _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q + j))));
            for (long j = count / 8 * 8; j < count; j++) out[j] = _cvtsh_ss(q[j]);
            break;
        }
        case W_Q8_0: {
            const int8_t *q = (const int8_t *)w->q + n0 * K;
            const uint16_t *d = (const uint16_t *)w->d + n0 * nb;
            for (long b = 0; b < (n1 - n0) * nb; b++) {
                __m256 vd = _mm256_set1_ps(_cvtsh_ss(d[b]));
                for (int part = 0; part < 4; part++) {
                    __m128i c = _mm_loadl_epi64((const __m128i *)(q + 32 * b + 8 * part));
                    _mm256_storeu_ps(out + 32 * b + 8 * part, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), vd));
                }
            }
            break;
        }
        case W_Q4_0:
        case W_Q4_1: {
            const uint8_t *q = (const uint8_t *)w->q + n0 * K / 2;
            const uint16_t *d = (const uint16_t *)w->d + n0 * nb, *m = (const uint16_t *)w->m + n0 * nb;
            int offset = w->kind == W_Q4_1;
            for (long b = 0; b < (n1 - n0) * nb; b++) {
                __m256 vd = _mm256_set1_ps(_cvtsh_ss(d[b]));
                __m256 vm = offset ? _mm256_set1_ps(_cvtsh_ss(m[b])) : _mm256_setzero_ps();
                __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * b));
                for (int part = 0; part < 4; part++) {
                    __m256 c = nibbles(bytes, part);
                    __m256 v = offset ? _mm256_fmadd_ps(c, vd, vm)
                                      : _mm256_mul_ps(_mm256_sub_ps(c, _mm256_set1_ps(8.0f)), vd);
                    _mm256_storeu_ps(out + 32 * b + 8 * part, v);
                }
            }
            break;
        }
        default: {
            const float *q = (const float *)w->q + n0 * K;
            for (long j = 0; j < count; j++) out[j] = q[j];
        }
    }
}

/* the whole weight as fp32 into out [N, K] (for forwards over many rows, which run as torch's matrix products) */
void packed_expand(const packed_t *w, long N, long K, float *out) {
    #pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64) expand_rows(w, K, n0, n0 + 64 < N ? n0 + 64 : N, out + n0 * K);
}

/* rows ids[0 .. n - 1] of the weight as fp32 into out [n, K] (an embedding lookup) */
void packed_gather(const packed_t *w, long K, const int64_t *ids, long n, float *out) {
    for (long i = 0; i < n; i++) expand_rows(w, K, ids[i], ids[i] + 1, out + i * K);
}

/* y = x @ w^T for x [M, K] with few rows (as skinny_linear, whose bits it gives): each thread expands CHUNK weight
 * rows into its buffer and runs skinny.c's blocks over them. Returns 0, or -1 without scratch memory. */
int packed_linear(const float *x, const packed_t *w, float *y, long M, long N, long K) {
    if (w->kind == W_F32) {
        skinny_linear(x, (const float *)w->q, y, M, N, K);
        return 0;
    }
    float *xi = M >= 4 ? malloc(sizeof(float) * ((M + 7) / 8 * 8) * K) : NULL;
    if (xi && !skinny_interleave(x, xi, M, K, 1)) {
        free(xi);
        xi = NULL;
    }
    int failed = 0;
    #pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * CHUNK * K);
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long n0 = 0; n0 < N; n0 += CHUNK) {
            if (!buf) continue;
            long n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            expand_rows(w, K, n0, n1, buf);
            skinny_rows(x, xi, 1, buf, y + n0, M, N, K, 0, n1 - n0);
        }
        free(buf);
    }
    free(xi);
    return failed ? -1 : 0;
}

/* The codes, scales (and offsets) of one block of 32 fp32 values in a block format such that its expansion gives
 * back every value bit for bit, trying the fp16 scales nearest to the block's estimate (the quantiser rounded its
 * own estimate to fp16). Returns 1 when found. */
static int find_block(long kind, const float *v, uint8_t *codes, uint16_t *d_out, uint16_t *m_out) {
    float lo = v[0], hi = v[0], far = v[0];
    for (int i = 1; i < 32; i++) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
        far = fabsf(v[i]) > fabsf(far) ? v[i] : far;
    }
    float m = 0.0f, estimate, qlo, qhi;
    if (kind == W_Q4_1) {
        m = lo;
        if (_cvtsh_ss(_cvtss_sh(m, 0)) != m) return 0;
        estimate = (hi - lo) / 15.0f, qlo = 0.0f, qhi = 15.0f;
    } else if (kind == W_Q8_0) {
        estimate = fmaxf(fabsf(lo), fabsf(hi)) / 127.0f, qlo = -128.0f, qhi = 127.0f;
    } else {
        estimate = far / -8.0f, qlo = -8.0f, qhi = 7.0f;
    }
    /* the nearest fp16 scale, its neighbours, and the nearest of the other sign (a block of -0.0 in q4_0) */
    static const int steps[] = {0, -1, 1, -2, 2, 0x8000};
    uint16_t h0 = _cvtss_sh(estimate, 0);
    for (int s = 0; s < 6; s++) {
        uint16_t h = steps[s] == 0x8000 ? (uint16_t)(h0 ^ 0x8000) : (uint16_t)(h0 + steps[s]);
        float d = _cvtsh_ss(h);
        if (!isfinite(d)) continue;
        int ok = 1;
        for (int i = 0; i < 32 && ok; i++) {
            float c = d == 0.0f ? 0.0f : rintf((kind == W_Q4_1 ? v[i] - m : v[i]) / d);
            int code = (int)(c < qlo ? qlo : c > qhi ? qhi : c);
            /* the value exactly as the expansion computes it (c * d is exact: the one rounding is the offset's) */
            float cf = kind == W_Q4_0 ? (float)(code + 8) - 8.0f : (float)code;
            float w = kind == W_Q4_1 ? cf * d + m : cf * d;
            uint32_t a, b;
            memcpy(&a, &w, 4);
            memcpy(&b, &v[i], 4);
            ok = a == b;
            codes[i] = (uint8_t)(kind == W_Q4_0 ? code + 8 : code);
        }
        if (ok) {
            *d_out = h;
            if (m_out) *m_out = _cvtss_sh(m, 0);
            return 1;
        }
    }
    return 0;
}

/* Pack w [N, K] (K a multiple of 32) into a block format (q: [N, K/2] bytes for 4 bits, [N, K] for q8_0; d, m:
 * [N, K/32] fp16). Returns 0 when every block's expansion gives back its values bit for bit, else -1 (stops at the
 * first block that does not). */
int packed_find(long kind, const float *w, long N, long K, void *q, uint16_t *d, uint16_t *m) {
    long nb = K / 32;
    int failed = 0;
    #pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        uint8_t codes[32];
        for (long b = 0; b < nb; b++) {
            if (failed) break;
            long at = n * nb + b;
            if (!find_block(kind, w + at * 32, codes, d + at, kind == W_Q4_1 ? m + at : NULL)) {
                #pragma omp atomic write
                failed = 1;
                break;
            }
            if (kind == W_Q8_0)
                memcpy((int8_t *)q + at * 32, codes, 32);
            else
                for (int j = 0; j < 16; j++) ((uint8_t *)q)[at * 16 + j] = (uint8_t)(codes[j] | (codes[j + 16] << 4));
        }
    }
    return failed ? -1 : 0;
}
