/* One Llama decoder layer for a few new tokens per row over a slot cache (fp32, AVX2 + FMA, OpenMP):
 *   h = rmsnorm(x); q, k, v = h Wq^T, h Wk^T, h Wv^T; [hooks(q, k, v)]; rope(q, k); cache[S + i] = k, v
 *   x += attention(q, cache, visible) Wo^T;  x += (silu(rmsnorm(x) Wg^T) * (rmsnorm(x) Wu^T)) Wd^T
 * Rows are b * q + i (row b of the batch, new token i). Query i of row b sees slot s when s <= S + i and
 * visible[b][s], and always its own slot S + i: the same rule as batchspec's attention mask. Each key/value head is
 * read once for all the query heads it serves, and the slots left of a row's first visible one are not read.
 * Elementwise steps follow Hugging Face's Llama in order of operations; sums run in another order, like any change of
 * batch size. Qwen2 and Qwen3 layers are this layer with ``hooks``: q/k/v biases, or RMS norms of each query and key
 * head. Gemma 3's adds norms of the attention's and the MLP's outputs before their residual adds, norm weights kept as
 * offsets from 1, a GELU (tanh) MLP and, on its local layers, a window of the row's last visible tokens. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "packed.h"
#include "vexp.h"

/* out = w * (x / rms(x)); with ``one`` (Gemma's norms, whose weights are offsets from 1), (1 + w) * (x / rms(x)). */
static void rmsnorm(const float *x, const float *w, float *out, long R, long H, float eps, int one) {
    for (long r = 0; r < R; r++) {
        const float *xr = x + r * H;
        float *o = out + r * H;
        double ss = 0.0;
        for (long j = 0; j < H; j++) ss += (double)xr[j] * xr[j];
        float inv = 1.0f / sqrtf((float)(ss / H) + eps);
        if (one)
            for (long j = 0; j < H; j++) o[j] = (1.0f + w[j]) * (xr[j] * inv);
        else
            for (long j = 0; j < H; j++) o[j] = w[j] * (xr[j] * inv);
    }
}

static void rope(float *v, const float *cs, const float *sn, long D) {
    long h = D / 2;
    for (long j = 0; j < h; j++) {
        float x1 = v[j], x2 = v[j + h];
        v[j] = x1 * cs[j] - x2 * sn[j];
        v[j + h] = x2 * cs[j + h] + x1 * sn[j + h];
    }
}

/* The family's steps between a row's projections and its rotary embedding, each skipped where its weight is absent
 * (a NULL ``q``): the q/k/v biases (w[0..2], Qwen2's), added after the products as a biased linear adds them; the RMS
 * norms of each query and key head over its D dimensions (w[3], w[4], Qwen3's). A Llama layer has none of them. */
static void hooks(float *qr, float *kr, float *vr, const packed_t *w, long nh, long nkv, long D, float eps, int one) {
    float *out[3] = {qr, kr, vr};
    long n[3] = {nh * D, nkv * D, nkv * D};
    for (int t = 0; t < 3; t++) {
        const float *bias = w[t].q;
        if (bias)
            for (long j = 0; j < n[t]; j++) out[t][j] += bias[j];
    }
    if (w[3].q) rmsnorm(qr, w[3].q, qr, nh, D, eps, one);
    if (w[4].q) rmsnorm(kr, w[4].q, kr, nkv, D, eps, one);
}

/* o[:64] = sum_t pn[t] V[t, :64] * inv, the sums in eight named registers */
static void values64(const float *pn, long T, const float *V, long vst, __m256 inv, float *o) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (long t = 0; t < T; t++) {
        if (pn[t] == 0.0f) continue;
        __m256 w = _mm256_set1_ps(pn[t]);
        const float *v = V + t * vst;
        a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
        a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
        a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
        a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
        a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4);
        a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
        a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6);
        a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(o, _mm256_mul_ps(a0, inv));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(a1, inv));
    _mm256_storeu_ps(o + 16, _mm256_mul_ps(a2, inv));
    _mm256_storeu_ps(o + 24, _mm256_mul_ps(a3, inv));
    _mm256_storeu_ps(o + 32, _mm256_mul_ps(a4, inv));
    _mm256_storeu_ps(o + 40, _mm256_mul_ps(a5, inv));
    _mm256_storeu_ps(o + 48, _mm256_mul_ps(a6, inv));
    _mm256_storeu_ps(o + 56, _mm256_mul_ps(a7, inv));
}

