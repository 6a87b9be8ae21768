"""Sampling requests decoded in one batched step (`decoder.step_samples`, `sampling_batch.sample_step`): bit for bit
the tokens, log probs and top log probs of each request's decoder stepped alone (checked against transformers in
test_decoding.py), and against transformers `generate()` here too; the warpers equal transformers' own; requests with different temperatures, top-k,
top-p, num_return_sequences, seeds, min_new_tokens, stop words, end ids and top_log_probs start and end at
different steps (rows of one request finishing at different steps); one failing request ends only itself; the
draw is `torch.multinomial`'s; a decode step of 16 sampling requests reads back from the device once."""
from __future__ import annotations

import contextlib

import pytest
import torch

from test_decode_batch import ckpt, each_alone, syncs_per_decode_step  # noqa: F401 - fixture
from test_decoding import EOS as HF_EOS, EOS2 as HF_EOS2, V as HF_V, TOL, hf_generate, model, prompt_for  # noqa: F401
from triton_vlm.engine.search import sampling_batch
from triton_vlm.engine.search.decoder import Decoder, StepResult, step_samples
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.search.sampling_batch import SampleSearch
from triton_vlm.errors import Cancelled, Internal
from triton_vlm.params import GenerationParams, GenerationRequest

V = 61
EOS, EOS2 = 2, 5

# (GenerationParams fields, end ids, stop words, start step)
SETTINGS = [
    (dict(temperature=1.0, max_tokens=12), (EOS,), (), 0),
    (dict(temperature=0.7, top_k=5, max_tokens=10, num_return_sequences=3), (EOS,), (), 1),
    (dict(temperature=1.3, top_p=0.8, max_tokens=14, num_return_sequences=4), (EOS, EOS2), (), 0),
    (dict(temperature=0.5, top_k=20, top_p=0.9, max_tokens=9, num_return_sequences=2, top_log_probs=3), (EOS,),
     ((11, 12),), 2),
    (dict(temperature=2.0, top_k=1000, max_tokens=16, num_return_sequences=5, min_tokens=6), (EOS,), (), 3),
    (dict(temperature=1.0, top_p=0.3, max_tokens=8, min_tokens=8, top_log_probs=5), (EOS,), ((13,),), 1),
    (dict(temperature=0.9, top_k=1, max_tokens=7, num_return_sequences=2), (EOS,), (), 4),  # top_k 1: argmax
    (dict(temperature=1.1, max_tokens=15, num_return_sequences=6, min_tokens=2, top_log_probs=2), (), ((11,),), 0),
    (dict(temperature=0.3, top_p=0.999, max_tokens=11, top_log_probs=3), (EOS, EOS2), (), 5),
    (dict(temperature=1.7, top_k=3, top_p=0.5, max_tokens=1, num_return_sequences=3), (EOS,), (), 2),
    (dict(temperature=1.0, top_k=61, max_tokens=13, num_return_sequences=8), (EOS,), ((14, 15, 16),), 6),
    # the context processors: penalties, no-repeat-ngram, bad words (`BAD_WORDS`)
    (dict(temperature=0.8, top_k=30, max_tokens=12, num_return_sequences=3, repetition_penalty=1.5,
          top_log_probs=2), (EOS,), (), 1),
    (dict(temperature=1.2, top_p=0.9, max_tokens=10, num_return_sequences=2, presence_penalty=0.9,
          frequency_penalty=0.4, no_repeat_ngram_size=2), (EOS,), ((11, 12),), 0),
    (dict(temperature=1.0, max_tokens=9, min_tokens=3, num_return_sequences=4, repetition_penalty=0.6,
          no_repeat_ngram_size=1), (EOS, EOS2), (), 2),
]
BAD_WORDS = {12: [[30, 31], [32]], 13: [[20, 21, 30], [EOS2]]}  # SETTINGS index -> bad_words_ids


