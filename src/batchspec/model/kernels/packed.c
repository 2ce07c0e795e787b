/* Linear layers over weights kept in a narrower format that holds their fp32 values exactly (``model/weights.py``).
 *
 * Each weight is expanded in a register, as it is read, to the very fp32 value it stands for, and the products are
 * summed in skinny.c's order (eight lanes over k in steps of 8, then the same pairwise hsum): every output has the
 * bits of the fp32 kernel, while a step reads 2-7x fewer bytes from memory. Formats (a block: 32 consecutive
 * weights of a row with one scale d, and offset m, both fp16 values, kept as fp32 so that the kernel broadcasts them
 * from memory without converting):
 *   bf16:  w = bits << 16
 *   f16:   w = (float) h
 *   q8_0:  w = d * q             q int8
 *   q4_0:  w = d * (q - 8)       q 4 bits
 *   q4_1:  w = d * q + m         q 4 bits
 * gguf's dequantiser computes d * q and then adds m, two roundings in fp32; d has 11 significant bits and |q| < 2^8,
 * so d * q is exact in fp32 and one fused multiply-add (a single rounding of d * q + m) gives the same bits. The
 * K-quants (q4_k, q5_k, q6_k) are read from a GGUF file's own blocks, described where their expansion is defined.
 *
 * 4-bit codes are laid out for eight 32-bit lanes, so that no byte shuffles are needed: a group of 8 words holds,
 * in word j, the codes of weights 64g + 8p + j, p = 0..7, in bits 4p..4p+3; lane j of part p is one shift and one
 * mask away. 8-bit codes are one byte per weight in row order (one sign-extending load gives 8 lanes). */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed.h"
#include "reduce.h"

#define CHUNK 12 /* weight rows a thread task takes (skinny.c's chunk) */
/* code groups (32 bytes each) prefetched ahead of the ones being read, and their scales: a row's codes, its scales
 * and its offsets are three streams, and the block of rows read together several of each; without it a step read
 * its packed weights at ~3 GB/s (24 ms for the default model's linears at batch 1), with it 16-20 ms; 128 groups
 * (4 KB) ahead, against 64: a batch-1 step's products (weights from memory, 2 threads) 0.97x the time for the default
 * model's q4_1, 0.92x for Gemma 3 270M's (its q8_0 0.88x); 256 no better for the default model */
#define AHEAD_GROUPS 128
/* q8_0's groups prefetched ahead (12 KB): Gemma 3 270M's layers as q8_0 (the shapes of its 18 layers, 113 MB, 2
 * threads) at 1 row 0.91x the time they took 128 groups ahead, even at 8 rows; the 4-bit formats measured even at 1
 * row and 1.04x slower at 8 */
#define AHEAD_Q8 384
/* weight rows a block of one or two rows of x takes at a time: 2 measured 1.2x as fast as 4 and 1.1x as fast as 1
 * at one row (each weight row is a stream of codes, scales and offsets) */
#define R1C 2
/* pairs of weight rows a block of one row of x takes (4 streams of codes): 0.85x the time of one pair */
#define ZR1C 2

/* Each format's weights, expanded in registers: F_SETUP(c) reads group ``kb / GROUP`` of weight row ``row[c]`` (its
 * code words, its scales), F_PART(c, P) gives its weights 8P .. 8P + 7 (P < GROUP / 8). */
/* 16-bit codes prefetched this many weights ahead (4 KB) within a row: a draft head's f16 weights read from memory
 * 1.15-1.3x as fast as with the hardware prefetcher alone */
#define AHEAD_H16 2048
#define H16_PREFETCH(p) _mm_prefetch((const char *)((p) + AHEAD_H16), _MM_HINT_T0)
#define H16_DECL                                                                                              \
    const uint16_t *h16 = (const uint16_t *)w->q;                                                             \
    const uint16_t *hp[C_];
#define BF16_AT(c, P)
#define BF16_GROUP 32
#define BF16_DECL H16_DECL
#define BF16_SETUP(c) hp[c] = h16 + row[c] * K + kb, H16_PREFETCH(hp[c])
#define BF16_PART(c, P)                                                                                       \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(hp[c] + 8 * P))), 16))
#define F16_AT(c, P)
#define F16_GROUP 32
#define F16_DECL H16_DECL
#define F16_SETUP(c) hp[c] = h16 + row[c] * K + kb, H16_PREFETCH(hp[c])
#define F16_PART(c, P) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hp[c] + 8 * P)))

#define SCALE(ptr, b) _mm256_broadcast_ss((ptr) + (b))
#define Q8_0_AT(c, P)
#define Q8_0_GROUP 32
#define Q8_0_DECL                                                                                             \
    const int8_t *codes = (const int8_t *)w->q;                                                               \
    const float *dp = (const float *)w->d;                                                                    \
    const int8_t *at[C_];                                                                                     \
    long blk[C_];
#define Q8_0_SETUP(c)                                                                                         \
    do {                                                                                                      \
        blk[c] = (row[c] * K + kb) / 32;                                                                      \
        at[c] = codes + blk[c] * 32;                                                                          \
        _mm_prefetch((const char *)(at[c] + 32 * AHEAD_Q8), _MM_HINT_T0);                                     \
        _mm_prefetch((const char *)(dp + blk[c] + AHEAD_Q8), _MM_HINT_T0);                                    \
    } while (0)
#define Q8_0_PART(c, P)                                                                                       \
    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(at[c] + 8 * P)))), \
                  SCALE(dp, blk[c]))
#define Q4_GROUP 64
#define Q4_DECL                                                                                               \
    const __m256i *words = (const __m256i *)w->q;                                                             \
    const float *dp = (const float *)w->d, *mp = (const float *)w->m;                                         \
    const __m256i low = _mm256_set1_epi32(0x0F);                                                              \
    __m256i code[C_];                                                                                         \
    long blk[C_];                                                                                             \
    (void)mp;
#define Q4_SETUP(c)                                                                                           \
    do {                                                                                                      \
        long g = (row[c] * K + kb) / 64;                                                                      \
        blk[c] = 2 * g;                                                                                       \
        code[c] = _mm256_loadu_si256(words + g);                                                              \
        _mm_prefetch((const char *)(words + g + AHEAD_GROUPS), _MM_HINT_T0);                                  \
        _mm_prefetch((const char *)(dp + blk[c] + 2 * AHEAD_GROUPS), _MM_HINT_T0);                            \
        if (mp) _mm_prefetch((const char *)(mp + blk[c] + 2 * AHEAD_GROUPS), _MM_HINT_T0);                    \
    } while (0)
#define NIB(c, P) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(code[c], 4 * P), low))
#define Q4_0_AT(c, P)
#define Q4_0_GROUP Q4_GROUP
#define Q4_0_DECL Q4_DECL
#define Q4_0_SETUP(c) Q4_SETUP(c)
#define Q4_0_PART(c, P) _mm256_mul_ps(_mm256_sub_ps(NIB(c, P), _mm256_set1_ps(8.0f)), SCALE(dp, blk[c] + P / 4))
#define Q4_1_AT(c, P)
#define Q4_1_GROUP Q4_GROUP
#define Q4_1_DECL Q4_DECL
#define Q4_1_SETUP(c) Q4_SETUP(c)
#define Q4_1_PART(c, P) /* d * q exact: the one rounding is the offset's */                                   \
    _mm256_fmadd_ps(NIB(c, P), SCALE(dp, blk[c] + P / 4), SCALE(mp, blk[c] + P / 4))

/* The 4-bit formats by lookup (AVX-512VL): a block's 16 possible values, computed with the expansion's own
 * operations (so the same bits), in two 8-lane tables (tab[c][0]: codes 0-7, tab[c][1]: 8-15), and one two-table
 * permute per part takes lane j's value by its code in bits 0-3 (the permute ignores the bits above): two vector
 * operations per 8 weights (shift, permute) where the expansion takes four (shift, mask, convert, multiply-add).
 * The tables are built at a block's first part (LQ4_AT), two operations per 32 weights. */
#define LQ4_DECL                                                                                              \
    Q4_DECL                                                                                                   \
    LUT_DECL                                                                                                  \
    (void)low;
#define LUT_DECL                                                                                              \
    const __m256 iota0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);                                              \
    const __m256 iota8 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);                                       \
    __m256 tab[C_][2];
#define LQ4_AT(c, P, VALUES)                                                                                  \
    if (P % 4 == 0) tab[c][0] = VALUES(blk[c] + P / 4, iota0), tab[c][1] = VALUES(blk[c] + P / 4, iota8)
