"""What grammar-constrained decoding costs: 16 concurrent requests guided vs the same unguided, in-process engine.

    python -m bench.engine.guided                  # the bench model, 16 requests x 48 tokens, 5 rounds per mode

Modes (each round: 16 greedy requests submitted at once, the engine stepped until all finish; tok/s = new tokens
of all 16 / wall time, the prefill included, medians over the rounds):
- `none`: unconstrained, `min_tokens = max_tokens` (every request generates max_tokens);
- `regex`: guided by a regex that never forces the end (`[a-z ,.]+`), also `min_tokens = max_tokens`: the same
  token count as `none`, so the difference is the guide's cost (a matcher per row, one bitmask fill and one masked
  fill for all the guided rows of the step, in the batched greedy step);
- `json_schema`: a small schema (an object of an enum, an integer and a short string), compact JSON; requests end
  when their document completes, so tok/s counts the tokens they generated.
Step cost: `greedy_step` alone over [16, V] logits, every row guided vs none (min of 50), the guide's own cost in
a decode step without the model's noise.
Guided sampling step cost: 16 guided sampling requests in one `sample_step` (every request's path since the
per-request sampler was removed), and the grammar's mask per request vs for all rows (`sampling_step_cost`).
Compile time: the first compilation of each guide (a fresh `GuideCompiler`, the tokenizer info built first and
timed on its own) vs the same guide again (the LRU's hit), medians of 20 cached calls. The ratio to unconstrained
is taken per round (modes interleaved) and its median printed: on a shared machine the absolute tok/s drift.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common.machine import describe as describe_machine, line
from bench.common.model import describe, ensure_bench_model

PROMPT = "USER: Describe the image as JSON. ASSISTANT:"
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"shape": {"enum": ["circle", "square", "triangle"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 999},
                   "note": {"type": "string", "maxLength": 24}},
    "required": ["shape", "count", "note"], "additionalProperties": False})
GUIDES = {"none": None, "regex": ("regex", "[a-z ,.]+"), "json_schema": ("json_schema", SCHEMA)}


def one_round(engine, mode: str, n: int, max_tokens: int, tag: str) -> tuple[int, float]:
    """-> (new tokens of all n requests, wall seconds)."""
    from triton_vlm.params import GenerationParams, GenerationRequest, GuidedDecoding  # noqa: PLC0415

    ids = engine.tokenizer(PROMPT)["input_ids"]
    guide = GUIDES[mode]
    min_tokens = 0 if mode == "json_schema" else max_tokens
    params = GenerationParams(max_tokens=max_tokens, min_tokens=min_tokens,
                              guided=None if guide is None else GuidedDecoding(*guide))
    reqs = [GenerationRequest(f"{tag}-{i}", list(ids) + [7 + i], params) for i in range(n)]  # distinct prompts
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    wall = time.perf_counter() - t0
    tokens = 0
    for r in reqs:
        last = out[r.request_id][-1]
        if last.error is not None:
            raise RuntimeError(f"{r.request_id}: {last.error}")
        tokens += len(last.sequences[0].token_ids)
    return tokens, wall


def compile_times(engine) -> dict:
    from triton_vlm.engine.search.guided import GuideCompiler  # noqa: PLC0415
    from triton_vlm.params import GuidedDecoding  # noqa: PLC0415

    t0 = time.perf_counter()
    compiler = GuideCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_ids)
    out = {"tokenizer_info_s": time.perf_counter() - t0}
    guides = {"json_schema": SCHEMA, "regex": "[a-z ,.]+", "ebnf_grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"',
              "json": ""}
    for kind, guide in guides.items():
        g = GuidedDecoding(kind, guide)
        t0 = time.perf_counter()
        compiler.compile(g)
        first = time.perf_counter() - t0
        cached = []
        for _ in range(20):
            t0 = time.perf_counter()
            compiler.compile(g)
            cached.append(time.perf_counter() - t0)
        out[kind] = {"first_ms": first * 1e3, "cached_ms": statistics.median(cached) * 1e3}
    return out


def step_cost(engine, rows: int, repeats: int = 50) -> dict:
    """The guide's own cost in one decode step, without the model: `greedy_step` over [rows, V] logits with every
    row guided (json_schema, fresh matchers each repeat) vs none; minimum over the repeats (robust to a loaded
    machine)."""
    import torch  # noqa: PLC0415

    from triton_vlm.engine.search.greedy import GreedySearch, greedy_step  # noqa: PLC0415
    from triton_vlm.engine.search.guided import new_matcher  # noqa: PLC0415
    from triton_vlm.params import GuidedDecoding  # noqa: PLC0415

    V = engine.model_config.vocab_size
    grammar = engine.guide_compiler().compile(GuidedDecoding("json_schema", SCHEMA))
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "json_schema"):
        best = float("inf")
        for _ in range(repeats):
            searches = [GreedySearch(max_new_tokens=8, eos_ids=engine.eos_ids, min_new_tokens=0,
                                     matcher=None if mode == "none" else new_matcher(grammar, engine.eos_ids))
                        for _ in range(rows)]
            t0 = time.perf_counter()
            greedy_step(searches, logits)
            best = min(best, time.perf_counter() - t0)
        out[mode] = best * 1e3
    return {f"greedy_step_{rows}_rows_ms": out}


def sampling_step_cost(engine, rows: int, steps: int = 8, repeats: int = 15) -> dict:
    """Guided sampling's own cost per decode step, without the model: `rows` requests (one row each, json_schema,
    temperature 1.3, top-k 50) stepped `steps` times over [rows, V] logits in one `sample_step` (one bitmask, one
    fill, one apply for every constrained row, one read-back; every request takes this path since the per-request
    sampler was removed), and the grammar's mask alone for the same rows: one `mask_rows` per request vs one for
    all (`mask_*`), alternated within each repeat; per step, minimum and median over the repeats."""
    import torch  # noqa: PLC0415

    from triton_vlm.engine.search.sampling_batch import SampleSearch, sample_step  # noqa: PLC0415
    from triton_vlm.params import GuidedDecoding  # noqa: PLC0415

    V, eos = engine.model_config.vocab_size, list(engine.eos_ids)
    grammar = engine.guide_compiler().compile(GuidedDecoding("json_schema", SCHEMA))
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(rows, V, generator=gen) * 4 for _ in range(steps)]
    sampling = dict(temperature=1.3, top_k=50, top_p=1.0)

    def batched() -> float:
        searches = [SampleSearch(num_rows=1, max_new_tokens=64, eos_ids=eos, min_new_tokens=0, seed=i,
                                 grammar=grammar, **sampling) for i in range(rows)]
        t0 = time.perf_counter()
        for x in logits:
            sample_step(searches, x, list(range(rows)))
        return (time.perf_counter() - t0) / steps

    from triton_vlm.engine.search.guided import mask_rows, new_matcher  # noqa: PLC0415

    matchers = [new_matcher(grammar, eos) for _ in range(rows)]

    def masks_per_request() -> float:  # the grammar alone: a bitmask, a fill and an apply per request
        t0 = time.perf_counter()
        for i in range(rows):
            mask_rows(logits[0][i:i + 1], [0], matchers[i:i + 1], V)
        return time.perf_counter() - t0

    def masks_batched() -> float:  # one bitmask, one fill, one apply for every row
        t0 = time.perf_counter()
        mask_rows(logits[0], range(rows), matchers, V)
        return time.perf_counter() - t0

    pairs = ((("batched", batched),),
             (("mask_per_request", masks_per_request), ("mask_batched", masks_batched)))
    times: dict[str, list[float]] = {name: [] for pair in pairs for name, _ in pair}
    for r in range(repeats):
        for pair in pairs:
            for name, f in (pair if r % 2 == 0 else pair[::-1]):  # alternated
                times[name].append(f())
    return {f"guided_sampling_step_{rows}_requests_ms": {
        k: {"min": min(v) * 1e3, "median": statistics.median(v) * 1e3} for k, v in times.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-only", action="store_true", help="the step costs and compile times, no rounds")
    args = ap.parse_args(argv)
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415

    model_dir = ensure_bench_model()
    print(describe(model_dir))
    print(line({"machine": describe_machine()}))
    engine = Engine(model_dir, EngineConfig(max_rows=max(32, args.requests), kv_cache_tokens=8192))
    print(f"vocabulary {engine.model_config.vocab_size} tokens")
    print(json.dumps(compile_times(engine) | step_cost(engine, args.requests)
                     | sampling_step_cost(engine, args.requests), indent=1))
    if args.steps_only:
        return
    one_round(engine, "none", 2, 4, "warm")
    one_round(engine, "regex", 2, 4, "warm-g")
    results = {m: [] for m in GUIDES}
    for r in range(args.rounds):
        for mode in GUIDES:  # interleaved: the machine's drift falls on every mode alike
            results[mode].append(one_round(engine, mode, args.requests, args.max_tokens, f"{mode}-{r}"))
    base = [t / w for t, w in results["none"]]
    for mode, runs in results.items():
        tok_s = [t / w for t, w in runs]
        ratio = statistics.median(a / b for a, b in zip(tok_s, base))  # per round: the drift cancels
        print(f"{mode:12s} {args.requests} concurrent: {statistics.median(t for t, _ in runs):5.0f} tokens, "
              f"{statistics.median(tok_s):8.1f} tok/s (median of the rounds' ratios: {ratio:.2f} x unconstrained)")

if __name__ == "__main__":
    main()
