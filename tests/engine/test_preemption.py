"""On-demand KV (scheduler policy max_utilization): requests start with the blocks of their prompt, grow step by
step, the latest arrived is preempted when the cache runs out and recomputed when it runs again; every request
gets exactly the tokens (and log probs, and streamed pieces) it gets alone: greedy, seeded sampling (batched and
per request), with and without prefix caching, beams and several samples per request as a group; the policy name
is checked; guaranteed_no_evict never preempts."""
from __future__ import annotations

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.kv.kv_cache import blocks_needed
from triton_vlm.errors import Cancelled, InvalidArgument
from triton_vlm.params import GenerationParams, GenerationRequest

BS = 4
CONTEXT = 96
SMALL = 24 * BS  # the smallest cache the engine starts with: one request at the full context


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=CONTEXT)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties (and flips) are rare
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def engine(path, policy="max_utilization", **kw) -> Engine:
    base = dict(max_rows=32, kv_cache_tokens=SMALL, block_size=BS, prefill_chunk=16, scheduler_policy=policy)
    return Engine(path, EngineConfig(**(base | kw)))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def req(rid: str, ids, max_tokens=60, **kw) -> GenerationRequest:
    kw.setdefault("min_tokens", max_tokens)  # no early end: every request runs its whole length
    return GenerationRequest(rid, list(ids), GenerationParams(max_tokens=max_tokens, **kw))


def answer(results) -> list[list[int]]:
    last = results[-1]
    assert last.final and last.error is None, last.error
    return [s.token_ids for s in last.sequences]


def log_probs(results) -> list[list[float]]:
    return [s.log_probs for s in results[-1].sequences]


def same(got: dict, want: dict, want_lp: dict) -> None:
    """Each request's tokens exactly; its log probs to fp32 rounding: a recomputed key or value is the same sum as
    the one it replaces, computed by a prefill instead of a decode step (another order of additions)."""
    assert {k: answer(v) for k, v in got.items()} == want
    for k, v in got.items():
        for a, b in zip(log_probs(v), want_lp[k]):
            assert a == pytest.approx(b, abs=1e-4), k


def alone(path, reqs, lp: bool = False, **kw):
    """Each request run alone on a cache that holds its worst case (nothing to preempt) -> id -> its tokens (and
    id -> its log probs with `lp`)."""
    eng = engine(path, policy="guaranteed_no_evict", kv_cache_tokens=1024, **kw)
    res = {r.request_id: eng.generate([r])[r.request_id] for r in reqs}
    tokens = {k: answer(v) for k, v in res.items()}
    return (tokens, {k: log_probs(v) for k, v in res.items()}) if lp else tokens


def run_together(eng: Engine, reqs) -> tuple[dict, int]:
    """Submit all, step until done -> (request id -> results, the most requests running at once)."""
    results = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.submit(r, lambda res: results[res.request_id].append(res))
    most = 0
    for _ in range(5000):
        more = eng.step()
        most = max(most, eng.stats().running_requests)
        if not more:
            break
    assert all(v and v[-1].final for v in results.values())
    return results, most


def idle(eng: Engine) -> None:
    assert eng.cache.used_blocks == 0 and eng.cache.reserved == 0 and eng.scheduler.rows_reserved == 0
    assert not eng.scheduler.has_work()


MODES = {
    "greedy": dict(return_log_probs=True),
    "sampling": dict(do_sample=True, temperature=0.8, top_k=50, return_log_probs=True),
    "sampling-penalty": dict(do_sample=True, temperature=0.9, repetition_penalty=1.3, return_log_probs=True),
    "greedy-penalty": dict(presence_penalty=0.5, return_log_probs=True),
}


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_all_start_some_are_preempted_and_each_gets_its_tokens_alone(path, mode, caching):
    kw = dict(MODES[mode])
    reqs = [req(f"r{i}", prompt(9 + i % 3, 10 + i), seed=100 + i if "sampling" in mode else None, **kw)
            for i in range(6)]
    worst = blocks_needed(11, 60, 1, BS)
    assert 6 * worst > SMALL // BS >= worst  # together they need far more than the cache; each one fits alone
    eng = engine(path, enable_prefix_caching=caching)
    got, most = run_together(eng, reqs)
    assert most == 6  # every request started at once
    stats = eng.stats()
    assert stats.preemptions > 0 and stats.preempted_requests == 0
    same(got, *alone(path, reqs, lp=True, enable_prefix_caching=caching))
    idle(eng)
    if caching:  # the recomputes are not prompt lookups: one per request
        assert eng.prefix_cache_stats().requests == len(reqs)


