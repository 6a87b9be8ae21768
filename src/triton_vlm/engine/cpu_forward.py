"""A whole decode forward of 1 to 4 rows as one C call on a CPU: embeddings in, fp32 logits out, LoRA included.

`LlamaModel.forward` on a CPU already runs a decode step's pieces in C: the products through `gemv.py`, the
attention, residual adds + RMSNorms and SiLU gates through `cpu_decode.py`, each a ctypes call from the
layer loop in Python. For the rows of a small decode step this module runs that same sequence of the same C
functions from C: per layer RMSNorm, q/k/v product (+ bias), rotary + KV write + attention over the paged
cache, o product, residual add + RMSNorm, gate/up product, SiLU gate, down product, residual add + the next
norm; then the final norm and the lm_head. The products call the gemv library's own function (its address is
passed in), the other steps are `cpu_decode.C_SOURCE` compiled with the same flags, so without adapters the
logits are bit for bit those of the layer-by-layer path (tests/engine/test_cpu_forward.py, and the model's
check at load on this machine's build).

Adapters: a step whose rows carry LoRA adapters (`lora.LoraBatch`: per projection the batch's stacked A
[R, in] and B [out, R], and a [rows, R] mask holding each row's own adapter's scale in its columns and 0
elsewhere) adds the same deltas after each product, in fp32: h = (x A^T) * mask, y += h B^T, as
`LoraBatch.add` does with torch. The sums run in another order than MKL's (results within 1e-5 of the
layer-by-layer path; tokens are checked against PEFT by tests/test_lora.py). A row without an adapter has a
zero mask: its delta is exactly 0 and its logits are bit for bit the base model's, whatever adapters its batch
mates use (tested). The table of pointers for a set of adapters and a row map is built once and kept with the
set's stacks (`lora_table`).

Why: the layer-by-layer path spends ~20 Python-level calls per layer around the C work (~0.4 ms of a ~4.3 ms
one-stream step; with an adapter, 56 more calls of torch ops per step) and holds the GIL between them; as one
call, the forward runs without the GIL, so the server's responder thread (building and sending the previous
token's response) no longer waits for the engine thread's Python, nor the engine for the responder's.

Where it applies (`LlamaModel.forward`): a CPU fp32 model whose every projection has the gemv layout, a
decode step (q_len 1, last-position logits) of at most `gemv.MAX_ROWS` rows, no adapter or a `LoraBatch`
whose stacks are contiguous fp32 CPU tensors, and the C decode kernels on. Anything else takes the
layer-by-layer path. `TRITON_VLM_CPU_FORWARD=0` turns it off (for comparisons).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from . import cbuild, cpu_decode, gemv


ENV = "TRITON_VLM_CPU_FORWARD"  # "1" (default): one C call per small decode forward; "0": the per-call path

FORWARD_SOURCE = r"""
typedef int (*gemv_fn)(const float *x, int64_t rows, int64_t ldx, int64_t K, const float *w, int64_t Kp,
                       int64_t N, const float *bias, float *y, int64_t ldy);

typedef struct { const float *w; int64_t n, k, kp; const float *bias; } Lin; /* a packed weight (gemv.Layout) */

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
} ModelW;