/* The T scores pn (-inf: hidden, max m) made e^(score - m) in place; returns their sum. */
static float softmax(float *pn, float m, long T) {
    long s = 0;
    float sum = 0.0f, lanes[8];
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    for (; s + 8 <= T; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pn + s), vm));
        _mm256_storeu_ps(pn + s, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    for (int j = 0; j < 8; j++) sum += lanes[j];
    for (; s < T; s++) {
        pn[s] = pn[s] == -INFINITY ? 0.0f : expf(pn[s] - m);
        sum += pn[s];
    }
    return sum;
}

/* o [D] = inv * sum_t pn[t] V[t] (rows of V vst apart) */
static void values(const float *pn, long T, const float *V, long vst, long D, float inv, float *o) {
    __m256 vinv = _mm256_set1_ps(inv);
    long d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values64(pn, T, V + d0, vst, vinv, o + d0);
    for (; d0 < D; d0 += 8) {  /* what is left, 8 dimensions at a time */
        __m256 a = _mm256_setzero_ps();
        for (long t = 0; t < T; t++) a = _mm256_fmadd_ps(_mm256_set1_ps(pn[t]), _mm256_loadu_ps(V + t * vst + d0), a);
        _mm256_storeu_ps(o + d0, _mm256_mul_ps(a, vinv));
    }
}

/* floats of values prefetched ahead of the row being read (a row's keys and values come from memory once a round;
 * with it and the scores' prefetch, 16 rows x 800 slots decoded in ~0.85-0.9x the time) */
#define VALUES_AHEAD 3072
/* ``values`` for C queries at once (weights p, rows T apart; D a multiple of 64), with AVX-512: each value row read
 * once for the C queries, 16 dimensions per register. Every output sums over t in the same order with the same
 * operations as ``values64`` (a slot no query of the C may see is skipped; for one that only some may see, the
 * others add 0 x a finite value: their sums keep their bits), so the bits are the same. */
#define VALUES_Z(NAME, C)                                                                                     \
    __attribute__((target("avx512f"))) static void NAME(const float *p, long T, const float *V, long vst,     \
                                                        long D, const float *inv, float *const *o) {          \
        for (long d0 = 0; d0 < D; d0 += 64) {                                                                \
            __m512 a[C][4];                                                                                   \
            for (int j = 0; j < C; j++)                                                                       \
                for (int u = 0; u < 4; u++) a[j][u] = _mm512_setzero_ps();                                    \
            for (long t = 0; t < T; t++) {                                                                    \
                int any = 0;                                                                                  \
                for (int j = 0; j < C; j++) any |= p[j * T + t] != 0.0f;                                      \
                if (!any) continue;                                                                           \
                const float *v = V + t * vst + d0;                                                            \
                for (int u = 0; u < 4; u++) _mm_prefetch((const char *)(v + VALUES_AHEAD + 16 * u), _MM_HINT_T0); \
                __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),   \
                       v3 = _mm512_loadu_ps(v + 48);                                                          \
                for (int j = 0; j < C; j++) {                                                                 \
                    __m512 w = _mm512_set1_ps(p[j * T + t]);                                                  \
                    a[j][0] = _mm512_fmadd_ps(w, v0, a[j][0]);                                                \
                    a[j][1] = _mm512_fmadd_ps(w, v1, a[j][1]);                                                \
                    a[j][2] = _mm512_fmadd_ps(w, v2, a[j][2]);                                                \
                    a[j][3] = _mm512_fmadd_ps(w, v3, a[j][3]);                                                \
                }                                                                                             \
            }                                                                                                 \
            for (int j = 0; j < C; j++)                                                                       \
                for (int u = 0; u < 4; u++)                                                                   \
                    _mm512_storeu_ps(o[j] + d0 + 16 * u, _mm512_mul_ps(a[j][u], _mm512_set1_ps(inv[j])));     \
        }                                                                                                     \
    }

