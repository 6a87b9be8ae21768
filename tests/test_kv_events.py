"""KV-cache events (engine/kv/kv_events.py): the prefix cache's blocks stored / removed / cleared, published on ZMQ
in vLLM's layout and decoded here positionally as llm-d-kv-cache's vLLM adapter decodes them; an llm-d-style
index fed by them (bench.server.routing.KVIndex: its own keys recomputed from the events' token ids) finds a chat's next
turn on the engine that holds its blocks; a dead or failing subscriber never blocks or stops the engine."""
from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from bench.server.routing import KVIndex, decode_batch, engine_key
from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.kv import kv_events
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.lora.format import Adapter, LoraModule, module_shape
from triton_vlm.params import GenerationParams, GenerationRequest

BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=96)
    return model, save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def make_engine(path, **kw) -> Engine:
    base = dict(max_rows=16, kv_cache_tokens=1024, block_size=BS, prefill_chunk=8)
    return Engine(path, EngineConfig(**(base | kw)))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def run(eng: Engine, rid: str, ids: list[int], max_tokens: int = 8, **kw):
    r = GenerationRequest(rid, list(ids), GenerationParams(max_tokens=max_tokens, min_tokens=max_tokens),
                          **kw)
    res = eng.generate([r])[rid][-1]
    assert res.final and res.error is None, res.error
    return res.sequences[0].token_ids, res.cached_tokens


class Sub:
    """A subscriber of one publisher: raw frames kept, batches decoded as llm-d decodes them."""

    def __init__(self, publisher: kv_events.KVEventPublisher):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "kv@")
        self.sock.connect(publisher.endpoint)
        self.frames: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while not self.sock.poll(50):  # the slow joiner: announce until the subscription is through
            assert time.monotonic() < deadline, "the subscriber never received anything"
            publisher.cleared()
        self.frames.append(self.sock.recv_multipart())

    def receive(self, quiet_s: float = 0.3) -> list[dict]:
        """Every event until `quiet_s` pass without a message."""
        events = []
        while self.sock.poll(int(quiet_s * 1000)):
            frames = self.sock.recv_multipart()
            self.frames.append(frames)
            events += decode_batch(frames[2])[1]
        return events

    def close(self):
        self.sock.close(0)


@pytest.fixture
def published(ckpt):
    """An engine publishing its events on a loopback port, and a subscriber connected to it."""
    made = []

    def make(layout="map", **kw):
        eng = make_engine(ckpt[1], **kw)
        pub = kv_events.attach(eng, "tcp://127.0.0.1:*", topic="kv@pod-a@llava", layout=layout)
        sub = Sub(pub)
        sub.receive(0.1)
        made.append((eng, pub, sub))
        return eng, pub, sub

    yield make
    for eng, pub, sub in made:
        pub.close()
        sub.close()
        eng.shutdown()


STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")


