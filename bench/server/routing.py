"""Routing benchmark: llm-d's precise prefix-cache routing (fed by the engine's KV-cache events) against round
robin, side by side on the same replicas and the same chats; the measure is the engines' own prefix-cache hit
rate (`triton_vlm_prefix_cache_hits_total / triton_vlm_prefix_cache_queries_total`, summed over the replicas).

    python -m bench.server.routing              # 2 replicas of the demo model, 6 chats x 4 turns, both policies

The picker stand-in (`KVIndex`, `Router`) does what llm-d-router's precise-prefix-cache-producer and
prefix-cache-scorer do with llm-d-kv-cache (v0.10.0 / its `kvevents.Pool`): a SUB socket receives every replica's
events (`kv@<pod>@<model>` topics, msgpack `KVEventBatch`, decoded positionally as `engineadapter/vllm_adapter.go`
does); for each `BlockStored` it recomputes its own block keys from `token_ids`, the parent's key (found through
the engine key of `parent_block_hash`), the model (or `lora_name`) and `extra_keys`, as `chunkedTokenDatabase`
does (FNV-64a over canonical CBOR of `[parent, tokens, extra]`; not checked bit for bit against the Go code,
which the routing does not need: both sides here use this one), and maps the engine's block hashes (opaque; their
last 8 bytes) to them; `BlockRemoved` evicts by engine key, `AllBlocksCleared` drops the pod. A request's prompt
is tokenized as the server does, cut into blocks, keyed the same way; each replica scores the number of leading
blocks it holds; the most wins, ties go round robin.
"""
from __future__ import annotations

import argparse
import json
import random
import struct
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgpack
import zmq

FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fnv64a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(value) -> bytes:
    """Canonical CBOR of the few types the key hash encodes: None, unsigned ints, str, lists, str-keyed dicts."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    if isinstance(value, dict):
        items = sorted(((cbor(k), cbor(v)) for k, v in value.items()), key=lambda kv: (len(kv[0]), kv[0]))
        return _head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(type(value))


def engine_key(h) -> int:
    """llm-d's `getHashAsUint64`: an int as is, bytes by their last 8 (big-endian)."""
    return h if isinstance(h, int) else int.from_bytes(bytes(h)[-8:].rjust(8, b"\0"), "big")


def decode_batch(payload: bytes) -> tuple[float, list[dict]]:
    """A `KVEventBatch` payload -> (ts, events as dicts by vLLM's field names). Events in either layout, as
    llm-d-kv-cache's vLLM adapter reads them (v0.9.0: a tagged map is read by name, a tagged array by position,
    `fieldAt`: absent trailing fields are None)."""
    batch = msgpack.unpackb(payload, raw=False)
    ts, events = batch[0], batch[1]
    names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                             "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
             "BlockRemoved": ("block_hashes", "medium", "group_idx"), "AllBlocksCleared": ()}
    out = []
    for f in events:
        tag = f.get("type") if isinstance(f, dict) else f[0]
        if tag not in names:
            raise ValueError(f"unknown event tag {tag!r}")
        if isinstance(f, dict):
            out.append({"type": tag, **{k: f.get(k) for k in names[tag]}})
        else:
            out.append({"type": tag, **{k: f[i + 1] if i + 1 < len(f) else None for i, k in enumerate(names[tag])}})
    return ts, out


