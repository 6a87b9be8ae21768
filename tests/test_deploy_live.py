"""The deployment files against running servers: the probes, ports and metric names the manifests use are the
ones the server has, and the endpoint picker of the Gateway API Inference Extension, played by the test with
the shipped EndpointPickerConfig, tells unevenly loaded replicas apart the way its scorers need.

The picker reads each replica at the InferencePool's target port (the OpenAI-compatible API, 9000), whose
/metrics re-exports the server's: each replica here runs the front end beside its server, as the launcher does,
and is scraped there."""
from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient

from dataclasses import dataclass

from triton_vlm.server.frontend import OpenAIFrontend
from triton_vlm.server.process import free_port

from bench.server.routing import KVIndex, Subscriber, run_chats
from deploy_support import (EndpointMetrics, Spec, epp_config, extract, one, parse_prometheus, pick, render,
                            score, server_container)

pytestmark = pytest.mark.server

GATEWAY = "overlays/inference-gateway"
PRECISE = "overlays/inference-gateway-precise"


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@dataclass
class Replica:
    """A server and the OpenAI-compatible front end beside it (what the launcher runs in a pod)."""

    server: object  # process.TritonServer
    frontend: OpenAIFrontend

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def http_url(self) -> str:
        return self.server.http_url


@contextlib.contextmanager
def frontend_beside(server, tmp_path, lora_dir=None):
    frontend = OpenAIFrontend(server.grpc_url, f"http://localhost:{server.metrics_port}/metrics",
                              str(server.model_path), port=free_port(), host="127.0.0.1",
                              lora_dir=str(lora_dir) if lora_dir else None, log_file=tmp_path / "openai.log")
    try:
        frontend.start().wait_ready(120)
        yield Replica(server, frontend)
    finally:
        frontend.stop()


def scrape(replica: Replica) -> dict:
    """What a picker scrapes: /metrics on the InferencePool's target port, the front end's."""
    status, text = get(f"{replica.frontend.url}/metrics", timeout=10)
    assert status == 200
    return parse_prometheus(text)


def live_ports(replica: Replica) -> dict[int, int]:
    """containerPort -> the port this test replica listens on (the launcher serves HTTP, gRPC, metrics and the
    OpenAI-compatible API)."""
    s = replica.server
    return {8000: s.http_port, 8001: s.grpc_port, 8002: s.metrics_port, 9000: replica.frontend.port}


def test_probes_ports_and_metric_names_are_the_servers(triton_server, tmp_path):
    with frontend_beside(triton_server, tmp_path) as replica:
        check_probes_ports_and_metric_names(replica)