def make(batched: bool, copies: int = 2) -> list[tuple[Decoder, int]]:
    """batched or not, the same decoders (the unbatched ones are stepped alone)."""
    out = []
    for c in range(copies):
        for j, (kw, eos, stop, start) in enumerate(SETTINGS):
            prompt = [1] + [(7 * j + 3 * c + k) % (V - 20) + 20 for k in range(2 + j % 4)]
            d = Decoder(GenerationParams(do_sample=True, seed=100 * c + j, **kw), prompt, eos_ids=eos,
                        vocab_size=V, stop_words_ids=stop, bad_words_ids=BAD_WORDS.get(j, []))
            out.append((d, start + 3 * c))
    return out


def logits_for(step: int, rows: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, V, generator=g) * 2
    x[:, EOS] += 1.0  # end ids likely: rows finish early, min_tokens holds some back
    x[:, EOS2] += 0.5
    x[:, 11:17] += 1.5  # stop words likely
    x[::2, 30] = x[::2, 31] = x[::2, 32] = 3.0  # exact ties: top-k / top-p sort and topk order them alike
    return x.to(dtype)


def run_both(dtype, copies=2, logits_fn=None):
    """Step the batched decoders (one `step_samples` per step) and copies each stepped alone on the same logits;
    compare every StepResult, stream prefix and token info, then the final sequences. -> the batched decoders."""
    batched, single = make(True, copies), make(False, copies)
    assert all(d.batched_sampling for d, _ in batched)
    step = 0
    while any(not d.done for d, _ in batched):
        live = [i for i, (d, start) in enumerate(batched) if start <= step and not d.done]
        starts, n = [], 0
        for i in live:
            starts.append(n)
            n += batched[i][0].num_rows
        logits = (logits_fn or logits_for)(step, n, dtype)
        got = step_samples([batched[i][0] for i in live], logits, starts)
        for k, (i, res) in enumerate(zip(live, got)):
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
        assert [(x.token_ids, x.cum_log_prob, x.log_probs, x.top_log_probs, x.top_ids) for x in fb] == [
            (x.token_ids, x.cum_log_prob, x.log_probs, x.top_log_probs, x.top_ids) for x in fs]  # bit for bit
        for j, x in enumerate(fb):
            assert b.token_info(j, 1, len(x.token_ids)) == s.token_info(j, 1, len(x.token_ids))
    return [d for d, _ in batched]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: many more exact ties
def test_batched_sampling_equals_each_request_alone(dtype):
    done = run_both(dtype)
    seqs = [s for d in done for s in d.finalize()]
    lens = [len(s.token_ids) for s in seqs]
    assert min(lens) == 1 and max(lens) >= 14 and len(set(lens)) > 6  # rows ended at different steps
    assert any(len({len(s.token_ids) for s in d.finalize()}) > 1 for d in done)  # ... within one request
    assert any(s.token_ids[-1] in (EOS, EOS2) for s in seqs)  # some ended on an end id
    assert any(s.token_ids[-2:] == [11, 12] or s.token_ids[-1:] == [13] for s in seqs)  # ... a stop word
    assert any(s.top_log_probs and len(s.top_log_probs[0]) == 5 for s in seqs)


