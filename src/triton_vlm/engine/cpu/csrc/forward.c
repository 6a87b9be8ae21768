/* A whole decode forward of 1-4 rows in one call (`cpu_forward.py`): the functions of decode.c in the layer
   loop, the products through the gemv library's own function (its address is passed in), and those on FP8
   weights kept as e4m3 through the FP8 gemv library's (`gemv_fp8.c`, its address passed in too), and those on
   bf16 / fp16 weights kept as stored through the 16-bit gemv library's (`gemv_bf16.c`, likewise). */
#include "decode.c"

typedef int (*gemv_fn)(const float *x, int64_t rows, int64_t ldx, int64_t K, const float *w, int64_t Kp,
                       int64_t N, const float *bias, float *y, int64_t ldy);

typedef int (*gemv8_fn)(const float *x, int64_t rows, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
                        const float *scale, int64_t bm, int64_t bn, const float *bias, float *y, int64_t ldy);

typedef int (*gemv16_fn)(const float *x, int64_t rows, int64_t ldx, int64_t K, const uint16_t *w, int64_t N,
                         int64_t kind, const float *bias, float *y, int64_t ldy);

/* a packed weight: fp32 in gemv.Layout (scale null, half 0), e4m3 bytes [N/64][K][64] with fp32 scales
   [ceil(N / bm)][ceil(K / bn)] (gemv_fp8.PackedFp8), or 16-bit codes [N/64][K][64] (half 1: bf16, 2: fp16;
   gemv_bf16.PackedHalf) */
typedef struct {
    const void *w; int64_t n, k, kp; const float *bias; const float *scale; int64_t bm, bn, half;
} Lin;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    Lin qkv, o, gate_up, down;
} LayerW;

/* One projection's LoRA for this step's rows (`lora.LoraBatch`): a [r, in] and b [out, r], the stacked A and B
   of the batch's adapters; mask [rows, r]: row i's weight of each column (its own adapter's scale, else 0).
   r == 0: no adapter of the batch adapts it. */
typedef struct { const float *a, *b, *mask; int64_t r; } LoraMod;
enum { L_Q, L_K, L_V, L_O, L_GATE, L_UP, L_DOWN, L_MODULES }; /* per layer, in this order */

typedef struct {
    int64_t layers, hidden, inter;
    float eps, final_eps;
    const LayerW *layer;         /* [layers] */
    const float *norm;           /* [hidden] */
    Lin lm_head;
    int64_t layer_stride;        /* floats from one layer's K (or V) pool to the next */
    gemv_fn gemv;
    gemv8_fn gemv8;              /* null where no weight is FP8 */
    gemv16_fn gemv16;            /* null where no weight is bf16 / fp16 */
} ModelW;

static int lin(const ModelW *m, const Lin *l, const float *x, int64_t rows, float *y) {
    if (l->half)
        return m->gemv16 ? m->gemv16(x, rows, l->k, l->k, (const uint16_t *)l->w, l->n, l->half - 1, l->bias, y,
                                     l->n) : -7;
    if (l->scale)
        return m->gemv8 ? m->gemv8(x, rows, l->k, l->k, (const uint8_t *)l->w, l->n, l->scale, l->bm, l->bn,
                                   l->bias, y, l->n) : -7;
    return m->gemv(x, rows, l->k, l->k, (const float *)l->w, l->kp, l->n, l->bias, y, l->n);
}

/* y[i, off:off + out] += ((x[i] . a^T) * mask[i]) . b^T for each row: `LoraBatch.add` (h = x A^T, h *= mask,
   y += h B^T), in fp32. h is the caller's scratch of rows * r floats. */
static void lora_add(const LoraMod *L, const float *x, int64_t rows, int64_t in, float *y, int64_t ldy,
                     int64_t off, int64_t out, float *h) {
    if (!L || !L->r) return;
    const int64_t r = L->r;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < r; k++) h[i * r + k] = dot(x + i * in, L->a + k * in, in) * L->mask[i * r + k];
    for (int64_t i = 0; i < rows; i++)
        for (int64_t o = 0; o < out; o++) y[i * ldy + off + o] += dot(h + i * r, L->b + o * r, r);
}

