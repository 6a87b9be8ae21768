"""KV-cache events: the prefix cache's blocks stored and removed, published as vLLM publishes them, so that llm-d's
KV-cache indexer (llm-d-kv-cache, read by llm-d-router's precise prefix-cache scorer) knows which replica holds
which prompt prefix and routes a chat's next turn to it.

Wire format (vLLM's `vllm/distributed/kv_events.py`, `ZmqEventPublisher`; what llm-d-kv-cache's
`engineadapter/vllm_adapter.go` decodes):
- A ZMQ PUB socket (bound for `tcp://*:PORT`, `ipc://` or `inproc://`, else connected); each message is three
  frames: the topic (`kv@<pod>@<model>`: llm-d's subscribers filter on `kv@` and read the pod and model from it),
  the sequence number (8 bytes, big-endian, from 0) and the payload.
- The payload is msgpack of a `KVEventBatch` as msgspec encodes vLLM's structs: the batch an array
  (`array_like`), `[ts, [event, ...], data_parallel_rank]` (rank 0). Each event, in `layout` "map" (vLLM since
  #42892, 2026-06: llm-d-kv-cache reads it since v0.9.0, the one llm-d-router v0.10.0 uses) a map tagged by
  "type": `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
  "medium", "lora_name", ["extra_keys",] "group_idx": 0, "kv_cache_spec_kind": "full_attention"}` (omit_defaults:
  no extra_keys when no block has any), `{"type": "BlockRemoved", "block_hashes", "medium", "group_idx": 0}`,
  `{"type": "AllBlocksCleared"}`; in `layout` "array" (vLLM before, `array_like=True`, for consumers built
  before the change) the same fields by position, tag first, without the group fields:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name(,
  extra_keys)]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
- With `replay_endpoint` a ROUTER socket answers a request `[b"", start_seq (8 bytes)]` with every buffered
  `[b"", seq, payload]` from that sequence number on, then `[b"", -1 (8 bytes, signed), b""]`.

What the fields carry: `block_hashes` are the engine's own (`prefix_cache.py`: 32-byte SHA-256 chain, sent as
msgpack bin as vLLM sends its sha256 hashes). llm-d's indexer uses them only as opaque keys (it takes their last
8 bytes): it recomputes its own keys from `token_ids` (all the event's blocks' ids, in order), the parent's key
(looked up by `parent_block_hash`, None for a request's first block), `lora_name` (the adapter's name; its key
space, as the model name for the base model) and `extra_keys` (per block: the hex identifiers of the image spans
in it, then for the first block the request's cache salt, as vLLM sends `cache_salt`). `lora_id` is None (we have
no integer adapter ids; llm-d reads `lora_name`). `medium` is "GPU" or "CPU", where the KV cache lives.
`AllBlocksCleared` is sent when the publisher starts (a new process has an empty cache: an indexer drops what it
held for this pod) and when it closes.

Never able to stop the engine: the engine thread only appends to a bounded deque (`stored` / `removed`, O(1), no
lock, no I/O); a background thread batches what is there every `interval_s`, encodes and sends without blocking
(`zmq.NOBLOCK`; a PUB socket drops for a subscriber past its high-water mark); idle, it looks every `idle_s`.
When the deque is full, or the send fails, events are dropped and counted (`dropped`), and the failure logged;
nothing is raised to the engine.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Optional

import msgpack
import zmq

from .prefix_cache import BlockHash, RequestHasher

log = logging.getLogger("triton_vlm")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
LAYOUTS = ("map", "array")
FIELDS = {  # vLLM's field order (BlockStored: the fields before the HMA group fields)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
GROUP = {"BlockStored": {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}, "BlockRemoved": {"group_idx": 0}}


@dataclass
class _Stored:
    block_hash: BlockHash
    parent: Optional[BlockHash]
    hasher: RequestHasher


def default_topic(model: str) -> str:
    """llm-d's topic layout, `kv@<pod>@<model>`, with this host's name as the pod."""
    return f"kv@{socket.gethostname()}@{model}"


class KVEventPublisher:
    """`prefix_cache.BlockEvents` published on ZMQ (module doc). Attach with `KVCache.events = publisher`."""

    def __init__(self, endpoint: str, *, topic: str, block_size: int, medium: str = "GPU",
                 replay_endpoint: Optional[str] = None, max_events: int = 100_000, buffer_batches: int = 10_000,
                 hwm: int = 100_000, interval_s: float = 0.005, idle_s: float = 0.05, layout: str = "map"):
        if layout not in LAYOUTS:
            raise ValueError(f"kv_events_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.topic, self.block_size, self.medium, self.layout = topic.encode(), block_size, medium, layout
        self.max_events, self.interval_s, self.idle_s = max_events, interval_s, idle_s
        self.dropped = self.sent_batches = 0
        self._events: deque = deque()
        self._buffer: deque = deque(maxlen=buffer_batches)  # (seq, payload) for replay
        self._seq = count()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._wake, self._closed = threading.Event(), False
        self.cleared()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # --- the engine thread's side: O(1), never raises ----------------------------------------------------------
    def _put(self, event) -> None:
        if self._closed or len(self._events) >= self.max_events:
            self.dropped += 1
            return
        self._events.append(event)

    def stored(self, block_hash: BlockHash, parent: Optional[BlockHash], hasher: RequestHasher) -> None:
        self._put(_Stored(block_hash, parent, hasher))

    def removed(self, block_hash: BlockHash) -> None:
        self._put(("BlockRemoved", block_hash))

    def cleared(self) -> None:
        self._put(("AllBlocksCleared",))

    # --- the publisher thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        busy = True
        while not self._closed or self._events:
            self._wake.wait(self.interval_s if busy else self.idle_s)  # every 5 ms while events come, else 50
            self._wake.clear()
            try:
                if self._replay is not None:
                    self._serve_replay()
                busy = bool(self._events)
                self._flush()
            except Exception:  # noqa: BLE001 - logged; events are dropped, the engine never sees it
                log.exception("KV-cache events: publishing failed; dropping this batch")
                time.sleep(0.1)

    def _drain(self) -> list:
        out, events = [], self._events
        while events:
            out.append(events.popleft())
        return out

    def _flush(self) -> None:
        pending = self._drain()
        if not pending:
            return
        events = self.encode(pending)
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        seq = next(self._seq)
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.sent_batches += 1
        except zmq.Again:
            self.dropped += len(pending)
        self._buffer.append((seq, payload))

    def encode(self, pending: list) -> list:
        """Events in vLLM's layout (`self.layout`); consecutive stores of one chain (same adapter) become one
        BlockStored, consecutive removals one BlockRemoved (as vLLM emits them per step)."""
        out: list = []
        for e in pending:
            last = out[-1] if out else None
            if isinstance(e, _Stored):
                meta = e.hasher.meta.get(e.block_hash)
                if meta is None:  # not hashed by this hasher: nothing honest to say about its tokens
                    self.dropped += 1
                    continue
                keys = list(meta.extra_keys) or None
                if (last is not None and last[0] == "BlockStored" and last[1][-1] == e.parent
                        and last[7] == e.hasher.lora_name):
                    last[1].append(e.block_hash)
                    last[3].extend(int(t) for t in meta.tokens)
                    last[8].append(keys)
                    continue
                out.append(["BlockStored", [e.block_hash], e.parent, [int(t) for t in meta.tokens], self.block_size,
                            None, self.medium, e.hasher.lora_name, [keys]])
            elif e[0] == "BlockRemoved" and last is not None and last[0] == "BlockRemoved":
                last[1].append(e[1])
            elif e[0] == "BlockRemoved":
                out.append(["BlockRemoved", [e[1]], self.medium])
            else:
                out.append(list(e))
        for ev in out:  # omit_defaults: no extra_keys when no block has any
            if ev[0] == "BlockStored" and not any(ev[8]):
                del ev[8]
        if self.layout == "array":
            return out
        return [{"type": ev[0], **dict(zip(FIELDS[ev[0]], ev[1:])), **GROUP.get(ev[0], {})} for ev in out]

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("KV-cache events: invalid replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([client, b"", END_SEQ, b""])

    def close(self, timeout: float = 2.0) -> None:
        """Announce the cache gone (`AllBlocksCleared`), send what is queued, close the sockets."""
        if self._closed:
            return
        self.cleared()
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)


def attach(engine, endpoint: str, *, topic: str, replay_endpoint: Optional[str] = None,
           layout: str = "map") -> KVEventPublisher:
    """Publish `engine`'s prefix-cache events on `endpoint` (e.g. `tcp://*:5557`)."""
    cache = engine.cache
    medium = "GPU" if cache.device.type == "cuda" else "CPU"
    publisher = KVEventPublisher(endpoint, topic=topic, block_size=cache.block_size, medium=medium,
                                 replay_endpoint=replay_endpoint, layout=layout)
    cache.events = publisher
    return publisher