def check_probes_ports_and_metric_names(replica: Replica) -> None:
    docs = render(GATEWAY)
    c = server_container(docs)
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    ports = live_ports(replica)
    assert set(named.values()) == set(ports)
    [pool] = [d for d in docs if d["kind"] == "InferencePool"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [9000]
    status, body = get(f"http://localhost:{ports[9000]}/v1/models")
    assert status == 200 and json.loads(body)["data"], "the pool's target port serves the OpenAI API"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        http = c[probe]["httpGet"]
        status, _ = get(f"http://localhost:{ports[named[http['port']]]}{http['path']}")
        assert status == 200, (probe, http)
    status, _ = get(f"http://localhost:{ports[named['http']]}/v2/health/nonexistent")
    assert status != 200  # the probes' 200 means something
    with grpcclient.InferenceServerClient(f"localhost:{ports[named['grpc']]}") as client:
        assert client.is_server_ready()
    [endpoint] = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    status, text = get(f"http://localhost:{ports[named[endpoint['port']]]}{endpoint['path']}")
    assert status == 200 and "nv_inference_request_success" in text and "triton_vlm_" in text
    families = scrape(replica)  # the picker's scrape, on the pool's target port
    for path in (GATEWAY, PRECISE):  # both configurations' metric specs name series the server has
        _, engine = epp_config(render(path))
        for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheNumBlocksSpec"):
            Spec.parse(engine[key]).latest(families)  # LookupError if the server has no such series
    blocks = Spec.parse(engine["cacheNumBlocksSpec"]).latest(families).value
    assert blocks > 0 and blocks == int(blocks)  # the approximate prefix index's capacity per replica
    assert 0.0 <= Spec.parse(engine["kvUsageSpec"]).latest(families).value <= 1.0
    info = Spec.parse(engine["loraSpec"]).latest_lora(families).labels
    assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= set(info)

    [rule] = [r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    selectors = re.findall(r"([a-z_:]+)\{model(=~|=)\"([^\"]+)\"\}", rule["expr"])
    assert len(selectors) >= 4
    for name, op, value in selectors:
        models = value.split("|") if op == "=~" else [value]
        for model in models:
            assert any(s.labels.get("model") == model for s in families.get(name, [])), (name, model)


# --- the picker's view -----------------------------------------------------------------------------------------
REPLICA_PARAMS = {"max_rows": "2", "max_loras": "2", "kv_cache_mb": "0", "kv_cache_tokens": "1024"}
# a's requests: a 300-token prompt (19 KV blocks taken at prefill) and 150 new tokens. b's one request: a short
# prompt and 240 new tokens on 2 beams, so b is busy most of the time and holds at most 32 blocks (2 rows of 16),
# fewer than a's two prefilled prompts (38).
PROMPT_TOKENS, NEW_TOKENS = 300, 150
# b's request is a beam search of width 2 (the per-request beam decoder): greedy decoding is batched and fast
# enough that one greedy request kept b's engine busy only a few % of the time.
SHORT_PROMPT, LONG_NEW_TOKENS, B_BEAMS = "USER: Say hello. ASSISTANT:", 240, 2


@pytest.fixture(scope="module")
def events_sub():
    """The picker stand-in's KV-events subscriber (llm-d's central mode: it binds, the replicas connect), with the
    precise overlay's topic filter and block size."""
    config, _ = epp_config(render(PRECISE))
    [params] = [p["parameters"] for p in config["plugins"] if p["type"] == "precise-prefix-cache-producer"]
    sub = Subscriber(KVIndex(block_size=params["tokenProcessorConfig"]["blockSize"]),
                     topic_filter=params["kvEventsConfig"]["topicFilter"])
    yield sub
    sub.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, demo_model, demo_adapters, events_sub):
    """Two replicas of the server as shipped, small enough that 4 long requests queue: 2 rows each, 2 LoRA slots,
    a KV cache of 64 blocks of 16 tokens; each publishes its KV-cache events to the picker stand-in."""
    from conftest import _start_servers, _stop_server

    names = ("replica-a", "replica-b")
    specs = [(demo_model, {"*": {"lora_dir": str(demo_adapters)},
                           "llm": {**REPLICA_PARAMS, "kv_events_endpoint": events_sub.endpoint,
                                   "kv_events_topic": f"kv@{name}@llm"}}, name) for name in names]
    started = _start_servers(tmp_path_factory, specs)  # side by side
    with contextlib.ExitStack() as stack:
        try:
            for i, name in enumerate(names):
                started[i] = stack.enter_context(
                    frontend_beside(started[i], tmp_path_factory.mktemp(f"{name}-openai"), demo_adapters))
            yield started
        finally:
            stack.close()  # the front ends first
            for replica in started:
                _stop_server(getattr(replica, "server", replica))


def long_prompt(demo_model) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model), local_files_only=True)
    body = "the red circle"
    while len(tok(f"USER: {body} ASSISTANT:").input_ids) < PROMPT_TOKENS:
        body += " and the red circle"
    return f"USER: {body} ASSISTANT:"


class Load:
    """Threads that each send one long request after another to a replica until stopped (bounded: each request
    has a fixed number of new tokens; every answer must succeed)."""

    def __init__(self):
        self.stop, self.threads, self.errors, self.done = threading.Event(), [], [], 0
        self.by_url: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, server, adapter: str, prompt: str, new_tokens: int, count: int, beams: int = 1) -> None:
        body = json.dumps({"text_input": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens,
                           "exclude_input_in_output": True, "lora_name": adapter, "beam_width": beams}).encode()
        url = f"http://{server.http_url}/v2/models/ensemble/generate"

        def loop():
            while not self.stop.is_set():
                req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        text = json.loads(r.read())["text_output"]
                    with self.lock:
                        self.done += 1 if text else 0
                        self.by_url[url] = self.by_url.get(url, 0) + 1
                except Exception as e:  # noqa: BLE001 - reported by the test
                    with self.lock:
                        self.errors.append(repr(e))
                    return

        for _ in range(count):
            t = threading.Thread(target=loop, daemon=True)
            t.start()
            self.threads.append(t)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads)
        assert not self.errors, self.errors


