#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* What a decode step's rows share across layers (built once per forward). */
typedef struct {
    int64_t rows, heads, kv_heads, hd, max_pos, T, slots;
    const int64_t *positions;   /* [rows] */
    const int64_t *write_slots; /* [rows] */
    const int64_t *read_slots;  /* [rows, T] */
    const float *cos, *sin_rot; /* [max_pos, hd] */
    float scale;
} Step;

/* out[d] = x[d] * c[d] + x[(d + hd/2) % hd] * s[d]: apply_rotary (x * cos + roll(x, hd/2) * sin_rot) */
static void rope(const float *x, const float *c, const float *s, int64_t hd, float *out) {
    int64_t half = hd / 2;
    for (int64_t d = 0; d < hd; d++) {
        float a = x[d] * c[d];
        float b = x[(d + half) % hd] * s[d];
        out[d] = a + b;
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    vf acc[NV];
    for (int j = 0; j < NV; j++) acc[j] = (vf){0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < NV; j++) {
            vf x, y;
            memcpy(&x, a + d + j * VW, sizeof(vf));
            memcpy(&y, b + d + j * VW, sizeof(vf));
            acc[j] += x * y;
        }
    float sum = lanes_sum(acc);
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

/* exp(x) for the lanes of x <= 0 (scores less their maximum): x = n ln2 + r, exp(r) by Cephes' expf polynomial
   (relative error ~1e-7), times 2^n built in the exponent bits. Below -87 (and -inf: a masked key) the result
   is exactly 0, where expf would return subnormals below 1e-37 (slow, and nothing next to the maximum's 1). */
static inline vf vselect(vi m, vf a, vf b) { /* a where m is all ones, else b */
    vi ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof(a));
    return a;
}

static inline vf vexp(vf x) {
    vi live = x >= -87.0f;
    x = vselect(live, x, (vf){0} - 87.0f);
    vf t = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi);          /* truncates toward 0 */
    vf nf = __builtin_convertvector(n, vf);
    vi above = nf > t;                                /* floor for negative t */
    n += above;                                         /* true lanes are -1 */
    nf = __builtin_convertvector(n, vf);
    x = x - nf * 0.693359375f;
    x = x - nf * -2.12194440e-4f;
    vf y = x * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    vi bits = (n + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof(scale));
    return vselect(live, y * scale, (vf){0});
}

/* 0 when every index is inside its table and every row has a key to attend to, else a negative code. */
int triton_vlm_decode_check(const Step *st, const uint8_t *mask) {
    if (st->rows < 0 || st->heads < 1 || st->kv_heads < 1 || st->heads % st->kv_heads || st->hd < 2 ||
        st->hd % 2 || st->T < 0)
        return -1;
    for (int64_t r = 0; r < st->rows; r++) {
        if (st->positions[r] < 0 || st->positions[r] >= st->max_pos) return -2;
        if (st->write_slots[r] < 0 || st->write_slots[r] >= st->slots) return -3;
        int any = 0;
        for (int64_t j = 0; j < st->T; j++) {
            if (!mask[r * st->T + j]) continue;
            if (st->read_slots[r * st->T + j] < 0 || st->read_slots[r * st->T + j] >= st->slots) return -4;
            any = 1;
        }
        if (!any) return -5;
    }
    return 0;
}

/* qkv [rows, (heads + 2 kv_heads) * hd]; mask [rows, T]; kc, vc [slots, kv_heads, hd] (the new K/V written);
   out [rows, heads * hd]. The caller ran triton_vlm_decode_check on this step and mask. */