@pytest.mark.parametrize("layout", ["map", "array"])
def test_stored_on_prefill_and_decode_in_vllms_layout(published, layout):
    eng, pub, sub = published(layout=layout)
    ids = prompt(23, 1)
    answer, _ = run(eng, "t1", ids, max_tokens=12)
    events = sub.receive()
    topic, seq, payload = sub.frames[-1]
    assert topic == b"kv@pod-a@llava" and len(seq) == 8
    ts, raw, rank = msgpack.unpackb(payload, raw=False)  # the batch: array_like, [ts, events, dp rank]
    assert isinstance(ts, float) and rank == 0
    if layout == "map":  # vLLM since #42892: tagged maps, omit_defaults (no extra_keys here), one KV group
        assert all(list(f) == ["type", *STORED, "group_idx", "kv_cache_spec_kind"] for f in raw)
        assert all((f["group_idx"], f["kv_cache_spec_kind"]) == (0, "full_attention") for f in raw)
    else:  # before: positional, tag first, trailing defaults omitted
        assert all(f[0] == "BlockStored" and len(f) == 1 + len(STORED) for f in raw)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored
    hashes = [h for e in stored for h in e["block_hashes"]]
    tokens = [t for e in stored for t in e["token_ids"]]
    # the prompt's 5 full blocks, then the answer's full blocks (the last token is never fed back)
    full = (23 + 12 - 1) // BS
    assert len(hashes) == full and tokens == (ids + answer)[:full * BS]
    assert set(hashes) == set(eng.cache._by_hash)  # the engine's own 32-byte hashes, every one it registered
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert stored[0]["parent_block_hash"] is None
    for prev, nxt in zip(stored, stored[1:]):  # later events continue the chain
        assert nxt["parent_block_hash"] == prev["block_hashes"][-1]
    e = stored[0]
    assert (e["block_size"], e["lora_id"], e["medium"], e["lora_name"], e["extra_keys"]) == \
        (BS, None, "CPU", None, None)
    seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_an_llm_d_index_finds_the_next_turn_where_its_blocks_are(published):
    """llm-d's indexer recomputes its own keys from the events' token ids: the next turn of the chat (history +
    answer + a question) matches as many leading blocks as the engine then reuses."""
    eng, pub, sub = published()
    index = KVIndex(block_size=BS)
    p1 = prompt(23, 2)
    a1, _ = run(eng, "c1", p1, max_tokens=12)
    run(eng, "other", prompt(30, 3), max_tokens=4)
    index.apply("pod-a", "llava", sub.receive())
    p2 = p1 + a1 + prompt(9, 4)[1:]
    assert index.match(p2, "llava") == {"pod-a": (23 + 12 - 1) // BS}
    assert index.match(prompt(23, 5), "llava") == {}  # an unrelated prompt: nothing
    _, cached = run(eng, "c2", p2, max_tokens=4)
    assert cached == (23 + 12 - 1) // BS * BS
    assert index.skipped == 0


def test_removed_on_eviction_and_the_index_follows_the_cache(published):
    eng, pub, sub = published(kv_cache_tokens=24 * BS)
    index = KVIndex(block_size=BS)
    alive: set[bytes] = set()
    removed = 0
    for i in range(8):
        run(eng, f"r{i}", prompt(30 + i % 3, 100 + i), max_tokens=6)
        for e in sub.receive(0.15):
            if e["type"] == "BlockStored":
                alive |= set(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                assert set(e["block_hashes"]) <= alive and e["medium"] == "CPU"
                alive -= set(e["block_hashes"])
                removed += len(e["block_hashes"])
            index.apply("pod-a", "llava", [e])
    assert removed > 0
    assert alive == set(eng.cache._by_hash)  # the subscriber's view is the cache's index exactly
    assert {engine_key(h) for h in alive} == {k[1] for k in index.by_engine}


def test_cleared_when_the_publisher_starts_and_closes(published):
    eng, pub, sub = published()
    run(eng, "x", prompt(20, 7))
    assert [e["type"] for e in sub.receive()][0] == "BlockStored"
    pub.close()
    assert sub.receive()[-1] == {"type": "AllBlocksCleared"}
    assert decode_batch(sub.frames[0][2])[1] == [{"type": "AllBlocksCleared"}]  # the first message of all


def test_image_identifiers_and_the_salt_enter_extra_keys(ckpt, published):
    model, _ = ckpt
    eng, pub, sub = published()
    n, img = model.config.image_seq_length, model.config.image_token_id
    torch.manual_seed(3)
    with torch.no_grad():
        feats = torch.stack(list(model.get_image_features(torch.rand(1, 3, 32, 32), vision_feature_layer=-2,
                                                          vision_feature_select_strategy="default").pooler_output))
    ids = [1, 20, 21, 22, 23, 24] + [img] * n + [30, 31, 32, 33, 34, 35, 36]
    run(eng, "img", ids, max_tokens=2, image_embeds=feats, cache_salt="tenant-1")
    stored = [e for e in sub.receive() if e["type"] == "BlockStored"]
    keys = [k for e in stored for k in (e["extra_keys"] or [None] * len(e["block_hashes"]))]
    assert keys[0] == ["tenant-1"]  # block 0: text only, then the salt (vLLM: cache_salt in block 0)
    image_blocks = [i for i in range(len(keys)) if any(p == img for p in ids[i * BS:(i + 1) * BS])]
    assert image_blocks and all(keys[i] and len(keys[i][0]) == 64 for i in image_blocks)  # sha256 hex
    assert len({keys[i][0] for i in image_blocks}) == 1  # one image: one identifier
    assert all(not keys[i] for i in range(1, len(keys)) if i not in image_blocks)


def test_adapter_blocks_carry_its_name_and_live_in_its_own_key_space(published):
    """An adapter's blocks come with `lora_name`; the index keys them in that name's space (llm-d's effective
    model name), so the same tokens without the adapter match nothing, and with it they match."""
    eng, pub, sub = published()
    spec, g = eng.model_config, torch.Generator().manual_seed(8)
    mods = {(layer, m): LoraModule(torch.randn(2, module_shape(spec, m)[0], generator=g),
                                   torch.randn(module_shape(spec, m)[1], 2, generator=g), 1.0)
            for layer in range(spec.num_layers) for m in ("k_proj", "v_proj")}
    ids = prompt(21, 9)
    run(eng, "lora", ids, max_tokens=2, adapter=Adapter("french", mods))
    stored = [e for e in sub.receive() if e["type"] == "BlockStored"]
    assert stored and {e["lora_name"] for e in stored} == {"french"} and stored[0]["lora_id"] is None
    index = KVIndex(block_size=BS)
    index.apply("pod-a", "llava", stored)
    assert index.match(ids, "llava") == {}  # the base model's key space: not these blocks
    assert index.match(ids, "french") == {"pod-a": 21 // BS}


def test_replay_resends_the_batches_from_a_sequence_number(ckpt):
    """vLLM's replay socket: a ROUTER answering [b"", start (8 bytes)] with every buffered [b"", seq, payload] from
    there, then the end marker (-1) (a DEALER reads the stream; a REQ socket would keep only the first)."""
    eng = make_engine(ckpt[1])
    pub = kv_events.KVEventPublisher("tcp://127.0.0.1:*", topic="kv@r@llava", block_size=BS,
                                     replay_endpoint="tcp://127.0.0.1:*")
    eng.cache.events = pub
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub._replay.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        for i in range(3):
            run(eng, f"p{i}", prompt(20, 300 + i))
            time.sleep(0.1)  # a batch or more each
        time.sleep(0.2)  # all sent

        def replay(first: int) -> list[tuple[int, list[dict]]]:
            req.send_multipart([b"", first.to_bytes(8, "big")])
            got = []
            while True:
                assert req.poll(5000), "no replay answer"
                empty, seq, payload = req.recv_multipart()
                assert empty == b""
                if seq == kv_events.END_SEQ:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))

        everything = replay(0)
        assert [s for s, _ in everything] == list(range(pub.sent_batches)) and pub.sent_batches >= 2
        assert everything[0][1][0] == {"type": "AllBlocksCleared"}  # the start's announcement comes first
        assert [s for s, _ in replay(1)] == list(range(1, pub.sent_batches))
        stored = {h for _, events in everything for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
        assert stored == set(eng.cache._by_hash)
    finally:
        req.close(0)
        pub.close()
        eng.shutdown()


def test_a_dead_subscriber_never_blocks_the_engine(ckpt):
    """A subscriber that never reads (high-water mark 1 on both sides) and a queue of 4 events: the engine runs
    to the end at its own pace; what cannot be sent is dropped and counted."""
    eng = make_engine(ckpt[1])
    pub = kv_events.KVEventPublisher("tcp://127.0.0.1:*", topic="kv@dead@llava", block_size=BS, hwm=1,
                                     max_events=4, interval_s=0.05)
    eng.cache.events = pub
    dead = zmq.Context.instance().socket(zmq.SUB)
    dead.setsockopt(zmq.RCVHWM, 1)
    dead.setsockopt(zmq.LINGER, 0)
    dead.setsockopt_string(zmq.SUBSCRIBE, "")
    dead.connect(pub.endpoint)
    try:
        t0 = time.perf_counter()
        for i in range(6):
            run(eng, f"d{i}", prompt(40, 200 + i), max_tokens=8)
        assert time.perf_counter() - t0 < 60
        assert pub.dropped > 0
    finally:
        pub.close()
        dead.close(0)
        eng.shutdown()


def test_a_failing_publisher_logs_drops_and_the_engine_goes_on(ckpt, caplog):
    eng = make_engine(ckpt[1])
    pub = kv_events.attach(eng, "tcp://127.0.0.1:*", topic="kv@broken@llava")
    try:
        def broken(*a, **k):
            raise zmq.ZMQError(zmq.ETERM, "socket gone")

        pub._pub.send_multipart = broken
        got, _ = run(eng, "b1", prompt(30, 9))
        deadline = time.monotonic() + 5
        while "publishing failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "publishing failed" in caplog.text
        assert run(eng, "b2", prompt(30, 9))[0] == got and pub._thread.is_alive()
    finally:
        pub.close()
        eng.shutdown()