def picker_view(servers, engine, attempts: int = 10) -> dict[str, EndpointMetrics]:
    """One scrape of every replica. The LoRA gauge is replaced (family deleted, then created) when its labels
    change, so a scrape can fall between the two and find no series; a picker keeps its last value then, and
    this view scrapes again (a missing series on every try still fails)."""
    for attempt in range(attempts):
        try:
            return {name: extract(engine, scrape(s)) for name, s in servers.items()}
        except LookupError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05)


def wait_for(servers, engine, condition, what: str, deadline_s: float = 120, load=None):
    deadline = time.monotonic() + deadline_s
    seen = []
    while True:
        view = picker_view(servers, engine)
        if condition(view):
            return view
        seen.append(view)
        assert load is None or not load.errors, f"the load failed: {load.errors}"
        if time.monotonic() > deadline:
            b_running = sum(1 for v in seen if v["b"].running) if "b" in view else None
            raise AssertionError(f"not seen within {deadline_s:.0f} s: {what}; last view {view}; "
                                 f"{len(seen)} views, b running in {b_running}; answered per url {getattr(load, 'by_url', None)}")
        time.sleep(0.2)


def queue_compute_ratio(before: dict, after: dict) -> float:
    """prometheusrule.yaml's triton_vlm:queue_compute:ratio over the interval between two scrapes."""
    def total(f, name, models):
        return sum(s.value for s in f.get(name, []) if s.labels.get("model") in models)

    def delta(name, models):
        return total(after, name, models) - total(before, name, models)

    queue = delta("nv_inference_queue_duration_us", ("preprocess", "vision")) / 1e6 + \
        delta("triton_vlm_queue_seconds_sum", ("llm",))
    compute = delta("nv_inference_compute_infer_duration_us", ("preprocess", "vision")) / 1e6 + \
        delta("triton_vlm_request_seconds_sum", ("llm",)) - delta("triton_vlm_queue_seconds_sum", ("llm",))
    return queue / max(compute, 1e-6)


