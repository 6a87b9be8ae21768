"""The GPU check's big step (`bench/gpu/check.py` step 4): a random-weight llava-1.5-7b-shaped model, ours vs
transformers `generate()`, in-process.

Model: Llama hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32064, context 4096; CLIP-L/336 tower
(1024 hidden, 24 layers, 576 image tokens). Built by transformers directly on the device in the run dtype
(`_from_config` under `torch.device`), saved with `save_pretrained` to a temporary folder (the engine and
`HFGenerator` load checkpoints from a folder), build and save timed. `--tiny`: the same steps on small shapes.
Every request: BOS, two marker ids (every prompt distinct: no prefix-cache hit between measurements), one image's
576 placeholders (features from our torch vision encoder in the run dtype), 8 text ids; `min_tokens ==
max_tokens` so every request generates exactly its tokens (random weights would otherwise stop at any EOS).
Measured, first the baseline (`HFGenerator.run`, the project's transformers backend, one request at a time):
- TTFT: median wall time of requests with max_tokens 1; one stream: a request of `stream_tokens`, decode tok/s =
  (tokens - 1) / (its wall - TTFT); bandwidth fraction = tok/s x bytes per token (`bench.common.bandwidth.token_bytes`:
  weights but the embedding table + one row + the KV read) / the measured bandwidth (`env` step);
- greedy and beam 4: `baseline_requests` requests one after another, tok/s = tokens / total wall;
- fp16 agreement: `agreement_prompts` greedy prompts of equal length as one `generate()` batch (no padding).
Then ours (`Engine`, `step()` driven in this thread): the same TTFT and one stream, the agreement prompts as one
batch (first divergence position per prompt against transformers' tokens; = new tokens where identical), greedy at
64 concurrent, beam 4 at 16 concurrent (tok/s = best-sequence tokens / wall, submit to last result), with CUDA
graphs on, then off (`runner.graphs = None`). The attention is torch SDPA here (`gpu_check` adds flex rows).
With graphs on, `kernel_profile` (torch.profiler) of one stream and of greedy at 64: wall and busy device time
per token, the kernels with the most device time (`profile_*`).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu.report import Check


@dataclass(frozen=True)
class Shapes:
    text_hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    max_pos: int
    image_size: int
    patch: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    new_tokens: int  # per request of the throughput rows
    stream_tokens: int
    agreement_tokens: int
    agreement_prompts: int
    baseline_requests: int  # transformers one at a time, per row
    greedy_concurrency: int = 64
    beam_concurrency: int = 16
    beams: int = 4


LLAVA_7B = Shapes(text_hidden=4096, layers=32, heads=32, intermediate=11008, vocab=32064, max_pos=4096,
                  image_size=336, patch=14, vision_hidden=1024, vision_layers=24, vision_heads=16,
                  vision_intermediate=4096, new_tokens=64, stream_tokens=128, agreement_tokens=32,
                  agreement_prompts=64, baseline_requests=2)
TINY = Shapes(text_hidden=128, layers=2, heads=4, intermediate=256, vocab=1000, max_pos=512, image_size=32, patch=8,
              vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64, new_tokens=8,
              stream_tokens=16, agreement_tokens=8, agreement_prompts=64, baseline_requests=2)
TEXT_IDS = 8


class IdsTokenizer:
    """Decodes ids as their numbers: the random 7B model's vocabulary is larger than the saved test tokenizer's."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


