"""Greedy requests decoded in one batched step (`decoder.step_greedy`): the same tokens and log probs, bit for bit,
as each request's decoder stepped alone (one row: the step test_decoding.py checks against transformers), penalties,
no-repeat-ngram, bad words and top log probs included; one failing row ends only its request, and a decode step of
64 greedy requests reads back from the device a constant number of times (counted on every tensor-to-host call
while the scheduler's decode phase runs)."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.search import greedy as greedy_mod
from triton_vlm.engine import scheduler as scheduler_mod
from triton_vlm.engine.search.decoder import Decoder, step_greedy
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.errors import Internal
from triton_vlm.params import GenerationParams, GenerationRequest

V = 97
EOS, EOS2 = 2, 5

SETTINGS = [  # GenerationParams fields, eos ids, stop words: greedy requests with different settings in one step
    (dict(max_tokens=12), (EOS,), ()),
    (dict(max_tokens=9, min_tokens=6), (EOS, EOS2), ()),
    (dict(max_tokens=15, min_tokens=15), (EOS,), ()),
    (dict(max_tokens=14), (EOS,), ((11, 12), (13,))),
    (dict(max_tokens=10, min_tokens=3), (), ((11,),)),
    (dict(max_tokens=1), (EOS,), ()),
    (dict(max_tokens=11, repetition_penalty=1.4, top_log_probs=3), (EOS,), ()),
    (dict(max_tokens=13, no_repeat_ngram_size=2, presence_penalty=0.6, frequency_penalty=0.3), (EOS,), ((11, 12),)),
    (dict(max_tokens=12, min_tokens=4, repetition_penalty=0.7, no_repeat_ngram_size=1, top_log_probs=1), (EOS,), ()),
]
BAD_WORDS = [(), (), (), (), (), (), (), ((4, 20), (21,)), ((3, 4, 21), (EOS,))]  # per SETTINGS entry


def decoders(prompt=(1, 3, 4)) -> list[Decoder]:
    out = []
    for i in range(3):
        for (kw, eos, stop), bad in zip(SETTINGS, BAD_WORDS):
            out.append(Decoder(GenerationParams(**kw), list(prompt) + [i], eos_ids=eos, vocab_size=V,
                               stop_words_ids=stop, bad_words_ids=bad))
    return out


def logits_for(step: int, rows: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, V, generator=g) * 3
    x[:, EOS] += 2.5  # end ids likely: some requests end early, others are held by min_tokens
    x[:, 11:14] += 2.0  # stop words likely
    x[::4, 20] = x[::4, 21] = 50.0  # exact ties: the first index wins on both paths
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_greedy_equals_per_request_decoders(dtype):
    batched, single = decoders(), decoders()  # single: each stepped alone
    assert all(d.batched_greedy for d in batched)
    step, finished = 0, 0
    while any(not d.done for d in batched):
        live = [i for i, d in enumerate(batched) if not d.done]
        logits = logits_for(step, len(live), dtype)
        got = step_greedy([batched[i] for i in live], logits)
        for r, i in enumerate(live):
            want = single[i].step(logits[r:r + 1])
            assert (got[r].parents, got[r].tokens, got[r].done) == (want.parents, want.tokens, want.done)
            assert batched[i].stream_prefixes() == single[i].stream_prefixes()
            finished += got[r].done
        step += 1
        assert step < 40
    assert finished == len(batched) and all(d.done for d in single)
    for b, s in zip(batched, single):
        fb, fs = b.finalize(), s.finalize()
        assert [x.token_ids for x in fb] == [x.token_ids for x in fs]
        assert [x.log_probs for x in fb] == [x.log_probs for x in fs]  # bit for bit
        assert [x.cum_log_prob for x in fb] == [x.cum_log_prob for x in fs]
        n = len(fb[0].token_ids)
        assert b.token_info(0, 0, n) == s.token_info(0, 0, n)
    lens = sorted(len(d.finalize()[0].token_ids) for d in batched)
    assert lens[0] == 1 and lens[-1] == 15 and len(set(lens)) > 3  # requests ended at different steps


def test_only_the_row_with_nothing_to_choose_fails():
    def make(alone):
        return [Decoder(GenerationParams(max_tokens=4, min_tokens=2, repetition_penalty=1.2 if alone else 1.0),
                        [1, 3], eos_ids=(EOS,), vocab_size=V) for _ in range(3)]

    logits = torch.randn(3, V)
    logits[0] = -float("inf")
    logits[0, EOS] = 0.0  # only an end id is left, and min_tokens holds it back
    logits[2, 7] = float("nan")
    ds = make(False)
    out = step_greedy(ds, logits)
    assert isinstance(out[0], Internal) and "non-finite" in str(out[0])
    assert not isinstance(out[1], Exception) and out[1].tokens == [int(logits[1].argmax())]
    assert isinstance(out[2], Internal) and "non-finite" in str(out[2])
    assert ds[0].stream_prefixes() == [] and ds[1].stream_prefixes() == [[out[1].tokens[0]]]
    for i, d in enumerate(make(True)):  # each alone, with a penalty: the same rows end with the same errors
        if i == 1:
            assert d.step(logits[i:i + 1]).tokens == out[1].tokens
        else:
            with pytest.raises(type(out[i]), match="non-finite"):
                d.step(logits[i:i + 1])


def test_every_greedy_request_is_batched_and_only_greedy():
    for kw in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(no_repeat_ngram_size=2),
               dict(top_log_probs=2)):
        assert Decoder(GenerationParams(max_tokens=4, **kw), [1], eos_ids=(EOS,), vocab_size=V).batched_greedy
    assert Decoder(GenerationParams(max_tokens=4), [1], eos_ids=(EOS,), vocab_size=V,
                   bad_words_ids=[[9]]).batched_greedy
    for kw in (dict(do_sample=True, seed=1), dict(beam_width=2)):
        assert not Decoder(GenerationParams(max_tokens=4, **kw), [1], eos_ids=(EOS,), vocab_size=V).batched_greedy
    with pytest.raises(Internal):
        step_greedy([Decoder(GenerationParams(max_tokens=4, beam_width=2), [1], eos_ids=(EOS,), vocab_size=V)],
                    torch.zeros(1, V))


@contextlib.contextmanager
def each_alone():
    """The scheduler steps every request's decoder by itself (one step and one read-back per request), not
    batched: the reference the batched steps are compared with in the engine."""
    orig = scheduler_mod.Scheduler._batched_steps
    scheduler_mod.Scheduler._batched_steps = lambda self, batch, logits, starts: {}
    try:
        yield
    finally:
        scheduler_mod.Scheduler._batched_steps = orig


# --- host-device synchronisations per decode step -----------------------------------------------------------
SYNC_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=7, max_position_embeddings=64)
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def syncs_per_decode_step(path, n_requests: int, monkeypatch, **params) -> Counter:
    """Run n requests together; count, per decode step of all n that ends none of them, the calls that copy a
    tensor to the host (on an accelerator each is a synchronisation; here every tensor-to-host call is counted,
    host-built tensors included, so the count is an upper bound)."""
    eng = Engine(path, EngineConfig(max_rows=64, kv_cache_tokens=64 * 48, block_size=4, prefill_chunk=32))
    counting = [False]
    calls: Counter = Counter()
    for name in SYNC_METHODS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            if counting[0]:
                calls[_name] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    per_step: list[int] = []
    sizes: list[int] = []
    orig_decode = scheduler_mod.Scheduler._decode

    def decode(self, batch, out):
        before, n_out = sum(calls.values()), len(out)
        counting[0] = True
        try:
            return orig_decode(self, batch, out)
        finally:
            counting[0] = False
            sizes.append(len(batch))
            if len(batch) == n_requests and not any(r.final for _, r in out[n_out:]):  # no request ended in it
                per_step.append(sum(calls.values()) - before)

    monkeypatch.setattr(scheduler_mod.Scheduler, "_decode", decode)
    results: dict[str, list] = {}
    p = GenerationParams(**({"max_tokens": 24, "min_tokens": 24} | params))
    for i in range(n_requests):
        results[f"r{i}"] = []
        eng.submit(GenerationRequest(f"r{i}", [1, 10 + i % 50, 20 + i % 7], p),
                   lambda res: results[res.request_id].append(res))
    steps = 0
    while any(not r or not r[-1].final for r in results.values()):
        eng.step()
        steps += 1
        assert steps < 200
    assert all(r[-1].error is None and len(r[-1].sequences[0].token_ids) == p.max_tokens for r in results.values())
    monkeypatch.undo()
    assert len(per_step) >= 4, sizes  # full decode steps were counted
    return Counter(per_step)


def test_a_decode_step_of_64_greedy_requests_reads_back_a_constant_number_of_times(ckpt, monkeypatch):
    many = syncs_per_decode_step(ckpt, 64, monkeypatch)
    few = syncs_per_decode_step(ckpt, 4, monkeypatch)
    assert max(many) <= 2 and max(many) == max(few), (many, few)  # the step's one read-back (+ the plan's max)
    # penalties, no-repeat-ngram and log probs: still one read-back for all 64 (they were one each before)
    ctx = syncs_per_decode_step(ckpt, 64, monkeypatch, repetition_penalty=1.3, presence_penalty=0.4,
                                no_repeat_ngram_size=3, return_log_probs=True, top_log_probs=3)
    assert max(ctx) == max(few), (ctx, few)
    # the counter sees per-request read-backs: with each request stepped alone, at least one per request
    with each_alone():
        single = syncs_per_decode_step(ckpt, 64, monkeypatch)
    assert min(single) >= 64, single


def test_readback_is_the_one_device_to_host_copy(monkeypatch):
    seen = []
    monkeypatch.setattr(greedy_mod, "readback", lambda t: seen.append(tuple(t.shape)) or t.tolist())
    ds = [Decoder(GenerationParams(max_tokens=3), [1], eos_ids=(EOS,), vocab_size=V) for _ in range(5)]
    step_greedy(ds, torch.randn(5, V))
    assert seen == [(5, 3)]


@pytest.mark.parametrize("kw", [dict(beam_width=4, max_tokens=10, min_tokens=10),
                                dict(beam_width=4, max_tokens=10, min_tokens=10, repetition_penalty=1.3,
                                     no_repeat_ngram_size=2),
                                dict(beam_width=4, max_tokens=10, min_tokens=10, do_sample=True, seed=5, top_k=20),
                                dict(do_sample=True, seed=3, num_return_sequences=4, max_tokens=10, min_tokens=10),
                                dict(do_sample=True, seed=3, num_return_sequences=4, max_tokens=10, min_tokens=10,
                                     frequency_penalty=0.5, top_log_probs=2)])
def test_beam_and_sampling_requests_read_back_once_per_step(ckpt, monkeypatch, kw):
    per_step = syncs_per_decode_step(ckpt, 16, monkeypatch, **kw)  # 64 rows
    assert max(per_step) <= 2, per_step  # one for all 16 requests (+ the plan's max)