#define LQ4_PART(c, P) _mm256_permutex2var_ps(tab[c][0], P ? _mm256_srli_epi32(code[c], 4 * P) : code[c], tab[c][1])
#define LQ4_0_GROUP Q4_GROUP
#define LQ4_0_DECL LQ4_DECL
#define LQ4_0_SETUP(c) Q4_SETUP(c)
#define LQ4_0_VALUES(b, io) _mm256_mul_ps(_mm256_sub_ps(io, _mm256_set1_ps(8.0f)), _mm256_set1_ps(dp[b]))
#define LQ4_0_AT(c, P) LQ4_AT(c, P, LQ4_0_VALUES)
#define LQ4_0_PART(c, P) LQ4_PART(c, P)
#define LQ4_1_GROUP Q4_GROUP
#define LQ4_1_DECL LQ4_DECL
#define LQ4_1_SETUP(c) Q4_SETUP(c)
#define LQ4_1_VALUES(b, io) _mm256_fmadd_ps(io, _mm256_set1_ps(dp[b]), _mm256_set1_ps(mp[b]))
#define LQ4_1_AT(c, P) LQ4_AT(c, P, LQ4_1_VALUES)
#define LQ4_1_PART(c, P) LQ4_PART(c, P)

/* The K-quants, read from ggml's super-blocks as a GGUF file stores them: 256 weights of a row with an fp16 scale d
 * (and min dmin) and, per sub-block of 32 (q4_k, q5_k: a 6-bit scale sc and min m, packed in 12 bytes) or 16 (q6_k:
 * an int8 scale sc), 4-, 5- or 6-bit codes q:
 *   q4_k, q5_k:  w = (d * sc) * q - dmin * m
 *   q6_k:        w = (d * sc) * (q - 32)
 * d * sc and dmin * m are exact in fp32 (11 significant bits by at most 7), and so is (d * sc) * q (at most 23 bits):
 * gguf's dequantiser rounds once, at the subtraction, as one fused multiply-subtract does. A group is 64 weights of a
 * super-block: two sub-blocks of q4_k / q5_k, four of q6_k; a super-block's scales are computed at its first group. */
enum { QK = 256, Q4_K_BYTES = 144, Q5_K_BYTES = 176, Q6_K_BYTES = 210 };
/* bytes prefetched ahead of the group being read: Gemma 3 270M's K-quant linears of a decode step, weights from
 * memory, at 1 row took 0.7x the time they took with 2048 (2 threads: 0.73x); 6144-12288 measured even */
#define AHEAD_KQ 4096

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the scales and offsets d * sc and dmin * m of the 8 sub-blocks of a q4_k / q5_k super-block ``s``, once per
 * super-block: its 12 bytes of 6-bit fields unpacked as ggml does, four at a time (sc and m of sub-block j < 4: the low
 * 6 bits of bytes j and j + 4; of j >= 4: a nibble of byte j + 4 and the top 2 bits of bytes j - 4 and j) */
static inline void kq_scales(const uint8_t *s, float *dsc, float *dm) {
    uint32_t u[4];
    memcpy(u, s + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
    uint32_t m03 = u[1] & 0x3F3F3F3F;
    u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = m03;
    u[0] &= 0x3F3F3F3F;
    __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u));
    __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)));
    _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(half_at(s)), _mm256_cvtepi32_ps(sc)));
    _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(half_at(s + 2)), _mm256_cvtepi32_ps(m)));
}

/* the scales d * sc of the 16 sub-blocks of a q6_k super-block ``s`` */
static inline void q6_scales(const uint8_t *s, float *dsc) {
    __m128i sc = _mm_loadu_si128((const __m128i *)(s + 192));
    __m256 d = _mm256_set1_ps(half_at(s + 208));
    _mm256_storeu_ps(dsc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(dsc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
}

#define KQ_DECL                                                                                               \
    const uint8_t *blocks = (const uint8_t *)w->q;                                                            \
    const __m256i low = _mm256_set1_epi32(0x0F);                                                              \
    const uint8_t *qs[C_], *qh[C_];                                                                           \
    float dsc[C_][16], dm[C_][8];                                                                             \
    const float *sc[C_], *mn[C_];                                                                             \
    int shift[C_];                                                                                            \
    (void)qh, (void)mn, (void)shift;
/* the super-block of group kb / 64 of row[c], the group's place in it (0..3), and a prefetch ahead of it; a
 * super-block's scales are computed at its first group (sc[c], mn[c]: the group's own) */
#define KQ_SETUP(c, BYTES)                                                                                    \
    const uint8_t *s = blocks + ((row[c] * K + kb) / QK) * (BYTES);                                           \
    int g = (int)(kb % QK) / 64;                                                                              \
    _mm_prefetch((const char *)(s + 64 * g + AHEAD_KQ), _MM_HINT_T0)
#define KQ_BYTES(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
/* bits ``n`` .. of 8 bytes at p, masked by ``mask`` and moved above a 4-bit code */
#define KQ_HIGH(p, n, mask)                                                                                   \
    _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(KQ_BYTES(p), _mm_cvtsi32_si128(n)), _mm256_set1_epi32(mask)), 4)
/* the 4-bit codes of weights 8P .. 8P + 7 of a q4_k / q5_k group: the low nibbles of its 32 bytes, then the high */
#define KQ_NIB(c, P)                                                                                          \
    (P < 4 ? _mm256_and_si256(KQ_BYTES(qs[c] + 8 * P), low) : _mm256_srli_epi32(KQ_BYTES(qs[c] + 8 * (P - 4)), 4))
#define KQ_AFFINE(c, P, codes)                                                                                \
    _mm256_fmsub_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(sc[c][P / 4]), _mm256_set1_ps(mn[c][P / 4]))
#define Q4_K_AT(c, P)
#define Q4_K_GROUP 64
#define Q4_K_DECL KQ_DECL
#define Q4_K_SETUP(c)                                                                                         \
    do {                                                                                                      \
        KQ_SETUP(c, Q4_K_BYTES);                                                                              \
        if (g == 0) kq_scales(s, dsc[c], dm[c]);                                                              \
        sc[c] = dsc[c] + 2 * g, mn[c] = dm[c] + 2 * g;                                                        \
        qs[c] = s + 16 + 32 * g;                                                                              \
    } while (0)
#define Q4_K_PART(c, P) KQ_AFFINE(c, P, KQ_NIB(c, P))
/* q4_k by lookup (AVX-512VL), as the 4-bit formats above: a sub-block's 16 values from its scales with the expansion's
 * own fused multiply-subtract, a part's codes one byte a lane (the permute ignores the high nibble above them) */
#define LQ4_K_GROUP 64
#define LQ4_K_DECL                                                                                            \
    KQ_DECL                                                                                                   \
    LUT_DECL                                                                                                  \
    (void)low;
#define LQ4_K_SETUP(c) Q4_K_SETUP(c)
#define LQ4_K_VALUES(c, P, io) _mm256_fmsub_ps(io, _mm256_set1_ps(sc[c][P / 4]), _mm256_set1_ps(mn[c][P / 4]))
#define LQ4_K_AT(c, P) if (P % 4 == 0) tab[c][0] = LQ4_K_VALUES(c, P, iota0), tab[c][1] = LQ4_K_VALUES(c, P, iota8)
#define LQ4_K_CODES(c, P) (P < 4 ? KQ_BYTES(qs[c] + 8 * P) : _mm256_srli_epi32(KQ_BYTES(qs[c] + 8 * (P - 4)), 4))
#define LQ4_K_PART(c, P) _mm256_permutex2var_ps(tab[c][0], LQ4_K_CODES(c, P), tab[c][1])
/* the same lookup in 16 lanes (AVX-512): a sub-block's 16 values in one register, one permute gives two parts (16
 * weights a load of 16 bytes), each half the 8 lanes the lookup above gives */
#define LQ4_K16_GROUP 64
#define LQ4_K16_DECL                                                                                          \
    KQ_DECL                                                                                                   \
    const __m512 iota16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);               \
    __m512 tz[C_], wz[C_];                                                                                    \
    (void)low;
#define LQ4_K16_SETUP(c) Q4_K_SETUP(c)
#define LQ4_K16_AT(c, P)                                                                                      \
    do {                                                                                                      \
        if (P % 4 == 0)                                                                                       \
            tz[c] = _mm512_fmsub_ps(iota16, _mm512_set1_ps(sc[c][P / 4]), _mm512_set1_ps(mn[c][P / 4]));      \
        if (P % 2 == 0) {                                                                                     \
            __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs[c] + 8 * (P % 4))));        \
            wz[c] = _mm512_permutexvar_ps(P < 4 ? i : _mm512_srli_epi32(i, 4), tz[c]);                        \
        }                                                                                                     \
    } while (0)