VALUES_Z(values6z, 6)
VALUES_Z(values3z, 3)

/* Attention scores p[n * N + s] = Q[n] . K[s] for nq queries against N keys (rows D apart, D a multiple of 8) with
 * AVX-512, in skinny.c's order of sums (eight lanes over the dimensions in steps of 8, then ``hsum8``'s pairs), so
 * the bits ``skinny_rows`` gives. A 16-lane register holds two queries (``xi``: rows 2p and 2p+1, interleaved 8
 * dimensions at a time, a zero row after an odd last one) against one key's 8 dimensions broadcast to both halves;
 * a block of P pairs x 8 keys keeps its 8P sums in registers, and their 16P horizontal sums are done together: the
 * same three levels of pairs as ``hsum8`` (l_j + l_(j+4), then 0+2 and 1+3, then 0+1), on shuffled registers (the
 * one-score-at-a-time sums were most of the scores' work at 64 dimensions, and grew with the queries of a
 * verification block). Keys past N (a last, short block) repeat the last key; their scores are not written. */
#define SCORE_KEYS 8
#define SCORE_AHEAD 3072 /* floats of keys prefetched ahead of those being read (skinny.c's distance) */
#define SCORES_Z(NAME, P)                                                                                     \
    __attribute__((target("avx512f,avx512dq"))) static void NAME(const float *xi, long D, const float *K, long N, \
                                                        float *p, long n0, long nr) {                         \
        const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);       \
        long D8 = D / 8;                                                                                      \
        for (long s0 = 0; s0 < N; s0 += SCORE_KEYS) {                                                         \
            const float *kr[SCORE_KEYS];                                                                      \
            for (int c = 0; c < SCORE_KEYS; c++) kr[c] = K + (s0 + c < N ? s0 + c : N - 1) * D;               \
            __m512 acc[P][SCORE_KEYS];                                                                        \
            for (int q = 0; q < P; q++)                                                                       \
                for (int c = 0; c < SCORE_KEYS; c++) acc[q][c] = _mm512_setzero_ps();                        \
            for (long k8 = 0; k8 < D8; k8++) {                                                                \
                __m512 xq[P];                                                                                 \
                for (int q = 0; q < P; q++) xq[q] = _mm512_loadu_ps(xi + (q * D8 + k8) * 16);                 \
                for (int c = 0; c < SCORE_KEYS; c++) {                                                        \
                    if (!(k8 & 1)) _mm_prefetch((const char *)(kr[c] + 8 * k8 + SCORE_AHEAD), _MM_HINT_T0);   \
                    __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(kr[c] + 8 * k8));                      \
                    for (int q = 0; q < P; q++) acc[q][c] = _mm512_fmadd_ps(kv, xq[q], acc[q][c]);            \
                }                                                                                             \
            }                                                                                                 \
            long nk = N - s0 < SCORE_KEYS ? N - s0 : SCORE_KEYS;                                               \
            for (int q = 0; q < P; q++) {                                                                     \
                __m512 *a = acc[q], s[4], w[2];                                                               \
                for (int c = 0; c < 4; c++) /* lanes (k0 query 0, k0 query 1, k1 q0, k1 q1) of keys 2c, 2c+1 */ \
                    s[c] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * c], a[2 * c + 1], 0x88),                  \
                                         _mm512_shuffle_f32x4(a[2 * c], a[2 * c + 1], 0xDD));                 \
                for (int c = 0; c < 2; c++)                                                                   \
                    w[c] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * c], s[2 * c + 1], 0x44),                     \
                                         _mm512_shuffle_ps(s[2 * c], s[2 * c + 1], 0xEE));                    \
                __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD)); \
                r = _mm512_permutexvar_ps(order, r); /* query 2q's 8 scores, then query 2q+1's */               \
                long n = n0 + 2 * q;                                                                          \
                if (nk == SCORE_KEYS) {                                                                       \
                    _mm256_storeu_ps(p + n * N + s0, _mm512_castps512_ps256(r));                              \
                    if (n + 1 < nr) _mm256_storeu_ps(p + (n + 1) * N + s0, _mm512_extractf32x8_ps(r, 1));     \
                } else {                                                                                      \
                    float out[16];                                                                            \
                    _mm512_storeu_ps(out, r);                                                                 \
                    memcpy(p + n * N + s0, out, nk * sizeof(float));                                          \
                    if (n + 1 < nr) memcpy(p + (n + 1) * N + s0, out + 8, nk * sizeof(float));                \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

SCORES_Z(scores1z, 1)
SCORES_Z(scores2z, 2)
SCORES_Z(scores3z, 3)

/* ``scores_z`` over all nq queries: xi (room for nq + 1 rows) gets them interleaved in pairs (``skinny_pairs``),
 * then blocks of up to three pairs pass over the keys. */
static void scores_z(const float *Q, float *xi, long nq, long D, const float *K, long N, float *p) {
    long D8 = D / 8, pairs = (nq + 1) / 2;
    skinny_pairs(Q, xi, nq, 2 * pairs, D);
    for (long q0 = 0; q0 < pairs;) {
        long left = pairs - q0, step = left >= 3 ? 3 : left;
        const float *x = xi + q0 * D8 * 16;
        if (step == 3)
            scores3z(x, D, K, N, p, 2 * q0, nq);
        else if (step == 2)
            scores2z(x, D, K, N, p, 2 * q0, nq);
        else
            scores1z(x, D, K, N, p, 2 * q0, nq);
        q0 += step;
    }
}

/* torch's GELU with the tanh approximation, in its order of operations */
static inline float gelu_tanh(float x) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(beta * (x + kappa * (x * x * x))));
}