/* x_in [rows, hidden] -> logits [rows, vocab]; masks [layers]: each layer's [rows, T] mask; kc, vc: layer 0's
   pools [slots, kv_heads, hd], the next layer's layer_stride floats further. The caller checked `st` and every
   mask (triton_vlm_decode_check). Returns 0, or the first failing step's code. */
int triton_vlm_decode_forward(const ModelW *m, const Step *st, const uint8_t *const *masks, const float *x_in,
                              float *kc, float *vc, float *logits, const LoraMod *lora, float *lora_h) {
    const int64_t rows = st->rows, hid = m->hidden, H = st->heads, hd = st->hd;
    const int64_t qkv_n = m->layer[0].qkv.n, gu_n = m->layer[0].gate_up.n;
    float *x = malloc(sizeof(float) * rows * hid), *h = malloc(sizeof(float) * rows * hid);
    float *qkv = malloc(sizeof(float) * rows * qkv_n), *att = malloc(sizeof(float) * rows * H * hd);
    float *o = malloc(sizeof(float) * rows * hid), *gu = malloc(sizeof(float) * rows * gu_n);
    float *act = malloc(sizeof(float) * rows * m->inter);
    int rc = (x && h && qkv && att && o && gu && act) ? 0 : -6;
    if (rc == 0) triton_vlm_add_rms_norm(x_in, 0, m->layer[0].input_norm, m->eps, rows, hid, x, h);
    for (int64_t l = 0; rc == 0 && l < m->layers; l++) {
        const LayerW *L = m->layer + l;
        const LoraMod *ad = lora ? lora + l * L_MODULES : 0; /* this layer's 7 projections, or none */
        const int64_t kvw = st->kv_heads * hd;
        if ((rc = lin(m, &L->qkv, h, rows, qkv))) break;
        if (ad) {
            lora_add(ad + L_Q, h, rows, hid, qkv, qkv_n, 0, H * hd, lora_h);
            lora_add(ad + L_K, h, rows, hid, qkv, qkv_n, H * hd, kvw, lora_h);
            lora_add(ad + L_V, h, rows, hid, qkv, qkv_n, H * hd + kvw, kvw, lora_h);
        }
        rc = triton_vlm_decode_attention(st, masks[l], qkv, kc + l * m->layer_stride, vc + l * m->layer_stride,
                                         att);
        if (rc || (rc = lin(m, &L->o, att, rows, o))) break;
        if (ad) lora_add(ad + L_O, att, rows, H * hd, o, hid, 0, hid, lora_h);
        triton_vlm_add_rms_norm(x, o, L->post_norm, m->eps, rows, hid, x, h);
        if ((rc = lin(m, &L->gate_up, h, rows, gu))) break;
        if (ad) {
            lora_add(ad + L_GATE, h, rows, hid, gu, gu_n, 0, m->inter, lora_h);
            lora_add(ad + L_UP, h, rows, hid, gu, gu_n, m->inter, m->inter, lora_h);
        }
        triton_vlm_silu_mul(gu, rows, m->inter, act);
        if ((rc = lin(m, &L->down, act, rows, o))) break;
        if (ad) lora_add(ad + L_DOWN, act, rows, m->inter, o, hid, 0, hid, lora_h);
        int last = l + 1 == m->layers;
        triton_vlm_add_rms_norm(x, o, last ? m->norm : m->layer[l + 1].input_norm, last ? m->final_eps : m->eps,
                                rows, hid, x, h);
    }
    if (rc == 0) rc = lin(m, &m->lm_head, h, rows, logits);
    free(x); free(h); free(qkv); free(att); free(o); free(gu); free(act);
    return rc;
}
