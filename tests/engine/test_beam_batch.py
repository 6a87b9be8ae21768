"""Beam requests decoded in one batched step (`decoder.step_beams`, `beam_batch.beam_step`): bit for bit the tokens,
scores and log probs of each request's decoder stepped alone (checked against transformers in test_decoding.py),
and against transformers `generate()` here too; requests with different settings (length penalty, early stopping,
end ids, min_new_tokens, stop words, max tokens, prompt length, penalties, no-repeat-ngram, bad words, beam
sampling) start and end at different steps; one failing
request ends only itself; a decode step of 16 beam requests reads back from the device once."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from test_decode_batch import ckpt, each_alone, syncs_per_decode_step  # noqa: F401 - fixture
from test_decoding import EOS as HF_EOS, EOS2 as HF_EOS2, V as HF_V, TOL, hf_generate, model, prompt_for  # noqa: F401
from triton_vlm.engine.search import beam_batch
from triton_vlm.engine.search.decoder import Decoder, StepResult, step_beams
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.errors import Cancelled, Internal
from triton_vlm.params import GenerationParams, GenerationRequest

V = 61
EOS, EOS2 = 2, 5

# (GenerationParams fields, end ids, stop words, prompt length, start step)
SETTINGS = [
    (dict(beam_width=4, max_tokens=12, length_penalty=1.0, early_stopping=False), (EOS,), (), 3, 0),
    (dict(beam_width=4, max_tokens=9, length_penalty=0.0, early_stopping=True), (EOS,), (), 7, 2),
    (dict(beam_width=4, max_tokens=14, length_penalty=-1.0, early_stopping="never"), (EOS,), (), 5, 1),
    (dict(beam_width=4, max_tokens=10, length_penalty=2.0, early_stopping="never"), (), (), 4, 3),
    (dict(beam_width=4, max_tokens=16, length_penalty=1000.0, early_stopping=False), (EOS,), (), 2, 0),
    (dict(beam_width=4, max_tokens=11, length_penalty=-1000.0, early_stopping=True), (EOS,), (), 6, 5),
    (dict(beam_width=4, max_tokens=13, length_penalty=0.7, min_tokens=6), (EOS,), ((11, 12), (13,)), 3, 4),
    (dict(beam_width=4, max_tokens=8, length_penalty=1.3, min_tokens=8), (EOS,), (), 9, 1),
    (dict(beam_width=4, max_tokens=1), (EOS,), (), 3, 6),
    (dict(beam_width=4, max_tokens=15, length_penalty=-0.5, early_stopping="never"), (EOS,), ((14, 15, 16),), 4, 7),
    # two end ids: K = 3 nb, a group of its own
    (dict(beam_width=4, max_tokens=12, length_penalty=1.0, early_stopping=False), (EOS, EOS2), (), 3, 0),
    (dict(beam_width=4, max_tokens=10, length_penalty=2.0, early_stopping=True, min_tokens=3), (EOS, EOS2),
     ((11,),), 5, 2),
    (dict(beam_width=4, max_tokens=14, length_penalty=0.0, early_stopping="never"), (EOS, EOS2), (), 8, 3),
    # other beam widths
    (dict(beam_width=2, max_tokens=12, length_penalty=1.0, early_stopping=True), (EOS,), ((12, 13),), 3, 1),
    (dict(beam_width=2, max_tokens=9, length_penalty=-2.0, early_stopping=False), (EOS,), (), 4, 0),
    (dict(beam_width=3, max_tokens=12, length_penalty=1.5, early_stopping="never", min_tokens=2), (EOS, EOS2),
     ((11, 12),), 3, 2),
    # the context processors (bad words: `BAD_WORDS`) and beam sampling, in the groups of the others
    (dict(beam_width=4, max_tokens=12, repetition_penalty=1.4, no_repeat_ngram_size=2), (EOS,), (), 4, 1),
    (dict(beam_width=4, max_tokens=10, presence_penalty=0.8, frequency_penalty=0.5, min_tokens=3), (EOS,),
     ((11,),), 6, 0),
    (dict(beam_width=4, max_tokens=11, repetition_penalty=0.7, no_repeat_ngram_size=1), (EOS, EOS2), (), 3, 2),
    (dict(beam_width=4, max_tokens=12, do_sample=True, seed=3, temperature=0.8, top_k=20), (EOS,), (), 5, 0),
    (dict(beam_width=4, max_tokens=9, do_sample=True, seed=4, top_p=0.8, repetition_penalty=1.2), (EOS, EOS2),
     (), 4, 3),
    (dict(beam_width=2, max_tokens=10, do_sample=True, seed=5, temperature=1.3, no_repeat_ngram_size=2), (EOS,),
     ((12, 13),), 3, 1),
]
BAD_WORDS = {16: [[30, 31], [40]], 18: [[20, 21, 22], [EOS2]], 19: [[33]]}  # SETTINGS index -> bad_words_ids


def make(batched: bool, copies: int = 2) -> list[tuple[Decoder, int]]:
    """batched or not, the same decoders (the unbatched ones are stepped alone)."""
    out = []
    for c in range(copies):
        for j, (kw, eos, stop, lp, start) in enumerate(SETTINGS):
            prompt = [1] + [(7 * j + 3 * c + k) % (V - 20) + 20 for k in range(lp - 1)]
            d = Decoder(GenerationParams(num_return_sequences=kw["beam_width"], **kw), prompt, eos_ids=eos,
                        vocab_size=V, stop_words_ids=stop, bad_words_ids=BAD_WORDS.get(j, []))
            out.append((d, start + 3 * c))
    return out


def logits_for(step: int, rows: int, dtype, ties: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, V, generator=g) * 2
    x[:, EOS] += 1.5  # end ids likely: hypotheses finish early, heuristics decide when requests stop
    x[:, EOS2] += 1.0
    x[:, 11:17] += 2.5  # stop words likely
    if ties:
        x[::3, 30] = x[::3, 31] = 5.0  # exact ties: topk orders them alike on both paths (CPU)
    return x.to(dtype)


def run_both(dtype, device="cpu", copies=2, ties=True):
    """Step the batched decoders (one `step_beams` per key) and copies each stepped alone on the same logits;
    compare every StepResult and stream prefix, then the final sequences. -> the batched decoders."""
    batched, single = make(True, copies), make(False, copies)
    assert all(d.beam_key is not None for d, _ in batched)
    step = 0
    while any(not d.done for d, _ in batched):
        live = [i for i, (d, start) in enumerate(batched) if start <= step and not d.done]
        starts, n = [], 0
        for i in live:
            starts.append(n)
            n += batched[i][0].num_rows
        logits = logits_for(step, n, dtype, ties).to(device)
        groups: dict = {}
        for k, i in enumerate(live):
            groups.setdefault(batched[i][0].beam_key, []).append(k)
        for ks in groups.values():
            got = step_beams([batched[live[k]][0] for k in ks], logits, [starts[k] for k in ks])
            for k, res in zip(ks, got):
                i = live[k]
                d_single = single[i][0]
                want = d_single.step(logits[starts[k]:starts[k] + d_single.num_rows])
                assert isinstance(res, StepResult), res
                assert (res.parents, res.tokens, res.done) == (want.parents, want.tokens, want.done), (i, step)
                assert batched[i][0].stream_prefixes() == d_single.stream_prefixes()
        step += 1
        assert step < 60
    assert all(d.done for d, _ in single)
    for (b, _), (s, _) in zip(batched, single):
        fb, fs = b.finalize(), s.finalize()
        assert [x.token_ids for x in fb] == [x.token_ids for x in fs]
        if device == "cpu":  # bit for bit (nan == nan aside)
            assert [x.cum_log_prob for x in fb] == [x.cum_log_prob for x in fs]
            assert [x.log_probs for x in fb] == [x.log_probs for x in fs]
        else:  # the GPU check on an H200 (2026-11-26) found the scores 1-2 fp32 ulps apart: same tokens and parents
            # at every step, sums rounded in another order on the device; within fp32 rounding here
            for x, y in zip(fb, fs):
                assert x.cum_log_prob == pytest.approx(y.cum_log_prob, rel=1e-6, nan_ok=True), (x, y)
                assert x.log_probs == pytest.approx(y.log_probs, rel=1e-6, abs=1e-6, nan_ok=True), (x, y)
    return [d for d, _ in batched]


@pytest.mark.parametrize("grow", [beam_batch.GROW, 3])  # 3: the histories widen during the test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_beams_equal_each_request_alone(dtype, grow, monkeypatch):
    monkeypatch.setattr(beam_batch, "GROW", grow)
    done = run_both(dtype)
    lens = [len(d.finalize()[0].token_ids) for d in done]
    assert min(lens) == 1 and max(lens) >= 12 and len(set(lens)) > 5  # requests ended at different steps
    assert any(d.finalize()[0].token_ids[-1] in (EOS, EOS2) for d in done)  # some ended on an end id
    assert any(s.token_ids[-2:] in ([11, 12], [12, 13]) for d in done for s in d.finalize())  # ... a stop word
    scores = [s.cum_log_prob for d in done for s in d.finalize()]
    assert any(s == 0.0 and math.copysign(1, s) < 0 for s in scores)  # length_penalty 1000: -0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_beams_equal_each_request_alone_on_cuda(dtype):
    """On CUDA, without exact ties in the logits: CUDA's topk may pick its kernel by the number of rows."""
    run_both(dtype, device="cuda", ties=False)


