/* One Llama decoder layer for a few new tokens per row over a slot cache (fp32, AVX2 + FMA, OpenMP):
 *   h = rmsnorm(x); q, k, v = h Wq^T, h Wk^T, h Wv^T; rope(q, k); cache[S + i] = k, v
 *   x += attention(q, cache, visible) Wo^T;  x += (silu(rmsnorm(x) Wg^T) * (rmsnorm(x) Wu^T)) Wd^T
 * Rows are b * q + i (row b of the batch, new token i). Query i of row b sees slot s when s <= S + i and
 * visible[b][s], and always its own slot S + i: the same rule as batchspec's attention mask. Each key/value head is
 * read once for all the query heads it serves, and slots no query may see are skipped, not read.
 * Elementwise steps follow Hugging Face's Llama in order of operations; sums run in another order, like any change of
 * batch size. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void skinny_linear(const float *x, const float *w, float *y, long M, long N, long K);

static void rmsnorm(const float *x, const float *w, float *out, long R, long H, float eps) {
    for (long r = 0; r < R; r++) {
        const float *xr = x + r * H;
        float *o = out + r * H;
        double ss = 0.0;
        for (long j = 0; j < H; j++) ss += (double)xr[j] * xr[j];
        float inv = 1.0f / sqrtf((float)(ss / H) + eps);
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

/* e^x for 8 lanes (Cephes' single-precision polynomial, within ~2 ulp); lanes below -87 (including -inf, the hidden
 * slots) give 0. */
static inline __m256 exp8(__m256 x) {
    __m256 hidden = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(hidden, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* Eight sums of eight lanes each, as one vector: [sum(d[0]), ..., sum(d[7])]. */
static inline __m256 sum8(const __m256 *d) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* May query i (slot S + i) see slot s? */
static inline int seen(const unsigned char *vis, long S, long i, long s) {
    return s <= S + i && (vis[s] || s == S + i);
}

/* Scores of query qv against the eight keys at K (rows kst apart), as one vector; only the first w keys are read.
 * (Named accumulators: an array here ends up in memory, and every sum then waits on a store.) */
static inline __m256 scores8(const float *qv, const float *K, long kst, long D, long w) {
    __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0, d4 = d0, d5 = d0, d6 = d0, d7 = d0;
    if (w == 8) {
        for (long k = 0; k < D; k += 8) {
            __m256 qk = _mm256_loadu_ps(qv + k);
            d0 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + k), d0);
            d1 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + kst + k), d1);
            d2 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + 2 * kst + k), d2);
            d3 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + 3 * kst + k), d3);
            d4 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + 4 * kst + k), d4);
            d5 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + 5 * kst + k), d5);
            d6 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + 6 * kst + k), d6);
            d7 = _mm256_fmadd_ps(qk, _mm256_loadu_ps(K + 7 * kst + k), d7);
        }
        __m256 d[8] = {d0, d1, d2, d3, d4, d5, d6, d7};
        return sum8(d);
    }
    __m256 d[8] = {d0, d1, d2, d3, d4, d5, d6, d7};  /* the last, partial block: zeros past w */
    for (long u = 0; u < w; u++)
        for (long k = 0; k < D; k += 8) d[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qv + k), _mm256_loadu_ps(K + u * kst + k), d[u]);
    return sum8(d);
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

/* Softmax of the T scores pn (-inf: hidden, max m) times the values at V (rows vst apart), written to o [D]. */
static void softmax_values(float *pn, float m, long T, const float *V, long vst, long D, float *o) {
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
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    long d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values64(pn, T, V + d0, vst, inv, o + d0);
    for (; d0 < D; d0 += 8) {  /* what is left, 8 dimensions at a time */
        __m256 a = _mm256_setzero_ps();
        for (long t = 0; t < T; t++) a = _mm256_fmadd_ps(_mm256_set1_ps(pn[t]), _mm256_loadu_ps(V + t * vst + d0), a);
        _mm256_storeu_ps(o + d0, _mm256_mul_ps(a, inv));
    }
}

/* Attention of the G query heads of key/value head g, for the q new tokens of row b (queries n = i * G + j).
 * Scores come eight slots at a time (blocks no query may see are skipped unread); then softmax and each query's
 * weighted sum of values. p: scratch [q * G * T]. */