int triton_vlm_decode_attention(const Step *st, const uint8_t *mask, const float *qkv, float *kc, float *vc,
                                float *out) {
    const int64_t H = st->heads, KV = st->kv_heads, hd = st->hd, T = st->T;
    const int64_t width = (H + 2 * KV) * hd, kvw = KV * hd, groups = H / KV;
    for (int64_t r = 0; r < st->rows; r++) { /* every row's new K and V first: a row reads its own new token */
        const float *src = qkv + r * width;
        const float *c = st->cos + st->positions[r] * hd, *s = st->sin_rot + st->positions[r] * hd;
        float *kdst = kc + st->write_slots[r] * kvw;
        for (int64_t g = 0; g < KV; g++) rope(src + (H + g) * hd, c, s, hd, kdst + g * hd);
        memcpy(vc + st->write_slots[r] * kvw, src + (H + KV) * hd, kvw * sizeof(float));
    }
    const int64_t Tp = (T + LANES - 1) / LANES * LANES; /* scores padded to whole rows of 16 lanes */
    float *q = malloc(sizeof(float) * H * hd), *acc = malloc(sizeof(float) * H * hd);
    float *p = malloc(sizeof(float) * H * (Tp ? Tp : LANES)), *mx = malloc(sizeof(float) * H * 2);
    if (!q || !acc || !p || !mx) { free(q); free(acc); free(p); free(mx); return -6; }
    float *sum = mx + H;
    for (int64_t r = 0; r < st->rows; r++) {
        const float *c = st->cos + st->positions[r] * hd, *s = st->sin_rot + st->positions[r] * hd;
        const int64_t *rs = st->read_slots + r * T;
        const uint8_t *mk = mask + r * T;
        for (int64_t h = 0; h < H; h++) {
            rope(qkv + r * width + h * hd, c, s, hd, q + h * hd);
            mx[h] = -INFINITY;
            for (int64_t j = T; j < Tp; j++) p[h * Tp + j] = -INFINITY;
        }
        for (int64_t j = 0; j < T; j++) { /* one slot's keys (all kv heads, contiguous) for every query head */
            if (!mk[j]) {
                for (int64_t h = 0; h < H; h++) p[h * Tp + j] = -INFINITY;
                continue;
            }
            const float *krow = kc + rs[j] * kvw;
            for (int64_t h = 0; h < H; h++) {
                float x = dot(q + h * hd, krow + (h / groups) * hd, hd) * st->scale;
                p[h * Tp + j] = x;
                if (x > mx[h]) mx[h] = x;
            }
        }
        for (int64_t h = 0; h < H; h++) { /* softmax numerators; masked keys get exactly 0 */
            vf total[NV];
            for (int k = 0; k < NV; k++) total[k] = (vf){0};
            for (int64_t j = 0; j < Tp; j += LANES)
                for (int k = 0; k < NV; k++) {
                    vf x;
                    memcpy(&x, p + h * Tp + j + k * VW, sizeof(x));
                    x = vexp(x - mx[h]);
                    memcpy(p + h * Tp + j + k * VW, &x, sizeof(x));
                    total[k] += x;
                }
            sum[h] = lanes_sum(total);
        }
        memset(acc, 0, sizeof(float) * H * hd);
        for (int64_t j = 0; j < T; j++) {
            if (!mk[j]) continue;
            const float *vrow = vc + rs[j] * kvw;
            for (int64_t h = 0; h < H; h++) {
                float w = p[h * Tp + j], *a = acc + h * hd;
                const float *v = vrow + (h / groups) * hd;
                for (int64_t d = 0; d < hd; d++) a[d] += w * v[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float inv = 1.0f / sum[h], *o = out + r * H * hd + h * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = acc[h * hd + d] * inv;
        }
    }
    free(q); free(acc); free(p); free(mx);
    return 0;
}

/* exp for any x: above 88 clamped (1.6e38, no overflow to inf), below -87 exactly 0 */
static inline vf vexp_any(vf x) {
    vi high = x > 88.0f;
    return vexp(vselect(high, (vf){0} + 88.0f, x));
}

/* Per row of n: x_out = x + d (x alone when d is NULL); h = w * (x_out * (1 / sqrt(mean(x_out^2) + eps))):
   the residual add and transformers' LlamaRMSNorm in fp32. */
void triton_vlm_add_rms_norm(const float *x, const float *d, const float *w, float eps, int64_t rows, int64_t n,
                             float *x_out, float *h) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n, *dr = d ? d + r * n : 0;
        float *xo = x_out + r * n, *hr = h + r * n;
        vf acc[NV];
        for (int j = 0; j < NV; j++) acc[j] = (vf){0};
        float tail = 0.0f;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int j = 0; j < NV; j++) {
                vf a, b = (vf){0};
                memcpy(&a, xr + i + j * VW, sizeof(a));
                if (dr) memcpy(&b, dr + i + j * VW, sizeof(b));
                a = a + b;
                memcpy(xo + i + j * VW, &a, sizeof(a));
                acc[j] += a * a;
            }
        for (; i < n; i++) {
            float a = xr[i] + (dr ? dr[i] : 0.0f);
            xo[i] = a;
            tail += a * a;
        }
        float inv = 1.0f / sqrtf((lanes_sum(acc) + tail) / (float)n + eps);
        for (i = 0; i < n; i++) hr[i] = w[i] * (xo[i] * inv);
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, n + i], silu(g) = g / (1 + exp(-g)): the gated MLP's activation */
void triton_vlm_silu_mul(const float *gu, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) /* rows of 16: the same elements take the vector exp at any width */
            for (int j = 0; j < NV; j++) {
                vf a, b;
                memcpy(&a, g + i + j * VW, sizeof(a));
                memcpy(&b, u + i + j * VW, sizeof(b));
                vf y = a / (vexp_any((vf){0} - a) + 1.0f) * b;
                memcpy(o + i + j * VW, &y, sizeof(y));
            }
        for (; i < n; i++) o[i] = g[i] / (expf(-g[i]) + 1.0f) * u[i];
    }
}