/* May query i (slot S + i) see slot s? */
static inline int seen(const unsigned char *vis, long S, long i, long s) {
    return s <= S + i && (vis[s] || s == S + i);
}

/* The first slot query i may see under a window of W visible tokens (0: no window): the slots s with fewer than W
 * visible ones in s + 1 .. S + i, as ``kv.attention_mask`` counts them (holes and padding not counted); lo when all. */
static long window_from(const unsigned char *vis, long S, long i, long lo, long W) {
    long s = S + i, c = 0;
    if (!W) return lo;
    while (s > lo && c + vis[s] < W) c += vis[s--];
    return s;
}

/* Each score of pn [n] that is not -inf replaced by the next of src (room for 16 more), the others by 0; ``z``:
 * AVX-512's expand, 16 at a time (a row's holes make this every query's work in a round: no branch a slot). */
__attribute__((target("avx512f"))) static long scatter_seen_z(float *pn, long n, const float *src, long *k) {
    long s = 0;
    for (; s + 16 <= n; s += 16) {
        __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(pn + s), _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        _mm512_storeu_ps(pn + s, _mm512_maskz_expand_ps(m, _mm512_loadu_ps(src + *k)));
        *k += __builtin_popcount(m);
    }
    return s;
}

static void scatter_seen(float *pn, long n, const float *src, int z) {
    long k = 0;
    for (long s = z ? scatter_seen_z(pn, n, src, &k) : 0; s < n; s++) pn[s] = pn[s] != -INFINITY ? src[k++] : 0.0f;
}

/* The loop of ``attend`` that hides what query i may not see, 16 slots at a time with AVX-512 (slots lo .. T-1 of
 * scores pn, from ``from``): each score scaled (or -inf), written back, the visible ones that are not -inf appended to
 * seen_scores in order (*nv counts them) and their maximum kept in *m (NaN skipped), as the scalar loop does.
 * Returns the slot where the scalar loop goes on (the last 0-15). */