# --- the model ---------------------------------------------------------------------------------------------
def build(check: Check, s: Shapes, dtype: str) -> tuple[Path, dict]:
    from transformers import LlavaForConditionalGeneration  # noqa: PLC0415

    from triton_vlm.demo.checkpoint import build_tokenizer, make_llava_config, make_processor, save_checkpoint

    tok = build_tokenizer(None, 512)
    config = make_llava_config(
        tok, text_hidden=s.text_hidden, layers=s.layers, heads=s.heads, kv_heads=s.heads, intermediate=s.intermediate,
        image_size=s.image_size, patch_size=s.patch, vision_hidden=s.vision_hidden, vision_layers=s.vision_layers,
        vision_heads=s.vision_heads, vision_intermediate=s.vision_intermediate, max_position_embeddings=s.max_pos,
        vision_feature_select_strategy="default", vision_feature_layer=-2, tie_word_embeddings=False)
    config.text_config.vocab_size = s.vocab
    t0 = time.perf_counter()
    torch.manual_seed(0)
    try:  # random init on the device itself: seconds for 7B on a GPU, minutes on the CPU
        with torch.device(check.device):
            model = LlavaForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype)).eval()
    except Exception as e:  # noqa: BLE001 - slower, but the check goes on
        check.note(f"building on {check.device} failed ({type(e).__name__}: {e}); building on the CPU")
        _free(check)
        model = LlavaForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype)).eval()
    _sync(check)
    t1 = time.perf_counter()
    out_dir = Path(check.tmp) / "llava-7b-shaped"
    save_checkpoint(model, make_processor(tok, image_size=s.image_size, patch_size=s.patch,
                                          vision_feature_select_strategy="default"), out_dir)
    t2 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    del model
    _free(check)
    size = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
    return out_dir, {"parameters_b": round(params / 1e9, 3), "checkpoint_gb": round(size / 1e9, 2),
                     "build_s": round(t1 - t0, 1), "save_s": round(t2 - t1, 1)}


def image_features(check: Check, model_dir: Path, s: Shapes, dtype: str, images: int = 8) -> tuple[torch.Tensor, dict]:
    """[images, T, hidden] float32 features of random images by our torch vision encoder, and its timing."""
    from triton_vlm.vision import VisionEncoder, VisionSettings  # noqa: PLC0415

    bits = 16 if dtype == "float16" else 32
    dev = str(check.device)
    enc = VisionEncoder(model_dir, VisionSettings(vision_device=dev, vision_bits=bits, projector_device=dev,
                                                  projector_bits=bits))
    pixels = torch.randn(images, 3, s.image_size, s.image_size, generator=torch.Generator().manual_seed(1))
    enc(pixels[:1])  # warm-up
    t0 = time.perf_counter()
    feats = enc(pixels)
    seconds = time.perf_counter() - t0
    del enc
    _free(check)
    return feats, {"vision_torch_ms_per_image": round(1e3 * seconds / images, 2), "image_tokens": feats.shape[1]}


