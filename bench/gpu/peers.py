"""The GPU check's peers step: the strongest baselines a bare GPU image has, on the big step's model (issue 39 item 1).

The big step compares the engine with `generate()` one request at a time with a dynamic cache: the weakest thing a
GPU user would compare with. This step runs, on the same saved random model, in the same dtype and process:
- **transformers static cache + torch.compile** (`generate(..., cache_implementation="static")`: on CUDA transformers
  compiles the decoding forward itself, `CompileConfig`'s defaults, CUDA graphs through mode "reduce-overhead";
  a gpt-fast-class decoder, the one-stream bandwidth bar): TTFT (median of 3 one-token requests) and one stream's
  decode tok/s, measured after two warm-up runs of the same lengths (compilation and graph capture happen there);
- **transformers continuous batching** (`generate_batch`, its paged attention and scheduler): greedy tok/s at 64 and
  256 concurrent (`new_tokens` each, EOS off so every request generates all of them).
Prompts are text ids of the big step's prompt length (its image placeholders replaced by text ids: the language
model's work per token is the same; `generate_batch` takes token ids only). Ratios against the big step's rows of
the engine (`ours_vs_static_one_stream`, `ours_vs_cb_greedy64`) feed the check's targets.

On a CPU (the suite's rehearsal) transformers does not compile (`peer_static_compiled` False) and the continuous
batching cache is sized small (`ContinuousBatchingConfig`: its default sizing from free memory and warm-up take
tens of seconds on a CPU); 4 and 8 concurrent stand in for 64 and 256.
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.gpu.report import Check


def _prompt(n: int, length: int, vocab: int) -> list[int]:
    """BOS then `length - 1` text ids, distinct per `n` (no prefix shared between requests)."""
    span = vocab - 10
    return [1] + [5 + (n * 7919 + 31 * i) % span for i in range(length - 1)]


def _load(check: Check, model_dir, dtype: str):
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    t0 = time.perf_counter()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                        device_map=str(check.device)).eval()
    return model, round(time.perf_counter() - t0, 1)


def _generate(check: Check, model, ids: list[int], tokens: int) -> float:
    """One request through `generate()` with a static cache: wall seconds for exactly `tokens` new tokens."""
    x = torch.tensor([ids], device=check.device)
    _sync(check)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, num_beams=1, cache_implementation="static", pad_token_id=0)
    _sync(check)
    if out.shape[1] != len(ids) + tokens:
        raise RuntimeError(f"static-cache generate returned {out.shape[1] - len(ids)} tokens, not {tokens}")
    return time.perf_counter() - t0


def static_rows(check: Check, model, length: int, vocab: int, stream_tokens: int) -> dict:
    """TTFT and one stream's decode tok/s of transformers with a static cache (compiled on CUDA)."""
    t0 = time.perf_counter()
    for w in range(2):  # compile + graph capture of both lengths happen here, not in the timed runs
        _generate(check, model, _prompt(1000 + w, length, vocab), 1)
        _generate(check, model, _prompt(1010 + w, length, vocab), stream_tokens)
    warm = time.perf_counter() - t0
    ttft = statistics.median(_generate(check, model, _prompt(i, length, vocab), 1) for i in range(3))
    wall = _generate(check, model, _prompt(3, length, vocab), stream_tokens)
    compiled = hasattr(model, "_compiled_call")  # transformers compiled its decoding forward (CUDA only)
    return {"peer_static_warmup_s": round(warm, 1), "peer_static_compiled": compiled,
            "peer_static_ttft_ms": round(1e3 * ttft, 1),
            "peer_static_one_stream_tok_s": round((stream_tokens - 1) / max(wall - ttft, 1e-9), 1)}


def cb_rows(check: Check, model, length: int, vocab: int, new_tokens: int, counts: tuple[int, ...]) -> dict:
    """Greedy tok/s of `generate_batch` (transformers' continuous batching) at each concurrency in `counts`."""
    from transformers import GenerationConfig  # noqa: PLC0415
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: PLC0415

    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cpu = check.device.type == "cpu"
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=4 * max(counts) * -(-(length + new_tokens) // 16),
                                  max_batch_tokens=2048) if cpu else None
    out: dict = {}
    for n in counts:
        if check.left() < 15:
            check.note(f"peers: continuous batching at {n} skipped, {check.left():.0f} s left")
            continue
        prompts = [_prompt(10_000 * n + i, length, vocab) for i in range(n)]
        _sync(check)
        t0 = time.perf_counter()
        res = model.generate_batch(prompts, generation_config=cfg, continuous_batching_config=cb, warmup=not cpu)
        _sync(check)
        wall = time.perf_counter() - t0
        made = sum(len(r.generated_tokens) for r in res.values())
        if len(res) != n or made != n * new_tokens:
            raise RuntimeError(f"generate_batch at {n}: {len(res)} results, {made} tokens (want {n * new_tokens})")
        out[f"peer_cb_greedy{n}_tok_s"] = round(made / wall, 1)
    return out


def _sync(check: Check) -> None:
    if check.device.type == "cuda":
        torch.cuda.synchronize(check.device)


def run_peers(check: Check, big: dict) -> dict:
    """The peers' rows on the big step's saved model, and the engine's ratios against them (`big`: its numbers)."""
    from bench.gpu import big as gb  # noqa: PLC0415

    if check.big_dir is None or "prompt_tokens" not in big:
        raise RuntimeError("the big step saved no model: nothing to compare with")
    s = gb.TINY if check.tiny else gb.LLAVA_7B
    counts = (4, 8) if check.device.type == "cpu" else (s.greedy_concurrency, 256)
    model, load_s = _load(check, check.big_dir, check.big_dtype)
    out: dict = {"peer_load_s": load_s, "peer_prompt_tokens": big["prompt_tokens"], "peer_cb_counts": list(counts)}
    try:
        gb.attempt(check, out, "peer_static",
                   lambda: static_rows(check, model, big["prompt_tokens"], s.vocab, s.stream_tokens))
        gb.attempt(check, out, "peer_cb",
                   lambda: cb_rows(check, model, big["prompt_tokens"], s.vocab, s.new_tokens, counts))
    finally:
        del model
        gb._free(check)
    if big.get("one_stream_tok_s") and out.get("peer_static_one_stream_tok_s"):
        out["ours_vs_static_one_stream"] = round(big["one_stream_tok_s"] / out["peer_static_one_stream_tok_s"], 2)
    if big.get("fusion_one_stream_tok_s") and out.get("peer_static_one_stream_tok_s"):  # the fused decode step's
        out["fusion_vs_static_one_stream"] = round(big["fusion_one_stream_tok_s"]
                                                   / out["peer_static_one_stream_tok_s"], 2)
    ours, theirs = big.get(f"greedy{s.greedy_concurrency}_tok_s"), out.get(f"peer_cb_greedy{counts[0]}_tok_s")
    if ours and theirs and counts[0] == s.greedy_concurrency:  # the same concurrency on both sides
        out["ours_vs_cb_greedy64"] = round(ours / theirs, 2)
    check.note(f"peers: {out}")
    return out