__attribute__((target("avx512f"))) static long visible_z(float *pn, const unsigned char *vis, long S, long i, long lo,
                                                         long from, long T, float scale, float *seen_scores,
                                                         long *nv, float *m) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 hidden = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    __m512 top = hidden;
    long s = lo, self = S + i, n = *nv;
    if (T - lo >= 16 && self < INT32_MAX && from < INT32_MAX)
        for (; s + 16 <= T; s += 16) {
            __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int)s), lanes);
            __mmask16 shown = _mm512_cmpneq_epi32_mask(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vis + s))), _mm512_setzero_si512());
            shown |= _mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32((int)self));
            shown &= _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32((int)from)) &
                     _mm512_cmple_epi32_mask(at, _mm512_set1_epi32((int)self));
            __m512 v = _mm512_mask_mul_ps(hidden, shown, _mm512_loadu_ps(pn + s - lo), vscale);
            _mm512_storeu_ps(pn + s - lo, v);
            top = _mm512_max_ps(v, top); /* a NaN score leaves the maximum as it was */
            __mmask16 kept = _mm512_cmp_ps_mask(v, hidden, _CMP_NEQ_UQ);
            _mm512_mask_compressstoreu_ps(seen_scores + n, kept, v);
            n += __builtin_popcount(kept);
        }
    float best = _mm512_reduce_max_ps(top);
    *m = best > *m ? best : *m;
    *nv = n;
    return s;
}

/* Attention of the G query heads of key/value head g, for the q new tokens of row b (queries n = i * G + j), over
 * slots lo .. S + q - 1 (lo: the row's first visible slot, or its first query's window's; a hole after it is scored,
 * then hidden, as is a slot left of a later query's window, ``window_from``). The scores of all
 * the queries against those keys are one skinny product (``scores_z``, or ``skinny.c``'s: each key read once per block
 * of queries, and every score summed in one order whatever the number of queries, so a token's attention has the same
 * bits in a verification block as in a decode step); then each query's visibility, softmax and weighted sum of values.
 * Scratch: p [q * G * (S + q)], Q [q * G * D], xi [(q * G + 1) * D], seen_scores [S + q + 16]. */
static void attend(const float *qb, const float *K, const float *V, float *out, const unsigned char *vis, long S,
                   long q, long nh, long G, long g, long D, float scale, long lo, long W, float *p, float *Q,
                   float *xi, float *seen_scores) {
    lo = window_from(vis, S, 0, lo, W); /* the first query's window starts first */
    long T = S + q, nq = q * G, N = T - lo;
    for (long n = 0; n < nq; n++) memcpy(Q + n * D, qb + ((n / G) * nh + g * G + n % G) * D, D * sizeof(float));
    int z = skinny_avx512(-1); /* the AVX-512 blocks: the same bits as the AVX2 ones */
    if (D % 8 == 0 && z)
        scores_z(Q, xi, nq, D, K + lo * D, N, p);
    else
        skinny_rows(Q, skinny_interleave(Q, xi, nq, D, 0) ? xi : NULL, 0, K + lo * D, p, nq, N, D, 0, N);
    float inv[6], *o[6];
    int wide = D % 64 == 0 && z;
    for (long n0 = 0, c; n0 < nq; n0 += c) {  /* queries in groups of 6, then 3, then one by one */
        c = !wide ? 1 : nq - n0 >= 6 ? 6 : nq - n0 >= 3 ? 3 : 1;
        for (long j = 0; j < c; j++) {
            long n = n0 + j, i = n / G, from = window_from(vis, S, i, lo, W), nv = 0;
            float *pn = p + n * N, m = -INFINITY;
            long s0 = z ? visible_z(pn, vis, S, i, lo, from, T, scale, seen_scores, &nv, &m) : lo;
            for (long s = s0; s < T; s++) {
                float v = s >= from && seen(vis, S, i, s) ? pn[s - lo] * scale : -INFINITY;
                pn[s - lo] = v;
                m = v > m ? v : m;
                seen_scores[nv] = v; /* the visible ones, in order */
                nv += v != -INFINITY;
            }
            /* the softmax sums the query's visible scores alone, in order: each falls in the lane it takes in a decode
             * step of the query alone over a row without holes, whatever the block's width, the holes rejected
             * drafts left and the slots after the query; the others weigh 0 (the value sums skip them) */
            long a = from - lo, e = S + i + 1 - lo;
            if (nv == e - a) { /* no holes: they lie in order already (a decode step: all of them, a = 0, e = N) */
                inv[j] = 1.0f / softmax(pn + a, m, nv);
                for (long s = 0; s < a; s++) pn[s] = 0.0f;
                for (long s = e; s < N; s++) pn[s] = 0.0f;
            } else { /* summed gathered, then put back */
                inv[j] = 1.0f / softmax(seen_scores, m, nv);
                scatter_seen(pn, N, seen_scores, wide);
            }
            o[j] = out + (i * nh + g * G + n % G) * D;
        }
        if (c == 6)
            values6z(p + n0 * N, N, V + lo * D, D, D, inv, o);
        else if (c == 3)
            values3z(p + n0 * N, N, V + lo * D, D, D, inv, o);
        else
            values(p + n0 * N, N, V + lo * D, D, D, inv[0], o[0]);
    }
}