class Prompts:
    """Distinct equal-length prompts: BOS, two marker ids, one image's placeholders, TEXT_IDS text ids."""

    def __init__(self, feats: torch.Tensor, image_id: int, vocab: int):
        self.feats, self.image_id, self.vocab, self.n = feats, image_id, vocab, 0
        self.text = [5 + (7 * i) % (vocab - 10) for i in range(TEXT_IDS)]

    def next(self) -> tuple[list[int], torch.Tensor]:
        n, span = self.n, self.vocab - 10
        self.n += 1
        ids = [1, 5 + n % span, 5 + (n // span) % span] + [self.image_id] * self.feats.shape[1] + self.text
        return ids, self.feats[n % self.feats.shape[0]][None]  # [1, T, hidden]

    @property
    def length(self) -> int:
        return 3 + self.feats.shape[1] + TEXT_IDS


def _sync(check: Check) -> None:
    if check.device.type == "cuda":
        torch.cuda.synchronize(check.device)


def _free(check: Check) -> None:
    gc.collect()
    if check.device.type == "cuda":
        torch.cuda.empty_cache()


def _request(prompts: Prompts, rid: str, tokens: int, beams: int = 1):
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415

    ids, feats = prompts.next()
    return GenerationRequest(rid, ids, GenerationParams(max_tokens=tokens, min_tokens=tokens, beam_width=beams),
                             image_embeds=feats)


# --- running requests --------------------------------------------------------------------------------------
def hf_one(check: Check, gen, req) -> tuple[float, list[int]]:
    """One request through `HFGenerator.run`: (wall seconds, best sequence's tokens)."""
    box = []
    _sync(check)
    t0 = time.perf_counter()
    gen.run(req, box.append)
    _sync(check)
    final = [r for r in box if r.final][0]
    if final.error is not None:
        raise RuntimeError(f"transformers failed request {req.request_id}: {final.error!r}")
    return time.perf_counter() - t0, final.sequences[0].token_ids


def engine_batch(check: Check, engine, reqs) -> tuple[float, dict[str, list[int]]]:
    """Submit `reqs` at once, step until all are final: (wall seconds, request id -> best tokens)."""
    got: dict[str, list[int]] = {}

    errors: list[str] = []

    def on_result(res) -> None:  # runs inside engine.step(), which logs and swallows a callback's exception
        if res.final:
            got[res.request_id] = [] if res.error is not None else res.sequences[0].token_ids
            if res.error is not None:
                errors.append(f"{res.request_id}: {res.error!r}")

    _sync(check)
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r, on_result)
    while len(got) < len(reqs):
        if not engine.step() and len(got) < len(reqs):
            raise RuntimeError("engine idle with requests unfinished")
        if check.left() < -30:
            raise TimeoutError(f"{len(reqs) - len(got)} of {len(reqs)} requests unfinished past the step's budget")
    _sync(check)
    if errors:
        raise RuntimeError(f"our engine failed {len(errors)} requests, e.g. {errors[0]}")
    return time.perf_counter() - t0, got


def latency_rows(check: Check, run_one, prompts: Prompts, s: Shapes, tag: str) -> dict:
    """TTFT (median of 3 one-token requests) and one stream's decode tok/s, via `run_one(req) -> seconds`."""
    ttft = statistics.median(run_one(_request(prompts, f"{tag}-t{i}", 1)) for i in range(3))
    wall = run_one(_request(prompts, f"{tag}-s", s.stream_tokens))
    return {"ttft_ms": round(1e3 * ttft, 1), "one_stream_tok_s": round((s.stream_tokens - 1) / max(wall - ttft, 1e-9), 1)}


# --- the two sides -----------------------------------------------------------------------------------------
def baseline(check: Check, model_dir: Path, prompts: Prompts, s: Shapes, dtype: str, out: dict) -> list:
    """transformers: latency, greedy and beam rows one request at a time (into `out`); returns the agreement
    batch's [(ids, features, tokens)] ([] when it failed or time is short)."""
    from triton_vlm.baseline.generate import HFGenerator  # noqa: PLC0415

    t0 = time.perf_counter()
    gen = HFGenerator(model_dir, device=str(check.device), dtype=dtype)
    gen.tokenizer = IdsTokenizer()
    out["hf_load_s"] = round(time.perf_counter() - t0, 1)
    ref: list = []
    try:
        hf_one(check, gen, _request(prompts, "hf-warm", 2))
        run_one = lambda r: hf_one(check, gen, r)[0]  # noqa: E731
        attempt(check, out, "hf_latency",
                lambda: {f"hf_{k}": v for k, v in latency_rows(check, run_one, prompts, s, "hf").items()})
        for label, beams in (("greedy", 1), ("beam", s.beams)):
            def row(label=label, beams=beams) -> dict:
                walls = [run_one(_request(prompts, f"hf-{label}{i}", s.new_tokens, beams))
                         for i in range(s.baseline_requests)]
                return {f"hf_{label}_tok_s": round(s.baseline_requests * s.new_tokens / sum(walls), 2)}
            attempt(check, out, f"hf_{label}", row)
        check.note(f"transformers one at a time: { {k: v for k, v in out.items() if k.startswith('hf_')} }")
        if check.left() > 30:
            attempt(check, out, "hf_agreement", lambda: {"_ref": agreement_reference(check, gen, prompts, s)})
            ref = out.pop("_ref", [])
    finally:
        del gen
        _free(check)
    return ref


@torch.inference_mode()
def agreement_reference(check: Check, gen, prompts: Prompts, s: Shapes) -> list:
    """transformers greedy tokens of the agreement prompts, one `generate()` batch: [(ids, feats, tokens)]."""
    from triton_vlm.engine.model.merge import merge_image_embeds  # noqa: PLC0415

    cases = [prompts.next() for _ in range(s.agreement_prompts)]
    ids = torch.tensor([c[0] for c in cases], device=check.device)  # [B, P]
    emb = gen.model.get_input_embeddings()
    embeds = torch.stack([merge_image_embeds(ids[i], emb(ids[i]), f, gen.image_token_id)
                          for i, (_, f) in enumerate(cases)])  # [B, P, hidden]
    out = gen.model.generate(input_ids=ids, inputs_embeds=embeds, attention_mask=torch.ones_like(ids),
                             max_new_tokens=s.agreement_tokens, min_new_tokens=s.agreement_tokens, do_sample=False,
                             num_beams=1, eos_token_id=gen.eos_ids, pad_token_id=gen.pad_id)
    new = out[:, ids.shape[1]:].tolist() if out.shape[1] > s.agreement_tokens else out.tolist()
    return [(c[0], c[1], toks) for c, toks in zip(cases, new)]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def attempt(check: Check, out: dict, name: str, fn) -> None:
    """out |= fn(); a failure is recorded as out[name + "_error"] and the step goes on."""
    try:
        out |= fn()
    except Exception as e:  # noqa: BLE001
        out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
        check.note(f"{name} failed: {out[f'{name}_error']}")


PROFILE_TOKENS = 16  # new tokens per request in a profiled run
PROFILE_TOP = 12  # kernels listed


def kernel_profile(check: Check, run, tokens: int) -> dict:
    """`run()` under torch.profiler: wall and device time per generated token (`tokens` of them) and the kernels
    with the most device time (on a CPU: the ops with the most own CPU time), each with its share and calls per
    token. The device time over the wall says whether the step waits for the host."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = check.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(check)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        _sync(check)
    wall = time.perf_counter() - t0
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(((e.key, getattr(e, attr, 0.0), e.count) for e in prof.key_averages()
                   if getattr(e, attr, 0.0) > 0 and (cuda or e.key.startswith("aten::"))), key=lambda r: -r[1])
    total = sum(t for _, t, _ in rows) or 1.0
    return {"wall_ms_per_token": round(1e3 * wall / tokens, 3), "busy_ms_per_token": round(total / 1e3 / tokens, 3),
            "top": [f"{100 * t / total:.1f}% {name[:90]} ({n / tokens:.1f}/token)" for name, t, n in rows[:PROFILE_TOP]]}


def profile_rows(check: Check, engine, prompts: Prompts, s: Shapes, tag: str, out: dict) -> None:
    """Kernel profiles of one stream (`PROFILE_TOKENS` after its prefill) and of greedy at the row's concurrency
    (prefills + `PROFILE_TOKENS` decode steps) -> `{tag}profile_one_stream`, `{tag}profile_greedy{n}`."""
    n = s.greedy_concurrency
    for label, count in (("one_stream", 1), (f"greedy{n}", n)):
        if check.left() < 25:
            check.note(f"{tag}profile_{label}: skipped, {check.left():.0f} s left")
            return
        reqs = [_request(prompts, f"{tag}prof-{label}{i}", PROFILE_TOKENS) for i in range(count)]
        attempt(check, out, f"{tag}profile_{label}", lambda: {f"{tag}profile_{label}": kernel_profile(
            check, lambda: engine_batch(check, engine, reqs), count * PROFILE_TOKENS)})


def ours(check: Check, model_dir: Path, prompts: Prompts, s: Shapes, dtype: str, ref: list, out: dict) -> None:
    """Our engine: the rows of the module doc with CUDA graphs on, then off; numbers into `out` as they come."""
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415

    context = 1 << (prompts.length + max(s.new_tokens, s.stream_tokens, s.agreement_tokens)).bit_length()
    rows = max(s.greedy_concurrency, s.beam_concurrency * s.beams)
    cfg = EngineConfig(device=str(check.device), dtype=dtype, max_rows=rows, context_length=min(context, s.max_pos),
                       kv_cache_tokens=rows * (prompts.length + 2 * s.stream_tokens + 64))
    t0 = time.perf_counter()
    engine = Engine(model_dir, cfg, tokenizer=IdsTokenizer())
    out |= {"engine_load_s": round(time.perf_counter() - t0, 1), "kv_cache_tokens": cfg.kv_cache_tokens,
            "context_length": cfg.context_length, "memory_plan": engine.memory.summary(),
            "weights_bytes": engine.memory.weights_bytes,
            "cuda_graphs": engine.decode_graphs is not None}
    try:
        engine_batch(check, engine, [_request(prompts, "warm", 4)])
        for graphs in (True, False):
            if not graphs:
                if engine.decode_graphs is not None:
                    out["graphs_counters"] = graph_counters(engine) | {
                        "pool_mib_measured": round(engine.decode_graphs.pool_bytes / 2**20, 1),
                        "pool_mib_estimate": round(engine.memory.graph_pool_bytes / 2**20, 1)}
                engine.decode_graphs = engine.scheduler.runner.graphs = None
                if "nographs" in check.skip_rows:
                    check.note("graphs off: skipped (--skip-rows nographs)")
                    break
                if check.left() < 20:
                    check.note(f"graphs off: skipped, {check.left():.0f} s left")
                    break
            tag = "" if graphs else "nographs_"
            ours_rows(check, engine, prompts, s, ref if graphs else [], tag, out)
            if graphs and "profile" not in check.skip_rows:  # where the device time goes (SDPA, graphs on)
                profile_rows(check, engine, prompts, s, "", out)
            shown = {k: v for k, v in out.items() if k.endswith(("_tok_s", "_ms", "_error", "_median"))
                     and not k.startswith("hf_") and k.startswith("nographs_") == (not graphs)}
            check.note(f"ours, graphs {'on' if graphs else 'off'}: {shown}")
    finally:
        engine.shutdown()
        del engine
        _free(check)


def graph_counters(engine) -> dict:
    """The engine's CUDA graph counters (`DecodeGraphs`); {} without graphs."""
    g = engine.decode_graphs
    return {} if g is None else {"captured": g.captured, "replays": g.replays, "fallbacks": g.fallbacks,
                                 "capture_failures": g.capture_failures, "replay_errors": g.replay_errors}


def ours_rows(check: Check, engine, prompts: Prompts, s: Shapes, ref: list, tag: str, out: dict) -> None:
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415

    def latency() -> dict:
        run_one = lambda r: engine_batch(check, engine, [r])[0]  # noqa: E731
        return {f"{tag}{k}": v for k, v in latency_rows(check, run_one, prompts, s, f"o{tag}").items()}

    def agreement() -> dict:
        reqs = [GenerationRequest(f"agree{i}", ids, GenerationParams(max_tokens=s.agreement_tokens,
                                                                     min_tokens=s.agreement_tokens),
                                  image_embeds=f) for i, (ids, f, _) in enumerate(ref)]
        _, got = engine_batch(check, engine, reqs)
        div = [first_divergence(got[f"agree{i}"], r[2]) for i, r in enumerate(ref)]
        return {"agreement_prompts": len(div), "agreement_new_tokens": s.agreement_tokens,
                "agreement_identical": sum(d == s.agreement_tokens for d in div),
                "first_divergence_median": statistics.median(div), "first_divergence_min": min(div),
                "first_divergences": div}

    def throughput(label: str, n: int, beams: int) -> dict:
        # untimed first: a batch of n at its first use pays cuBLAS / cuDNN plans for its shapes (an H200 measured
        # greedy at 64 at 304 tok/s cold against 633 warm)
        engine_batch(check, engine, [_request(prompts, f"{tag}{label}-warm{i}", 2, beams) for i in range(n)])
        wall, _ = engine_batch(check, engine, [_request(prompts, f"{tag}{label}{i}", s.new_tokens, beams)
                                               for i in range(n)])
        return {f"{tag}{label}{n}_tok_s": round(n * s.new_tokens / wall, 1)}

    attempt(check, out, f"{tag}latency", latency)
    if ref:
        attempt(check, out, "agreement", agreement)
    for label, n, beams in (("greedy", s.greedy_concurrency, 1), ("beam", s.beam_concurrency, s.beams)):
        if check.left() < 10:
            check.note(f"{tag}{label}: skipped, {check.left():.0f} s left")
            continue
        attempt(check, out, f"{tag}{label}{n}", lambda: throughput(label, n, beams))


def run_big(check: Check) -> dict:
    from bench.common.bandwidth import token_bytes  # noqa: PLC0415

    s = TINY if check.tiny else LLAVA_7B
    dtype = check.big_dtype
    out = check.current.numbers  # filled as the step goes: a failure late in it keeps what was measured
    out |= {"shapes": "tiny" if check.tiny else "llava-1.5-7b", "dtype": dtype}
    model_dir, built = build(check, s, dtype)
    out |= built
    check.note(f"built and saved: {out}")
    check.big_dir = model_dir
    feats, vis = image_features(check, model_dir, s, dtype)
    out |= vis
    image_id = json.loads((model_dir / "config.json").read_text())["image_token_index"]
    prompts = Prompts(feats, image_id, s.vocab)
    if check.left() < 150 and not check.tiny:  # a slow build or save: fewer baseline requests and prompts
        s = dataclasses.replace(s, baseline_requests=1, agreement_prompts=16, stream_tokens=64)
        check.note(f"{check.left():.0f} s left after the build: reduced to {s}")
    out["attention"] = "torch scaled_dot_product_attention (the engine has no attention library to switch)"
    out["prompt_tokens"] = prompts.length
    if "hf" in check.skip_rows:
        check.note("transformers one at a time: skipped (--skip-rows hf): no ratios against it, no agreement")
        ref = []
    else:
        ref = baseline(check, model_dir, prompts, s, dtype, out)
    check.big_ref = ref  # the FP8 rows' agreement reference (bench/gpu/fp8.py)
    ours(check, model_dir, prompts, s, dtype, ref, out)
    tb = token_bytes(model_dir, prompts.length, s.stream_tokens, dtype)
    out["bytes_per_token_mb"] = round(tb.total / 1e6, 2)
    bw = check.bandwidth_gb_s
    if bw and "one_stream_tok_s" in out:
        used = out["one_stream_tok_s"] * tb.total / 1e9
        out["one_stream_gb_s"], out["one_stream_bw_fraction"] = round(used, 1), round(used / bw, 3)
    for key, ours_key, hf_key in (("greedy64_speedup", f"greedy{s.greedy_concurrency}_tok_s", "hf_greedy_tok_s"),
                                  ("beam16_speedup", f"beam{s.beam_concurrency}_tok_s", "hf_beam_tok_s")):
        if ours_key in out and out.get(hf_key):
            out[key] = round(out[ours_key] / out[hf_key], 1)
    if "first_divergence_median" in out:
        out["agreement_summary"] = (f"{out['agreement_identical']}/{out['agreement_prompts']} prompts identical over "
                                    f"{out['agreement_new_tokens']} tokens; first divergence median "
                                    f"{out['first_divergence_median']}, min {out['first_divergence_min']}")
    failed = [k for k in out if k.endswith("_error")]
    if failed:
        check.fail(f"{len(failed)} measurements failed: {', '.join(failed)} (their *_error numbers)")
    return out


def tensorrt_vs_torch(check: Check) -> dict:
    """The fp16 TensorRT plan of the big model's vision encoder (or a tiny one) vs the torch fp16 encoder."""
    from triton_vlm.demo.checkpoint import build_random_llava  # noqa: PLC0415
    from triton_vlm.vision import VisionEncoder, VisionSettings  # noqa: PLC0415
    from triton_vlm.vision.backends import BackendSettings  # noqa: PLC0415
    from triton_vlm.vision.export import export_onnx  # noqa: PLC0415
    from triton_vlm.vision.trt import TensorRTBackend, build_plan  # noqa: PLC0415

    model_dir = getattr(check, "big_dir", None) or build_random_llava(Path(check.tmp) / "trt-llava", seed=3)
    tmp = Path(check.tmp)
    t0 = time.perf_counter()
    plan = build_plan(export_onnx(model_dir, tmp / "v16.onnx", "float16"), tmp / "v.plan", max_batch=4)
    out = {"tensorrt": "present", "plan_build_s": round(time.perf_counter() - t0, 1)}
    trt = TensorRTBackend(model_dir, BackendSettings(backend="tensorrt", plan_path=str(plan)))
    enc = VisionEncoder(model_dir, VisionSettings(vision_device="cuda", vision_bits=16, projector_device="cuda",
                                                  projector_bits=16))
    pixels = torch.randn(4, 3, enc.image_size, enc.image_size)
    for name, fn in (("trt", lambda: trt(pixels.numpy()).float().cpu()), ("torch", lambda: enc(pixels))):
        fn()
        t = time.perf_counter()
        res = [fn() for _ in range(5)][-1]
        out[f"{name}_ms_per_batch4"] = round(1e3 * (time.perf_counter() - t) / 5, 2)
        out[f"_{name}"] = res
    a, b = out.pop("_trt"), out.pop("_torch")
    cos = torch.nn.functional.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
    out["cosine_min"] = round(float(cos.min()), 5)
    return out
