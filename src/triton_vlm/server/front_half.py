"""How many preprocess and vision instances, and how many decode threads per preprocess instance: the multimodal
front half sized from the machine (the most common complaint of VLM serving at scale is CPU preprocessing starving
the accelerator).

The rule (`plan`, a pure function of the machine's shape; docs/deploying.md says why):

    usable CPUs   = the CPUs this process may run on (`sched_getaffinity`), capped by the cgroup's CPU quota
                    (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`, rounded up)
    reserved      = the llm's CPU threads when the llm runs on a CPU (`cpu_layout`: its own cores), else 1 (the
                    engine's host thread and tritonserver's own threads)
    front CPUs    = max(1, usable - reserved)
    preprocess    = clamp(front // 4, 1, 8) instances: one per 4 front CPUs. An instance is a process: it runs a
                    whole request (tokenization, decode, the checkpoint's processor, serialization) apart from the
                    others; beyond 8 the image work of a request, not the request count, is the bottleneck
    decode threads= clamp(front // preprocess, 1, 4) per instance: a request's images decoded and resized in
                    parallel (PIL's decoders and resizers and numpy release the GIL); 4 = the images of a typical
                    multi-image request; 1 = the sequential path
    vision        = 1 instance: the vision model batches across requests (dynamic batching, `max_batch_size` 64,
                    each image encoded once per batch); a second instance splits those batches and the embedding
                    cache, and on a CPU its intra-op threads already use every core (`bench.vision.front_half`
                    measures 1 vs 2)

On a 2-core machine every count is 1 (the same as the model repository as shipped): the rule never adds processes
a small machine cannot hold. Overrides: the `instance_count` parameter of `preprocess` / `vision` (`--set
preprocess.instance_count=N`; `auto` = the rule) and preprocess's `decode_threads` (`0` = the rule).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

AUTO = "auto"
MAX_PREPROCESS = 8
MAX_DECODE_THREADS = 4
CPUS_PER_PREPROCESS = 4
MODELS = ("preprocess", "vision")


@dataclass(frozen=True)
class FrontHalf:
    preprocess: int  # preprocess instances (python stubs)
    vision: int  # vision instances
    decode_threads: int  # per preprocess instance: a request's images decoded and resized at once
    front_cpus: int  # the CPUs the rule counted for the front half

    def describe(self) -> str:
        return (f"preprocess x{self.preprocess} ({self.decode_threads} decode threads each), vision x{self.vision} "
                f"({self.front_cpus} CPUs for the front half)")


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def plan(cpus: int, llm_cpu_threads: int = 0) -> FrontHalf:
    """The rule (module doc) for `cpus` usable CPUs; `llm_cpu_threads` > 0 when the llm runs on a CPU (its threads
    hold their own cores), 0 when it runs on a GPU."""
    cpus = max(1, int(cpus))
    reserved = max(1, int(llm_cpu_threads))
    front = max(1, cpus - reserved)
    pre = _clamp(front // CPUS_PER_PREPROCESS, 1, MAX_PREPROCESS)
    return FrontHalf(preprocess=pre, vision=1, decode_threads=_clamp(front // pre, 1, MAX_DECODE_THREADS),
                     front_cpus=front)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """The cgroup's CPU quota in whole CPUs (rounded up), None without one (or where it cannot be read)."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else max(1, math.ceil(int(quota) / int(period or 100000)))
        v1 = root / "cpu"
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        period = int((v1 / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup's quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return max(1, min(n, limit) if limit else n)


def parse_count(model: str, key: str, value: Optional[str], auto: int, zero_is_auto: bool = False) -> int:
    """A count setting: `auto` / empty (or `0` where `zero_is_auto`) -> `auto`, else a positive integer; ValueError
    naming the setting otherwise."""
    text = (value or "").strip().lower()
    if text in ("", AUTO) or (zero_is_auto and text == "0"):
        return auto
    if not re.fullmatch(r"\d{1,4}", text) or int(text) < 1:
        allowed = "auto, 0 (the rule) or" if zero_is_auto else "auto (the rule) or"
        raise ValueError(f"{model}.{key} must be {allowed} a positive integer, got {value!r}")
    return int(text)


def resolve(params: Mapping[str, Mapping[str, str]], llm_cpu_threads: int, cpus: Optional[int] = None) -> FrontHalf:
    """The rule for this machine with the settings of `params` (model -> key -> value, `*` for every model)
    applied: `instance_count` of preprocess / vision, preprocess's `decode_threads`."""
    rule = plan(usable_cpus() if cpus is None else cpus, llm_cpu_threads)

    def get(model: str, key: str) -> Optional[str]:
        return {**params.get("*", {}), **params.get(model, {})}.get(key)

    pre = parse_count("preprocess", "instance_count", get("preprocess", "instance_count"), rule.preprocess)
    vision = parse_count("vision", "instance_count", get("vision", "instance_count"), rule.vision)
    threads = parse_count("preprocess", "decode_threads", get("preprocess", "decode_threads"),
                          _clamp(rule.front_cpus // pre, 1, MAX_DECODE_THREADS), zero_is_auto=True)
    return FrontHalf(pre, vision, threads, rule.front_cpus)


_GROUP_RE = re.compile(r"^(\s*instance_group\s*\[\s*\{[^}]*?count:\s*)\d+", re.M)


def set_instance_count(config_text: str, count: int) -> str:
    """A config.pbtxt with its (first) instance group's `count` set; ValueError when it declares none."""
    text, n = _GROUP_RE.subn(lambda m: f"{m.group(1)}{int(count)}", config_text, count=1)
    if n != 1:
        raise ValueError("config.pbtxt declares no instance_group with a count")
    return text


def apply(config_text: str, model: str, front: FrontHalf) -> str:
    """`model`'s config.pbtxt with the counts of `front`: its instance group's count and, where declared, the
    `instance_count` / `decode_threads` parameters (what the rule chose, for whoever reads the model's config)."""
    from .repository import fill_parameters  # noqa: PLC0415

    if model not in MODELS:
        return config_text
    count = front.preprocess if model == "preprocess" else front.vision
    values = {"instance_count": str(count)}
    if model == "preprocess":
        values["decode_threads"] = str(front.decode_threads)
    return fill_parameters(set_instance_count(config_text, count), values)