@pytest.mark.parametrize("seed", range(4))
def test_row_wise_warpers_equal_transformers_on_ties(seed):
    """Rows of many exact ties at the top-k / top-p boundaries (integer scores), random per-row temperature, top-k,
    top-p and min_new_tokens, 96 requests' rows in one call: each row's processed scores equal transformers' own
    processors' (MinNewTokensLength -> Temperature -> TopK -> TopP) on that row."""
    from transformers import (MinNewTokensLengthLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)
    g = torch.Generator().manual_seed(seed)
    ss, chains, R = [], [], 96
    for i in range(R):
        kw = dict(temperature=[1.0, 0.7, 1.9, 0.3][i % 4], top_k=[0, 1, 3, 7, 60, 61, 500][i % 7],
                  top_p=[1.0, 0.5, 0.9, 0.3, 0.999, 0.05][i % 6])
        min_new = [0, 1, 5][i % 3]
        ss.append(SampleSearch(num_rows=1, max_new_tokens=8, eos_ids=(EOS, EOS2), min_new_tokens=min_new, **kw))
        chain = [MinNewTokensLengthLogitsProcessor(1, min_new, [EOS, EOS2])] if min_new else []
        chain += [TemperatureLogitsWarper(kw["temperature"])] if kw["temperature"] != 1.0 else []
        chain += [TopKLogitsWarper(kw["top_k"])] if kw["top_k"] else []
        chain += [TopPLogitsWarper(kw["top_p"])] if kw["top_p"] < 1.0 else []
        chains.append(chain)
    x = (torch.randn(R, V, generator=g) * 3).round()  # integers: ties everywhere
    x[:, EOS] = 9.0  # the end ids most likely: held back or kept
    ss[4].t = 2  # past its min_new_tokens (1): its end ids are not held
    got = sampling_batch._process(ss, list(range(R)), x)
    for i, chain in enumerate(chains):
        want, ids = x[i:i + 1], torch.ones((1, 1 + ss[i].t), dtype=torch.long)
        for proc in chain:
            want = proc(ids, want)
        assert torch.equal(got[i:i + 1], want), i
    removed = torch.isinf(got).sum(-1)
    assert (removed > 2).sum() > R // 2 and (removed == 0).sum() > 0  # the warpers removed tokens, or none


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("V_", [7, 61, 1000, 32000])
def test_the_draw_is_torch_multinomial(V_, device):
    """`_draw` over several requests' blocks = `torch.multinomial(probs [n, V], 1)` per request from the same
    generator state, and leaves each generator where multinomial leaves it."""
    g = torch.Generator().manual_seed(V_)
    ns = [1, 3, 2, 5, 1]
    ss = [SampleSearch(num_rows=n, max_new_tokens=4, eos_ids=(), min_new_tokens=0, temperature=1.0, top_k=0,
                       top_p=1.0, seed=11 * j) for j, n in enumerate(ns)]
    for s in ss:
        s.generator = torch.Generator(device=device).manual_seed(s.seed)
    scores = torch.randn(sum(ns), V_, generator=g) * 4
    scores[::2, ::3] = -float("inf")
    scores = scores.to(device)
    tokens = sampling_batch._draw(ss, scores, None)
    off = 0
    for s in ss:
        ref = torch.Generator(device=device).manual_seed(s.seed)
        want = torch.multinomial(torch.softmax(scores[off:off + s.n], -1), 1, generator=ref).squeeze(1)
        assert torch.equal(tokens[off:off + s.n], want)
        assert torch.equal(s.generator.get_state(), ref.get_state())
        off += s.n


def test_a_request_with_nothing_to_choose_fails_alone():
    ps = [GenerationParams(do_sample=True, seed=i, max_tokens=6, min_tokens=3, num_return_sequences=2, top_k=4)
          for i in range(3)]
    ds = [Decoder(p, [1, 3], eos_ids=(EOS,), vocab_size=V) for p in ps]
    logits = torch.randn(3, V)
    logits[0] = -float("inf")
    logits[0, EOS] = 0.0  # only an end id is left, and min_tokens holds it back
    logits[2, 7] = float("nan")
    out = step_samples(ds, logits, [0, 1, 2])
    assert isinstance(out[0], Internal) and "non-finite" in str(out[0])
    assert isinstance(out[1], StepResult) and out[1].parents == [0, 0] and not out[1].done
    assert isinstance(out[2], Internal) and "non-finite" in str(out[2])
    refs = [Decoder(p, [1, 3], eos_ids=(EOS,), vocab_size=V) for p in ps]
    assert refs[1].step(logits[1:2]).tokens == out[1].tokens
    for i in (0, 2):  # each alone: the same requests end with the same errors
        with pytest.raises(type(out[i])):
            refs[i].step(logits[i:i + 1])
    logits = torch.randn(2, V)
    nxt = step_samples([ds[1]], logits, [0])[0]  # the survivor goes on alone
    assert isinstance(nxt, StepResult) and nxt.tokens == refs[1].step(logits).tokens


