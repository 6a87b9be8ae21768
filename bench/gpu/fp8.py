"""The GPU check's FP8 rows (issue 38): the big step's model quantized offline to block-wise FP8 ([128, 128]
`weight_scale_inv`, Qwen's `-FP8` layout, `demo/fp8_checkpoint.py`) on a fresh engine, against the big step's.

On a GPU the engine runs in bf16 and takes `quant/fp8_gpu.py`'s block-scaled products where they are chosen (a
Hopper device: the weights stay e4m3 in HBM), else dequantizes to bf16 at load; the row says which and why. The CPU
rehearsal (`--device cpu --tiny`) runs fp32 with the FP8 gemv (`engine/cpu/gemv_fp8.py`). Numbers (`fp8_*`): how
the projections are held, the choice's reason, the weights' bytes and share of the device's memory against the
big step's, TTFT and one stream's decode tok/s against the big step's, and greedy agreement with transformers on
the big step's reference prompts (its fp16 tokens: first divergence per prompt; FP8 activations change ulps, so
this is agreement, not equality).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from bench.gpu.report import Check


def fp8_rows(check: Check, big: dict) -> dict:
    """`big`: the big step's numbers so far (its `weights_bytes`, `one_stream_tok_s`)."""
    from bench.gpu import big as gb  # noqa: PLC0415
    from triton_vlm.demo.fp8_checkpoint import quantize_checkpoint  # noqa: PLC0415
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415
    from triton_vlm.quant import fp8_gpu  # noqa: PLC0415

    s = gb.TINY if check.tiny else gb.LLAVA_7B
    t0 = time.perf_counter()
    model_dir = quantize_checkpoint(check.big_dir, Path(check.tmp) / "big-fp8", "fp8-block", (128, 128))
    out: dict = {"fp8_quantize_s": round(time.perf_counter() - t0, 1)}
    dtype = "bfloat16" if check.device.type == "cuda" else check.big_dtype
    feats, _ = gb.image_features(check, check.big_dir, s, dtype)  # the tower is not quantized: the same features
    import json  # noqa: PLC0415

    prompts = gb.Prompts(feats, json.loads((model_dir / "config.json").read_text())["image_token_index"], s.vocab)
    prompts.n = 1 << 21  # other prompts than the big and flex steps'
    context = 1 << (prompts.length + max(s.stream_tokens, s.agreement_tokens)).bit_length()
    cfg = EngineConfig(device=str(check.device), dtype=dtype, max_rows=16, context_length=min(context, s.max_pos),
                       kv_cache_tokens=16 * (prompts.length + 2 * s.stream_tokens + 64))
    fp8_gpu._chosen.clear()  # decided (and logged) again for this engine
    t0 = time.perf_counter()
    engine = Engine(model_dir, cfg, tokenizer=gb.IdsTokenizer())
    weights = engine.memory.weights_bytes
    out |= {"fp8_engine_load_s": round(time.perf_counter() - t0, 1), "fp8_dtype": dtype,
            "fp8_held": engine.weights_info["held"], "fp8_weights": engine.weights_info["weights"],
            "fp8_choice": next(iter(fp8_gpu._chosen.values()), (None, "CPU: the FP8 gemv"))[1],
            "fp8_weights_mib": round(weights / 2**20, 1)}
    if big.get("weights_bytes"):
        out["fp8_vs_big_weights"] = round(weights / big["weights_bytes"], 3)
    if check.device.type == "cuda":
        out["fp8_weights_hbm_share"] = round(weights / torch.cuda.get_device_properties(check.device).total_memory, 4)
    try:
        gb.engine_batch(check, engine, [gb._request(prompts, "fp8-warm", 4)])
        run_one = lambda r: gb.engine_batch(check, engine, [r])[0]  # noqa: E731
        out |= {f"fp8_{k}": v for k, v in gb.latency_rows(check, run_one, prompts, s, "fp8").items()}
        if big.get("one_stream_tok_s") and out.get("fp8_one_stream_tok_s"):
            out["fp8_vs_big_one_stream"] = round(out["fp8_one_stream_tok_s"] / big["one_stream_tok_s"], 2)
        ref = getattr(check, "big_ref", None) or []
        if ref and check.left() > 15:
            reqs = [GenerationRequest(f"fp8-agree{i}", ids, GenerationParams(max_tokens=s.agreement_tokens,
                                                                             min_tokens=s.agreement_tokens),
                                      image_embeds=f.to(getattr(torch, dtype))) for i, (ids, f, _) in enumerate(ref)]
            _, got = gb.engine_batch(check, engine, reqs)
            div = [gb.first_divergence(got[f"fp8-agree{i}"], r[2]) for i, r in enumerate(ref)]
            out |= {"fp8_agreement_identical": sum(d == s.agreement_tokens for d in div),
                    "fp8_agreement_prompts": len(div), "fp8_first_divergence_median": statistics.median(div)}
    finally:
        engine.shutdown()
        del engine
        gb._free(check)
    check.note(f"fp8: {out}")
    return out
