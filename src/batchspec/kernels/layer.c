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

static inline float dot(const float *a, const float *b, long D) {
    __m256 acc = _mm256_setzero_ps();
    for (long d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Attention of the G query heads of key/value head g, for the q new tokens of row b. p: scratch [q * G * T]. */
static void attend(const float *qb, const float *K, const float *V, float *out, const unsigned char *vis, long S,
                   long q, long nh, long G, long g, long D, float scale, float *p, float *acc) {
    long T = S + q, nq = q * G;
    for (long s = 0; s < T; s++) {
        int any = s >= S || vis[s];
        for (long i = 0; i < q; i++) {
            int seen = any && s <= S + i && (vis[s] || s == S + i);
            for (long j = 0; j < G; j++)
                p[(i * G + j) * T + s] = seen ? dot(qb + (i * nh + g * G + j) * D, K + s * D, D) * scale : -INFINITY;
        }
    }
    for (long n = 0; n < nq; n++) {
        float *pn = p + n * T, m = -INFINITY, sum = 0.0f;
        for (long s = 0; s < T; s++) m = pn[s] > m ? pn[s] : m;
        for (long s = 0; s < T; s++) {
            pn[s] = pn[s] == -INFINITY ? 0.0f : expf(pn[s] - m);
            sum += pn[s];
        }
        for (long s = 0; s < T; s++) pn[s] /= sum;
    }
    memset(acc, 0, nq * D * sizeof(float));
    for (long s = 0; s < T; s++) {
        if (s < S && !vis[s]) continue;
        const float *vs = V + s * D;
        for (long n = 0; n < nq; n++) {
            float w = p[n * T + s];
            if (w == 0.0f) continue;
            __m256 wv = _mm256_set1_ps(w);
            float *a = acc + n * D;
            for (long d = 0; d < D; d += 8)
                _mm256_storeu_ps(a + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(vs + d), _mm256_loadu_ps(a + d)));
        }
    }
    for (long i = 0; i < q; i++)
        for (long j = 0; j < G; j++)
            memcpy(out + (i * nh + g * G + j) * D, acc + (i * G + j) * D, D * sizeof(float));
}

/* w: input norm, Wq, Wk, Wv, Wo, post-attention norm, Wgate, Wup, Wdown. x: [B*q, H], updated in place.
 * cos, sin: [B*q, D]. kc, vc: [B, nkv, cap, D] caches; slots S..S+q-1 are written. vis: [B, S+q].
 * dims: B, q, S, cap, H, nh, nkv, D, I. Returns 0, or -1 when scratch memory could not be had. */
int llama_layer(float *x, const float *const *w, const float *cos, const float *sin, float *kc, float *vc,
                const unsigned char *vis, const long *dims, float eps, float scale) {
    long B = dims[0], q = dims[1], S = dims[2], cap = dims[3], H = dims[4], nh = dims[5], nkv = dims[6], D = dims[7],
         I = dims[8], R = B * q, G = nh / nkv, T = S + q;
    float *h = malloc(sizeof(float) * R * (H + nh * D * 2 + nkv * D * 2 + I * 2));
    if (!h) return -1;
    float *qb = h + R * H, *att = qb + R * nh * D, *kb = att + R * nh * D, *vb = kb + R * nkv * D,
          *gate = vb + R * nkv * D, *up = gate + R * I;

    rmsnorm(x, w[0], h, R, H, eps);
    skinny_linear(h, w[1], qb, R, nh * D, H);
    skinny_linear(h, w[2], kb, R, nkv * D, H);
    skinny_linear(h, w[3], vb, R, nkv * D, H);
    for (long r = 0; r < R; r++) {
        long b = r / q, i = r % q;
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
        float *p = malloc(sizeof(float) * (q * G * T + q * G * D));
        if (!p) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(dynamic)
        for (long b = 0; b < B; b++)
            for (long g = 0; g < nkv; g++) {
                if (!p) continue;
                long base = (b * nkv + g) * cap * D;
                attend(qb + b * q * nh * D, kc + base, vc + base, att + b * q * nh * D, vis + b * T, S, q, nh, G,
                       g, D, scale, p, p + q * G * T);
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