def test_every_sampling_request_but_beam_sampling_is_batched():
    for kw in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
               dict(no_repeat_ngram_size=2), dict(top_log_probs=3)):
        p = GenerationParams(max_tokens=4, do_sample=True, seed=1, **kw)
        assert Decoder(p, [1], eos_ids=(EOS,), vocab_size=V).batched_sampling, kw
    p = GenerationParams(max_tokens=4, do_sample=True, seed=1)
    assert Decoder(p, [1], eos_ids=(EOS,), vocab_size=V, bad_words_ids=[[9]]).batched_sampling
    assert Decoder(p, [1], eos_ids=(EOS,), vocab_size=V).batched_sampling
    for kw in (dict(), dict(beam_width=2), dict(beam_width=2, do_sample=True)):
        assert not Decoder(GenerationParams(max_tokens=4, **kw), [1], eos_ids=(EOS,), vocab_size=V).batched_sampling
    with pytest.raises(Internal):
        step_samples([Decoder(GenerationParams(max_tokens=4), [1], eos_ids=(EOS,), vocab_size=V)], torch.zeros(1, V),
                     [0])


# --- against transformers ------------------------------------------------------------------------------------
HF_CASES = [  # params, end ids, stop words, prompt seed, start step
    (dict(temperature=1.0, num_return_sequences=2, max_tokens=12, seed=5), (HF_EOS,), (), 1, 0),
    (dict(temperature=0.7, top_k=20, num_return_sequences=3, max_tokens=10, seed=6), (HF_EOS, HF_EOS2), (), 2, 1),
    (dict(temperature=1.3, top_p=0.9, num_return_sequences=4, max_tokens=14, min_tokens=4, seed=7), (HF_EOS,),
     ((150, 151),), 3, 3),
    (dict(temperature=2.0, top_k=5, top_p=0.95, num_return_sequences=5, max_tokens=9, seed=8), (HF_EOS,), (), 4, 2),
    (dict(temperature=1.6, num_return_sequences=8, max_tokens=16, seed=77), (HF_EOS, HF_EOS2), ((150,),), 5, 0),
]


def test_batched_sampling_matches_hf(model):
    """Requests of different settings, prompt lengths and start steps stepped together (full forward per row),
    each against its own `generate()` from `torch.manual_seed(seed)`."""
    reqs = []
    for kw, eos, stop, seed, start in HF_CASES:
        prompt = prompt_for(seed, n=5 + seed)
        p = GenerationParams(do_sample=True, **kw)
        reqs.append(dict(p=p, eos=eos, stop=stop, prompt=prompt, start=start, rows=[list(prompt)],
                         dec=Decoder(p, prompt, eos_ids=eos, vocab_size=HF_V, stop_words_ids=stop)))
    assert all(r["dec"].batched_sampling for r in reqs)
    step = 0
    while any(not r["dec"].done for r in reqs):
        live = [r for r in reqs if r["start"] <= step and not r["dec"].done]
        starts, logits = [], []
        for r in live:
            starts.append(sum(len(x["rows"]) for x in live[:len(starts)]))
            with torch.no_grad():
                logits.append(model(input_ids=torch.tensor(r["rows"])).logits[:, -1])
        for r, res in zip(live, step_samples([r["dec"] for r in live], torch.cat(logits), starts)):
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
    assert len({len(g.token_ids) for g in reqs[-1]["dec"].finalize()}) > 1  # its rows finished at different steps