def test_a_request_with_nothing_to_choose_fails_alone():
    ps = [GenerationParams(beam_width=2, max_tokens=6, min_tokens=3, num_return_sequences=2) for _ in range(3)]
    ds = [Decoder(p, [1, 3], eos_ids=(EOS,), vocab_size=V) for p in ps]
    logits = torch.randn(3, V)
    logits[0] = -float("inf")
    logits[0, EOS] = 0.0  # only an end id is left, and min_tokens holds it back
    logits[2, 7] = float("nan")
    out = step_beams(ds, logits, [0, 1, 2])
    assert isinstance(out[0], Internal) and "non-finite" in str(out[0])
    assert isinstance(out[1], StepResult) and out[1].parents == [0, 0] and not out[1].done
    assert isinstance(out[2], Internal) and "non-finite" in str(out[2])
    refs = [Decoder(p, [1, 3], eos_ids=(EOS,), vocab_size=V) for p in ps]
    assert refs[1].step(logits[1:2]).tokens == out[1].tokens
    for i in (0, 2):  # each alone: the same requests end with the same errors
        with pytest.raises(Internal, match="non-finite"):
            refs[i].step(logits[i:i + 1])
    nxt = step_beams([ds[1]], torch.randn(2, V), [0])[0]  # the survivor goes on alone (a new group)
    assert isinstance(nxt, StepResult) and ds[1].beam_key is not None


