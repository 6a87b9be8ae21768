"""The GPU check (`bench/gpu/check.py`) rehearsed on the CPU, so that it cannot rot before a GPU runs it: every step
with its numbers in one results file, fp32 tokens identical to transformers, no import the GPU machine lacks
(tritonclient, pytriton, the OpenAI front end's packages are blocked in the subprocess), a failing step recorded
while the check goes on, and a hung step ended by the watchdog with the results written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ABSENT_ON_THE_GPU_MACHINE = ("tritonclient", "pytriton", "fastapi", "uvicorn", "openai", "matplotlib", "starlette")
BLOCKER = f"""
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")
sys.meta_path.insert(0, _Absent())
"""


def _env(tmp_path: Path) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src")]), OUT="")


def test_cpu_tiny_check_writes_every_step_with_numbers(tmp_path):
    out = tmp_path / "res" / "gpu_check.md"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.check", "--device", "cpu", "--tiny", "--out", str(out),
                           "--budget-s", "150"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_suffix(".json").read_text())
    steps = {s["name"]: s for s in res["steps"]}
    assert list(steps) == ["env", "fp32_exact", "big", "peers", "gpu_tests", "tensorrt"]
    assert steps["env"]["status"] == "ok" and steps["env"]["numbers"]["bandwidth_gb_s"] > 0
    assert steps["gpu_tests"]["status"] == "skipped" and "no GPU" in steps["gpu_tests"]["notes"][0]
    exact = steps["fp32_exact"]
    assert exact["status"] == "ok" and exact["numbers"]["exact"] is True
    assert exact["numbers"]["identical"] == exact["numbers"]["generations"] == 12
    assert exact["numbers"]["with_image"] == 4
    big = steps["big"]
    assert big["status"] == "ok", big["error"] + big["traceback"]
    n = big["numbers"]
    for key in ("hf_ttft_ms", "hf_one_stream_tok_s", "hf_greedy_tok_s", "hf_beam_tok_s", "ttft_ms", "one_stream_tok_s",
                "greedy64_tok_s", "beam16_tok_s", "nographs_one_stream_tok_s", "nographs_greedy64_tok_s",
                "one_stream_bw_fraction", "greedy64_speedup", "beam16_speedup"):
        assert n[key] > 0, key
    assert n["agreement_prompts"] == 64 and len(n["first_divergences"]) == 64  # fp32 here: all identical
    assert n["agreement_identical"] == 64
    for key in ("profile_one_stream", "profile_greedy64"):  # the kernel profiles (here: torch ops' CPU time)
        prof = n[key]
        assert prof["wall_ms_per_token"] > 0 and 0 < prof["busy_ms_per_token"] and len(prof["top"]) >= 5, key
        assert all("% aten::" in line and "/token)" in line for line in prof["top"]), prof["top"]
    # the decode step fused (uncompiled on a CPU) on a fresh engine: its rows, ratios against the eager rows, the race
    assert n["fusion_on"] is True and n["fusion_compiler"] == "none", n.get("fusion_error")
    for key in ("fusion_ttft_ms", "fusion_one_stream_tok_s", "fusion_greedy4_tok_s", "fusion_race_eager_ms",
                "fusion_race_fused_ms", "fusion_race_pointwise_ms", "fusion_one_stream_bw_fraction"):
        assert n[key] > 0, key
    assert n["fusion_vs_eager_one_stream"] == round(n["fusion_one_stream_tok_s"] / n["one_stream_tok_s"], 2)
    assert n["fusion_after_rows"].startswith("fused (")  # no fused call failed while serving
    peers = steps["peers"]  # transformers static cache (not compiled on a CPU) and continuous batching, same model
    assert peers["status"] == "ok", peers["error"] + peers["traceback"]
    p = peers["numbers"]
    assert p["peer_static_compiled"] is False and p["peer_cb_counts"] == [4, 8]
    for key in ("peer_static_ttft_ms", "peer_static_one_stream_tok_s", "peer_cb_greedy4_tok_s", "peer_cb_greedy8_tok_s"):
        assert p[key] > 0, key
    assert p["ours_vs_static_one_stream"] == round(n["one_stream_tok_s"] / p["peer_static_one_stream_tok_s"], 2)
    assert steps["tensorrt"]["status"] in ("skipped", "ok")
    targets = {t["target"]: t for t in res["targets"]}
    assert targets["fp32 tokens identical to transformers"]["met"] is True
    assert "eager's" in targets["one stream with decode fusion on at >= 70% of the measured bandwidth"]["value"]
    md = out.read_text()
    for name in steps:
        assert f"| {name} |" in md
    assert "| target | measured | met |" in proc.stdout  # the table is printed last


def test_a_failing_step_is_recorded_and_the_check_goes_on(tmp_path):
    from bench.gpu.report import Check

    check = Check(device=torch.device("cpu"), tiny=True, out=tmp_path / "r.md", budget_s=60, tmp=str(tmp_path),
                  big_dtype="float32", command="test")

    def broken(c):
        raise ValueError("no such kernel")

    check.run("broken", broken, 10)
    check.run("fine", lambda c: {"x": 1}, 10)
    check.finish()
    res = json.loads((tmp_path / "r.json").read_text())
    assert [(s["name"], s["status"]) for s in res["steps"]] == [("broken", "failed"), ("fine", "ok")]
    assert res["steps"][0]["error"] == "ValueError: no such kernel" and "Traceback" in res["steps"][0]["traceback"]
    assert "| broken | failed |" in (tmp_path / "r.md").read_text()


def test_the_watchdog_writes_the_results_and_ends_a_hung_check(tmp_path):
    script = textwrap.dedent(f"""
        import time, torch
        from bench.gpu.report import Check
        check = Check(device=torch.device("cpu"), tiny=True, out=__import__("pathlib").Path({str(tmp_path)!r}) / "w.md",
                      budget_s=1.0, tmp={str(tmp_path)!r}, big_dtype="float32", command="test",
                      min_step_s=0.0)
        check.start_watchdog(grace_s=1.0)
        check.run("done", lambda c: {{"x": 1}}, 5)
        check.run("hang", lambda c: time.sleep(120), 5)
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 50
    res = json.loads((tmp_path / "w.json").read_text())
    assert [s["name"] for s in res["steps"]] == ["done", "hang"]
    assert res["steps"][1]["status"] == "running" and "watchdog" in res["steps"][1]["error"]