# --- in the engine ---------------------------------------------------------------------------------------------
def engine_run(path, batched: bool) -> dict:
    """12 sampling requests with different settings (3 streaming, log probs, top log probs), arriving over 6
    steps, one cancelled after 5 steps; every result the engine sends, per request."""
    eng = Engine(path, EngineConfig(max_rows=64, kv_cache_tokens=64 * 48, block_size=4, prefill_chunk=32))
    results: dict[str, list] = {}
    reqs = []
    for i in range(12):
        p = GenerationParams(max_tokens=6 + i % 5, do_sample=True, seed=i, num_return_sequences=1 + i % 3,
                             temperature=[1.0, 0.7, 1.4][i % 3], top_k=[0, 10, 0, 40][i % 4],
                             top_p=[1.0, 1.0, 0.9, 0.7][i % 4], min_tokens=2 * (i % 2), stream=i % 4 == 0,
                             return_log_probs=True, top_log_probs=i % 3)
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
    return {rid: [(r.final, r.sequence_index, type(r.error), [(s.token_ids, s.text, s.cum_log_prob, s.log_probs,
                                                               s.top_log_probs, s.top_ids) for s in r.sequences])
                  for r in res] for rid, res in results.items()}


def test_engine_results_equal_per_request_path(ckpt, monkeypatch):  # noqa: F811
    sizes = []
    orig = sampling_batch.sample_step
    monkeypatch.setattr(sampling_batch, "sample_step", lambda s, *a: sizes.append(len(s)) or orig(s, *a))
    import triton_vlm.engine.search.decoder as decoder_mod
    monkeypatch.setattr(decoder_mod, "sample_step", sampling_batch.sample_step)
    batched = engine_run(ckpt, True)
    assert max(sizes) >= 4  # requests were stepped together
    single = engine_run(ckpt, False)
    assert batched == single  # every streamed piece and final result, log probs bit for bit
    assert batched["r3"][-1][2] is Cancelled
    assert sum(not r[0] for res in batched.values() for r in res) > 3  # streamed pieces were sent
    assert all(res[-1][0] and res[-1][2] is type(None) for rid, res in batched.items() if rid != "r3")
    assert any(s[4] for res in batched.values() for r in res for s in r[3])  # top log probs were sent


# --- device read-backs -----------------------------------------------------------------------------------------
def test_a_decode_step_of_16_sampling_requests_reads_back_once(ckpt, monkeypatch):  # noqa: F811
    kw = dict(do_sample=True, seed=3, num_return_sequences=4, max_tokens=10, min_tokens=10, top_k=20, top_p=0.9,
              temperature=0.8, top_log_probs=2)
    per_step = syncs_per_decode_step(ckpt, 16, monkeypatch, **kw)  # 64 rows
    assert max(per_step) <= 2, per_step  # the sampling step's one read-back (+ the plan's max)
    with each_alone():
        single = syncs_per_decode_step(ckpt, 16, monkeypatch, **kw)
    assert min(single) >= 16, single  # the counter sees per-request read-backs


def test_readback_is_the_one_device_to_host_copy(monkeypatch):
    seen = []
    monkeypatch.setattr(sampling_batch, "readback", lambda t: seen.append(tuple(t.shape)) or t.tolist())
    ds = [Decoder(GenerationParams(do_sample=True, seed=i, max_tokens=3, num_return_sequences=2, top_p=0.9,
                                   top_log_probs=i % 3), [1, 2 + i], eos_ids=(EOS,), vocab_size=V) for i in range(5)]
    step_samples(ds, torch.randn(5, V), list(range(5)))  # first step: one row each
    step_samples(ds, torch.randn(10, V), list(range(0, 10, 2)))
    assert seen == [(10, 3 + 2 * 2), (10, 3 + 2 * 2)]


@pytest.mark.gpu
def test_batched_sampling_equals_each_request_alone_on_cuda():
    """The same comparison with the logits on CUDA (temperature as CUDA's fp32 reciprocal, CUDA's exponential_,
    sort and cumsum). fp32 logits without exact ties: CUDA's topk may order ties by the number of rows."""
    def cuda_logits(step: int, rows: int, dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(rows, V, generator=g, dtype=torch.float64) * 2
        x[:, EOS] += 1.0
        x[:, 11:17] += 1.5
        return x.to(dtype).to("cuda")

    run_both(torch.float32, logits_fn=cuda_logits)