def test_every_beam_request_is_batched():
    for kw in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
               dict(no_repeat_ngram_size=2), dict(do_sample=True, seed=1)):
        p = GenerationParams(max_tokens=4, **({"beam_width": 2} | kw))
        assert Decoder(p, [1], eos_ids=(EOS,), vocab_size=V).beam_key == (2, 4), kw
    assert Decoder(GenerationParams(max_tokens=4), [1], eos_ids=(EOS,), vocab_size=V).beam_key is None
    p = GenerationParams(max_tokens=4, beam_width=2)
    assert Decoder(p, [1], eos_ids=(EOS,), vocab_size=V, bad_words_ids=[[9]]).beam_key == (2, 4)
    assert Decoder(p, [1], eos_ids=(EOS,), vocab_size=V).beam_key == (2, 4)
    assert Decoder(p, [1], eos_ids=(EOS, EOS2), vocab_size=V).beam_key == (2, 6)
    a, b = (Decoder(GenerationParams(max_tokens=4, beam_width=2), [1], eos_ids=e, vocab_size=V)
            for e in ((EOS,), (EOS, EOS2)))
    with pytest.raises(Internal):
        step_beams([a, b], torch.zeros(2, V), [0, 1])  # different K


def test_cancel_mid_flight_and_streaming_read_the_group(monkeypatch):
    """finalize() before the end (cancel) and stream prefixes of a request whose state lives in a group (with
    histories narrower than max_new)."""
    monkeypatch.setattr(beam_batch, "GROW", 2)
    def two(batched):
        return [Decoder(GenerationParams(beam_width=3, max_tokens=20, num_return_sequences=3,
                                         repetition_penalty=1.3 if i else 1.0), [1, 4 + i],
                        eos_ids=(EOS,), vocab_size=V) for i in range(2)]
    bs, ss = two(True), two(False)
    for step in range(5):
        logits = logits_for(step, sum(d.num_rows for d in bs), torch.float32)
        n = bs[0].num_rows
        step_beams(bs, logits, [0, n])
        for k, d in enumerate(ss):
            d.step(logits[k * n:(k + 1) * n])
    assert bs[0]._search.group is not None and bs[0]._search.group[0].W < 20  # the state lives in the group
    assert [d.stream_prefixes() for d in bs] == [d.stream_prefixes() for d in ss]
    fb, fs = bs[0].finalize(), ss[0].finalize()  # cancel: running beams join the pool
    assert [(x.token_ids, x.cum_log_prob, x.log_probs) for x in fb] == [
        (x.token_ids, x.cum_log_prob, x.log_probs) for x in fs]
    logits = logits_for(9, 3, torch.float32)  # the other one goes on alone
    assert step_beams([bs[1]], logits, [0])[0].tokens == ss[1].step(logits).tokens


