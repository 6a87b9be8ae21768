"""Decode steps on bucketed static shapes (`cuda_graph.py`).

On the CPU the padded path runs uncaptured (`capture=False`: the same buffers and forward a graph records): an
engine on it generates the same tokens as the plain engine for greedy and beam requests of different lengths
arriving at different steps (row counts and key counts crossing buckets), padding rows never change the real
rows' logits nor any cache slot but the scratch slot, and LoRA / oversized steps run eager. On a GPU (`gpu`
marker): captured graphs replay the same tokens as eager, are reused across steps and requests, and a steady
decode step synchronises with the host a constant number of times.
"""
from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine import scheduler as scheduler_mod
from triton_vlm.engine.lora.graph_slots import GraphAdapters, buffer_bytes
from triton_vlm.engine.lora.lora import LoraBatch, StackCache
from triton_vlm.engine.model import cuda_graph
from triton_vlm.engine.model.cuda_graph import DecodeGraphs, keys_buckets, rows_buckets, static_bytes
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.model.model import LlamaModel
from triton_vlm.errors import InvalidArgument
from triton_vlm.lora.format import Adapter, LoraModule, module_shape
from triton_vlm.params import GenerationParams, GenerationRequest

CONTEXT = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=CONTEXT)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties (and flips) are rare
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def engine(path, padded: bool, capture: bool = False, **kw) -> Engine:
    base = dict(max_rows=32, kv_cache_tokens=2048, block_size=4, prefill_chunk=8, cuda_graph_min_keys=8)
    eng = Engine(path, EngineConfig(**(base | kw)))
    if padded and eng.decode_graphs is None:
        eng.make_decode_graphs(capture=capture)
    return eng


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def request(rid: str, ids, max_tokens=8, beam=1, adapter=None, **kw) -> GenerationRequest:
    params = GenerationParams(max_tokens=max_tokens, beam_width=beam, num_return_sequences=beam, **kw)
    return GenerationRequest(request_id=rid, input_ids=list(ids), params=params, adapter=adapter)


def run_staggered(eng: Engine, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, list]:
    results: dict[str, list] = {}
    step = 0
    while step <= max(arrivals) or any(not r or not r[-1].final for r in results.values()):
        for req in arrivals.get(step, []):
            results[req.request_id] = []
            eng.submit(req, lambda res: results[res.request_id].append(res))
        eng.step()
        step += 1
        assert step < 500
    return results


def finals(results) -> dict[str, tuple]:
    out = {}
    for rid, rs in results.items():
        assert rs[-1].final and rs[-1].error is None, rs[-1].error
        out[rid] = tuple((tuple(s.token_ids), s.cum_log_prob) for s in rs[-1].sequences)
    return out