def test_guaranteed_no_evict_runs_what_fits_and_never_preempts(path):
    reqs = [req(f"g{i}", prompt(9, 30 + i)) for i in range(4)]
    eng = engine(path, policy="guaranteed_no_evict")
    got, most = run_together(eng, reqs)
    assert most == 1 and eng.stats().preemptions == 0  # one worst case fills the cache
    assert {r.request_id: answer(got[r.request_id]) for r in reqs} == alone(path, reqs)


def test_streamed_pieces_of_a_preempted_request_are_its_tokens_once(path):
    reqs = [req(f"s{i}", prompt(10, 40 + i), stream=True) for i in range(5)]
    eng = engine(path)
    got, _ = run_together(eng, reqs)
    assert eng.stats().preemptions > 0
    want = alone(path, reqs)
    for r in reqs:
        pieces = [t for res in got[r.request_id] if not res.final for s in res.sequences for t in s.token_ids]
        assert pieces == want[r.request_id][0] == answer(got[r.request_id])[0]


ROWS = {
    "beams-batched": dict(beam_width=2, num_return_sequences=2),
    "beams-penalty": dict(beam_width=3, repetition_penalty=1.2, return_log_probs=True),
    "samples-batched": dict(do_sample=True, temperature=0.8, top_k=50, num_return_sequences=2, return_log_probs=True),
    "samples-penalty": dict(do_sample=True, frequency_penalty=0.4, num_return_sequences=3, return_log_probs=True),
}


def spy_preempt(eng: Engine) -> list[str]:
    """The ids of the requests the engine preempts, in order."""
    preempted, original = [], eng.scheduler.policy.preempt

    def spy(a):
        preempted.append(a.id)
        original(a)

    eng.scheduler.policy.preempt = spy
    return preempted


@pytest.mark.parametrize("mode", sorted(ROWS))
def test_requests_of_several_rows_are_preempted_as_a_group_and_get_their_tokens_alone(path, mode):
    """Beams (with their scores and finished hypotheses) and several samples per request: all rows of a request go
    and come back together, each recomputing its own tokens after the shared prompt; greedy ones around them."""
    kw = dict(ROWS[mode])
    width = max(kw.get("beam_width", 1), kw.get("num_return_sequences", 1))
    n = 18 if width == 3 else 30
    assert blocks_needed(10, n, width, BS) <= SMALL // BS
    reqs = [req(f"m{i}", prompt(9 + i % 2, 80 + i), max_tokens=n, seed=7 + i, **kw) for i in range(4)]
    reqs.insert(2, req("greedy", prompt(9, 90), max_tokens=n))
    eng = engine(path)
    preempted = spy_preempt(eng)
    runner, rows_chunks = eng.scheduler.runner, []
    prefill_rows = runner._prefill_rows
    runner._prefill_rows = lambda chunk: rows_chunks.append(len(chunk.active.kv.rows)) or prefill_rows(chunk)
    got, most = run_together(eng, reqs)
    assert most == len(reqs) and any(p.startswith("m") for p in preempted)
    assert rows_chunks and min(rows_chunks) >= 2  # rows recomputed their own tokens together
    same(got, *alone(path, reqs, lp=True))
    idle(eng)


def test_the_oldest_request_is_never_preempted_and_the_latest_is_first(path):
    reqs = [req(f"o{i}", prompt(9, 60 + i)) for i in range(4)]
    eng = engine(path)
    order = []
    original = eng.scheduler.policy.preempt

    def spy(a):
        order.append((a.id, sorted(r.id for r in eng.scheduler.running)))
        original(a)

    eng.scheduler.policy.preempt = spy
    run_together(eng, reqs)
    assert order and all(victim != "o0" for victim, _ in order)
    assert all(victim == max(running, key=lambda x: int(x[1:])) for victim, running in order)


