"""A Qwen3.5-shaped hybrid model (random weights, scaled to a CPU): our engine vs `transformers` `generate()`.

    python -m bench.engine.hybrid                 # 4 requests of 200 prompt + 64 new tokens, one JSON line

The checkpoint is `demo/qwen35_checkpoint.py`'s builder at `--hidden` / `--layers` (3 Gated DeltaNet layers to 1
gated full-attention layer, the fixture's head shapes), fp32, one intra-op thread on both sides. Greedy requests of
random prompt ids with `min_tokens` = `max_tokens` (every request decodes its whole length): `transformers`
`Qwen3_5ForConditionalGeneration.generate()` one request at a time (the baseline), then the engine
(`triton_vlm.engine.Engine`, in process, no Triton) one request at a time and all at once. The tokens of every
run are checked equal to the baseline's; the rate is new tokens / wall seconds (prefill included).

    python -m bench.engine.hybrid --fp8 [--hidden 1024 --layers 8 --rounds 5]

FP8 (issue 38): the same builder's checkpoint against its block-wise FP8 copy as Qwen's `-FP8` releases lay it out
(`demo.fp8_checkpoint.quantize_checkpoint`: e4m3 projections with bf16 weight_scale_inv per [64, 64] block, the
fixture's 64-row k/v projections being too small for [128, 128]; the linear layers' in_proj_a / in_proj_b, conv,
norms, embedding and lm_head in bf16), each served in fp32 by the engine in process: `fp32`, `fp8` (projections
held e4m3 and read by the FP8 gemv, bf16 ones by the 16-bit gemv; kernels forced on) and `fp8-upcast` (the same
files with both gemvs off: every weight dequantized / upcast to fp32 at load, as before this change). One stream:
greedy requests of `--prompt` random ids decoding `--new` tokens (min_tokens), the sides alternating `--rounds`
times, each keeping its best rate; the rate is decoded tokens after the first / the seconds after the first.
Also the bytes of the engine's weight tensors (`profile.model_bytes`), what each side holds (`weights_held`), and
whether fp8's tokens equal fp8-upcast's (the same values, other products).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--fp8", action="store_true", help="one stream and weights' bytes: fp32 vs its FP8 copy (doc)")
    ap.add_argument("--rounds", type=int, default=3, help="--fp8: alternate the sides this many times")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.fp8:
        return fp8_sides(a)
    from transformers import Qwen3_5ForConditionalGeneration  # noqa: PLC0415

    from triton_vlm.demo.qwen35_checkpoint import build_qwen3_5  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = build_qwen3_5(Path(tmp) / "qwen3_5", seed=1, hidden=a.hidden, layers=a.layers,
                             max_position_embeddings=max(1024, 2 * (a.prompt + a.new)))
        g = torch.Generator().manual_seed(0)
        prompts = [[1] + torch.randint(5, 370, (a.prompt - 1,), generator=g).tolist() for _ in range(a.requests)]
        ref = Qwen3_5ForConditionalGeneration.from_pretrained(path).eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            want = [ref.generate(input_ids=torch.tensor([ids]), max_new_tokens=a.new, min_new_tokens=a.new,
                                 do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
        hf_s = time.perf_counter() - t0
        alone_s, together_s, equal = _engine(path, prompts, a.new, want)
    tokens = a.requests * a.new
    out = {"bench": "hybrid", "args": vars(a), "machine": machine.describe(), "equal_to_generate": equal,
           "transformers_s": round(hf_s, 3), "engine_alone_s": round(alone_s, 3),
           "engine_together_s": round(together_s, 3), "transformers_tok_s": round(tokens / hf_s, 1),
           "engine_alone_tok_s": round(tokens / alone_s, 1), "engine_together_tok_s": round(tokens / together_s, 1)}
    print(json.dumps(out))
    return out


def _engine(path: Path, prompts: list[list[int]], new: int, want: list[list[int]]) -> tuple[float, float, bool]:
    """(seconds one request at a time, seconds all at once, every run's tokens equal to `want`)."""
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415

    eng = Engine(path, EngineConfig(max_rows=max(8, len(prompts)), kv_cache_tokens=len(prompts) * 2048,
                                    prefill_chunk=512))

    def reqs(tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", ids, GenerationParams(max_tokens=new, min_tokens=new))
                for i, ids in enumerate(prompts)]

    try:
        t0 = time.perf_counter()
        alone = [eng.generate([r])[r.request_id][-1].sequences[0].token_ids for r in reqs("a")]
        alone_s = time.perf_counter() - t0
        batch = reqs("b")
        t0 = time.perf_counter()
        res = eng.generate(batch)
        together_s = time.perf_counter() - t0
    finally:
        eng.shutdown()
    together = [res[r.request_id][-1].sequences[0].token_ids for r in batch]
    return alone_s, together_s, alone == want and together == want


FP8_BLOCK = (64, 64)  # the builder's k/v projections have 64 rows (2 heads x 32)


def fp8_sides(a) -> dict:
    """`--fp8` (module doc): the three sides' one-stream rate, weights' bytes and what they hold, one JSON line."""
    from bench.engine.fp8 import FORCED  # noqa: PLC0415
    from triton_vlm.demo.fp8_checkpoint import quantize_checkpoint  # noqa: PLC0415
    from triton_vlm.demo.qwen35_checkpoint import build_qwen3_5  # noqa: PLC0415
    from triton_vlm.engine.cpu import gemv_bf16, gemv_fp8  # noqa: PLC0415
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from triton_vlm.engine.profile import model_bytes  # noqa: PLC0415

    os.environ.update(FORCED)
    g = torch.Generator().manual_seed(0)
    ids = [1] + torch.randint(5, 370, (a.prompt - 1,), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_qwen3_5(Path(tmp) / "qwen3_5", seed=1, hidden=a.hidden, layers=a.layers,
                             max_position_embeddings=max(1024, 2 * (a.prompt + a.new)))
        fp8 = quantize_checkpoint(base, Path(tmp) / "qwen3_5-fp8", "fp8-block", FP8_BLOCK, torch.bfloat16)
        engines = {}
        for name, path, on in (("fp32", base, "1"), ("fp8", fp8, "1"), ("fp8-upcast", fp8, "0")):
            os.environ[gemv_fp8.ENV] = on
            os.environ[gemv_bf16.ENV] = on
            gemv_fp8._once.reset()
            gemv_bf16._once.reset()
            engines[name] = Engine(path, EngineConfig(max_rows=1, kv_cache_tokens=max(1024, 2 * (a.prompt + a.new)),
                                                      prefill_chunk=512))
        best, tokens = {name: 0.0 for name in engines}, {}
        try:
            for r in range(a.rounds):
                for name, eng in engines.items():
                    rate, tokens[name] = _one_stream(eng, f"{name}{r}", ids, a.new)
                    best[name] = max(best[name], rate)
            sides = {name: {"held": eng.weights_info["held"], "weights_bytes": model_bytes(eng.model),
                            "tok_s": round(best[name], 1)} for name, eng in engines.items()}
        finally:
            for eng in engines.values():
                eng.shutdown()
    f32 = sides["fp32"]
    out = {"bench": "hybrid-fp8", "args": vars(a), "machine": machine.describe(), "load_average": os.getloadavg(),
           "sides": sides, "fp8_tokens_equal_upcast": tokens["fp8"] == tokens["fp8-upcast"],
           "fp8_over_fp32": {"tok_s": round(sides["fp8"]["tok_s"] / f32["tok_s"], 2),
                             "weights_bytes": round(sides["fp8"]["weights_bytes"] / f32["weights_bytes"], 3)}}
    print(json.dumps(out))
    return out


def _one_stream(eng, rid: str, ids: list[int], new: int) -> tuple[float, list[int]]:
    """(decoded tokens after the first / the seconds after it, the tokens) of one greedy request alone."""
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415

    stamps, done, last = [], [False], [None]

    def on_result(res) -> None:
        stamps.append(time.perf_counter())
        done[0], last[0] = done[0] or res.final, res

    eng.submit(GenerationRequest(rid, list(ids), GenerationParams(max_tokens=new, min_tokens=new, stream=True)),
               on_result)
    while not done[0]:
        eng.step()
    return (new - 1) / (stamps[-1] - stamps[0]), last[0].sequences[0].token_ids


if __name__ == "__main__":
    main()