# --- against transformers ------------------------------------------------------------------------------------
HF_CASES = [  # params, end ids, stop words, prompt seed, start step
    (dict(beam_width=4, length_penalty=1.0, early_stopping=False, num_return_sequences=2, max_tokens=12),
     (HF_EOS,), (), 1, 0),
    (dict(beam_width=4, length_penalty=-1.0, early_stopping="never", num_return_sequences=4, max_tokens=10),
     (HF_EOS, 45, 169, 103), (), 2, 1),
    (dict(beam_width=4, length_penalty=2.0, early_stopping=True, num_return_sequences=1, max_tokens=14,
          min_tokens=5), (HF_EOS,), (), 3, 3),
    (dict(beam_width=4, length_penalty=0.0, early_stopping=False, num_return_sequences=3, max_tokens=9),
     (HF_EOS,), ((150, 151),), 4, 2),
    (dict(beam_width=4, length_penalty=1.0, early_stopping="never", num_return_sequences=2, max_tokens=16),
     (HF_EOS, HF_EOS2), (), 5, 0),
    (dict(beam_width=4, length_penalty=2.0, early_stopping=False, num_return_sequences=4, max_tokens=20),
     (HF_EOS, 45, 169, 103), (), 6, 4),
    # penalties and beam sampling, in the group of the first one
    (dict(beam_width=4, length_penalty=1.0, num_return_sequences=2, max_tokens=12, repetition_penalty=1.3,
          no_repeat_ngram_size=2, presence_penalty=0.4), (HF_EOS,), (), 7, 1),
    (dict(beam_width=4, num_return_sequences=2, max_tokens=10, do_sample=True, seed=11, temperature=0.9, top_k=30,
          top_p=0.95, repetition_penalty=1.2, no_repeat_ngram_size=3), (HF_EOS,), (), 8, 2),
]


def test_batched_beams_match_hf(model):
    """Requests of different settings, prompt lengths and start steps stepped together (full forward per row),
    each against its own `generate()`."""
    reqs = []
    for kw, eos, stop, seed, start in HF_CASES:
        prompt = prompt_for(seed, n=5 + seed)
        p = GenerationParams(**kw)
        reqs.append(dict(p=p, eos=eos, stop=stop, prompt=prompt, start=start, rows=[list(prompt)],
                         dec=Decoder(p, prompt, eos_ids=eos, vocab_size=HF_V, stop_words_ids=stop)))
    assert all(r["dec"].beam_key is not None for r in reqs)
    step = 0
    while any(not r["dec"].done for r in reqs):
        live = [r for r in reqs if r["start"] <= step and not r["dec"].done]
        starts, logits = [], []
        for r in live:
            starts.append(sum(len(x["rows"]) for x in live[:len(starts)]))
            with torch.no_grad():
                logits.append(torch.cat([model(input_ids=torch.tensor([row])).logits[:, -1] for row in r["rows"]]))
        logits = torch.cat(logits)  # [rows, V]
        groups: dict = {}
        for k, r in enumerate(live):
            groups.setdefault(r["dec"].beam_key, []).append(k)
        for ks in groups.values():
            for k, res in zip(ks, step_beams([live[k]["dec"] for k in ks], logits, [starts[k] for k in ks])):
                r = live[k]
                r["rows"] = [r["rows"][p] + [t] for p, t in zip(res.parents, res.tokens)]
        step += 1
        assert step < 40
    for r in reqs:
        ref = hf_generate(model, r["prompt"], r["p"], r["eos"], stop=r["stop"])
        got = r["dec"].finalize()
        assert len(got) == len(ref) == r["p"].num_return_sequences
        for g, (toks, score, lps) in zip(got, ref):
            assert g.token_ids == toks
            assert abs(g.cum_log_prob - score) < TOL, (g.cum_log_prob, score)
            assert max((abs(a - b) for a, b in zip(g.log_probs, lps)), default=0.0) < TOL