static void attend(const float *qb, const float *K, const float *V, float *out, const unsigned char *vis, long S,
                   long q, long nh, long G, long g, long D, float scale, float *p) {
    long T = S + q, nq = q * G;  /* vis: at least S + q slots */
    for (long n = 0; n < nq; n++) {
        long i = n / G;
        const float *qv = qb + (i * nh + g * G + n % G) * D;
        float *pn = p + n * T, m = -INFINITY;
        for (long s0 = 0; s0 < T; s0 += 8) {
            long w = T - s0 < 8 ? T - s0 : 8, any = 0;
            for (long u = 0; u < w; u++) any |= seen(vis, S, i, s0 + u);
            if (!any) {
                for (long u = 0; u < w; u++) pn[s0 + u] = -INFINITY;
                continue;
            }
            float sc[8];
            _mm256_storeu_ps(sc, scores8(qv, K + s0 * D, D, D, w));
            for (long u = 0; u < w; u++) {
                pn[s0 + u] = seen(vis, S, i, s0 + u) ? sc[u] * scale : -INFINITY;
                m = pn[s0 + u] > m ? pn[s0 + u] : m;
            }
        }
        softmax_values(pn, m, T, V, D, D, out + (i * nh + g * G + n % G) * D);
    }
}

/* w: input norm, Wq, Wk, Wv, Wo, post-attention norm, Wgate, Wup, Wdown. x: [R, H], updated in place: R = B*q
 * rows b * q + i, or, packed, the first count[b] new tokens of each row in order (``first`` [B + 1]: row b's are rows
 * first[b] .. first[b + 1] - 1; the other new slots are padding, not computed, and their cache slots not written).
 * cos, sin: [R, D]. kc, vc: [B, nkv, cap, D] caches; slots S..S+q-1 are written. vis: [B, S+q].
 * dims: B, q, S, cap, H, nh, nkv, D, I, R. Returns 0, or -1 when scratch memory could not be had. */
int llama_layer(float *x, const float *const *w, const float *cos, const float *sin, float *kc, float *vc,
                const unsigned char *vis, const long *dims, float eps, float scale, const long *first) {
    long B = dims[0], q = dims[1], S = dims[2], cap = dims[3], H = dims[4], nh = dims[5], nkv = dims[6], D = dims[7],
         I = dims[8], R = first ? first[B] : B * q, G = nh / nkv, T = S + q;
    float *h = malloc(sizeof(float) * R * (H + nh * D * 2 + nkv * D * 2 + I * 2));
    if (!h) return -1;
    float *qb = h + R * H, *att = qb + R * nh * D, *kb = att + R * nh * D, *vb = kb + R * nkv * D,
          *gate = vb + R * nkv * D, *up = gate + R * I;

    rmsnorm(x, w[0], h, R, H, eps);
    skinny_linear(h, w[1], qb, R, nh * D, H);
    skinny_linear(h, w[2], kb, R, nkv * D, H);
    skinny_linear(h, w[3], vb, R, nkv * D, H);
    for (long r = 0, b = 0; r < R; r++) {
        while (first && r >= first[b + 1]) b++;
        long i = first ? r - first[b] : r % q;
        if (!first) b = r / q;
        const float *cs = cos + r * D, *sn = sin + r * D;
        for (long n = 0; n < nh; n++) rope(qb + (r * nh + n) * D, cs, sn, D);
        for (long g = 0; g < nkv; g++) {
            float *kr = kb + (r * nkv + g) * D;
            rope(kr, cs, sn, D);
            long slot = ((b * nkv + g) * cap + S + i) * D;
            memcpy(kc + slot, kr, D * sizeof(float));
            memcpy(vc + slot, vb + (r * nkv + g) * D, D * sizeof(float));
        }
    }
    int failed = 0;
    #pragma omp parallel
    {
        float *p = malloc(sizeof(float) * q * G * T);
        if (!p) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(dynamic)
        for (long b = 0; b < B; b++)
            for (long g = 0; g < nkv; g++) {
                if (!p) continue;
                long base = (b * nkv + g) * cap * D, r0 = first ? first[b] : b * q, n = first ? first[b + 1] - r0 : q;
                attend(qb + r0 * nh * D, kc + base, vc + base, att + r0 * nh * D, vis + b * T, S, n, nh, G, g, D,
                       scale, p);
            }
        free(p);
    }
    if (failed) {
        free(h);
        return -1;
    }
    skinny_linear(att, w[4], h, R, H, nh * D);
    for (long j = 0; j < R * H; j++) x[j] += h[j];
    rmsnorm(x, w[5], h, R, H, eps);
    skinny_linear(h, w[6], gate, R, I, H);
    skinny_linear(h, w[7], up, R, I, H);
    for (long j = 0; j < R * I; j++) gate[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    skinny_linear(gate, w[8], h, R, H, I);
    for (long j = 0; j < R * H; j++) x[j] += h[j];
    free(h);
    return 0;
}
