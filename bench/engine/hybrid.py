"""A Qwen3.5-shaped hybrid model (random weights, scaled to a CPU): our engine vs `transformers` `generate()`.

    python -m bench.engine.hybrid                 # 4 requests of 200 prompt + 64 new tokens, one JSON line

The checkpoint is `demo/qwen35_checkpoint.py`'s builder at `--hidden` / `--layers` (3 Gated DeltaNet layers to 1
gated full-attention layer, the fixture's head shapes), fp32, one intra-op thread on both sides. Greedy requests of
random prompt ids with `min_tokens` = `max_tokens` (every request decodes its whole length): `transformers`
`Qwen3_5ForConditionalGeneration.generate()` one request at a time (the baseline), then the engine
(`triton_vlm.engine.Engine`, in process, no Triton) one request at a time and all at once. The tokens of every
run are checked equal to the baseline's; the rate is new tokens / wall seconds (prefill included).
"""
from __future__ import annotations

import argparse
import json
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
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