# --- in the engine ---------------------------------------------------------------------------------------------
def engine_run(path, batched: bool) -> dict:
    """12 beam requests with different settings (3 streaming, return_log_probs), arriving over 6 steps, one
    cancelled after 5 steps; every result the engine sends, per request."""
    eng = Engine(path, EngineConfig(max_rows=64, kv_cache_tokens=64 * 48, block_size=4, prefill_chunk=32))
    results: dict[str, list] = {}
    reqs = []
    for i in range(12):
        context = [{}, dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2, presence_penalty=0.5), {},
                   dict(do_sample=True, seed=i, top_k=20), {}][i % 6]
        p = GenerationParams(max_tokens=6 + i % 5, beam_width=2 + i % 3, num_return_sequences=1 + i % 2,
                             length_penalty=[1.0, 0.0, -1.0, 2.0][i % 4], early_stopping=[False, True, "never"][i % 3],
                             min_tokens=2 * (i % 2), stream=i % 4 == 0, return_log_probs=True, **context)
        reqs.append((i // 2, GenerationRequest(f"r{i}", [1, 10 + i, 20 + i % 7][:2 + i % 2], p,
                                               stop_words_ids=[[7 + i]] if i % 3 == 0 else [])))
    with contextlib.nullcontext() if batched else each_alone():
        step = 0
        while step < 8 or any(not r or not r[-1].final for r in results.values()):
            for at, req in reqs:
                if at == step:
                    results[req.request_id] = []
                    eng.submit(req, lambda res: results[res.request_id].append(res))
            if step == 5:
                eng.cancel("r3")
            eng.step()
            step += 1
            assert step < 100
    return {rid: [(r.final, r.sequence_index, type(r.error), [(s.token_ids, s.text, s.cum_log_prob, s.log_probs)
                                                              for s in r.sequences]) for r in res]
            for rid, res in results.items()}


def test_engine_results_equal_per_request_path(ckpt, monkeypatch):  # noqa: F811
    sizes = []
    orig = beam_batch.beam_step
    monkeypatch.setattr(beam_batch, "beam_step", lambda s, *a: sizes.append(len(s)) or orig(s, *a))
    batched = engine_run(ckpt, True)
    assert max(sizes) >= 4  # requests were stepped together
    single = engine_run(ckpt, False)
    assert batched == single  # every streamed piece and final result, scores bit for bit
    assert batched["r3"][-1][2] is Cancelled
    assert sum(not r[0] for res in batched.values() for r in res) > 3  # streamed pieces were sent
    assert all(res[-1][0] and res[-1][2] is type(None) for rid, res in batched.items() if rid != "r3")


# --- device read-backs -----------------------------------------------------------------------------------------
def test_a_decode_step_of_16_beam_requests_reads_back_once(ckpt, monkeypatch):  # noqa: F811
    per_step = syncs_per_decode_step(ckpt, 16, monkeypatch, beam_width=4, max_tokens=10, min_tokens=10)  # 64 rows
    assert max(per_step) <= 2, per_step  # the beam group's one read-back (+ the plan's max)
    with each_alone():
        single = syncs_per_decode_step(ckpt, 16, monkeypatch, beam_width=4, max_tokens=10, min_tokens=10)
    assert min(single) >= 16, single  # the counter sees per-request read-backs


def test_readback_is_the_one_device_to_host_copy(monkeypatch):
    seen = []
    monkeypatch.setattr(beam_batch, "readback", lambda t: seen.append(tuple(t.shape)) or t.tolist())
    ds = [Decoder(GenerationParams(beam_width=4, max_tokens=3, length_penalty=0.5 * i), [1, 2 + i],
                  eos_ids=(EOS,), vocab_size=V) for i in range(5)]
    step_beams(ds, torch.randn(5, V), list(range(5)))  # first step: one row each
    step_beams(ds, torch.randn(20, V), list(range(0, 20, 4)))
    assert seen == [(5, 12), (5, 12)]
