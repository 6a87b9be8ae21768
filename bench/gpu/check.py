"""The GPU check: one command, one results file, for the first GPU machine available (issue 25, item 6).

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 -m bench.gpu.check --out $OUT/gpu_check.md   # on a GPU
    python -m bench.gpu.check --device cpu --tiny --out /tmp/gpu_check.md                  # rehearsal (the suite)

Needs only torch, transformers (and what the project imports with them); no network, no server. Steps, each
guarded (a failing step records its error and the check goes on) and each with a time budget inside a global
one (`--budget-s`); the results are rewritten after every step, and a watchdog writes them and ends the process
if a step hangs past the global budget:
1. `env`: GPU, versions, nvcc / TensorRT / attention libraries present, measured memory bandwidth (a large
   device-to-device copy, bytes read + written, median of several passes timed with CUDA events).
2. `gpu_tests`: pytest `-m gpu` on every test file with `gpu` marks, in a subprocess with a timeout
   (`--continue-on-collection-errors`: a file that cannot import does not hide the others); counts and the
   failures' short text. Skipped on a CPU (nothing to run: those tests need CUDA).
3. `fp32_exact`: a small random LLaVA in fp32, our vision encoder + engine vs transformers `generate()` with
   the pixels, greedy and beam 4, prompts with and without an image: tokens identical.
4. `big`: the llava-1.5-7b-shaped random model in fp16 (`bench/gpu/big.py`): ours vs transformers in-process, the
   attention on torch SDPA; then one stream and greedy at 64 again with the paged FlexAttention backend
   (`TRITON_VLM_ATTENTION=flex`, a fresh engine): `flex_*` numbers and `flex_vs_sdpa_*` ratios. Before them the
   decode step fused by torch.compile (`TRITON_VLM_DECODE_FUSION=on`, a fresh engine; the big step's own rows run
   `off`): `fusion_*` numbers, `fusion_vs_eager_*` ratios, its bandwidth fraction, the kernel profiles of its
   steps and its load-time race (`fusion_race_{eager,fused,pointwise}_ms`).
5. `peers`: the strongest baselines the image has, on the big step's model (`bench/gpu/peers.py`): transformers
   static cache + torch.compile (one stream) and continuous batching (`generate_batch`, greedy at 64 and 256).
6. `tensorrt`: the TensorRT vision plan vs torch fp16, where `import tensorrt` works.
Writes `<out>` (markdown: a table per step and the targets) and `<out>.json` (raw numbers); prints the table.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:  # the project need not be installed on the GPU machine
    sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every step on torch SDPA unless it names its attention (the big step's flex rows do): the self-check and race
# that `auto` runs at load compile FlexAttention, tens of seconds a step's budget does not hold
os.environ.setdefault("TRITON_VLM_ATTENTION", "sdpa")
# and the decode step eager unless it names its fusion (the big step's fusion rows do): `auto` compiles and races
# at load on CUDA, which the other steps (and the gpu tests' engines) would pay
os.environ.setdefault("TRITON_VLM_DECODE_FUSION", "off")

import torch  # noqa: E402

from bench.gpu.report import Check, StepResult, Targets  # noqa: E402

def gpu_test_files() -> list[str]:
    """Every test file that marks a test `gpu` (found, not listed: a new gpu test cannot be left out)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


ATTENTION_LIBRARIES = ("flash_attn", "flashinfer", "xformers")