/* w: input norm, Wq, Wk, Wv, Wo, post-attention norm, Wgate, Wup, Wdown (the norms fp32; the linears fp32 or packed),
 * then ``hooks``' q/k/v biases and query/key head norms, then the norms of the attention's output and of the MLP's
 * (Gemma's, applied before each residual add) (fp32, or a NULL ``q`` where the family has none).
 * x: [R, H], updated in place: R = B*q rows b * q + i, or, packed, the first count[b] new tokens of each row in order
 * (``first`` [B + 1]: row b's are rows first[b] .. first[b + 1] - 1; the other new slots are padding, not computed,
 * and their cache slots not written).
 * cos, sin: [R, D]. kc, vc: [B, nkv, cap, D] caches; slots S..S+q-1 are written. vis: [B, S+q]. W: the window of
 * visible tokens each query sees (0: all).
 * dims: B, q, S, cap, H, nh, nkv, D, I, R, the MLP's activation (0: SiLU, 1: GELU with tanh), norm weights as offsets
 * from 1 (1: Gemma's). Returns 0, or -1 when scratch memory could not be had. */
int llama_layer(float *x, const packed_t *w, const float *cos, const float *sin, float *kc, float *vc,
                const unsigned char *vis, const long *dims, float eps, float scale, const long *first, long W) {
    long B = dims[0], q = dims[1], S = dims[2], cap = dims[3], H = dims[4], nh = dims[5], nkv = dims[6], D = dims[7],
         I = dims[8], R = first ? first[B] : B * q, G = nh / nkv, T = S + q, gelu = dims[10];
    int one = (int)dims[11];
    float *h = malloc(sizeof(float) * R * (H + nh * D * 2 + nkv * D * 2 + I * 2));
    if (!h) return -1;
    float *qb = h + R * H, *att = qb + R * nh * D, *kb = att + R * nh * D, *vb = kb + R * nkv * D,
          *gate = vb + R * nkv * D, *up = gate + R * I;

    int failed = 0;
    float *xi = NULL; /* the linears' shared scratch */
    #pragma omp parallel /* one region for the layer: each step below is shared out, or run by one thread */
    {
        #pragma omp single
        rmsnorm(x, w[0].q, h, R, H, eps, one);
        packed_linears(h, &w[1], (float *[]){qb, kb, vb}, (long[]){nh * D, nkv * D, nkv * D}, 3, R, H, &xi);
        #pragma omp single
        for (long r = 0, b = 0; r < R; r++) {
            while (first && r >= first[b + 1]) b++;
            long i = first ? r - first[b] : r % q;
            if (!first) b = r / q;
            const float *cs = cos + r * D, *sn = sin + r * D;
            hooks(qb + r * nh * D, kb + r * nkv * D, vb + r * nkv * D, &w[9], nh, nkv, D, eps, one);
            for (long n = 0; n < nh; n++) rope(qb + (r * nh + n) * D, cs, sn, D);
            for (long g = 0; g < nkv; g++) {
                float *kr = kb + (r * nkv + g) * D;
                rope(kr, cs, sn, D);
                long slot = ((b * nkv + g) * cap + S + i) * D;
                memcpy(kc + slot, kr, D * sizeof(float));
                memcpy(vc + slot, vb + (r * nkv + g) * D, D * sizeof(float));
            }
        }
        float *p = malloc(sizeof(float) * (q * G * (T + 2 * D) + D + T + 16)), *Q = p + q * G * T,
              *xa = Q + q * G * D;
        if (!p) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(dynamic)
        for (long b = 0; b < B; b++)
            for (long g = 0; g < nkv; g++) {
                if (!p) continue;
                long base = (b * nkv + g) * cap * D, r0 = first ? first[b] : b * q, n = first ? first[b + 1] - r0 : q;
                const unsigned char *seen_from = memchr(vis + b * T, 1, S);
                long lo = seen_from ? seen_from - (vis + b * T) : S;
                attend(qb + r0 * nh * D, kc + base, vc + base, att + r0 * nh * D, vis + b * T, S, n, nh, G, g, D,
                       scale, lo, W, p, Q, xa, xa + (q * G + 1) * D);
            }
        free(p);
        packed_linears(att, &w[4], (float *[]){h}, (long[]){H}, 1, R, nh * D, &xi);
        #pragma omp single
        {
            if (w[14].q) rmsnorm(h, w[14].q, h, R, H, eps, one);
            for (long j = 0; j < R * H; j++) x[j] += h[j];
            rmsnorm(x, w[5].q, h, R, H, eps, one);
        }
        packed_linears(h, &w[6], (float *[]){gate, up}, (long[]){I, I}, 2, R, H, &xi);
        #pragma omp for schedule(static)
        for (long j = 0; j < R * I; j++)
            gate[j] = (gelu ? gelu_tanh(gate[j]) : gate[j] / (1.0f + expf(-gate[j]))) * up[j];
        packed_linears(gate, &w[8], (float *[]){h}, (long[]){H}, 1, R, I, &xi);
        #pragma omp single
        {
            if (w[15].q) rmsnorm(h, w[15].q, h, R, H, eps, one);
            for (long j = 0; j < R * H; j++) x[j] += h[j];
        }
    }
    free(h);
    return failed ? -1 : 0; /* failed: an attention's scratch could not be had (x is then not to be used) */
}

/* Every layer of a forward in one call: layer l over w[l], the rotary tables cos[rope[l]], sin[rope[l]], the
 * caches kc[l], vc[l] of capacity caps[l] and the window windows[l] (the other arguments as llama_layer's, dims[3]
 * unused). One call from Python where one a layer spent ~8 us of a batch-1 step on its own bookkeeping (reserving,
 * pointers, the call). Returns 0, or -1 as llama_layer. */
int llama_layers(float *x, const packed_t *const *w, const float *const *cos, const float *const *sin,
                 float *const *kc, float *const *vc, const unsigned char *vis, const long *dims, float eps, float scale,
                 const long *first, const long *caps, long layers, const long *rope, const long *windows) {
    long d[12];
    memcpy(d, dims, sizeof d);
    for (long l = 0; l < layers; l++) {
        d[3] = caps[l];
        if (llama_layer(x, w[l], cos[rope[l]], sin[rope[l]], kc[l], vc[l], vis, d, eps, scale, first, windows[l]))
            return -1;
    }
    return 0;
}
