"""On-demand KV through the server (llm parameter scheduler_policy max_utilization): 12 greedy requests of 250
tokens on a cache of 1,280 KV tokens all start together (under guaranteed_no_evict 4 would), some are preempted
(the counter says so), and each gets the tokens it gets alone. Stock tritonclient, one gRPC stream (live server)."""
from __future__ import annotations

import queue
import re
import time
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.server

N, TOKENS, KV_TOKENS = 12, 250, 1280


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model):
    from conftest import _start_server, _stop_server

    params = {"llm": {"scheduler_policy": "max_utilization", "kv_cache_tokens": str(KV_TOKENS)}}
    srv = _start_server(tmp_path_factory, demo_model, params, "preemption-server")
    yield srv
    _stop_server(srv)


def preemptions(server) -> float:
    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^triton_vlm_preemptions_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m, "no triton_vlm_preemptions_total"
    return float(m.group(1))


def stream_all(server, prompts: list[str]) -> dict[str, dict]:
    """Send every prompt at once on one gRPC stream (streamed tokens, greedy, exactly TOKENS each) -> request id ->
    {"ids": the streamed token ids, "first": arrival of the first piece, "end": arrival of the final response}."""
    import tritonclient.grpc as grpcclient

    def inp(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error, time.monotonic())))
    got = {str(i): {"ids": [], "first": None, "end": None} for i in range(len(prompts))}
    try:
        for i, prompt in enumerate(prompts):
            client.async_stream_infer("ensemble", [
                inp("text_input", np.array([[prompt]], dtype=object), "BYTES"),
                inp("max_tokens", np.array([[TOKENS]], np.int32), "INT32"),
                inp("min_tokens", np.array([[TOKENS]], np.int32), "INT32"),
                inp("stream", np.array([[True]], np.bool_), "BOOL")],
                request_id=str(i), enable_empty_final_response=True)
        left = set(got)
        while left:
            result, error, at = q.get(timeout=120)
            assert error is None, error
            r = result.get_response()
            entry = got[r.id]
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                entry["ids"].extend(int(t) for t in ids.reshape(-1))
                entry["first"] = entry["first"] or at
            final = r.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                entry["end"] = at
                left.discard(r.id)
    finally:
        client.stop_stream()
        client.close()
    return got


def test_twelve_long_greedy_requests_start_together_are_preempted_and_answer_as_alone(server):
    prompts = [f"USER: Tell me story number {i}. ASSISTANT:" for i in range(N)]
    before = preemptions(server)
    together = stream_all(server, prompts)
    alone = {k: stream_all(server, [p])["0"] for k, p in zip(together, prompts)}
    first_end = min(r["end"] for r in together.values())
    assert all(r["first"] is not None and r["first"] < first_end for r in together.values()), \
        "every request streams its first token before any request finishes"
    for k, r in together.items():
        assert len(r["ids"]) == TOKENS and r["ids"] == alone[k]["ids"], f"request {k}"
    assert len({tuple(r["ids"]) for r in together.values()}) > 1  # the prompts lead to different answers
    deadline = time.monotonic() + 10  # the counter is refreshed every 0.5 s
    while preemptions(server) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert preemptions(server) > before


def test_an_unknown_policy_is_refused_at_load_naming_the_allowed_ones(tmp_path_factory, demo_model):
    """The llm alone: its load fails with the parameter, the value and the allowed values."""
    from triton_vlm.server.process import TritonServer, free_port

    run_dir = tmp_path_factory.mktemp("bad-policy")
    srv = TritonServer(str(demo_model), free_port(), free_port(), free_port(), models=("llm",), run_dir=run_dir,
                       params={"llm": {"scheduler_policy": "evict_everything"}}, log_file=run_dir / "server.log",
                       exit_timeout=10)
    srv.start()
    try:
        with pytest.raises(RuntimeError) as err:
            srv.wait_ready(300)
    finally:
        srv.stop()
    assert "scheduler_policy must be one of guaranteed_no_evict, max_utilization, got 'evict_everything'" in \
        str(err.value), str(err.value)