#define LQ4_K16_PART(c, P) (P % 2 ? _mm512_extractf32x8_ps(wz[c], 1) : _mm512_castps512_ps256(wz[c]))
#define Q5_K_AT(c, P)
#define Q5_K_GROUP 64
#define Q5_K_DECL KQ_DECL
#define Q5_K_SETUP(c) /* the fifth bit of sub-block j's codes: bit j of 32 bytes */                         \
    do {                                                                                                      \
        KQ_SETUP(c, Q5_K_BYTES);                                                                              \
        if (g == 0) kq_scales(s, dsc[c], dm[c]);                                                              \
        sc[c] = dsc[c] + 2 * g, mn[c] = dm[c] + 2 * g;                                                        \
        qh[c] = s + 16, qs[c] = s + 48 + 32 * g, shift[c] = 2 * g;                                            \
    } while (0)
#define Q5_K_PART(c, P)                                                                                       \
    KQ_AFFINE(c, P, _mm256_or_si256(KQ_NIB(c, P), KQ_HIGH(qh[c] + 8 * (P % 4), shift[c] + P / 4, 1)))
/* q6_k's codes are put together 32 at a time at the group's setup, as bytes q - 32 (shifts and masks on 32 bytes at
 * once, q8[c][h]: weights 32h .. 32h + 31), and a part sign-extends 8 of them: five vector operations a part where
 * putting each part's codes together in 32-bit lanes took eleven (the same integers, so the same values) */
#define Q6_K_AT(c, P)
#define Q6_K_GROUP 64
#define Q6_K_DECL                                                                                             \
    KQ_DECL                                                                                                   \
    __m256i q8[C_][2];                                                                                        \
    (void)low, (void)qs, (void)dm;
/* q6_k group g of super-block s: its codes - 32 as bytes, weights 0-31 in q8[0], 32-63 in q8[1] (a half of 128: 64
 * bytes of low nibbles (then high), 32 of 2-bit fields (bits 0, 2, 4, 6)) */
static inline void q6_group(const uint8_t *s, int g, __m256i *q8) {
    const uint8_t *ql = s + 64 * (g / 2);
    __m128i sh = _mm_cvtsi32_si128(4 * (g % 2));
    __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    __m256i hi = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(s + 128 + 32 * (g / 2))), sh);
    for (int h = 0; h < 2; h++) {
        __m256i lo = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(ql + 32 * h)), sh), nib);
        __m256i up = _mm256_and_si256(h ? _mm256_slli_epi16(hi, 2) : _mm256_slli_epi16(hi, 4), two);
        q8[h] = _mm256_sub_epi8(_mm256_or_si256(lo, up), k32);
    }
}
#define Q6_K_SETUP(c)                                                                                         \
    do {                                                                                                      \
        KQ_SETUP(c, Q6_K_BYTES);                                                                              \
        if (g == 0) q6_scales(s, dsc[c]);                                                                     \
        sc[c] = dsc[c] + 4 * g;                                                                               \
        q6_group(s, g, q8[c]);                                                                                \
    } while (0)
/* the 8 bytes of part P: in the low or high lane of q8[c][P / 4], the low or high half of it */
#define Q6_K_CODES(c, P)                                                                                      \
    _mm256_cvtepi8_epi32(P % 2 ? _mm_unpackhi_epi64(Q6_K_LANE(c, P), Q6_K_LANE(c, P)) : Q6_K_LANE(c, P))
#define Q6_K_LANE(c, P) (P % 4 < 2 ? _mm256_castsi256_si128(q8[c][P / 4]) : _mm256_extracti128_si256(q8[c][P / 4], 1))
#define Q6_K_PART(c, P) _mm256_mul_ps(_mm256_cvtepi32_ps(Q6_K_CODES(c, P)), _mm256_set1_ps(sc[c][P / 2]))

/* q6_k two parts at a time (AVX-512): a sub-block's 16 weights share a scale, so its two parts are sign-extended,
 * converted and scaled in one 16-lane register (WQ6_K_AT, at the even part), each half the 8 lanes the part above
 * gives: the same values in fewer instructions */
#define WQ6_K_GROUP 64
#define WQ6_K_DECL                                                                                            \
    Q6_K_DECL                                                                                                 \
    __m512 wz[C_];
#define WQ6_K_SETUP(c) Q6_K_SETUP(c)
#define WQ6_K_AT(c, P)                                                                                        \
    if (P % 2 == 0)                                                                                           \
    wz[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(Q6_K_LANE(c, P))), _mm512_set1_ps(sc[c][P / 2]))
#define WQ6_K_PART(c, P) (P % 2 ? _mm512_extractf32x8_ps(wz[c], 1) : _mm512_castps512_ps256(wz[c]))

/* super-block ``s`` of a K-quant as fp32 into out[256], with the kernel's arithmetic (the expansion's reference) */
static void kq_expand(long kind, const uint8_t *s, float *out) {
    float dsc[8], dm[8];
    if (kind != W_Q6_K) kq_scales(s, dsc, dm);
    for (int i = 0; i < QK; i++) {
        int g = i / 64, b = i % 64, j = i / 32;
        if (kind == W_Q6_K) {
            int q = ((s[64 * (g / 2) + b] >> (4 * (g % 2))) & 15) |
                    (((s[128 + 32 * (g / 2) + b % 32] >> (4 * (g % 2) + 2 * (b / 32))) & 3) << 4);
            out[i] = (half_at(s + 208) * (float)(int8_t)s[192 + 4 * g + b / 16]) * (float)(q - 32);
            continue;
        }
        int q = kind == W_Q4_K ? (s[16 + 32 * (j / 2) + i % 32] >> (4 * (j % 2))) & 15
                               : ((s[48 + 32 * (j / 2) + i % 32] >> (4 * (j % 2))) & 15) |
                                     (((s[16 + i % 32] >> j) & 1) << 4);
        out[i] = fmaf((float)q, dsc[j], -dm[j]);
    }
}

/* weights 8P .. 8P + 7 of the group against the R rows of x (P past the group's parts: nothing) */
#define PSTEP(F, P)                                                                                           \
    if (8 * P < F##_GROUP) {                                                                                  \
        __m256 wv[C_];                                                                                        \
        for (int c = 0; c < C_; c++) {                                                                        \
            F##_AT(c, P);                                                                                     \
            wv[c] = F##_PART(c, P);                                                                           \
        }                                                                                                     \
        for (int r = 0; r < R_; r++) {                                                                        \
            __m256 t = _mm256_loadu_ps(x + r * K + kb + 8 * P);                                               \
            for (int c = 0; c < C_; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], t, acc[r][c]);                    \
        }                                                                                                     \
    }

/* R rows of x against weight rows n .. n + nw - 1 (nw <= C; a short block repeats its first row, unwritten) */
#define PBLOCK(NAME, F, R, C) PBLOCK_T(NAME, F, R, C, )
#define PBLOCK_T(NAME, F, R, C, TARGET)                                                                       \
    TARGET static void NAME(const float *x, const packed_t *w, float *y, long N, long K, long n, int nw) {    \
        enum { R_ = R, C_ = C };                                                                              \
        F##_DECL                                                                                              \
        __m256 acc[R][C];                                                                                     \
        long row[C];                                                                                          \
        for (int c = 0; c < C; c++) {                                                                         \
            row[c] = n + (c < nw ? c : 0);                                                                    \
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_setzero_ps();                                      \
        }                                                                                                     \
        for (long kb = 0; kb < K; kb += F##_GROUP) {                                                          \
            for (int c = 0; c < C; c++) F##_SETUP(c);                                                         \
            PSTEP(F, 0) PSTEP(F, 1) PSTEP(F, 2) PSTEP(F, 3) PSTEP(F, 4) PSTEP(F, 5) PSTEP(F, 6) PSTEP(F, 7)   \
        }                                                                                                     \
        for (int r = 0; r < R; r++)                                                                           \
            for (int c = 0; c < nw; c++) y[r * N + n + c] = hsum8(acc[r][c]);                                 \
    }

/* With AVX-512 (where the CPU has it): two weight rows in one 16-lane register, row 2c in the low half and row
 * 2c + 1 in the high half, each expanded as above, against x's 8 columns broadcast to both halves. Each half is the
 * AVX2 block's 8-lane sum of its row, with the same operations lane by lane and the same hsum: the same bits at half
 * the instructions (expanding a weight, not reading it, is what bounds a step of one row: five vector operations a
 * weight). ZF_SETUP(c) reads group ``kb / GROUP`` of the pair's rows, ZF_PART(c, P) gives their weights 8P .. 8P + 7. */