@dataclass
class KVIndex:
    """llm-d-kv-cache's index as the routing needs it: request key -> pods, and each pod's engine -> request keys."""

    block_size: int = 16
    hash_seed: str = ""
    pods: dict = field(default_factory=lambda: defaultdict(set))  # request key -> pods holding it
    by_engine: dict = field(default_factory=dict)  # (pod, engine key) -> request key
    skipped: int = 0  # stored events whose parent was unknown (llm-d skips them too)

    def _hash(self, parent: int, tokens, extra) -> int:
        return fnv64a(cbor([parent, tokens, extra]))

    def keys(self, parent: Optional[int], tokens: list[int], model: str, extra=None) -> list[int]:
        """`TokensToKVBlockKeys`: full blocks only; extra[i] = block i's identifiers (or None)."""
        prev = parent if parent is not None else self._hash(fnv64a(self.hash_seed.encode()), None, model)
        out = []
        for i in range(len(tokens) // self.block_size):
            keys = extra[i] if extra and i < len(extra) else None
            mm = [{"Hash": k} for k in keys if isinstance(k, str)] if keys else None
            prev = self._hash(prev, list(tokens[i * self.block_size:(i + 1) * self.block_size]), mm or None)
            out.append(prev)
        return out

    def apply(self, pod: str, model: str, events: list[dict]) -> None:
        for ev in events:
            if ev["type"] == "BlockStored":
                parent = None
                if ev["parent_block_hash"] is not None:
                    parent = self.by_engine.get((pod, engine_key(ev["parent_block_hash"])))
                    if parent is None:
                        self.skipped += 1
                        continue
                keys = self.keys(parent, ev["token_ids"], ev["lora_name"] or model, ev["extra_keys"])
                for h, k in zip(ev["block_hashes"], keys):  # engine and index blocks are the same size here
                    self.by_engine[(pod, engine_key(h))] = k
                    self.pods[k].add(pod)
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    k = self.by_engine.pop((pod, engine_key(h)), None)
                    if k is not None:
                        self.pods[k].discard(pod)
            else:
                for pk in [pk for pk in self.by_engine if pk[0] == pod]:
                    self.pods[self.by_engine.pop(pk)].discard(pod)

    def match(self, tokens: list[int], model: str) -> dict[str, int]:
        """Leading blocks of `tokens` each pod holds (llm-d's longest-prefix lookup)."""
        found: dict[str, int] = defaultdict(int)
        alive = None
        for k in self.keys(None, tokens, model):
            alive = set(self.pods.get(k, ())) if alive is None else alive & self.pods.get(k, set())
            if not alive:
                break
            for pod in alive:
                found[pod] += 1
        return dict(found)


class Subscriber:
    """A SUB socket bound at `endpoint` (llm-d's central mode: the engines connect to it) feeding a `KVIndex`."""

    def __init__(self, index: KVIndex, endpoint: str = "tcp://127.0.0.1:*", topic_filter: str = "kv@"):
        self.index, self.lock = index, threading.Lock()
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic_filter)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.seqs: dict[str, list[int]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            _, pod, model = topic.decode().split("@", 2)
            _, events = decode_batch(payload)
            with self.lock:
                self.seqs[pod].append(int.from_bytes(seq, "big"))
                self.index.apply(pod, model, events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


class Router:
    """`precise`: each replica scored by the share of the prompt's blocks it holds (leading blocks / blocks, the
    prefix-cache-scorer's match ratio), through `weigh` when given (the picker's other scorers: ratio -> total
    score per replica); the highest wins, ties round robin. `round-robin`: one after the other."""

    def __init__(self, policy: str, pods: list[str], sub: Optional[Subscriber] = None, model: str = "llm",
                 weigh: Optional[Callable[[dict], dict]] = None):
        self.policy, self.pods, self.sub, self.model, self.weigh, self.turn = policy, pods, sub, model, weigh, 0

    def pick(self, tokens: list[int]) -> tuple[str, dict]:
        self.turn += 1
        if self.policy == "round-robin":
            return self.pods[self.turn % len(self.pods)], {}
        with self.sub.lock:
            found = self.sub.index.match(tokens, self.model)
        total = max(len(tokens) // self.sub.index.block_size, 1)
        ratio = {p: found.get(p, 0) / total for p in self.pods}
        scores = self.weigh(ratio) if self.weigh else ratio
        best = max(scores.values())
        tied = [p for p in self.pods if scores[p] >= best - 1e-9]
        return tied[self.turn % len(tied)], scores


# --- the workload ------------------------------------------------------------------------------------------------
SYSTEM = "A chat between a curious user and an assistant. The assistant answers in a few words."
TOPICS = ["red circles", "blue squares", "green triangles", "yellow stars", "purple hexagons", "orange ovals",
          "silver lines", "golden arcs"]


def question(chat: int, turn: int) -> str:
    return f"Tell me about {TOPICS[chat % len(TOPICS)]}, part {turn + 1}, in chat number {chat}."


def generate(url: str, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                       "exclude_input_in_output": True}).encode()
    req = urllib.request.Request(f"{url}/v2/models/ensemble/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["text_output"]


def prefix_counters(metrics_url: str) -> tuple[float, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    got = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for k in got:
            if line.startswith(f"triton_vlm_prefix_cache_{k}_total{{") and 'model="llm"' in line:
                got[k] += float(line.rsplit(" ", 1)[1])
    return got["hits"], got["queries"]


@dataclass
class RunResult:
    policy: str
    hits: float
    queries: float
    placements: dict  # chat -> the replicas of its turns, in order
    stayed: int  # turns after the first sent to the replica of the chat's previous turn

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.queries, 1.0)


def run_chats(policy: str, replicas: dict[str, dict], tokenize, *, chats: int, turns: int, max_tokens: int,
              seed: int, sub: Optional[Subscriber] = None, settle_s: float = 0.3,
              weigh: Optional[Callable[[dict], dict]] = None) -> RunResult:
    """`chats` conversations of `turns` turns, one turn of every chat per round in a seeded order; each turn
    resends the history. Runs with different seeds share no prefix (the seed opens every prompt).
    `replicas`: pod -> {"url": Triton HTTP base, "metrics": /metrics URL}."""
    pods = sorted(replicas)
    router, rng = Router(policy, pods, sub, weigh=weigh), random.Random(seed)
    before = [prefix_counters(replicas[p]["metrics"]) for p in pods]
    history = {c: f"Session {seed}. {SYSTEM}" for c in range(chats)}  # no prefix shared with another run
    placements: dict[int, list[str]] = {c: [] for c in range(chats)}
    for t in range(turns):
        order = list(range(chats))
        rng.shuffle(order)
        for c in order:
            prompt = f"{history[c]} USER: {question(c, t)} ASSISTANT:"
            pod, _ = router.pick(tokenize(prompt))
            answer = generate(replicas[pod]["url"], prompt, max_tokens)
            history[c] = f"{prompt} {answer.strip()}</s>"
            placements[c].append(pod)
            time.sleep(settle_s if sub is not None else 0)  # the events of this turn reach the picker
    after = [prefix_counters(replicas[p]["metrics"]) for p in pods]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    stayed = sum(1 for p in placements.values() for x, y in zip(p, p[1:]) if x == y)
    return RunResult(policy, hits, queries, placements, stayed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica", action="append", required=True, metavar="POD=HTTP_URL,METRICS_URL",
                    help="a running server whose llm publishes its KV events to --events with topic kv@POD@llm")
    ap.add_argument("--events", required=True, help="where the picker stand-in binds its SUB socket")
    ap.add_argument("--model", required=True, help="the checkpoint folder (its tokenizer)")
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    replicas = {}
    for spec in args.replica:
        pod, urls = spec.split("=", 1)
        http, metrics = urls.split(",")
        replicas[pod] = {"url": http, "metrics": metrics}
    sub = Subscriber(KVIndex(block_size=args.block_size), args.events)
    try:
        results = [run_chats(policy, replicas, lambda t: tok(t).input_ids, chats=args.chats, turns=args.turns,
                             max_tokens=args.max_tokens, seed=args.seed + i, sub=sub)
                   for i, policy in enumerate(("round-robin", "precise"))]
    finally:
        sub.close()
    for r in results:
        print(f"{r.policy:12s} hit rate {r.hit_rate:.3f} ({r.hits:.0f} / {r.queries:.0f} prompt tokens); "
              f"next turn on the same replica {r.stayed}")


if __name__ == "__main__":
    main()