def mixed_arrivals(n: int = 14) -> dict[int, list[GenerationRequest]]:
    """Greedy and beam (2..4) requests, prompts of 3..41 tokens, two arriving every third step."""
    arrivals: dict[int, list] = {}
    for i in range(n):
        r = request(f"q{i}", prompt(3 + (7 * i) % 39, 100 + i), max_tokens=5 + (3 * i) % 14, beam=1 + i % 4)
        arrivals.setdefault(i // 2 * 3, []).append(r)
    return arrivals


def record_shapes(monkeypatch) -> list[tuple[int, int, int]]:
    """(rows, B, T) of every step the padded path takes."""
    seen: list[tuple[int, int, int]] = []
    orig = DecodeGraphs.bucket_shape

    def bucket_shape(self, rows, keys):
        shape = orig(self, rows, keys)
        seen.append((rows, *shape))
        return shape

    monkeypatch.setattr(DecodeGraphs, "bucket_shape", bucket_shape)
    return seen


def assert_same(got: dict, want: dict) -> None:
    """Same tokens; scores within fp32 rounding (the GEMMs see B rows instead of n: ulp-level blocking changes)."""
    assert got.keys() == want.keys()
    for rid in want:
        assert [s[0] for s in got[rid]] == [s[0] for s in want[rid]], rid
        assert [s[1] for s in got[rid]] == pytest.approx([s[1] for s in want[rid]], rel=1e-4, abs=1e-4), rid


# --- buckets ---------------------------------------------------------------------------------------------------
def test_buckets():
    assert rows_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert rows_buckets(20) == [1, 2, 4, 8, 16, 20] and rows_buckets(3) == [1, 2, 3] and rows_buckets(1) == [1]
    assert keys_buckets(96, 8) == [8, 16, 32, 64, 96] and keys_buckets(4096, 256) == [256, 512, 1024, 2048, 4096]
    assert keys_buckets(64, 64) == [64]


def test_config_validation_and_default_off_on_cpu(ckpt):
    for name in ("cuda_graph_max_rows", "cuda_graph_min_keys"):
        with pytest.raises(InvalidArgument, match=f"{name} must be >= 1, got 0"):
            EngineConfig(**{name: 0}).validate()
    eng = engine(ckpt, padded=False)
    assert eng.config.cuda_graphs and eng.decode_graphs is None and eng.scheduler.runner.graphs is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        eng.make_decode_graphs(capture=True)


# --- the padded path on the CPU ----------------------------------------------------------------------------------
def test_padded_engine_generates_the_plain_engines_tokens(ckpt, monkeypatch):
    shapes = record_shapes(monkeypatch)
    plain = finals(run_staggered(engine(ckpt, padded=False), mixed_arrivals()))
    eng = engine(ckpt, padded=True, enable_prefix_caching=False)  # a second run repeats the first one's steps
    padded = finals(run_staggered(eng, mixed_arrivals()))
    assert_same(padded, plain)
    g = eng.decode_graphs
    steps, buckets = g.static_steps, len(g._buckets)
    assert steps == len(shapes) > 20 and g.fallbacks == 0 and g.replays == 0
    assert len({b for _, b, _ in shapes}) >= 4 and len({t for _, _, t in shapes}) >= 4  # crossing buckets
    assert any(n < b for n, b, _ in shapes) and any(n == b for n, b, _ in shapes)  # padded and full buckets
    assert eng.cache.used_blocks == 0 and eng.cache.reserved == 0 and not eng.scheduler.has_work()
    assert_same(finals(run_staggered(eng, mixed_arrivals())), plain)  # again: the same buckets serve it
    assert g.static_steps == 2 * steps and len(g._buckets) == buckets


def prefilled_rows(model: LlamaModel, cache, lengths, seed=0):
    """Rows holding random prompts of the given lengths (eager prefill), and each row's next token."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        row = cache.new_row()
        ids = torch.randint(5, 300, (n,), generator=g)
        model.forward(model.embed(ids)[None], cache.plan([row], n), cache)
        rows.append(row)
    return rows, torch.randint(5, 300, (len(rows),), generator=g).tolist()


def restore(rows, state) -> None:
    for r, (blocks, length) in zip(rows, state):
        r.blocks, r.length = list(blocks), length


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: captured
@pytest.mark.parametrize("lengths", [(5, 6, 7), (9, 2, 14, 5, 1)])  # 3 rows in bucket 4, 5 rows in bucket 8
def test_padding_rows_never_change_real_rows(ckpt, lengths, device):
    """The same step twice with different padding content: the real rows' logits are bit for bit the same (a row
    reads only its own keys, every row's arithmetic is its own), and no cache slot but the rows' new slots and
    the scratch slot changes (on CUDA: warm-up and capture included). Against the eager forward the logits agree
    to fp32 rounding."""
    model = LlamaModel.from_pretrained(ckpt, device=device)
    cache = model.new_cache(32, 4)
    rows, tokens = prefilled_rows(model, cache, lengths)  # no row's next token opens a new block
    state = [(list(r.blocks), r.length) for r in rows]
    graphs = DecodeGraphs(model, cache, max_rows=8, context=CONTEXT, min_keys=8, capture=device == "cuda")
    assert graphs.bucket_shape(len(rows), max(lengths) + 1)[0] > len(rows)  # padding rows present
    assert cache.scratch_slot == 32 * 4 == cache.k.shape[1] - 1  # the slot after the blocks
    k0, v0 = cache.k.clone(), cache.v.clone()
    runs = []
    for pad in (0, 77):
        restore(rows, state)
        graphs.pad_token = pad
        runs.append((graphs.decode(rows, tokens), cache.k.clone(), cache.v.clone()))
    (a, ka, va), (b, kb, vb) = runs
    assert torch.equal(a, b) and a.shape == (len(rows), model.config.vocab_size)
    assert graphs.replays == (2 if device == "cuda" else 0) and graphs.captures == (device == "cuda")
    new = [r.blocks[(r.length - 1) // 4] * 4 + (r.length - 1) % 4 for r in rows] + [cache.scratch_slot]
    keep = torch.ones(cache.k.shape[1], dtype=torch.bool, device=device)
    keep[new] = False
    assert torch.equal(ka[:, keep], k0[:, keep]) and torch.equal(va[:, keep], v0[:, keep])  # nothing else written
    assert torch.equal(ka[:, :cache.scratch_slot], kb[:, :cache.scratch_slot])  # the rows' own K: the same
    assert not torch.equal(ka[:, cache.scratch_slot], kb[:, cache.scratch_slot])  # the pads wrote the scratch slot
    bucket = next(iter(graphs._buckets.values()))
    graphs._set_padding(bucket)  # what warm-up and capture run: every row padding, only the scratch slot written
    graphs._run(bucket)
    assert torch.equal(cache.k[:, keep], k0[:, keep]) and torch.equal(cache.k[:, new[:-1]], kb[:, new[:-1]])
    restore(rows, state)
    x = model.embed(torch.tensor(tokens))[:, None]  # [rows, 1, hidden]
    eager = model.forward(x, cache.plan(rows, 1), cache)  # [rows, vocab]
    # fp32 logits up to ~20 (ulp ~2e-6; measured differences <= 5e-6 on the CPU): another GEMM row count / key
    # padding moves the last bits only
    torch.testing.assert_close(a, eager, rtol=1e-5, atol=1e-4)


def tiny_adapter(spec) -> Adapter:
    g = torch.Generator().manual_seed(3)
    n_in, n_out = module_shape(spec, "q_proj")
    return Adapter("t", {(0, "q_proj"): LoraModule(torch.randn(2, n_in, generator=g) * 0.1,
                                                   torch.randn(n_out, 2, generator=g) * 0.1, 1.0)})


def adapter(spec, name: str, rank: int, seed: int, modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
            dtype=torch.float32) -> Adapter:
    """Random deltas large enough to change the logits, on several projections of every layer."""
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(spec.num_layers):
        for m in modules:
            n_in, n_out = module_shape(spec, m)
            mods[(layer, m)] = LoraModule((torch.randn(rank, n_in, generator=g) * 0.3).to(dtype),
                                          (torch.randn(n_out, rank, generator=g) * 0.3).to(dtype), 0.5 + seed % 3)
    return Adapter(name, mods)


def lora_graphs(model, cache, slots: int = 2, rank: int = 4) -> DecodeGraphs:
    """Captured on a GPU, uncaptured (the same code) on the CPU."""
    return DecodeGraphs(model, cache, max_rows=8, context=CONTEXT, min_keys=8, capture=model.device.type == "cuda",
                        lora=GraphAdapters(model.config, slots, rank, model.device))


def eager_step(model, cache, rows, tokens, row_adapters):
    """The eager forward of one decode step (runner.decode's), LoRA by `LoraBatch`."""
    x = model.embed(torch.tensor(tokens))[:, None]  # [rows, 1, hidden]
    row_adapters = [None if a is None else a.to(model.device) for a in row_adapters]
    adapters = LoraBatch.build(row_adapters, StackCache(), model.device)
    return model.forward(x, cache.plan(rows, 1), cache, adapters)  # [rows, vocab]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: captured
def test_lora_rows_on_the_static_slots_equal_the_eager_lora_path(ckpt, device):
    """A step of 5 rows (bucket 8) with two adapters of ranks 2 and 4 (fp32, bf16) and rows without one: the LoRA
    rows' logits equal the eager `LoraBatch` step's to fp32 rounding (the GEMMs see every slot's columns), and
    differ from the plain step's; the rows without an adapter are the plain graph's bit for bit (they add 0)."""
    model = LlamaModel.from_pretrained(ckpt, device=device)
    cache = model.new_cache(32, 4)
    rows, tokens = prefilled_rows(model, cache, (5, 6, 7, 3, 9))
    state = [(list(r.blocks), r.length) for r in rows]
    a = adapter(model.config, "a", 2, 1).to(device)
    b = adapter(model.config, "b", 4, 2, modules=("q_proj", "k_proj", "gate_proj"), dtype=torch.bfloat16).to(device)
    row_adapters = [a, None, b, a, None]
    graphs = lora_graphs(model, cache)
    plain = graphs.decode(rows, tokens)
    restore(rows, state)
    got = graphs.decode(rows, tokens, row_adapters)
    assert graphs.static_steps + graphs.replays == 2 and graphs.fallbacks == 0 and graphs.lora.loads == 2
    assert (graphs.captures, graphs.lora_replays) == ((2, 1) if device == "cuda" else (0, 0))  # plain and LoRA
    restore(rows, state)
    want = eager_step(model, cache, rows, tokens, row_adapters)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for i in (0, 2, 3):
        assert (got[i] - plain[i]).abs().max() > 0.1, i  # the adapters change these rows
    assert torch.equal(got[1], plain[1]) and torch.equal(got[4], plain[4])  # and only these
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: captured
def test_an_adapter_reloaded_into_a_slot_updates_results_without_new_buffers(ckpt, device):
    """One slot: a step with adapter a, then one with b (reloaded into the same slot's buffers, the same tensors),
    then a again: each step equals the eager step with its adapter (on a GPU: one LoRA graph, captured once and
    replayed with each). An adapter whose rank exceeds the slots' runs eager (None, rows untouched), as does a step
    with more adapters than slots."""
    model = LlamaModel.from_pretrained(ckpt, device=device)
    cache = model.new_cache(32, 4)
    rows, tokens = prefilled_rows(model, cache, (5, 6, 7), seed=4)
    state = [(list(r.blocks), r.length) for r in rows]
    graphs = lora_graphs(model, cache, slots=1, rank=4)
    slots = graphs.lora
    ptrs = [t.data_ptr() for s in slots.buffers.values() for t in (s.a, s.b, s.scale)]
    a, b = adapter(model.config, "a", 3, 5), adapter(model.config, "b", 4, 6, modules=("k_proj", "down_proj"))
    a, b = a.to(device), b.to(device)
    for n, ad in enumerate((a, b, a)):
        restore(rows, state)
        got = graphs.decode(rows, tokens, [ad, None, ad])
        restore(rows, state)
        torch.testing.assert_close(got, eager_step(model, cache, rows, tokens, [ad, None, ad]), rtol=1e-5, atol=1e-4)
        assert slots.loads == n + 1
    assert ptrs == [t.data_ptr() for s in slots.buffers.values() for t in (s.a, s.b, s.scale)]
    assert graphs.lora_replays == 3 * graphs.captures == 3 * (device == "cuda")
    restore(rows, state)
    lengths = [r.length for r in rows]
    assert graphs.decode(rows, tokens, [adapter(model.config, "big", 5, 7), None, None]) is None
    assert graphs.decode(rows, tokens, [a, b, None]) is None  # two adapters, one slot
    assert [r.length for r in rows] == lengths and graphs.fallbacks == 2


class FakeGraph:
    """A recorded graph on the CPU: replay runs the bucket's step (as a replay would), or raises `error`."""

    def __init__(self, graphs: DecodeGraphs, b, lora: bool, error: Optional[Exception] = None):
        self.graphs, self.b, self.lora, self.error = graphs, b, lora, error

    def replay(self):
        if self.error is not None:
            raise self.error
        self.graphs._run(self.b, self.lora)


def test_a_failed_capture_is_retried_with_backoff_and_a_failed_replay_runs_that_step(ckpt, monkeypatch):
    """A capture that fails leaves its steps eager until RETRY_STEPS (doubling) decode steps later, then is tried
    again; after CAPTURE_TRIES failures it stays eager. A replay that raises (no CUDA fault) is counted, that step
    runs uncaptured with the same result, and the graph is captured again after the back-off; a CUDA fault raises."""
    monkeypatch.setattr(cuda_graph, "RETRY_STEPS", 3)
    model = LlamaModel.from_pretrained(ckpt)
    cache = model.new_cache(32, 4)
    rows, tokens = prefilled_rows(model, cache, (5, 6, 7), seed=8)
    state = [(list(r.blocks), r.length) for r in rows]
    graphs = lora_graphs(model, cache)
    want = graphs.decode(rows, tokens)  # the uncaptured step
    graphs.capture = True  # from here, steps need a graph (recorded by `record` below)
    outcomes = [RuntimeError("not capturable"),
                RuntimeError("CUDA error: operation not permitted when stream is capturing"), None]  # CUDA's own
    tried = []

    def record(b, lora):
        tried.append(graphs.steps)
        if outcomes[len(tried) - 1] is not None:
            raise outcomes[len(tried) - 1]
        return FakeGraph(graphs, b, lora)

    monkeypatch.setattr(graphs, "_record", record)
    got = []
    for _ in range(11):
        restore(rows, state)
        got.append(graphs.decode(rows, tokens))
    assert tried == [2, 5, 11]  # failed at 2: retry at 2 + 3; failed at 5: retry at 5 + 6
    assert all(g is None for g in got[:9]) and graphs.capture_failures == 2 and graphs.replays == 2
    assert torch.equal(got[9], want) and torch.equal(got[10], want)
    b = next(iter(graphs._buckets.values()))
    b.graphs[False].graph = FakeGraph(graphs, b, False, ValueError("replay broke"))
    restore(rows, state)
    assert torch.equal(graphs.decode(rows, tokens), want)  # that step ran uncaptured
    assert graphs.replay_errors == 1 and b.graph is None and b.graphs[False].retry_at == graphs.steps + 12
    b.graphs[False].graph = FakeGraph(graphs, b, False, RuntimeError("CUDA error: an illegal memory access"))
    restore(rows, state)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        graphs.decode(rows, tokens)
    rec = cuda_graph.Recorded()
    for _ in range(cuda_graph.CAPTURE_TRIES):
        assert rec.due(10**6)
        rec.failed(0)
    assert not rec.due(10**9)  # bounded: eager for good after CAPTURE_TRIES failures


def test_lora_and_oversized_steps(ckpt):
    """Through the engine: LoRA rows run on the padded path from their slots, steps with more rows than the largest
    bucket (4 here) or an adapter above the slots' rank run eager; tokens are the plain engine's either way."""
    eng_plain = engine(ckpt, padded=False)
    eng = engine(ckpt, padded=True, cuda_graph_max_rows=4, cuda_graph_lora_rank=2, max_loras=2)
    ad, big = tiny_adapter(eng.model_config), adapter(eng.model_config, "big", 3, 9)
    reqs = {0: [request("lora", prompt(9, 1), max_tokens=6, adapter=ad)],
            8: [request("wide", prompt(7, 2), max_tokens=6, beam=6)],
            16: [request("small", prompt(11, 3), max_tokens=6, beam=2)],
            24: [request("big", prompt(5, 4), max_tokens=4, adapter=big)]}
    want = finals(run_staggered(eng_plain, reqs))
    assert_same(finals(run_staggered(eng, reqs)), want)
    g = eng.decode_graphs
    assert g.lora is not None and g.lora.loads == 1 and g.lora_steps >= 4  # the rank-2 adapter, loaded once
    assert g.fallbacks >= 6 and g.static_steps >= 8  # wide / big steps eager, lora's and small's padded
    st = eng.stats()  # the counters as the llm model exports them (gauges triton_vlm_engine_cuda_graph_*)
    assert (st.cuda_graph_fallbacks, st.cuda_graph_replays, st.cuda_graphs_captured) == (g.fallbacks, 0, 0)
    assert eng_plain.stats().cuda_graph_fallbacks == 0  # no graphs: every counter 0


def test_the_graphs_buffers_are_what_the_profile_counts(ckpt):
    """`static_bytes` and `buffer_bytes` (what the KV profile takes for the graphs besides their pool) are the bytes
    of the buffers the graphs hold once every bucket exists; on a CPU no graph runs at start and nothing is taken."""
    eng = engine(ckpt, padded=True, max_loras=3, cuda_graph_lora_rank=8)
    g = eng.decode_graphs
    for rows in g.rows_buckets:
        for keys in g.keys_buckets:
            g._bucket(rows, keys)
    held = g._out.nbytes + sum(b.inputs.nbytes for b in g._buckets.values())
    assert static_bytes(eng.model_config.vocab_size, 32, CONTEXT, 8, 4) == held
    assert buffer_bytes(eng.model_config, 3, 8) == g.lora.nbytes > 0
    assert eng._graph_buffer_bytes() == held + g.lora.nbytes
    assert eng.memory.graph_bytes == 0 and engine(ckpt, padded=True, cuda_graph_lora_rank=0).decode_graphs.lora is None


def test_the_graphs_lora_slots_fit_the_lora_device_budget(ckpt):
    """The static slots never take more than `lora_cache_device_mb`: a 7B Llama's rank-16 slot is ~153 MiB, so the
    default 256 MiB holds one of the 16 `max_loras` (not 2.6 GB of every deployment's KV budget), 1 GiB holds six; a
    budget below one slot leaves LoRA steps eager (no buffers)."""
    from dataclasses import replace
    from triton_vlm.engine.lora.graph_slots import slot_count
    eng = engine(ckpt, padded=True, max_loras=3, cuda_graph_lora_rank=8)
    llama7b = replace(eng.model_config, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                      intermediate_size=11008, num_layers=32)
    one = buffer_bytes(llama7b, 1, 16)
    assert 150 * 2**20 < one < 155 * 2**20
    assert [slot_count(llama7b, 16, 16, mb * 2**20) for mb in (100, 256, 1024, 4096)] == [0, 1, 6, 16]
    small = engine(ckpt, padded=True, max_loras=3, cuda_graph_lora_rank=8, lora_cache_device_mb=1)
    per_slot = buffer_bytes(small.model_config, 1, 8)
    assert small.decode_graphs.lora.slots == min(3, 2**20 // per_slot)


# --- CUDA graphs (a GPU) -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_tokens_and_are_reused(ckpt):
    eager = engine(ckpt, padded=False, device="cuda", cuda_graphs=False)
    assert eager.decode_graphs is None
    want = finals(run_staggered(eager, mixed_arrivals()))
    eng = engine(ckpt, padded=False, device="cuda", enable_prefix_caching=False)  # cuda_graphs on by default
    g = eng.decode_graphs
    assert g is not None and g.capture
    assert_same(finals(run_staggered(eng, mixed_arrivals())), want)
    assert g.captures == g.captured > 1 and g.replays > 20 and g.static_steps == 0 and g.fallbacks == 0
    captures, replays = g.captures, g.replays
    assert_same(finals(run_staggered(eng, mixed_arrivals())), want)  # the same steps again: no new capture
    assert g.captures == captures and g.replays == 2 * replays


SYNC_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy")  # as test_decode_batch.py


def host_reads(monkeypatch, counting: list[bool]) -> list[int]:
    """CPU stand-in for syncs (test_decode_batch.py's): every tensor-to-host call while counting[0], host-built
    tensors included (an upper bound of what would synchronise on a GPU)."""
    calls = [0]
    for name in SYNC_METHODS:
        def wrapped(self, *a, _orig=getattr(torch.Tensor, name), **kw):
            calls[0] += counting[0]
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return calls


def sync_counts(eng: Engine, n_requests: int, monkeypatch) -> list[int]:
    """Host-device synchronisations of each decode step of all n greedy requests that captures no graph and ends
    no request: on CUDA the warnings of torch's sync debug mode, on a CPU the stand-in above."""
    per_step: list[int] = []
    orig, graphs, cuda = scheduler_mod.Scheduler._decode, eng.decode_graphs, eng.model.device.type == "cuda"
    counting = [False]
    calls = None if cuda else host_reads(monkeypatch, counting)

    def decode(self, batch, out):
        captures, n_out, before = graphs.captures if graphs else 0, len(out), 0 if cuda else calls[0]
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        counting[0] = True
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                return orig(self, batch, out)
        finally:
            counting[0] = False
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in seen) if cuda else calls[0] - before
            if (len(batch) == n_requests and (graphs.captures if graphs else 0) == captures
                    and not any(r.final for _, r in out[n_out:])):
                per_step.append(syncs)

    monkeypatch.setattr(scheduler_mod.Scheduler, "_decode", decode)
    p = GenerationParams(max_tokens=20, min_tokens=20)
    reqs = {0: [GenerationRequest(f"r{i}", prompt(3 + i % 9, i), p) for i in range(n_requests)]}
    finals(run_staggered(eng, reqs))
    monkeypatch.undo()
    assert len(per_step) >= 4
    return per_step


def test_a_padded_greedy_decode_step_reads_back_once(ckpt, monkeypatch):
    """The padded path builds its inputs on the host and copies them in one piece: the step's only tensor-to-host
    call is the greedy step's read-back, for 2 requests as for 30 (the eager plan adds its max length)."""
    eng = engine(ckpt, padded=True, prefill_chunk=512)  # every prompt prefilled in one step: 30 decode together
    few, many = sync_counts(eng, 2, monkeypatch), sync_counts(eng, 30, monkeypatch)
    assert eng.decode_graphs.static_steps > 0 and eng.decode_graphs.fallbacks == 0
    assert set(few) == set(many) == {1}, (few, many)
    assert set(sync_counts(engine(ckpt, padded=False, prefill_chunk=512), 30, monkeypatch)) == {2}


@pytest.mark.gpu
def test_a_graphed_greedy_decode_step_syncs_a_constant_number_of_times(ckpt, monkeypatch):
    """A graphed step copies its inputs from pinned memory (no sync): what is left is the greedy step's own (its
    read-back, and the index tensors of min_tokens), the same for 2 and 30 requests and fewer than eager's."""
    eng = engine(ckpt, padded=False, device="cuda", prefill_chunk=512)
    few, many = sync_counts(eng, 2, monkeypatch), sync_counts(eng, 30, monkeypatch)
    assert eng.decode_graphs.replays > 0 and eng.decode_graphs.fallbacks == 0
    eager = sync_counts(engine(ckpt, padded=False, device="cuda", cuda_graphs=False, prefill_chunk=512), 30,
                        monkeypatch)
    assert len(set(few) | set(many)) == 1 and 1 <= many[0] <= 3, (few, many)
    assert min(eager) > many[0], (eager, many)  # eager copies its plan and tokens to the device, synchronously


def lora_arrivals(spec) -> dict[int, list[GenerationRequest]]:
    """Three adapters (ranks 2, 4, 3) and plain requests, greedy and beam 2, arriving over the steps."""
    ads = [adapter(spec, f"a{i}", r, 20 + i) for i, r in enumerate((2, 4, 3))]
    arrivals: dict[int, list] = {}
    for i in range(8):
        r = request(f"l{i}", prompt(4 + (5 * i) % 17, 200 + i), max_tokens=6 + i % 5, beam=1 + i % 2,
                    adapter=None if i % 4 == 3 else ads[i % 3])
        arrivals.setdefault(i * 2, []).append(r)
    return arrivals


@pytest.mark.gpu
def test_lora_rows_replay_graphs_with_the_eager_tokens(ckpt):
    """LoRA steps replay their captured graphs (3 adapters through 2 slots: reloads between replays) and generate
    the eager engine's tokens."""
    eager = engine(ckpt, padded=False, device="cuda", cuda_graphs=False, max_loras=2)
    want = finals(run_staggered(eager, lora_arrivals(eager.model_config)))
    eng = engine(ckpt, padded=False, device="cuda", enable_prefix_caching=False, max_loras=2, cuda_graph_lora_rank=4)
    assert_same(finals(run_staggered(eng, lora_arrivals(eng.model_config))), want)
    g = eng.decode_graphs
    assert g.lora_replays == g.lora_steps > 5 and g.lora.loads >= 3 and g.fallbacks == 0
    assert g.capture_failures == g.replay_errors == 0
    st = eng.stats()
    assert (st.cuda_graph_lora_replays, st.cuda_graph_replays, st.cuda_graphs_captured) == \
        (g.lora_replays, g.replays, g.captured) and st.cuda_graph_capture_failures == st.cuda_graph_replay_errors == 0


@pytest.mark.gpu
def test_the_graph_pool_is_within_the_profiles_estimate(ckpt):
    """The memory the captures reserved (measured at start) is within the profile's estimate, which the KV budget
    was sized without."""
    eng = engine(ckpt, padded=False, device="cuda", kv_cache_tokens=0, gpu_memory_utilization=0.05)
    plan, g = eng.memory, eng.decode_graphs
    assert g.captured > 1 and 0 < g.pool_bytes <= plan.graph_pool_bytes, (g.pool_bytes, plan.summary())
    assert plan.graph_bytes == plan.graph_pool_bytes + eng._graph_buffer_bytes()
    left = plan.limit_bytes - plan.weights_bytes - plan.activation_bytes - plan.other_bytes - plan.graph_bytes
    assert plan.kv_tokens == left // plan.token_bytes // 4 * 4