#define ZSCALE(ptr, b0, b1) _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_broadcast_ss((ptr) + (b0))), \
                                               _mm256_broadcast_ss((ptr) + (b1)), 1)
#define ZH16_DECL                                                                                             \
    const uint16_t *h16 = (const uint16_t *)w->q;                                                             \
    const uint16_t *hp[C_][2];
#define ZH16_SETUP(c)                                                                                         \
    hp[c][0] = h16 + row[c][0] * K + kb, hp[c][1] = h16 + row[c][1] * K + kb, H16_PREFETCH(hp[c][0]),            \
    H16_PREFETCH(hp[c][1])
#define ZH16_LOAD(c, P)                                                                                       \
    _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(hp[c][0] + 8 * P))),    \
                            _mm_loadu_si128((const __m128i *)(hp[c][1] + 8 * P)), 1)
#define ZBF16_DECL ZH16_DECL
#define ZBF16_SETUP(c) ZH16_SETUP(c)
#define ZBF16_PART(c, P) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ZH16_LOAD(c, P)), 16))
#define ZF16_DECL ZH16_DECL
#define ZF16_SETUP(c) ZH16_SETUP(c)
#define ZF16_PART(c, P) _mm512_cvtph_ps(ZH16_LOAD(c, P))
#define ZQ8_0_DECL                                                                                            \
    const int8_t *codes = (const int8_t *)w->q;                                                               \
    const float *dp = (const float *)w->d;                                                                    \
    const int8_t *at[C_][2];                                                                                  \
    __m512 dz[C_];
#define ZQ8_0_SETUP(c)                                                                                        \
    do {                                                                                                      \
        long b0 = (row[c][0] * K + kb) / 32, b1 = (row[c][1] * K + kb) / 32;                                  \
        at[c][0] = codes + b0 * 32, at[c][1] = codes + b1 * 32;                                               \
        _mm_prefetch((const char *)(at[c][0] + 32 * AHEAD_Q8), _MM_HINT_T0);                                  \
        _mm_prefetch((const char *)(at[c][1] + 32 * AHEAD_Q8), _MM_HINT_T0);                                  \
        dz[c] = ZSCALE(dp, b0, b1);                                                                           \
    } while (0)
#define ZQ8_0_PART(c, P)                                                                                      \
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(                                 \
                      _mm_loadl_epi64((const __m128i *)(at[c][0] + 8 * P)),                                   \
                      _mm_loadl_epi64((const __m128i *)(at[c][1] + 8 * P))))),                                \
                  dz[c])
#define ZBF16_AT(c, P)
#define ZF16_AT(c, P)
#define ZQ8_0_AT(c, P)
/* The 4-bit formats by lookup in 16 lanes: each weight row's 16 possible values in one 16-lane table (computed with
 * the expansion's own operations, as LQ4's), the pair's two tables one two-table permute apart: lane j of the low
 * half (row 2c) takes the value of its code (bits 0-3), of the high half (row 2c + 1) that of its code + 16 (the
 * second table), the code masked and tagged in one operation. Three vector operations per 16 weights (shift,
 * mask-and-tag, permute) where the 8-lane lookup takes four, and half the multiply-adds. */
/* a lookup's 16 codes in order, the mask of a code, the second table's tag, and the pairs' tables */
#define ZLUT_DECL                                                                                             \
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);                 \
    const __m512i low = _mm512_set1_epi32(0x0F);                                                              \
    const __m512i tag = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);            \
    __m512 tab[C_][2];
#define ZLQ4_DECL                                                                                             \
    const __m256i *words = (const __m256i *)w->q;                                                             \
    const float *dp = (const float *)w->d, *mp = (const float *)w->m;                                         \
    ZLUT_DECL                                                                                                 \
    __m512i code[C_];                                                                                         \
    long blk[C_][2];                                                                                          \
    (void)mp;
#define ZLQ4_SETUP(c)                                                                                         \
    do {                                                                                                      \
        long g0 = (row[c][0] * K + kb) / 64, g1 = (row[c][1] * K + kb) / 64;                                  \
        blk[c][0] = 2 * g0, blk[c][1] = 2 * g1;                                                               \
        code[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(words + g0)),                  \
                                     _mm256_loadu_si256(words + g1), 1);                                      \
        for (int h = 0; h < 2; h++) {                                                                         \
            long g = h ? g1 : g0;                                                                             \
            _mm_prefetch((const char *)(words + g + AHEAD_GROUPS), _MM_HINT_T0);                              \
            _mm_prefetch((const char *)(dp + 2 * g + 2 * AHEAD_GROUPS), _MM_HINT_T0);                         \
            if (mp) _mm_prefetch((const char *)(mp + 2 * g + 2 * AHEAD_GROUPS), _MM_HINT_T0);                 \
        }                                                                                                     \
    } while (0)
#define ZLQ4_AT(c, P, VALUES)                                                                                 \
    if (P % 4 == 0) tab[c][0] = VALUES(blk[c][0] + P / 4), tab[c][1] = VALUES(blk[c][1] + P / 4)
/* 0xEA: (code & low) | tag */
#define ZLQ4_PART(c, P)                                                                                       \
    _mm512_permutex2var_ps(                                                                                   \
        tab[c][0], _mm512_ternarylogic_epi32(P ? _mm512_srli_epi32(code[c], 4 * P) : code[c], low, tag, 0xEA), \
        tab[c][1])
#define ZLQ4_0_DECL ZLQ4_DECL
#define ZLQ4_0_SETUP(c) ZLQ4_SETUP(c)
#define ZLQ4_0_VALUES(b) _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), _mm512_set1_ps(dp[b]))
#define ZLQ4_0_AT(c, P) ZLQ4_AT(c, P, ZLQ4_0_VALUES)
#define ZLQ4_0_PART(c, P) ZLQ4_PART(c, P)
#define ZLQ4_1_DECL ZLQ4_DECL
#define ZLQ4_1_SETUP(c) ZLQ4_SETUP(c)
#define ZLQ4_1_VALUES(b) _mm512_fmadd_ps(iota, _mm512_set1_ps(dp[b]), _mm512_set1_ps(mp[b]))
#define ZLQ4_1_AT(c, P) ZLQ4_AT(c, P, ZLQ4_1_VALUES)
#define ZLQ4_1_PART(c, P) ZLQ4_PART(c, P)
/* The K-quants, two weight rows a register: each row's super-block, scales and codes as above (KQ_SETUP's), the
 * pair's values side by side. q4_k by lookup as ZLQ4 (a sub-block's 16 values, by row, with the expansion's own fused
 * multiply-subtract), q6_k sign-extended and scaled as Q6_K_PART, 16 lanes at once. */
#define ZKQ_DECL                                                                                              \
    const uint8_t *blocks = (const uint8_t *)w->q;                                                            \
    int zg = 0; /* the group's place in its super-block (0..3) */
/* the super-block of group kb / 64 of row h of pair c as ``zs``, prefetched ahead */
#define ZKQ_BLOCK(c, h, BYTES)                                                                                \
    const uint8_t *zs = blocks + ((row[c][h] * K + kb) / QK) * (BYTES);                                       \
    _mm_prefetch((const char *)(zs + 64 * zg + AHEAD_KQ), _MM_HINT_T0)
/* q4_k and q5_k, two rows a register: each row's super-block, its scales at its first group, then ``CODES``
 * (where the group's codes lie) */
#define ZKQ_SCALED_DECL                                                                                       \
    ZKQ_DECL                                                                                                  \
    const uint8_t *qs[C_][2];                                                                                 \
    float dsc[C_][2][8], dm[C_][2][8];
#define ZKQ_SCALED_SETUP(c, BYTES, CODES)                                                                     \
    do {                                                                                                      \
        zg = (int)(kb % QK) / 64;                                                                             \
        for (int h = 0; h < 2; h++) {                                                                         \
            ZKQ_BLOCK(c, h, BYTES);                                                                           \
            if (zg == 0) kq_scales(zs, dsc[c][h], dm[c][h]);                                                  \
            CODES;                                                                                            \
        }                                                                                                     \
    } while (0)
#define ZLQ4_K_DECL                                                                                           \
    ZKQ_SCALED_DECL                                                                                           \
    ZLUT_DECL