# --- 1. environment ----------------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, mib: int, reps: int) -> dict:
    """GB/s of `dst.copy_(src)` over `mib` MiB, counting bytes read + written; median of `reps` passes."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # untimed first pass
    passes = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        passes.append(2 * n / seconds / 1e9)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bandwidth_gb_s": round(statistics.median(passes), 1), "bandwidth_max_gb_s": round(max(passes), 1),
            "bandwidth_method": f"copy_ of {mib} MiB on {device.type}, read + written, median of {reps}"}


def step_env(check: Check) -> dict:
    import transformers  # noqa: PLC0415

    dev = check.device
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "machine": platform.machine(), "cuda_available": torch.cuda.is_available(),
           "nvcc": shutil.which("nvcc") or "absent",
           "tensorrt": "present" if importlib.util.find_spec("tensorrt") else "absent",
           "attention_libraries": [m for m in ATTENTION_LIBRARIES if importlib.util.find_spec(m)] or "none",
           "engine_attention": "TRITON_VLM_ATTENTION: torch SDPA or PyTorch FlexAttention (paged); the big step "
                               "measures both"}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                "sdpa_flash": torch.backends.cuda.flash_sdp_enabled()}
    else:
        out |= {"gpu": "none (CPU)", "cpu_threads": torch.get_num_threads()}
    mib, reps = (4096, 10) if dev.type == "cuda" and not check.tiny else (64, 5)
    out |= copy_bandwidth(dev, mib, reps)
    check.bandwidth_gb_s = out["bandwidth_gb_s"]
    return out


# --- 2. the gpu tests --------------------------------------------------------------------------------------
def _junit_counts(xml_path: Path) -> dict:
    import xml.etree.ElementTree as ET  # noqa: PLC0415

    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = (bad.get("message") or bad.text or "").strip().splitlines()
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}: {(msg or [''])[0][:300]}")
    counts["failed_tests"] = failed
    return counts


def _log_counts(log_text: str) -> dict:
    """Counts from `pytest -v` lines (`path::test PASSED`), for a run killed before it wrote its junit file."""
    import re  # noqa: PLC0415

    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", log_text, re.M)
    counts = {k.lower(): sum(r == k for _, r in results) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return {"tests": len(results), "passed": counts["passed"], "failures": counts["failed"],
            "errors": counts["error"], "skipped": counts["skipped"],
            "failed_tests": [t for t, r in results if r in ("FAILED", "ERROR")]}


def step_gpu_tests(check: Check) -> dict:
    import subprocess  # noqa: PLC0415

    if check.device.type != "cuda":
        check.skip("no GPU: the gpu-marked tests need CUDA (skipped by design with --device cpu)")
        return {}
    budget = max(30, int(check.left() - 5))
    xml = check.artifact("gpu_tests.xml")
    log_path = check.artifact("gpu_tests.log")
    files = gpu_test_files()
    per_test = ["--timeout", str(min(60, budget))] if importlib.util.find_spec("pytest_timeout") else []
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-m", "gpu", "--continue-on-collection-errors",
           "-p", "no:cacheprovider", f"--junitxml={xml}", *per_test, *files]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        check.children.append(proc.pid)  # the watchdog ends its process group too
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
        finally:
            check.children.remove(proc.pid)
    out = {"files": len(files), "exit_code": rc, "seconds": round(time.monotonic() - t0, 1), "log": log_path.name}
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    out |= _junit_counts(xml) if xml.exists() else _log_counts(text)
    tail = text.strip().splitlines()[-1:]
    out["summary_line"] = tail[0][:300] if tail else ""
    if rc != 0:
        check.fail(f"pytest -m gpu exit {rc}: {out['summary_line']}")
    return out


# --- 3. fp32 exactness -------------------------------------------------------------------------------------
def step_fp32_exact(check: Check) -> dict:
    from transformers import LlavaForConditionalGeneration  # noqa: PLC0415

    from triton_vlm.demo.checkpoint import build_random_llava, num_image_tokens  # noqa: PLC0415
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from triton_vlm.params import GenerationParams, GenerationRequest  # noqa: PLC0415
    from triton_vlm.vision import VisionEncoder, VisionSettings  # noqa: PLC0415

    dev = str(check.device)
    model_dir = build_random_llava(Path(check.tmp) / "fp32-llava", seed=7, vocab_size=600)
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    enc = VisionEncoder(model_dir, VisionSettings(vision_device=dev, projector_device=dev))
    engine = Engine(model_dir, EngineConfig(device=dev, dtype="float32", max_rows=16, kv_cache_tokens=4096))
    image_id, n_img = hf.config.image_token_id, num_image_tokens(hf.config)
    gen = torch.Generator().manual_seed(0)
    cases, mismatches, new = [], [], 12
    for i in range(6):
        text = torch.randint(10, hf.config.text_config.vocab_size, (3 + i,), generator=gen).tolist()
        with_image = i % 3 != 2
        ids = [1] + ([image_id] * n_img if with_image else []) + text
        pixels = torch.randn(1, 3, enc.image_size, enc.image_size, generator=gen) if with_image else None
        cases.append((ids, pixels))
    for beams in (1, 4):
        for i, (ids, pixels) in enumerate(cases):
            kw = {} if pixels is None else {"pixel_values": pixels.to(dev)}
            with torch.inference_mode():
                ref = hf.generate(input_ids=torch.tensor([ids], device=dev), max_new_tokens=new, min_new_tokens=new,
                                  num_beams=beams, do_sample=False, **kw)[0, len(ids):].tolist()
            req = GenerationRequest(f"b{beams}-{i}", ids, GenerationParams(max_tokens=new, min_tokens=new,
                                                                          beam_width=beams),
                                    image_embeds=None if pixels is None else enc(pixels))
            got = [r for r in engine.generate([req])[req.request_id] if r.final][0]
            if got.error is not None or got.sequences[0].token_ids != ref:
                mismatches.append({"case": req.request_id, "ours": None if got.error else got.sequences[0].token_ids,
                                   "transformers": ref, "error": repr(got.error) if got.error else None})
    total = 2 * len(cases)
    if mismatches:
        check.fail(f"{len(mismatches)} of {total} fp32 generations differ from transformers")
    return {"prompts": len(cases), "with_image": sum(p is not None for _, p in cases), "new_tokens": new,
            "generations": total, "identical": total - len(mismatches), "exact": not mismatches,
            "mismatches": mismatches[:4]}


# --- 5. TensorRT -------------------------------------------------------------------------------------------
def step_tensorrt(check: Check) -> dict:
    if check.device.type != "cuda":
        check.skip("no GPU: a TensorRT plan needs CUDA")
        return {"tensorrt": "present" if importlib.util.find_spec("tensorrt") else "absent"}
    if importlib.util.find_spec("tensorrt") is None:
        check.skip("TensorRT absent (import tensorrt fails): no plan to compare")
        return {"tensorrt": "absent"}
    from bench.gpu.big import tensorrt_vs_torch  # noqa: PLC0415

    return tensorrt_vs_torch(check)


def step_big(check: Check) -> dict:
    """bench/gpu/big.py's rows with the attention on torch SDPA (TRITON_VLM_ATTENTION=sdpa), then one stream and greedy
    at 64 concurrent again on a fresh engine with FlexAttention (=flex): `flex_*` numbers and their ratios; then the
    model quantized to block-wise FP8 on a fresh engine (bench/gpu/fp8.py): `fp8_*` numbers."""
    from bench.gpu.big import attempt, run_big  # noqa: PLC0415
    from triton_vlm.engine.model import fusion  # noqa: PLC0415
    from triton_vlm.engine.model.attention import ENV  # noqa: PLC0415

    with _env(ENV, "sdpa"), _env(fusion.ENV, "off"):
        out = run_big(check)
    if "fusion" in check.skip_rows:
        check.note("decode fusion rows: skipped (--skip-rows)")
    elif check.left() < (20 if check.tiny else 100):  # (the 7B: load + compiles ~40 s, the rows ~30 s)
        check.note(f"decode fusion rows: skipped, {check.left():.0f} s left")
    else:
        with _env(ENV, "sdpa"):
            attempt(check, out, "fusion", lambda: fusion_rows(check))
        fusion_ratios(check, out)
    if "flex" in check.skip_rows:
        check.note("flex attention rows: skipped (--skip-rows)")
    elif check.left() < (20 if check.tiny else 90):
        check.note(f"flex attention rows: skipped, {check.left():.0f} s left")
    else:
        attempt(check, out, "flex", lambda: flex_rows(check))
        for row in ("one_stream_tok_s", "greedy64_tok_s"):
            if out.get(f"flex_{row}") and out.get(row):
                out[f"flex_vs_sdpa_{row.removesuffix('_tok_s')}"] = round(out[f"flex_{row}"] / out[row], 2)
    if "fp8" in check.skip_rows:
        check.note("fp8 rows: skipped (--skip-rows)")
        return out
    if check.left() < (30 if check.tiny else 150):  # (the 7B: ~90 s to quantize on the host, ~30 s to load)
        check.note(f"fp8 rows: skipped, {check.left():.0f} s left")
        return out
    from bench.gpu.fp8 import fp8_rows  # noqa: PLC0415

    with _env(ENV, "sdpa"):
        attempt(check, out, "fp8", lambda: fp8_rows(check, out))
    return out


def step_peers(check: Check) -> dict:
    """transformers static cache + compile (one stream) and continuous batching (`generate_batch`) on the big step's
    model: the peers a bare GPU image has (`bench/gpu/peers.py`), and the engine's ratios against them."""
    from bench.gpu.peers import run_peers  # noqa: PLC0415
    from bench.gpu.report import step_numbers  # noqa: PLC0415

    return run_peers(check, step_numbers(check, "big"))