def test_picker_tells_unevenly_loaded_replicas_apart(replicas, demo_model):
    docs = render(GATEWAY)
    config, engine = epp_config(docs)
    [rule] = [r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    for name in ("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
                 "triton_vlm_queue_seconds_sum", "triton_vlm_request_seconds_sum"):
        assert name in rule["expr"]  # queue_compute_ratio() computes the rule's expression
    servers = {"a": replicas[0], "b": replicas[1]}
    prompt = long_prompt(demo_model)
    before = {k: scrape(s) for k, s in servers.items()}

    load = Load()
    try:  # a: 4 streams of adapter french for 2 rows; b: 1 stream of adapter sentence
        load.add(servers["a"], "french", prompt, NEW_TOKENS, 4)
        load.add(servers["b"], "sentence", SHORT_PROMPT, LONG_NEW_TOKENS, 1, beams=B_BEAMS)
        # b's one stream keeps its engine busy most of the time, each request shorter than the gauges' refresh
        # (0.5 s): the gauges are sampled on their own clock, so b is seen running (test_metrics_live covers it)
        view = wait_for(servers, engine, lambda v: (
            v["a"].running == 2 and v["a"].waiting >= 1 and v["b"].running == 1 and v["b"].waiting == 0
            and v["a"].active_models == {"french"} and v["b"].active_models == {"sentence"}
            and v["a"].waiting_models == {"french"} and not v["b"].waiting_models
            and v["a"].kv_usage > v["b"].kv_usage),
            "a: 2 running, some waiting (french), more KV in use; b: 1 running (sentence)", load=load)
    finally:
        load.finish()
    a, b = view["a"], view["b"]
    assert a.waiting_models == {"french"} and not b.waiting_models  # the LoRA gauge, read in the same view
    assert a.max_active_models == b.max_active_models == int(REPLICA_PARAMS["max_loras"])
    assert a.kv_usage <= 1  # a 0-1 fraction
    assert score("queue-scorer", view, "")["b"] > score("queue-scorer", view, "")["a"]
    assert score("running-requests-size-scorer", view, "")["b"] > score("running-requests-size-scorer", view, "")["a"]
    assert score("kv-cache-utilization-scorer", view, "")["b"] > score("kv-cache-utilization-scorer", view, "")["a"]
    assert score("lora-affinity-scorer", view, "french") == {"a": 1.0, "b": 0.8}  # b has a free adapter slot
    assert score("lora-affinity-scorer", view, "sentence") == {"a": 0.0, "b": 1.0}  # a's slots are taken
    for model in ("", "french", "sentence"):
        chosen, totals = pick(config, view, model)
        assert chosen == "b", (model, totals)  # the configured weights steer away from the loaded replica

    idle = wait_for(servers, engine, lambda v: all(
        m.waiting == m.running == 0 and m.kv_usage == 0 and not m.active_models and not m.waiting_models
        for m in v.values()), "both replicas idle again")
    assert score("queue-scorer", idle, "") == {"a": 1.0, "b": 1.0}
    assert load.done >= 4
    after = {k: scrape(s) for k, s in servers.items()}
    ratio = {k: queue_compute_ratio(before[k], after[k]) for k in servers}
    assert ratio["a"] > 0.2 and ratio["a"] > 4 * ratio["b"], ratio  # the HPA's metric sees a's queue


# --- prefix-cache-aware routing ----------------------------------------------------------------------------------
def test_precise_prefix_routing_keeps_chats_where_their_blocks_are(replicas, events_sub, demo_model):
    """The picker stand-in, fed by both replicas' KV-cache events (its prefix-cache match) and their /metrics
    (its other scorers, the precise overlay's weights), sends every chat's next turn to the replica holding its
    blocks; over the same kind of multi-chat run the engines' prefix-cache hit rate is higher than with round
    robin (measured here, side by side on the same two replicas; runs of other seeds share no prefix)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model), local_files_only=True)
    tokenize = lambda text: tok(text, add_special_tokens=True).input_ids  # noqa: E731 - as preprocess does
    reps = {name: {"url": f"http://{r.http_url}", "metrics": f"http://localhost:{r.server.metrics_port}/metrics"}
            for name, r in zip(("replica-a", "replica-b"), replicas)}
    chats, turns = 5, 4
    config, engine = epp_config(render(PRECISE))  # the picker's weights, its scorers on each replica's /metrics
    servers = dict(zip(sorted(reps), replicas))

    def weigh(prefix: dict) -> dict:
        return pick(config, picker_view(servers, engine), "", prefix)[1]

    rr = run_chats("round-robin", reps, tokenize, chats=chats, turns=turns, max_tokens=8, seed=11, sub=events_sub)
    precise = run_chats("precise", reps, tokenize, chats=chats, turns=turns, max_tokens=8, seed=12, sub=events_sub,
                        weigh=weigh)
    print(f"\nprefix-cache hit rate over {chats} chats x {turns} turns on 2 replicas: round robin "
          f"{rr.hit_rate:.3f} ({rr.hits:.0f}/{rr.queries:.0f} tokens), precise {precise.hit_rate:.3f} "
          f"({precise.hits:.0f}/{precise.queries:.0f}); next turn on the same replica {rr.stayed} vs "
          f"{precise.stayed} of {chats * (turns - 1)}")
    assert set(events_sub.seqs) == {"replica-a", "replica-b"}  # both replicas published
    assert events_sub.index.skipped == 0  # every stored chain's parent was known
    assert precise.stayed == chats * (turns - 1), precise.placements  # each chat stays where its blocks are
    assert rr.stayed < chats * (turns - 1)
    assert precise.queries > 0 and rr.queries > 0
    assert precise.hit_rate > rr.hit_rate + 0.05, (precise.hit_rate, rr.hit_rate)
