"""The GPU check's bookkeeping (`bench/gpu/check.py`): steps with budgets, their results, the targets, the files.

`Check.run(name, fn, budget_s)` runs one step: `fn(check)` returns its numbers (a dict); it may call
`check.skip(why)` or `check.fail(why)`; an exception marks the step failed with its text, and the check goes on.
`check.left()` is the time left to the running step (its own budget, within the global one): steps shrink their
work to it. The results are written after every step (`<out>` markdown, `<out>.json`), and a watchdog thread
writes them once more and ends the process (exit code 3) when the global budget plus a grace period is spent,
so that a hung step still leaves a results file.
"""
from __future__ import annotations

import json
import os
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch


@dataclass
class StepResult:
    name: str
    status: str = "running"  # ok | failed | skipped | running (when the watchdog fired)
    seconds: float = 0.0
    budget_s: float = 0.0
    numbers: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    error: str = ""
    traceback: str = ""


@dataclass
class Targets:
    """Issue 25's targets on one H100/H200, each: the measured value and whether it is met (None: not measured)."""

    rows: list = field(default_factory=list)  # (target, value text, met)

    def add(self, target: str, value: Any, met: Optional[bool]) -> None:
        self.rows.append((target, value, met))


@dataclass
class Check:
    device: torch.device
    tiny: bool
    out: Path
    budget_s: float
    tmp: str
    big_dtype: str
    command: str
    skip_rows: frozenset = frozenset()  # the big step's optional row groups left out (`--skip-rows flex,hf`: check.SKIPPABLE_ROWS)
    bandwidth_gb_s: float = 0.0
    children: list = field(default_factory=list)  # process groups of running subprocesses (the gpu tests)
    min_step_s: float = 10.0  # a step starts only with this much of the global budget left
    big_dir: Optional[Path] = None  # the big step's checkpoint (the TensorRT step reuses its vision tower)
    big_ref: list = field(default_factory=list)  # the big step's transformers reference (ids, features, tokens)
    steps: list = field(default_factory=list)
    targets: Targets = field(default_factory=Targets)
    t0: float = field(default_factory=time.monotonic)
    _step_deadline: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- steps ---------------------------------------------------------------------------------------------
    def left(self) -> float:
        """Seconds left to the running step (its budget, within the global budget)."""
        return min(self._step_deadline, self.t0 + self.budget_s) - time.monotonic()

    def global_left(self) -> float:
        return self.t0 + self.budget_s - time.monotonic()

    @property
    def current(self) -> StepResult:
        return self.steps[-1]

    def skip(self, why: str) -> None:
        self.current.status, self.current.notes = "skipped", self.current.notes + [why]

    def fail(self, why: str) -> None:
        self.current.status, self.current.error = "failed", why

    def note(self, text: str) -> None:
        self.current.notes.append(text)
        print(f"[gpu_check {self.elapsed():6.1f}s] {self.current.name}: {text}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def artifact(self, name: str) -> Path:
        """A file next to the results (it comes back with them)."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        return self.out.parent / name

    def run(self, name: str, fn: Callable[["Check"], dict], budget_s: float) -> StepResult:
        step = StepResult(name, budget_s=budget_s)
        with self._lock:
            self.steps.append(step)
        if self.global_left() < self.min_step_s:
            step.status = "skipped"
            step.notes.append(f"out of time: {self.global_left():.0f} s of the global budget left")
            self.write()
            return step
        print(f"[gpu_check {self.elapsed():6.1f}s] step {name} (budget {budget_s:.0f} s)", flush=True)
        self._step_deadline = time.monotonic() + budget_s
        t = time.monotonic()
        try:
            step.numbers = fn(self) or step.numbers  # a step may fill step.numbers as it goes
            if step.status == "running":
                step.status = "ok"
        except Exception as e:  # noqa: BLE001 - one failing step is recorded, the check goes on
            step.status = "failed"
            step.error = f"{type(e).__name__}: {e}"[:2000]
            step.traceback = traceback.format_exc()[-3000:]
        finally:
            step.seconds = round(time.monotonic() - t, 1)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[gpu_check {self.elapsed():6.1f}s] step {name}: {step.status} in {step.seconds} s"
              + (f" ({step.error[:200]})" if step.error else ""), flush=True)
        self.write()
        return step

    # --- results -------------------------------------------------------------------------------------------
    def start_watchdog(self, grace_s: float) -> None:
        def watch() -> None:
            time.sleep(max(0.0, self.budget_s + grace_s))
            if self.steps:
                self.current.error = self.current.error or f"the watchdog ended the check after {self.elapsed():.0f} s"
            for pgid in list(self.children):
                try:
                    os.killpg(pgid, 9)
                except OSError:
                    pass
            self.finish()
            print(self.table(), flush=True)
            os._exit(3)

        threading.Thread(target=watch, name="gpu-check-watchdog", daemon=True).start()

    def finish(self) -> None:
        self.targets = targets_of(self)
        self.write()

    def to_dict(self) -> dict:
        return {"command": self.command, "device": str(self.device), "tiny": self.tiny, "budget_s": self.budget_s,
                "elapsed_s": round(self.elapsed(), 1), "steps": [asdict(s) for s in self.steps],
                "targets": [{"target": t, "value": v, "met": m} for t, v, m in self.targets.rows]}

    def write(self) -> None:
        with self._lock:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.with_suffix(".json").write_text(json.dumps(self.to_dict(), indent=1, default=str))
            self.out.write_text(self.markdown())

    def table(self) -> str:
        lines = ["| step | status | s | key numbers |", "|---|---|---|---|"]
        for s in self.steps:
            lines.append(f"| {s.name} | {s.status} | {s.seconds} | {_key_numbers(s)} |")
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        for t, v, m in self.targets.rows:
            lines.append(f"| {t} | {v} | {'n/a' if m is None else ('yes' if m else 'NO')} |")
        return "\n".join(lines)

    def markdown(self) -> str:
        parts = [f"# GPU check ({self.device}{', tiny' if self.tiny else ''})", "",
                 f"`{self.command}`: {self.elapsed():.0f} s of a {self.budget_s:.0f} s budget", "", self.table(), ""]
        for s in self.steps:
            parts += [f"## {s.name}: {s.status} ({s.seconds} s of {s.budget_s:.0f} s)", ""]
            if s.error:
                parts += [f"error: `{s.error[:1000]}`", ""]
            parts += [line for k, v in s.numbers.items() for line in _item(k, v)]
            parts += [""] + [f"- note: {n}" for n in s.notes] + [""]
            if s.traceback:
                parts += ["```", s.traceback, "```", ""]
        return "\n".join(parts)


KEYS = ("gpu", "bandwidth_gb_s", "passed", "failures", "errors", "identical", "generations", "one_stream_tok_s",
        "nographs_one_stream_tok_s", "hf_one_stream_tok_s", "one_stream_bw_fraction", "ttft_ms", "hf_ttft_ms",
        "greedy64_tok_s", "nographs_greedy64_tok_s", "hf_greedy_tok_s", "beam16_tok_s", "nographs_beam16_tok_s",
        "hf_beam_tok_s", "greedy64_speedup", "beam16_speedup", "agreement_prompts", "first_divergence_median",
        "fusion_one_stream_tok_s", "fusion_one_stream_bw_fraction", "fusion_vs_eager_one_stream",
        "fusion_greedy64_tok_s", "fusion_vs_eager_greedy64", "fusion_race_eager_ms", "fusion_race_fused_ms",
        "fusion_race_pointwise_ms",
        "fusion_vs_static_one_stream",
        "flex_ttft_ms", "flex_one_stream_tok_s", "flex_greedy64_tok_s", "flex_vs_sdpa_greedy64", "tensorrt")


def _item(key: str, value) -> list[str]:
    """A number's markdown lines: `- key: value`; a dict (a kernel profile) as a nested list."""
    if not isinstance(value, dict):
        return [f"- {key}: {value}"]
    lines = [f"- {key}:"]
    for k, v in value.items():
        lines += [f"  - {k}:"] + [f"    - {x}" for x in v] if isinstance(v, list) else [f"  - {k}: {v}"]
    return lines


def _key_numbers(s: StepResult) -> str:
    nums = s.numbers
    shown = [f"{k}={nums[k]}" for k in KEYS if k in nums]
    if not shown and s.notes:
        shown = [s.notes[0][:120]]
    if s.error:
        shown.append(f"error: {s.error[:120]}")
    return ", ".join(shown).replace("|", "/")


def step_numbers(check: Check, name: str) -> dict:
    return next((s.numbers for s in check.steps if s.name == name), {})


def targets_of(check: Check) -> Targets:
    t = Targets()
    gpu_run = check.device.type == "cuda" and not check.tiny
    big, exact = step_numbers(check, "big"), step_numbers(check, "fp32_exact")
    frac = big.get("one_stream_bw_fraction")
    detail = frac if frac is None else (f"{frac:.3f} ({big['one_stream_tok_s']} tok/s x {big['bytes_per_token_mb']} "
                                        f"MB/token = {big['one_stream_gb_s']} GB/s of {check.bandwidth_gb_s} GB/s)")
    t.add("one stream decodes at >= 70% of the measured bandwidth", detail,
          None if frac is None or not gpu_run else frac >= 0.70)
    frac = big.get("fusion_one_stream_bw_fraction")  # the decode step fused by torch.compile (`fusion_rows`)
    detail = frac if frac is None else (f"{frac:.3f} ({big['fusion_one_stream_tok_s']} tok/s, "
                                        f"{big.get('fusion_vs_eager_one_stream')}x eager's)")
    t.add("one stream with decode fusion on at >= 70% of the measured bandwidth", detail,
          None if frac is None or not gpu_run else frac >= 0.70)
    for key, ours, hf, label, goal in (
            ("greedy64_speedup", "greedy64_tok_s", "hf_greedy_tok_s",
             "greedy at 64 concurrent >= 10x transformers one at a time", 10),
            ("beam16_speedup", "beam16_tok_s", "hf_beam_tok_s",
             "beam 4 at 16 concurrent >= 8x transformers one at a time", 8)):
        v = big.get(key)
        t.add(label, v if v is None else f"{v}x ({big[ours]} vs {big[hf]} tok/s)",
              None if v is None or not gpu_run else v >= goal)
    peers = step_numbers(check, "peers")
    for key, label, goal in (
            ("ours_vs_static_one_stream", "one stream >= 1.0x transformers static cache + torch.compile", 1.0),
            ("ours_vs_cb_greedy64", "greedy at 64 >= 2x transformers continuous batching (generate_batch)", 2.0)):
        v = peers.get(key)
        t.add(label, v if v is None else f"{v}x", None if v is None or not gpu_run else v >= goal)
    t.add("fp32 tokens identical to transformers", exact.get("identical") and
          f"{exact.get('identical')}/{exact.get('generations')}", exact.get("exact"))
    t.add("fp16 agreement with transformers reported (first divergence over N prompts)",
          big.get("agreement_summary"), None)
    return t