#define ZLQ4_K_SETUP(c) ZKQ_SCALED_SETUP(c, Q4_K_BYTES, qs[c][h] = zs + 16 + 32 * zg)
#define ZLQ4_K_AT(c, P)                                                                                       \
    if (P % 4 == 0)                                                                                           \
        for (int h = 0; h < 2; h++)                                                                           \
            tab[c][h] = _mm512_fmsub_ps(iota, _mm512_set1_ps(dsc[c][h][2 * zg + P / 4]),                      \
                                        _mm512_set1_ps(dm[c][h][2 * zg + P / 4]))
/* the bytes of part P's codes (both nibbles; the high ones moved down at P >= 4), row 0's 8 then row 1's */
#define ZKQ_BYTES(c, P)                                                                                       \
    _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(qs[c][0] + 8 * (P % 4))),       \
                                            _mm_loadl_epi64((const __m128i *)(qs[c][1] + 8 * (P % 4)))))
#define ZLQ4_K_PART(c, P)                                                                                     \
    _mm512_permutex2var_ps(                                                                                   \
        tab[c][0],                                                                                            \
        _mm512_ternarylogic_epi32(P < 4 ? ZKQ_BYTES(c, P) : _mm512_srli_epi32(ZKQ_BYTES(c, P), 4), low, tag, 0xEA), \
        tab[c][1])
/* both halves of a pair's register: a of row 2c, b of row 2c + 1 */
#define ZPAIR(a, b) _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1)
#define ZQ6_K_DECL                                                                                            \
    ZKQ_DECL                                                                                                  \
    float dsc[C_][2][16];                                                                                     \
    __m256i q8[C_][2][2];
#define ZQ6_K_SETUP(c)                                                                                        \
    do {                                                                                                      \
        zg = (int)(kb % QK) / 64;                                                                             \
        for (int h = 0; h < 2; h++) {                                                                         \
            ZKQ_BLOCK(c, h, Q6_K_BYTES);                                                                      \
            if (zg == 0) q6_scales(zs, dsc[c][h]);                                                            \
            q6_group(zs, zg, q8[c][h]);                                                                       \
        }                                                                                                     \
    } while (0)
#define ZQ6_K_AT(c, P)
/* the 16 bytes that hold part P of row h's codes (Q6_K_LANE's) */
#define ZQ6_K_LANE(c, h, P)                                                                                   \
    (P % 4 < 2 ? _mm256_castsi256_si128(q8[c][h][P / 4]) : _mm256_extracti128_si256(q8[c][h][P / 4], 1))
#define ZQ6_K_PART(c, P)                                                                                      \
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                                    \
                      P % 2 ? _mm_unpackhi_epi64(ZQ6_K_LANE(c, 0, P), ZQ6_K_LANE(c, 1, P))                    \
                            : _mm_unpacklo_epi64(ZQ6_K_LANE(c, 0, P), ZQ6_K_LANE(c, 1, P)))),                 \
                  ZPAIR(dsc[c][0][4 * zg + P / 2], dsc[c][1][4 * zg + P / 2]))
/* q5_k as q5_k's own parts (Q5_K_PART: a 4-bit code, its fifth bit above it, one fused multiply-subtract), the
 * pair's 16 codes and both rows' scales side by side */
#define ZQ5_K_DECL                                                                                            \
    ZKQ_SCALED_DECL                                                                                           \
    const __m512i low = _mm512_set1_epi32(0x0F), one = _mm512_set1_epi32(1);                                  \
    const uint8_t *qh[C_][2];
#define ZQ5_K_SETUP(c) ZKQ_SCALED_SETUP(c, Q5_K_BYTES, (qh[c][h] = zs + 16, qs[c][h] = zs + 48 + 32 * zg))
#define ZQ5_K_AT(c, P)
/* the bytes that hold part P's fifth bits (bit 2 zg + P / 4 of each), row 0's 8 then row 1's */
#define ZQ5_K_HIGH(c, P)                                                                                      \
    _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(qh[c][0] + 8 * (P % 4))),       \
                                            _mm_loadl_epi64((const __m128i *)(qh[c][1] + 8 * (P % 4)))))
#define ZQ5_K_CODES(c, P)                                                                                     \
    _mm512_or_si512(                                                                                          \
        _mm512_and_si512(P < 4 ? ZKQ_BYTES(c, P) : _mm512_srli_epi32(ZKQ_BYTES(c, P), 4), low),               \
        _mm512_slli_epi32(                                                                                    \
            _mm512_and_si512(_mm512_srl_epi32(ZQ5_K_HIGH(c, P), _mm_cvtsi32_si128(2 * zg + P / 4)), one), 4))
#define ZQ5_K_PART(c, P)                                                                                      \
    _mm512_fmsub_ps(_mm512_cvtepi32_ps(ZQ5_K_CODES(c, P)),                                                    \
                    ZPAIR(dsc[c][0][2 * zg + P / 4], dsc[c][1][2 * zg + P / 4]),                              \
                    ZPAIR(dm[c][0][2 * zg + P / 4], dm[c][1][2 * zg + P / 4]))
#define ZSTEP(F, P)                                                                                           \
    if (8 * P < F##_GROUP) {                                                                                  \
        __m512 wv[C_];                                                                                        \
        for (int c = 0; c < C_; c++) {                                                                        \
            Z##F##_AT(c, P);                                                                                  \
            wv[c] = Z##F##_PART(c, P);                                                                        \
        }                                                                                                     \
        for (int r = 0; r < R_; r++) {                                                                        \
            __m512 t = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * K + kb + 8 * P));                       \
            for (int c = 0; c < C_; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], t, acc[r][c]);                    \
        }                                                                                                     \
    }

/* R rows of x against weight rows n .. n + nw - 1 in C pairs (nw <= 2C; a short block repeats row n, unwritten) */
#define ZPBLOCK(NAME, F, R, C)                                                                                \
    __attribute__((target("avx512f,avx512dq"))) static void NAME(const float *x, const packed_t *w, float *y, \
                                                                 long N, long K, long n, int nw) {            \
        enum { R_ = R, C_ = C };                                                                              \
        Z##F##_DECL                                                                                           \
        __m512 acc[R][C];                                                                                     \
        long row[C][2];                                                                                       \
        for (int c = 0; c < C; c++) {                                                                         \
            for (int h = 0; h < 2; h++) row[c][h] = n + (2 * c + h < nw ? 2 * c + h : 0);                     \
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_setzero_ps();                                      \
        }                                                                                                     \
        for (long kb = 0; kb < K; kb += F##_GROUP) {                                                          \
            for (int c = 0; c < C; c++) Z##F##_SETUP(c);                                                      \
            ZSTEP(F, 0) ZSTEP(F, 1) ZSTEP(F, 2) ZSTEP(F, 3) ZSTEP(F, 4) ZSTEP(F, 5) ZSTEP(F, 6) ZSTEP(F, 7)   \
        }                                                                                                     \
        for (int r = 0; r < R; r++)                                                                           \
            for (int c = 0; c < C; c++) {                                                                     \
                if (2 * c < nw) y[r * N + n + 2 * c] = hsum8(_mm512_castps512_ps256(acc[r][c]));              \
                if (2 * c + 1 < nw) y[r * N + n + 2 * c + 1] = hsum8(_mm512_extractf32x8_ps(acc[r][c], 1));   \
            }                                                                                                 \
    }

/* Whether this CPU runs a 512-bit multiply-add at full width: every AVX-512 CPU but AMD's Zen 4 (family 0x19), which
 * runs it as two 256-bit halves, so that there the 16-lane blocks cost what they save (measured on Zen 4: 5-8 rows
 * of x 1.15-1.35x slower than the AVX2 blocks) */
static int full_width_cpu(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    int amd = b == 0x68747541; /* "Auth" of "AuthenticAMD" */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned family = ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
    return !(amd && family == 0x19);
}

static int use_full = -1; /* -1: not asked yet */

/* Use the 16-lane blocks at every row count of x (1), the blocks chosen for half-width CPUs (0), or only ask (-1);
 * returns whether the full-width blocks are used (with AVX-512 on). For tests: every kind gives the same bits. */
int packed_full_width(int on) {
    if (on >= 0) use_full = on;
    if (use_full < 0) use_full = full_width_cpu();
    return use_full;
}

/* one block of rows of x: R rows against C weight rows at a time (nw <= C of them) */
typedef void (*block_t)(const float *x, const packed_t *w, float *y, long N, long K, long n, int nw);
typedef struct {
    block_t run;
    int C;
} kind_t;

