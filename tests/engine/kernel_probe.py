"""Run by test_kernels_anywhere.py in a subprocess (a sanitizer preloaded, another ISA, the stub's locale):
builds the CPU kernels the way a model load does, runs each against torch, and prints one JSON line.

    python kernel_probe.py check OUT.pt   every kernel vs torch; the outputs saved for a bit-for-bit comparison
    python kernel_probe.py overflow       a planted out-of-bounds read through the gemv kernel (sanitizer control)
    python kernel_probe.py engine MODEL   an Engine on MODEL generates (the llm's load, as the stub runs it)
"""
from __future__ import annotations

import json
import locale
import logging
import sys
import tempfile

import torch
import torch.nn.functional as F


def check(out_path: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from triton_vlm.engine.model import attention

    from triton_vlm.engine.cpu import gemm
    from triton_vlm.engine.cpu import cpu_decode
    from triton_vlm.engine.model.model import LlamaModel

    gk, dk = gemm.decode_kernel(), cpu_decode.kernel(attention.decode_torch)
    result = {"gemv": gk is not None, "decode": dk is not None, "forward": False}
    g = torch.Generator().manual_seed(0)
    saved = {}
    if gk is not None:
        for n, k in ((96, 64), (100, 60), (640, 384), (40, 24)):
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            packed = gemm.pack(w)  # alive while the kernel reads it
            lay = gk.layout(packed)
            for rows in range(1, 5):
                x = torch.randn(rows, k, generator=g)
                y = gk.run(x, lay, b)
                torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
                saved[f"gemv{n}x{k}x{rows}"] = y
    if dk is not None:
        assert dk.check(attention.decode_torch) is None
        x, d, w = torch.randn(3, 1, 200, generator=g), torch.randn(3, 1, 200, generator=g), torch.randn(200, generator=g)
        saved["norm"] = dk.add_rms_norm(x, d, w, 1e-6)[1]
        saved["silu"] = dk.silu_mul(torch.randn(3, 1, 400, generator=g) * 20)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)
        cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        LlamaForCausalLM(cfg).eval().save_pretrained(tmp)
        m = LlamaModel.from_pretrained(tmp)
        built = m.c_forward()
        result["forward"] = built is not None
        if built is not None:
            assert m._check_c_forward(built) is None  # logits and cache writes bit for bit the layer path's
            cache = m.new_cache(8, 4)
            rows = [cache.new_row() for _ in range(2)]
            m.forward(m.embed(torch.tensor([[5, 6, 7], [8, 9, 10]])), cache.plan(rows, 3), cache)
            saved["forward"] = m.forward(m.embed(torch.tensor([[11], [12]])), cache.plan(rows, 1), cache)
    torch.save(saved, out_path)
    return result


def overflow() -> dict:
    """The gemv kernel told a weight has more K rows than its buffer holds: it reads past the buffer's end."""
    from triton_vlm.engine.cpu import gemm
    from triton_vlm.engine.cpu import gemv

    gk = gemm.decode_kernel()
    w = gemm.pack(torch.randn(64, 16))
    lay = gk.layout(w)
    big = gemv.Layout(lay.ptr, lay.n, lay.k * 64, lay.kp * 64)
    gk.run(torch.randn(1, lay.k * 64), big, None)
    return {"overflow": "not detected"}


def engine(model_dir: str) -> dict:
    from triton_vlm.engine.engine import Engine, EngineConfig
    from triton_vlm.params import GenerationParams, GenerationRequest

    eng = Engine(model_dir, EngineConfig(device="cpu", dtype="float32"))
    out = eng.generate([GenerationRequest("a", [1, 40, 41, 42], GenerationParams(max_tokens=6, min_tokens=6))])
    tokens = [r for r in out["a"] if r.final][0].sequences[0].token_ids
    return {"tokens": tokens, "encoding": locale.getpreferredencoding(False)}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    what = sys.argv[1]
    found = {"check": lambda: check(sys.argv[2]), "overflow": overflow, "engine": lambda: engine(sys.argv[2])}[what]()
    print("RESULT " + json.dumps(found), flush=True)