def test_a_preempted_request_can_be_cancelled_while_it_waits(path):
    reqs = [req(f"c{i}", prompt(9, 70 + i)) for i in range(5)]
    eng = engine(path)
    results = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.submit(r, lambda res: results[res.request_id].append(res))
    while not any(a.preemptions for a in eng.scheduler.waiting):
        assert eng.step()
    victim = next(a.id for a in eng.scheduler.waiting if a.preemptions)
    assert eng.stats().preempted_requests >= 1
    eng.cancel(victim)
    while eng.step():
        pass
    assert isinstance(results[victim][-1].error, Cancelled)
    want = alone(path, [r for r in reqs if r.request_id != victim])
    assert {k: answer(v) for k, v in results.items() if k != victim} == want
    idle(eng)


def test_a_request_larger_than_the_cache_is_refused_and_the_policy_name_is_checked(path):
    eng = engine(path)
    with pytest.raises(InvalidArgument, match="KV blocks"):
        eng.validate(req("wide", prompt(9, 1), max_tokens=80, beam_width=2))
    with pytest.raises(InvalidArgument, match="guaranteed_no_evict, max_utilization.*'greedy'"):
        EngineConfig(scheduler_policy="greedy").validate()


def test_requests_with_images_resume_with_their_image_features(path):
    """The recompute merges the image features again (and finds the image's blocks by their hashes)."""
    from triton_vlm.engine.profile import max_image_tokens

    eng = engine(path)
    n, img = max_image_tokens(path), eng.image_token_id
    hidden = eng.model_config.hidden_size
    reqs = []
    for i in range(4):
        feats = torch.randn(1, n, hidden, generator=torch.Generator().manual_seed(i))
        ids = [1, 20 + i, 21] + [img] * n + prompt(6, 95 + i)[1:]
        reqs.append(GenerationRequest(f"i{i}", ids, GenerationParams(max_tokens=30, min_tokens=30,
                                                                     beam_width=1 + i % 2), image_embeds=feats))
    assert all(len(r.input_ids) + 30 <= CONTEXT for r in reqs)
    preempted = spy_preempt(eng)
    got, most = run_together(eng, reqs)
    assert most >= 3 and preempted  # the prompts (with their images) of all four do not fit at once
    assert {k: answer(v) for k, v in got.items()} == alone(path, reqs)
    idle(eng)


@pytest.mark.gpu
def test_preemption_on_cuda_answers_as_alone(path):
    """The same on a GPU (fp32 there, CUDA graphs on): greedy, seeded sampling and beams preempted and resumed."""
    reqs = [req("g0", prompt(9, 120)), req("s1", prompt(10, 121), do_sample=True, top_k=40, seed=5),
            req("b2", prompt(9, 122), max_tokens=30, beam_width=2), req("g3", prompt(11, 123)),
            req("s4", prompt(9, 124), max_tokens=30, do_sample=True, num_return_sequences=2, seed=6)]
    eng = engine(path, device="cuda")
    preempted = spy_preempt(eng)
    got, most = run_together(eng, reqs)
    assert most == len(reqs) and preempted
    assert {k: answer(v) for k, v in got.items()} == alone(path, reqs, device="cuda")
    idle(eng)


def test_requests_with_an_adapter_resume_with_it(path):
    """The adapter's device slot is given back at preemption and taken again: the recompute uses the same weights
    (k/v projections, in the cache itself), and base-model batch mates are unaffected."""
    from triton_vlm.lora.format import Adapter, LoraModule, module_shape

    eng = engine(path)
    spec, g = eng.model_config, torch.Generator().manual_seed(3)
    mods = {}
    for layer in range(spec.num_layers):
        for m in ("k_proj", "v_proj"):
            n_in, n_out = module_shape(spec, m)
            mods[(layer, m)] = LoraModule(torch.randn(2, n_in, generator=g), torch.randn(n_out, 2, generator=g), 1.0)
    ad = Adapter("kv", mods)
    reqs = [GenerationRequest(f"a{i}", prompt(9, 130 + i), GenerationParams(max_tokens=60, min_tokens=60),
                              adapter=ad if i % 2 else None) for i in range(5)]
    preempted = spy_preempt(eng)
    got, most = run_together(eng, reqs)
    assert most == 5 and {"a1", "a3"} & set(preempted)
    want = alone(path, reqs)
    assert {k: answer(v) for k, v in got.items()} == want
    assert want["a1"] != alone(path, [req("a1", prompt(9, 131))])["a1"]  # the adapter changes the answer
    idle(eng)