/* F's blocks by row count r (1-8) in each kind: AVX2, and with AVX-512 where a block there is faster (else none) */
#define PBLOCKS_AVX2(F)                                                                                       \
    PBLOCK(F##_r1, F, 1, R1C)                                                                                 \
    PBLOCK(F##_r2, F, 2, R1C)                                                                                 \
    PBLOCK(F##_r3, F, 3, 2)                                                                                   \
    PBLOCK(F##_r4, F, 4, 2)                                                                                   \
    PBLOCK(F##_r5, F, 5, 1)                                                                                   \
    PBLOCK(F##_r6, F, 6, 1)                                                                                   \
    PBLOCK(F##_r7, F, 7, 1)                                                                                   \
    PBLOCK(F##_r8, F, 8, 1)                                                                                   \
    static const kind_t F##_avx2[9] = {{0, 0},         {F##_r1, R1C}, {F##_r2, R1C}, {F##_r3, 2}, {F##_r4, 2}, \
                                       {F##_r5, 1},    {F##_r6, 1},   {F##_r7, 1},   {F##_r8, 1}};
/* the 16-bit and 8-bit formats: the 16-lane kind at 1 and 4 rows of x, where it measured 0.83-0.85x the AVX2 blocks'
 * time on a CPU that runs 512-bit operations as two halves (AMD Zen 4); 2-3 rows measured even, 5-8 rows 1.15-1.35x
 * slower there (the x broadcasts cost what the halved expansion saves) */
#define PBLOCKS(F)                                                                                            \
    PBLOCKS_AVX2(F)                                                                                           \
    ZPBLOCK(Z##F##_r1, F, 1, ZR1C)                                                                            \
    ZPBLOCK(Z##F##_r4, F, 4, 2)                                                                               \
    static const kind_t F##_wide[9] = {[1] = {Z##F##_r1, 2 * ZR1C}, [4] = {Z##F##_r4, 4}};
/* the 4-bit formats: lookups at 1-5 rows of x, against 4, 3, 2, 2, 2 weight rows a block. Over the default model's
 * q4_1 MLP matrices in cache on Zen 4, against the blocks used before (the 16-lane kind at 1 and 4 rows, AVX2 at 2, 3,
 * 5): 0.82x the time at 1 row (against 2 weight rows: 1.1x; 3: 1.04x; 6: 1.4x, registers spill), 0.84x at 2, even at
 * 3, 0.90x at 4, 0.86x at 5; even at 6 and 1.06x at 8 (so 6-8 rows keep the AVX2 blocks) */
#define LTARGET __attribute__((target("avx512f,avx512vl")))
#define WTARGET __attribute__((target("avx512f,avx512dq,avx512vl")))
#define PBLOCKS4(F)                                                                                           \
    PBLOCKS_AVX2(F)                                                                                           \
    PBLOCK_T(L##F##_r1, L##F, 1, 4, LTARGET)                                                                  \
    PBLOCK_T(L##F##_r2, L##F, 2, 3, LTARGET)                                                                  \
    PBLOCK_T(L##F##_r3, L##F, 3, 2, LTARGET)                                                                  \
    PBLOCK_T(L##F##_r4, L##F, 4, 2, LTARGET)                                                                  \
    PBLOCK_T(L##F##_r5, L##F, 5, 2, LTARGET)                                                                  \
    static const kind_t F##_wide[9] = {[1] = {L##F##_r1, 4}, [2] = {L##F##_r2, 3}, [3] = {L##F##_r3, 2},      \
                                       [4] = {L##F##_r4, 2}, [5] = {L##F##_r5, 2}};

/* On CPUs that run 512-bit multiply-adds at full width (``packed_full_width``), 16-lane blocks at every row count of
 * x: R rows against C pairs of weight rows, R x C sums in registers. Half the multiply-adds of the 8-lane blocks
 * (and for the 4-bit formats fewer operations to expand a weight). On a 2-core Zen 5 EPYC, every packed linear of
 * the default model's layers (q4_1, weights from memory, 2 threads), against the blocks chosen for Zen 4: 1 row 0.8x
 * the time, 2 0.78x, 4 0.72x, 6 0.59x, 8 0.62x; its q8_0 head 0.75x at 2 rows, 0.6x at 6, 0.73x at 8. C measured
 * per R (2-4 pairs at 1-4 rows, 1-3 at 5-8): 3 pairs at 1-2 rows, 2 at 3-8, the fastest or within noise of it. */
#define ZFULL(F)                                                                                              \
    ZPBLOCK(F##_z1, F, 1, 3)                                                                                  \
    ZPBLOCK(F##_z2, F, 2, 3)                                                                                  \
    ZPBLOCK(F##_z3, F, 3, 2)                                                                                  \
    ZFROM4(F)                                                                                                 \
    static const kind_t F##_full[9] = {{0, 0}, {F##_z1, 6}, {F##_z2, 6}, {F##_z3, 4}, ZFROM4_KINDS(F)};
/* the blocks of 4-8 rows (2 pairs each), and their entries of a table */
#define ZFROM4(F)                                                                                             \
    ZPBLOCK(F##_z4, F, 4, 2)                                                                                  \
    ZPBLOCK(F##_z5, F, 5, 2)                                                                                  \
    ZPBLOCK(F##_z6, F, 6, 2)                                                                                  \
    ZPBLOCK(F##_z7, F, 7, 2)                                                                                  \
    ZPBLOCK(F##_z8, F, 8, 2)
#define ZFROM4_KINDS(F) {F##_z4, 4}, {F##_z5, 4}, {F##_z6, 4}, {F##_z7, 4}, {F##_z8, 4}
/* The same for the K-quants (q4_k by lookup, q6_k) from 4 rows; at 1-3 rows their own kinds (B1-B3, of C1-C3 weight
 * rows). Gemma 3 270M's K-quant layers (2 threads, weights from memory), pair blocks against those: 1 row even, 2
 * rows 1.04x the time; at 4 rows 0.85x, 8 rows 0.89x, 16 rows 0.92x (against the AVX2 blocks, expanding once) */
#define ZFULL_KQ(F, B1, C1, B2, C2, B3, C3)                                                                   \
    ZFROM4(F)                                                                                                 \
    static const kind_t F##_full[9] = {{0, 0}, {B1, C1}, {B2, C2}, {B3, C3}, ZFROM4_KINDS(F)};
PBLOCKS(BF16)
PBLOCKS(F16)
PBLOCKS(Q8_0)
PBLOCKS4(Q4_0)
PBLOCKS4(Q4_1)
ZFULL(LQ4_0)
ZFULL(LQ4_1)
ZFULL(Q8_0)
ZFULL(BF16)
ZFULL(F16)
/* q4_k: lookups at 1-3 rows of x, against 4, 4, 3 weight rows a block: in 8 lanes at 1 row, in 16 at 2-3 (Gemma 3
 * 270M's matrices in cache on Zen 4, against the AVX2 blocks: 0.77x the time at 1 row (16 lanes: 1.02x that), 0.8x
 * at 2 (8 lanes: 0.92x), 0.9x at 3; 4-5 rows even, where the AVX2 blocks stay) */
PBLOCKS_AVX2(Q4_K)
PBLOCK_T(LQ4_K_r1, LQ4_K, 1, 4, LTARGET)
PBLOCK_T(LQ4_K16_r2, LQ4_K16, 2, 4, WTARGET)
PBLOCK_T(LQ4_K16_r3, LQ4_K16, 3, 3, WTARGET)
static const kind_t Q4_K_wide[9] = {[1] = {LQ4_K_r1, 4}, [2] = {LQ4_K16_r2, 4}, [3] = {LQ4_K16_r3, 3}};
PBLOCKS_AVX2(Q5_K)
/* q6_k: two parts a register at 1-3 rows of x, against 2, 4, 3 weight rows (Gemma 3 270M's down projections in
 * cache on Zen 4: 0.92x, 0.89x, 0.97x the AVX2 blocks' time; 4 rows even, where the AVX2 blocks stay) */
PBLOCKS_AVX2(Q6_K)
PBLOCK_T(WQ6_K_r1, WQ6_K, 1, 2, WTARGET)
PBLOCK_T(WQ6_K_r2, WQ6_K, 2, 4, WTARGET)
PBLOCK_T(WQ6_K_r3, WQ6_K, 3, 3, WTARGET)
static const kind_t Q6_K_wide[9] = {[1] = {WQ6_K_r1, 2}, [2] = {WQ6_K_r2, 4}, [3] = {WQ6_K_r3, 3}};
ZFULL_KQ(LQ4_K, LQ4_K_r1, 4, LQ4_K16_r2, 4, LQ4_K16_r3, 3)
ZFULL_KQ(Q6_K, WQ6_K_r1, 2, WQ6_K_r2, 4, WQ6_K_r3, 3)
/* q5_k in pairs at every row count (the matrices of Q5_K_EXPAND_ROWS, weights from memory, against the AVX2 blocks:
 * 1 row 0.89x the time, 2 rows 0.78x, 3 rows 0.70x, 4-8 rows 0.62-0.66x) */
ZFULL(Q5_K)
static const kind_t KQ_wide[9]; /* q5_k on half-width CPUs: the AVX2 blocks at every row count */

/* Rows of x from which a chunk of weight rows is expanded once, into fp32 in a buffer of the thread's, and then read
 * by skinny.c's fp32 kernel against every row of x; below it, the blocks above expand each weight again for every 8
 * rows of x (five vector operations a weight, against one multiply-add a row). The same values, summed in the same
 * order: the same bits. The default model's q4_1 up projection on Zen 4 at 2 threads, expanded once against the
 * blocks: 9 rows 0.8x the time, 16 rows 0.75-0.8x, 32 rows 0.7-0.85x, 64 rows 0.6x; 4-8 rows even or slower. */
#define EXPAND_ROWS 9
/* q5_k's pair blocks against expanding once (16 q5_k matrices of 2048 x 1024 and 1024 x 2048, 23 MB, 2 threads, Zen
 * 5): 12 rows 0.93x the time, 16 rows 0.90x, 20 rows 1.12x, 24 rows 1.06x, 32 rows 1.16x: up to two blocks of 8 */
#define Q5_K_EXPAND_ROWS 17

/* weights 8P .. 8P + 7 of the group of weight row ``row[0]``, stored at o + kb + 8P */
#define XSTEP(F, P)                                                                                           \
    if (8 * P < F##_GROUP) {                                                                                  \
        F##_AT(0, P);                                                                                         \
        _mm256_storeu_ps(o + kb + 8 * P, F##_PART(0, P));                                                     \
    }
/* weight rows n0 .. n1 - 1 of F as fp32 into out [n1 - n0, K], with the blocks' own expansion (F_SETUP, F_PART) */
#define PEXPAND(F)                                                                                            \
    static void F##_expand(const packed_t *w, long K, long n0, long n1, float *out) {                         \
        enum { C_ = 1 };                                                                                      \
        F##_DECL                                                                                              \
        long row[1];                                                                                          \
        for (long n = n0; n < n1; n++) {                                                                      \
            float *o = out + (n - n0) * K;                                                                    \
            row[0] = n;                                                                                       \
            for (long kb = 0; kb < K; kb += F##_GROUP) {                                                      \
                F##_SETUP(0);                                                                                 \
                XSTEP(F, 0) XSTEP(F, 1) XSTEP(F, 2) XSTEP(F, 3) XSTEP(F, 4) XSTEP(F, 5) XSTEP(F, 6) XSTEP(F, 7) \
            }                                                                                                 \
        }                                                                                                     \
    }
PEXPAND(BF16)
PEXPAND(F16)
PEXPAND(Q8_0)
PEXPAND(Q4_0)
PEXPAND(Q4_1)
PEXPAND(Q4_K)
PEXPAND(Q5_K)
PEXPAND(Q6_K)

/* weight rows n0 .. n1 - 1 of ``w`` (not fp32) as fp32 into out [n1 - n0, K], as the kernel's registers hold them */
static void expand_chunk(const packed_t *w, long K, long n0, long n1, float *out) {
    switch (w->kind) {
        case W_BF16: BF16_expand(w, K, n0, n1, out); break;
        case W_F16: F16_expand(w, K, n0, n1, out); break;
        case W_Q8_0: Q8_0_expand(w, K, n0, n1, out); break;
        case W_Q4_0: Q4_0_expand(w, K, n0, n1, out); break;
        case W_Q4_K: Q4_K_expand(w, K, n0, n1, out); break;
        case W_Q5_K: Q5_K_expand(w, K, n0, n1, out); break;
        case W_Q6_K: Q6_K_expand(w, K, n0, n1, out); break;
        default: Q4_1_expand(w, K, n0, n1, out); break;
    }
}

/* rows n0 .. n1 - 1 of y = x @ w^T, x's rows in the fewest blocks of at most 8, of sizes that differ by at most
 * one (9 rows as 5 + 4: a block of 1 after one of 8 reads and expands the weights again for one row; a verification
 * of 8 rows and 1-3 drafts measured 0.93-0.97x the time of 8 + the rest); with ``z`` (AVX-512), in the wide kind
 * where the format has a block of that many rows */
static void rows_of(const float *x, const packed_t *w, float *y, long M, long N, long K, long n0, long n1, int z) {
    const kind_t *avx2, *wide;
    int full = z && packed_full_width(-1);
    switch (w->kind) {
        case W_BF16: avx2 = BF16_avx2, wide = full ? BF16_full : BF16_wide; break;
        case W_F16: avx2 = F16_avx2, wide = full ? F16_full : F16_wide; break;
        case W_Q8_0: avx2 = Q8_0_avx2, wide = full ? Q8_0_full : Q8_0_wide; break;
        case W_Q4_0: avx2 = Q4_0_avx2, wide = full ? LQ4_0_full : Q4_0_wide; break;
        case W_Q4_K: avx2 = Q4_K_avx2, wide = full ? LQ4_K_full : Q4_K_wide; break;
        case W_Q5_K: avx2 = Q5_K_avx2, wide = full ? Q5_K_full : KQ_wide; break;
        case W_Q6_K: avx2 = Q6_K_avx2, wide = full ? Q6_K_full : Q6_K_wide; break;
        default: avx2 = Q4_1_avx2, wide = full ? LQ4_1_full : Q4_1_wide; break;
    }
    long blocks = (M + 7) / 8, r;
    for (long b = 0, m = 0; m < M; m += r, b++) {
        r = M / blocks + (b < M % blocks);
        kind_t k = z && wide[r].run ? wide[r] : avx2[r];
        for (long n = n0; n < n1; n += k.C) k.run(x + m * K, w, y + m * N, N, K, n, n1 - n < k.C ? (int)(n1 - n) : k.C);
    }
}

/* Whether ``w``'s chunks are expanded once for M rows of x (EXPAND_ROWS): not where the full-width 16-lane blocks
 * run, which expand each weight again for every 8 rows of x and still take less time (on Zen 5, 2 threads, against
 * expanding once at 9-96 rows: the default model's q4_1 layers 0.67-0.84x, Gemma 3 270M's q4_k, q6_k and q8_0 layers
 * 0.77-0.91x at 9-64 rows), but for q5_k from Q5_K_EXPAND_ROWS: its expansion costs more than a lookup */
static int expands(const packed_t *w, long M, int full) {
    return full ? w->kind == W_Q5_K && M >= Q5_K_EXPAND_ROWS : M >= EXPAND_ROWS;
}

/* y_i = x @ w[i]^T for ``count`` weights that share x [M, K] (ys[i]: [M, Ns[i]]; K a multiple of 32, of 64 for the
 * 4-bit formats, of 256 for the K-quants), with skinny_linear's bits, by the threads of the enclosing parallel region:
 * each of them calls it, and it returns when every output is written. The weights' rows go to the threads in chunks,
 * all the weights' in one loop: one barrier for them all, where a parallel region each cost a start and an end
 * (``layer.c`` runs a layer in one region: decode 1.02-1.05x as fast at 1-8 rows on 2 cores). ``xi``: a pointer
 * shared by the team, for fp32 weights' interleaved x (``skinny_scratch``). */
void packed_linears(const float *x, const packed_t *w, float *const *ys, const long *Ns, int count, long M, long K,
                    float **xi) {
    long chunks = 0;
    int z = skinny_avx512(-1), full = z && packed_full_width(-1), fp32 = 0, expand = 0;
    for (int i = 0; i < count; i++) {
        chunks += (Ns[i] + CHUNK - 1) / CHUNK;
        int once = expands(&w[i], M, full);
        expand |= once;
        fp32 |= w[i].kind == W_F32 || once;
    }
    if (fp32) {
        #pragma omp single
        *xi = skinny_scratch(x, M, K);
    }
    /* this thread's expanded chunk (without the memory, the blocks: the same bits) */
    float *wx = expand ? malloc(sizeof(float) * CHUNK * K) : NULL;
    #pragma omp for schedule(static)
    for (long t = 0; t < chunks; t++) {
        int i = 0;
        long c = t, n;
        while (c >= (n = (Ns[i] + CHUNK - 1) / CHUNK)) c -= n, i++;
        long n0 = c * CHUNK, n1 = n0 + CHUNK < Ns[i] ? n0 + CHUNK : Ns[i];
        if (w[i].kind == W_F32)
            skinny_rows(x, *xi, 1, (const float *)w[i].q, ys[i], M, Ns[i], K, n0, n1);
        else if (wx && expands(&w[i], M, full)) {
            expand_chunk(&w[i], K, n0, n1, wx);
            skinny_rows(x, *xi, 1, wx, ys[i] + n0, M, Ns[i], K, 0, n1 - n0);
        } else
            rows_of(x, &w[i], ys[i], M, Ns[i], K, n0, n1, z);
    }
    free(wx);
    if (fp32) {
        #pragma omp single
        free(*xi);
    }
}

/* rows n0 .. n1 - 1 of y = x @ w^T (y [M, N]), in the calling thread: the bits ``packed_linears`` gives them */
void packed_rows(const float *x, const packed_t *w, float *y, long M, long N, long K, long n0, long n1) {
    rows_of(x, w, y, M, N, K, n0, n1, skinny_avx512(-1));
}

/* y = x @ w^T for x [M, K], in a parallel region of its own. Returns 0. */
int packed_linear(const float *x, const packed_t *w, float *y, long M, long N, long K) {
    float *xi = NULL;
    #pragma omp parallel
    packed_linears(x, w, &y, &N, 1, M, K, &xi);
    return 0;
}

/* the value of weight i (0..31) of block b of a block format: exactly what the kernel's registers hold */
static inline float value(long kind, const void *q, const float *d, const float *m, long b, int i) {
    int p = i / 8, j = i % 8;
    float dv = d[b];
    if (kind == W_Q8_0) return (float)((const int8_t *)q)[b * 32 + i] * dv;
    int c = (((const uint32_t *)q)[(b / 2) * 8 + j] >> (4 * (p + 4 * (b % 2)))) & 0x0F;
    return kind == W_Q4_0 ? ((float)c - 8.0f) * dv : (float)c * dv + m[b];
}

/* Whether rows of K weights of this kind expand through the blocks' own registers (``expand_chunk``: whole groups
 * only), else one value at a time (``expand_rows``; the same values). A prefill forward's expansions, 2 threads:
 * Gemma 3 270M's q4_k / q6_k / q8_0 layers 3.9 ms against 29.8 (a kept prompt's last tokens 1.8x as fast), the
 * default model's q4_1 5.0 against 7.6 ms. */
static int by_blocks(long kind, long K) {
    long group = kind >= W_Q4_K ? QK : kind == W_Q4_0 || kind == W_Q4_1 ? 64 : 32;
    return kind != W_F32 && K % group == 0;
}

/* rows n0 .. n1 - 1 of ``w`` as fp32 into out [n1 - n0, K] */
static void expand_rows(const packed_t *w, long K, long n0, long n1, float *out) {
    long count = (n1 - n0) * K;
    if (w->kind == W_BF16 || w->kind == W_F16) {
        const uint16_t *q = (const uint16_t *)w->q + n0 * K;
        for (long j = 0; j < count; j++) {
            uint32_t bits = (uint32_t)q[j] << 16;
            if (w->kind == W_BF16)
                memcpy(out + j, &bits, 4);
            else
                out[j] = _cvtsh_ss(q[j]);
        }
        return;
    }
    if (w->kind == W_F32) {
        memcpy(out, (const float *)w->q + n0 * K, count * sizeof(float));
        return;
    }
    if (w->kind >= W_Q4_K) {
        long bytes = w->kind == W_Q4_K ? Q4_K_BYTES : w->kind == W_Q5_K ? Q5_K_BYTES : Q6_K_BYTES;
        for (long b = n0 * K / QK; b < n1 * K / QK; b++)
            kq_expand(w->kind, (const uint8_t *)w->q + b * bytes, out + (b - n0 * K / QK) * QK);
        return;
    }
    for (long b = n0 * K / 32; b < n1 * K / 32; b++)
        for (int i = 0; i < 32; i++) out[(b - n0 * K / 32) * 32 + i] = value(w->kind, w->q, w->d, w->m, b, i);
}

/* the whole weight as fp32 into out [N, K] (for forwards over many rows, which run as torch's matrix products) */
void packed_expand(const packed_t *w, long N, long K, float *out) {
    int blocks = by_blocks(w->kind, K);
    #pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 64)
        (blocks ? expand_chunk : expand_rows)(w, K, n0, n0 + 64 < N ? n0 + 64 : N, out + n0 * K);
}

/* rows ids[0 .. n - 1] of the weight as fp32 into out [n, K] (an embedding lookup) */
void packed_gather(const packed_t *w, long K, const int64_t *ids, long n, float *out) {
    int blocks = by_blocks(w->kind, K);
    for (long i = 0; i < n; i++)
        (blocks ? expand_chunk : expand_rows)(w, K, ids[i], ids[i] + 1, out + i * K);
}

/* The codes, scales (and offsets) of one block of 32 fp32 values in a block format such that its expansion gives
 * back every value bit for bit, trying the fp16 scales nearest to the block's estimate (the quantiser rounded its
 * own estimate to fp16). q8_0 also holds a Q5_0 block's values, d * (q - 16) with q 5 bits, whose scale is the
 * farthest value over -16 (the codes most GGUF files of rows not a multiple of 256 long use in place of Q4_K).
 * Returns 1 when found. */
static int find_block(long kind, const float *v, uint8_t *codes, float *d_out, float *m_out) {
    float lo = v[0], hi = v[0], far = v[0];
    for (int i = 1; i < 32; i++) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
        far = fabsf(v[i]) > fabsf(far) ? v[i] : far;
    }
    float m = 0.0f, estimate, qlo, qhi, other = NAN;
    if (kind == W_Q4_1) {
        m = lo;
        if (_cvtsh_ss(_cvtss_sh(m, 0)) != m) return 0;
        estimate = (hi - lo) / 15.0f, qlo = 0.0f, qhi = 15.0f;
    } else if (kind == W_Q8_0) {
        estimate = fmaxf(fabsf(lo), fabsf(hi)) / 127.0f, qlo = -128.0f, qhi = 127.0f, other = far / -16.0f;
    } else {
        estimate = far / -8.0f, qlo = -8.0f, qhi = 7.0f;
    }
    /* the nearest fp16 scale, its neighbours, and the nearest of the other sign (a block of -0.0 in q4_0) */
    static const int steps[] = {0, -1, 1, -2, 2, 0x8000, 0};
    uint16_t h0 = _cvtss_sh(estimate, 0);
    for (int s = 0; s < 7; s++) {
        if (s == 6 && isnan(other)) break;
        uint16_t h = s == 6                 ? _cvtss_sh(other, 0)
                     : steps[s] == 0x8000 ? (uint16_t)(h0 ^ 0x8000)
                                          : (uint16_t)(h0 + steps[s]);
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
            *d_out = d;
            if (m_out) *m_out = m;
            return 1;
        }
    }
    return 0;
}

/* Pack w [N, K] into a block format (K a multiple of 32, of 64 for 4 bits): q the code words laid out as above
 * ([N, K/8] int32 for 4 bits; [N, K] int8 for q8_0), d and m [N, K/32] (fp16 values, as fp32). Returns 0 when every block's expansion
 * gives back its values bit for bit, else -1 (stops at the first block that does not). */
int packed_find(long kind, const float *w, long N, long K, void *codes_out, float *d, float *m) {
    uint32_t *q = codes_out;
    long nb = K / 32;
    int failed = 0;
    #pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        uint8_t codes[32];
        for (long b = n * nb; b < (n + 1) * nb; b++) {
            if (failed) break;
            if (!find_block(kind, w + b * 32, codes, d + b, kind == W_Q4_1 ? m + b : NULL)) {
                #pragma omp atomic write
                failed = 1;
                break;
            }
            if (kind == W_Q8_0) {
                memcpy((int8_t *)q + b * 32, codes, 32);
                continue;
            }
            for (int j = 0; j < 8; j++) {
                uint32_t word = 0;
                for (int p = 0; p < 4; p++) word |= (uint32_t)codes[8 * p + j] << (4 * p);
                if (b % 2 == 0)
                    q[(b / 2) * 8 + j] = word;
                else
                    q[(b / 2) * 8 + j] |= word << 16;
            }
        }
    }
    return failed ? -1 : 0;
}