@contextlib.contextmanager
def _env(name: str, value: str):
    """os.environ[name] = value inside the block, restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _fresh_engine(check: Check, env: str, value: str, first_prompt: int):
    """The big model (saved by the big step) on a fresh engine configured as the big step's (CUDA graphs on), loaded
    with os.environ[env] = value -> (engine, prompts from number `first_prompt` on, shapes, load seconds)."""
    import json  # noqa: PLC0415

    from bench.gpu import big as gb  # noqa: PLC0415
    from triton_vlm.engine.engine import Engine, EngineConfig  # noqa: PLC0415

    s, model_dir = (gb.TINY if check.tiny else gb.LLAVA_7B), check.big_dir
    feats, _ = gb.image_features(check, model_dir, s, check.big_dtype)
    prompts = gb.Prompts(feats, json.loads((model_dir / "config.json").read_text())["image_token_index"], s.vocab)
    prompts.n = first_prompt  # other prompts than the big step's
    context = 1 << (prompts.length + max(s.new_tokens, s.stream_tokens, s.agreement_tokens)).bit_length()
    rows = max(s.greedy_concurrency, s.beam_concurrency * s.beams)  # as gpu_big.ours
    cfg = EngineConfig(device=str(check.device), dtype=check.big_dtype, max_rows=rows,
                       context_length=min(context, s.max_pos),
                       kv_cache_tokens=rows * (prompts.length + 2 * s.stream_tokens + 64))
    t0 = time.perf_counter()
    with _env(env, value):
        engine = Engine(model_dir, cfg, tokenizer=gb.IdsTokenizer())
    return engine, prompts, s, time.perf_counter() - t0


def fusion_rows(check: Check) -> dict:
    """The big model on a fresh engine with TRITON_VLM_DECODE_FUSION=on (`fusion.py`: compiled at load, inside the
    CUDA graphs): TTFT, one stream's decode tok/s, greedy at 64 concurrent (warmed first, as the big step's), the
    kernel profiles of its steps, and the load-time race of one decode step eager / fused / only the norms and gate
    fused (`fusion_race_{eager,fused,pointwise}_ms`) -> fusion_* numbers.
    On the CPU rehearsal the functions run uncompiled (`fusion.BACKEND` "none": inductor's C++ compiles take
    minutes on 2 cores), greedy runs at 4 and nothing is profiled."""
    from bench.gpu import big as gb  # noqa: PLC0415
    from triton_vlm.engine.model import fusion  # noqa: PLC0415

    rehearsal = check.device.type == "cpu"
    if rehearsal:
        fusion.BACKEND = "none"
    engine, prompts, s, load_s = _fresh_engine(check, fusion.ENV, "on", 2 << 20)
    choice = engine.model.fusion
    out = {"fusion_engine_load_s": round(load_s, 1), "fusion_on": choice.on, "fusion_choice": choice.describe(),
           "fusion_compiler": fusion.BACKEND}
    try:
        if not choice.on:
            raise RuntimeError(f"decode fusion refused at load: {choice.describe()}")
        gb.engine_batch(check, engine, [gb._request(prompts, "fusion-warm", 4)])
        run_one = lambda r: gb.engine_batch(check, engine, [r])[0]  # noqa: E731
        out |= {f"fusion_{k}": v for k, v in gb.latency_rows(check, run_one, prompts, s, "fusion").items()}
        n = 4 if rehearsal else s.greedy_concurrency
        gb.engine_batch(check, engine, [gb._request(prompts, f"fusion-gw{i}", 2) for i in range(n)])  # untimed
        wall, _ = gb.engine_batch(check, engine, [gb._request(prompts, f"fusion-g{i}", s.new_tokens)
                                                  for i in range(n)])
        out[f"fusion_greedy{n}_tok_s"] = round(n * s.new_tokens / wall, 1)
        if rehearsal:
            check.note("decode fusion: greedy at 4 and no kernel profile on a CPU (the functions uncompiled)")
        elif "profile" not in check.skip_rows:
            gb.profile_rows(check, engine, prompts, s, "fusion_", out)
        if engine.model.fused is not None:  # one decode step three ways, as `auto` times it at load
            times = fusion.race(engine.model, engine.model.fused, engine.config.block_size,
                                graphs=engine.decode_graphs is not None)
            out |= {f"fusion_race_{side}_ms": round(ms, 3) for side, ms in times.items()}
        out["fusion_after_rows"] = engine.model.fusion.describe()  # "failed while serving" if a call raised
        if engine.decode_graphs is not None:
            out["fusion_graphs"] = gb.graph_counters(engine)
    finally:
        engine.shutdown()
        del engine
        gb._free(check)
    check.note(f"decode fusion: { {k: v for k, v in out.items() if 'profile' not in k} }")
    return out


def fusion_ratios(check: Check, out: dict) -> None:
    """fusion_vs_eager_* (fused / the big step's eager rows) and the fused one stream's bandwidth fraction."""
    for row in ("one_stream_tok_s", "greedy64_tok_s"):
        if out.get(f"fusion_{row}") and out.get(row):
            out[f"fusion_vs_eager_{row.removesuffix('_tok_s')}"] = round(out[f"fusion_{row}"] / out[row], 2)
    if out.get("fusion_one_stream_tok_s") and out.get("bytes_per_token_mb") and check.bandwidth_gb_s:
        used = out["fusion_one_stream_tok_s"] * out["bytes_per_token_mb"] / 1e3  # GB/s
        out["fusion_one_stream_gb_s"] = round(used, 1)
        out["fusion_one_stream_bw_fraction"] = round(used / check.bandwidth_gb_s, 3)


def flex_rows(check: Check) -> dict:
    """The big model (saved by the big step) on a fresh engine with TRITON_VLM_ATTENTION=flex, configured as the
    big step's (CUDA graphs on): TTFT, one stream's decode tok/s, greedy at 64 concurrent -> flex_* numbers."""
    from bench.gpu import big as gb  # noqa: PLC0415
    from triton_vlm.engine.model import attention  # noqa: PLC0415

    engine, prompts, s, load_s = _fresh_engine(check, attention.ENV, "flex", 1 << 20)
    att = engine.model.attention
    out = {"flex_engine_load_s": round(load_s, 1), "flex_backend": att.backend, "flex_reason": att.reason}
    try:
        gb.engine_batch(check, engine, [gb._request(prompts, "flex-warm", 4)])
        run_one = lambda r: gb.engine_batch(check, engine, [r])[0]  # noqa: E731
        out |= {f"flex_{k}": v for k, v in gb.latency_rows(check, run_one, prompts, s, "flex").items()}
        # on a CPU (the suite's rehearsal) flex runs uncompiled, ~30x slower than SDPA: a short batch shows the path
        # works; the concurrency of the big step and the kernel profile are for the GPU
        rehearsal = check.device.type == "cpu"
        n = 4 if rehearsal else s.greedy_concurrency
        wall, _ = gb.engine_batch(check, engine, [gb._request(prompts, f"flex-g{i}", s.new_tokens) for i in range(n)])
        out[f"flex_greedy{n}_tok_s"] = round(n * s.new_tokens / wall, 1)
        if rehearsal:
            check.note("flex attention: greedy at 4 and no kernel profile on a CPU (uncompiled flex)")
        else:
            gb.profile_rows(check, engine, prompts, s, "flex_", out)
        out["flex_failed_at_run_time"] = attention.flex_failed or "no"
        # one layer's decode attention alone, in this model's shapes (smaller on a CPU, for the same reason)
        flex_ms, sdpa_ms = att.race(rows=4, keys=128, reps=2) if rehearsal else att.race()
        out |= {"layer_race_flex_ms": round(flex_ms, 3), "layer_race_sdpa_ms": round(sdpa_ms, 3)}
    finally:
        engine.shutdown()
        del engine
        gb._free(check)
    check.note(f"flex attention: { {k: v for k, v in out.items() if k != 'flex_reason' and 'profile' not in k} }")
    return out


# the big step (the targets) before the gpu tests: these take what is left (a subprocess, killed at its budget)
STEPS = (("env", step_env, 30), ("fp32_exact", step_fp32_exact, 45), ("big", step_big, 330),
         ("peers", step_peers, 150), ("gpu_tests", step_gpu_tests, 150), ("tensorrt", step_tensorrt, 60))


# the big step's row groups `--skip-rows` may leave out (a short rerun on a lent device: the FP8 rows alone, say)
SKIPPABLE_ROWS = ("flex", "fp8", "fusion", "hf", "nographs", "profile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="The GPU check (issue 25 item 6): one results file.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes for the big-model step (the CPU rehearsal)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results markdown (default $OUT/gpu_check.md, else bench/results/gpu_check.md)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="global time budget (the watchdog ends at +45 s)")
    ap.add_argument("--steps", default=",".join(s[0] for s in STEPS), help="comma-separated subset of the steps")
    ap.add_argument("--skip-rows", default="", help=f"the big step's rows to leave out, comma-separated: {', '.join(SKIPPABLE_ROWS)}")
    ap.add_argument("--big-dtype", default=None, help="dtype of the big step (default float16 on cuda, float32 on cpu)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.out is None:
        a.out = Path(os.environ["OUT"]) / "gpu_check.md" if os.environ.get("OUT") else \
            ROOT / "bench" / "results" / "gpu_check.md"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda but torch.cuda.is_available() is False; use --device cpu --tiny", file=sys.stderr)
        return 2
    wanted = set(a.steps.split(","))
    unknown = wanted - {s[0] for s in STEPS}
    if unknown:
        print(f"unknown steps {sorted(unknown)}; known: {[s[0] for s in STEPS]}", file=sys.stderr)
        return 2
    bad_rows = set(filter(None, a.skip_rows.split(","))) - set(SKIPPABLE_ROWS)
    if bad_rows:
        print(f"unknown --skip-rows {sorted(bad_rows)}; known: {list(SKIPPABLE_ROWS)}", file=sys.stderr)
        return 2
    if a.device == "cpu" and a.tiny:  # tiny shapes gain nothing from threads; on a shared CPU threads cost 8x
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        check = Check(device=torch.device(a.device), tiny=a.tiny, out=a.out, budget_s=a.budget_s, tmp=tmp,
                      skip_rows=frozenset(filter(None, a.skip_rows.split(","))),
                      big_dtype=a.big_dtype or ("float16" if a.device.startswith("cuda") else "float32"),
                      command=" ".join([Path(sys.executable).name, "-m", "bench.gpu.check", *(argv or sys.argv[1:])]))
        check.start_watchdog(grace_s=45.0)
        for name, fn, budget in STEPS:
            if name in wanted:
                check.run(name, fn, budget)
        check.finish()
    print(check.table(), flush=True)
    return 0 if all(s.status != "failed" for s in check.steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
