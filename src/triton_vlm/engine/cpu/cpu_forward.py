"""A whole decode forward of 1 to 4 rows as one C call on a CPU: embeddings in, fp32 logits out, LoRA included.

`LlamaModel.forward` on a CPU already runs a decode step's pieces in C: the products through `gemv.py`, the
attention, residual adds + RMSNorms and SiLU gates through `cpu_decode.py`, each a ctypes call from the
layer loop in Python. For the rows of a small decode step this module runs that same sequence of the same C
functions from C: per layer RMSNorm, q/k/v product (+ bias), rotary + KV write + attention over the paged
cache, o product, residual add + RMSNorm, gate/up product, SiLU gate, down product, residual add + the next
norm; then the final norm and the lm_head. The products call the gemv library's own function (its address is
passed in), the other steps are `csrc/decode.c` (included by `csrc/forward.c`) compiled with the same flags, so without adapters the
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

FP8 weights (`gemv_fp8.py`): a projection kept as e4m3 bytes + fp32 scales is read in place by the FP8 gemv's own
function (no fp32 copy), the one the layer-by-layer path calls, so its logits are bit for bit that path's too.
bf16 / fp16 weights kept as stored (`gemv_bf16.py`: the lm_head of an FP8 release, every projection of a bf16
checkpoint served in fp32) are read in place by the 16-bit gemv's function, likewise.

Where it applies (`LlamaModel.forward`): a CPU fp32 model whose every projection has the gemv layout or the FP8
gemv's, a decode step (q_len 1, last-position logits) of at most `gemv.MAX_ROWS` rows, no adapter or a
`LoraBatch` whose stacks are contiguous fp32 CPU tensors, and the C decode kernels on. Anything else takes the
layer-by-layer path. Chosen by measurement: at a model's first load on a machine the call races the
layer-by-layer path on that model (`model.LlamaModel.c_forward`, cached beside the build per model shape).
`TRITON_VLM_CPU_FORWARD`: "auto" (default, measured), "1" (wherever it checks), "0" (layer by layer).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from . import cbuild, cpu_decode, gemv


ENV = "TRITON_VLM_CPU_FORWARD"  # "auto" (default): one C call per small decode step where faster; "1"; "0"



class _Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kp", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bm", ctypes.c_int64),
                ("bn", ctypes.c_int64), ("half", ctypes.c_int64)]


class _LayerW(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Lin), ("o", _Lin),
                ("gate_up", _Lin), ("down", _Lin)]


class _ModelW(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("eps", ctypes.c_float), ("final_eps", ctypes.c_float), ("layer", ctypes.POINTER(_LayerW)),
                ("norm", ctypes.c_void_p), ("lm_head", _Lin), ("layer_stride", ctypes.c_int64),
                ("gemv", ctypes.c_void_p), ("gemv8", ctypes.c_void_p), ("gemv16", ctypes.c_void_p)]


class _LoraMod(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("r", ctypes.c_int64)]


MAX_TABLES = 16  # LoRA tables kept per adapter set (one per row map)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the C side's order


def _fp32_matrix(t: torch.Tensor, rows: int, cols: int) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" and t.shape == (rows, cols)


def _lin(linear, kernel: gemv.Kernel) -> Optional[_Lin]:
    """A `model.Linear` as the C side reads it, or None when its weight is in none of the gemv layout, the FP8
    gemv's (`gemv_fp8.PackedFp8`: e4m3 bytes + fp32 scales) and the 16-bit gemv's (`gemv_bf16.PackedHalf`), the
    last two read in place (no fp32 copy)."""
    w8, w16 = linear.fp8_packed, linear.half_packed
    lay = kernel.layout(linear.weight) if w8 is None and w16 is None and linear.weight.is_mkldnn else None
    n = w8.n if w8 is not None else w16.n if w16 is not None else lay.n if lay is not None else None
    bias = linear.bias
    if n is None or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                           or bias.shape != (n,))):
        return None
    b = None if bias is None else bias.data_ptr()
    if w8 is not None:
        return _Lin(w8.data.data_ptr(), w8.n, w8.k, w8.k, b, w8.scale.data_ptr(), w8.bm, w8.bn, 0)
    if w16 is not None:
        return _Lin(w16.data.data_ptr(), w16.n, w16.k, w16.k, b, None, 0, 0, w16.kind + 1)
    return _Lin(lay.ptr, lay.n, lay.k, lay.kp, b, None, 0, 0, 0)


class Forward:
    """One model's decode forward in C: `run(step, x, k_pool, v_pool, adapters)`; built by `for_model` (None
    where it cannot run). Holds the pointer tables; the model holds the tensors they point into."""

    def __init__(self, fn, model, layers: list[_LayerW], lm_head: _Lin, gemv_addr: int, gemv8_addr: Optional[int],
                 gemv16_addr: Optional[int] = None):
        c = model.config
        self._fn = fn
        self._layers = (_LayerW * len(layers))(*layers)
        self._w = _ModelW(len(layers), c.hidden_size, layers[0].gate_up.n // 2, model.layers[0].eps,
                          c.rms_norm_eps, ctypes.cast(self._layers, ctypes.POINTER(_LayerW)),
                          model.norm.data_ptr(), lm_head, 0, gemv_addr, gemv8_addr, gemv16_addr)
        self._model_layers = model.layers  # each layer's window is read at every call
        self.vocab = lm_head.n

    @classmethod
    def for_model(cls, model) -> Optional["Forward"]:
        lib, gk = _library(), gemv.kernel(_pack)
        if lib is None or gk is None or any(lay.q_norm is not None or lay.moe is not None for lay in model.layers):
            return None  # (QK-norm, experts: layer by layer, the norms and experts in torch between the C kernels)
        lins = [[_lin(lin, gk) for lin in layer.linears()] for layer in model.layers]  # qkv, o, gate_up, down
        head = _lin(model.lm_head, gk)
        norms = [model.norm] + [t for layer in model.layers for t in (layer.input_norm, layer.post_norm)]
        if head is None or any(x is None for row in lins for x in row) or not all(
                t.dtype == torch.float32 and t.is_contiguous() and t.shape == (model.config.hidden_size,)
                for t in norms):
            return None
        layers = [_LayerW(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *row)
                  for layer, row in zip(model.layers, lins)]
        fp8 = {lin.fp8_kernel for layer in model.layers for lin in layer.linears() if lin.fp8_packed is not None}
        gemv8 = ctypes.cast(next(iter(fp8))._fn, ctypes.c_void_p).value if fp8 else None  # (one kernel a process)
        half = {lin.half_kernel for lin in [model.lm_head] + [x for layer in model.layers for x in layer.linears()]
                if lin.half_packed is not None}
        gemv16 = ctypes.cast(next(iter(half))._fn, ctypes.c_void_p).value if half else None
        return cls(lib, model, layers, head, ctypes.cast(gk._fn, ctypes.c_void_p).value, gemv8, gemv16)

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


def mode() -> str:
    return _once.mode()


def library_path() -> Path:
    """The compiled forward's library (the key its per-model timings are cached under)."""
    return _build()


def _library():
    """The compiled forward (None where it cannot be built or is switched off), once per process."""
    return _once.get()


def _bind(lib: ctypes.CDLL):
    fn = lib.triton_vlm_decode_forward
    p = ctypes.c_void_p
    fn.argtypes = [p, p, p, p, p, p, p, p, p]
    fn.restype = ctypes.c_int
    return fn


SPEC = cbuild.Spec(ENV, "C decode forward", "decode steps run layer by layer",
                   "decode steps of 1-4 rows run as one call (checked and timed per model)", "the layer-by-layer path")


def _load():
    return cbuild.load_checked(_build, _bind, lambda fn: None, SPEC)


_once = cbuild.Once(ENV, _load)


def _build() -> Path:
    return cbuild.build("decode_forward", "forward.c", cpu_decode.FLAGS)