static int lin(const ModelW *m, const Lin *l, const float *x, int64_t rows, float *y) {
    return m->gemv(x, rows, l->k, l->k, l->w, l->kp, l->n, l->bias, y, l->n);
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
"""


class _Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kp", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class _LayerW(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Lin), ("o", _Lin),
                ("gate_up", _Lin), ("down", _Lin)]


class _ModelW(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("eps", ctypes.c_float), ("final_eps", ctypes.c_float), ("layer", ctypes.POINTER(_LayerW)),
                ("norm", ctypes.c_void_p), ("lm_head", _Lin), ("layer_stride", ctypes.c_int64),
                ("gemv", ctypes.c_void_p)]


class _LoraMod(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("r", ctypes.c_int64)]


MAX_TABLES = 16  # LoRA tables kept per adapter set (one per row map)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the C side's order


def _fp32_matrix(t: torch.Tensor, rows: int, cols: int) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" and t.shape == (rows, cols)


def _lin(linear, kernel: gemv.Kernel) -> Optional[_Lin]:
    """A `model.Linear` as the C side reads it, or None when its weight is not in the gemv layout."""
    lay = kernel.layout(linear.weight) if linear.weight.is_mkldnn else None
    bias = linear.bias
    if lay is None or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                             or bias.shape != (lay.n,))):
        return None
    return _Lin(lay.ptr, lay.n, lay.k, lay.kp, None if bias is None else bias.data_ptr())


class Forward:
    """One model's decode forward in C: `run(step, x, k_pool, v_pool, adapters)`; built by `for_model` (None
    where it cannot run). Holds the pointer tables; the model holds the tensors they point into."""

    def __init__(self, fn, model, layers: list[_LayerW], lm_head: _Lin, gemv_addr: int):
        c = model.config
        self._fn = fn
        self._layers = (_LayerW * len(layers))(*layers)
        self._w = _ModelW(len(layers), c.hidden_size, layers[0].gate_up.n // 2, model.layers[0].eps,
                          c.rms_norm_eps, ctypes.cast(self._layers, ctypes.POINTER(_LayerW)),
                          model.norm.data_ptr(), lm_head, 0, gemv_addr)
        self._model_layers = model.layers  # each layer's window is read at every call
        self.vocab = lm_head.n

    @classmethod
    def for_model(cls, model) -> Optional["Forward"]:
        lib, gk = _library(), gemv.kernel(_pack)
        if lib is None or gk is None:
            return None
        lins = [[_lin(lin, gk) for lin in layer.linears()] for layer in model.layers]  # qkv, o, gate_up, down
        head = _lin(model.lm_head, gk)
        norms = [model.norm] + [t for layer in model.layers for t in (layer.input_norm, layer.post_norm)]
        if head is None or any(x is None for row in lins for x in row) or not all(
                t.dtype == torch.float32 and t.is_contiguous() and t.shape == (model.config.hidden_size,)
                for t in norms):
            return None
        layers = [_LayerW(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *row)
                  for layer, row in zip(model.layers, lins)]
        return cls(lib, model, layers, head, ctypes.cast(gk._fn, ctypes.c_void_p).value)

    def run(self, step: cpu_decode.DecodeStep, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            adapters=None) -> Optional[torch.Tensor]:
        """x [rows <= 4, 1, hidden] fp32 embeddings; `step` checked for this batch (`cpu_decode.Kernel.step`);
        k_pool, v_pool [layers, slots, kv_heads, hd] (the cache's, written); `adapters` a `lora.LoraBatch` of these
        rows or None -> logits [rows, vocab] fp32, or None, before anything is written, when the adapters'
        tensors are not in a form the C side reads (`lora_table`): run that step layer by layer."""
        rows = x.shape[0]
        if not 0 < rows <= gemv.MAX_ROWS:
            raise ValueError(f"C decode forward: {rows} rows, 1 to {gemv.MAX_ROWS}")
        if rows != step.rows or x.numel() != rows * self._w.hidden or x.dtype != torch.float32:
            raise ValueError(f"C decode forward: x must be [{step.rows}, 1, {self._w.hidden}] fp32 (the step's rows), "
                             f"got {x.dtype} {tuple(x.shape)}")
        x = x.reshape(rows, -1).contiguous()
        for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):  # the pools the step's slots were checked for
            if (not t.is_contiguous() or t.dtype != torch.float32 or t.shape[0] != len(self._model_layers)
                    or t.shape[1:] != step.kv_shape):
                raise ValueError(f"C decode forward: {name} must be a contiguous fp32 [{len(self._model_layers)}, "
                                 f"{', '.join(map(str, step.kv_shape))}] pool, got {t.dtype} {tuple(t.shape)}")
        lora, keep, h = None, None, None
        if adapters is not None:
            lora, keep, widest = self.lora_table(adapters, rows)
            if lora is None:
                return None
            h = torch.empty(rows * max(widest, 1), dtype=torch.float32)  # the LoRA's [rows, r] scratch
        self._w.layer_stride = k_pool.stride(0)
        layers = self._model_layers
        masks = (ctypes.c_void_p * len(layers))(*(step.mask_ptr(layer.window) for layer in layers))
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)  # [rows, vocab]
        rc = self._fn(ctypes.byref(self._w), step.ref, masks, x.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                      logits.data_ptr(), lora, None if h is None else h.data_ptr())
        del keep  # the adapter tensors the table pointed into: alive until the call returned
        if rc != 0:
            raise ValueError(f"C decode forward failed: {cpu_decode.ERRORS.get(rc, rc)}")
        return logits

    def lora_table(self, adapters, rows: int) -> tuple[Optional[ctypes.Array], list, int]:
        """The C side's view of a `lora.LoraBatch` for `rows` rows: ([layers x 7] LoraMod, the tensors it points
        into, the widest stack's rank), or (None, [], 0) when a stack is not a contiguous fp32 [r, in] / [out, r]
        pair on the CPU (that step then runs layer by layer). Kept with the adapter set's stacks per row map
        (consecutive decode steps of the same requests reuse it; the set's stacks never change once built)."""
        key = (id(self), rows, adapters.row_key)
        views = adapters.views
        found = views.get(key)
        if found is None:
            found = views[key] = self._lora_table(adapters, rows)
            while len(views) > MAX_TABLES:  # row maps of past batches
                views.pop(next(iter(views)))
        return found

    def _lora_table(self, adapters, rows: int) -> tuple[Optional[ctypes.Array], list, int]:
        hid, inter = self._w.hidden, self._w.inter
        layer0 = self._layers[0]
        q_out, kv_out = self._model_layers[0].qkv_proj.parts[0][1], self._model_layers[0].qkv_proj.parts[1][1]
        shapes = {"q_proj": (hid, q_out), "k_proj": (hid, kv_out), "v_proj": (hid, kv_out),
                  "o_proj": (layer0.o.k, hid), "gate_proj": (hid, inter), "up_proj": (hid, inter),
                  "down_proj": (inter, hid)}  # (in, out)
        table = (_LoraMod * (len(self._model_layers) * len(LORA_MODULES)))()
        keep: list = []
        widest = 0
        for i in range(len(self._model_layers)):
            for j, module in enumerate(LORA_MODULES):
                stack = adapters.stack(i, module)
                if stack is None:
                    continue
                r = stack.a.shape[0]
                n_in, n_out = shapes[module]
                mask = adapters.mask(stack.layout)  # [rows, 1, r]
                if not (_fp32_matrix(stack.a, r, n_in) and _fp32_matrix(stack.b, n_out, r)
                        and _fp32_matrix(mask.reshape(-1, r), rows, r) and mask.is_contiguous()):
                    return None, [], 0
                table[i * len(LORA_MODULES) + j] = _LoraMod(stack.a.data_ptr(), stack.b.data_ptr(), mask.data_ptr(), r)
                keep += [stack.a, stack.b, mask]
                widest = max(widest, r)
        return table, keep, widest


def _pack(weight: torch.Tensor) -> torch.Tensor:
    from .gemm import pack  # noqa: PLC0415 - gemm imports gemv; the kernel is already built by then
    return pack(weight)


def enabled() -> bool:
    return _once.enabled()


def _library():
    """The compiled forward (None where it cannot be built or is switched off), once per process."""
    return _once.get()


def _bind(lib: ctypes.CDLL):
    fn = lib.triton_vlm_decode_forward
    p = ctypes.c_void_p
    fn.argtypes = [p, p, p, p, p, p, p, p, p]
    fn.restype = ctypes.c_int
    return fn


def _load():
    return cbuild.load_checked(_build, _bind, lambda fn: None, "C decode forward", "decode steps run layer by layer",
                               "decode steps of 1-4 rows without adapters run as one call (checked per model)")


_once = cbuild.Once(ENV, _load)


def _build() -> Path:
    return cbuild.build("decode_forward", cpu_decode.C_SOURCE + FORWARD_SOURCE, cpu_decode.FLAGS)
