"""The engine's Decoder against transformers `generate()` on a tiny random Llama (fp32 CPU, exact).

A reference driver follows each `StepResult` (parents/tokens) and computes every row's logits with a full forward
over prompt + generated ids (no cache); tokens must equal HF's, scores must agree within 1e-4.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from triton_vlm.engine.search.decoder import Decoder, StepResult
from triton_vlm.errors import Internal, InvalidArgument
from triton_vlm.baseline.generate import penalty_processors
from triton_vlm.params import GenerationParams, GenerationRequest, ModelLimits

V = 199
EOS = 2
EOS2 = 7
PAD = 0
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(12.0)  # spread the logits: ties become vanishingly rare
        m.lm_head.weight[EOS] *= 1.6  # EOS / second EOS plausible enough to end some beams early
        m.lm_head.weight[EOS2] *= 1.4
    return m


def prompt_for(seed: int, n: int = 9) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(10, V, (n - 1,), generator=g).tolist()


def drive(model, dec: Decoder, prompt: list[int], max_steps: int = 1000):
    """Reference scheduler: full forward per row, rows re-formed from parents/tokens."""
    rows = [list(prompt)]
    steps = 0
    while True:
        assert dec.num_rows == len(rows)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(rows)).logits[:, -1]  # [rows, V]
        res = dec.step(logits)
        assert isinstance(res, StepResult) and len(res.parents) == len(res.tokens)
        steps += 1
        if res.done:
            assert res.parents == [] and dec.num_rows == 0
            return dec.finalize()
        assert all(0 <= p < len(rows) for p in res.parents)
        rows = [rows[p] + [t] for p, t in zip(res.parents, res.tokens)]
        assert steps < max_steps


class StopWords(StoppingCriteria):
    """Token-level stop words over generated ids (the engine's semantics), for HF."""

    def __init__(self, words, prompt_len):
        self.words, self.prompt_len = words, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        gen = input_ids[:, self.prompt_len:]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for w in self.words:
            if gen.shape[1] >= len(w):
                done |= (gen[:, -len(w):] == torch.tensor(w)).all(-1)
        return done


def hf_generate(model, prompt, p: GenerationParams, eos, bad=(), stop=()):
    kw = dict(max_new_tokens=p.max_tokens, num_beams=p.beam_width, num_return_sequences=p.num_return_sequences,
              eos_token_id=list(eos), pad_token_id=PAD, do_sample=p.do_sample, return_dict_in_generate=True,
              output_scores=True, output_logits=True, repetition_penalty=p.repetition_penalty,
              no_repeat_ngram_size=p.no_repeat_ngram_size, min_new_tokens=p.min_tokens)
    if p.beam_width > 1:
        kw.update(length_penalty=p.length_penalty, early_stopping=p.early_stopping)
    if p.do_sample:
        kw.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
    if bad:
        kw["bad_words_ids"] = [list(w) for w in bad]
    if stop:
        kw["stopping_criteria"] = StoppingCriteriaList([StopWords(stop, len(prompt))])
    kw["logits_processor"] = LogitsProcessorList(penalty_processors(len(prompt), p.presence_penalty,
                                                                    p.frequency_penalty))
    if p.do_sample:
        torch.manual_seed(p.seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             **kw)
    Lp = len(prompt)
    seqs = []
    if p.beam_width > 1:
        trans = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
        for i in range(out.sequences.shape[0]):
            n = int((out.beam_indices[i] >= 0).sum())
            seqs.append((out.sequences[i, Lp:Lp + n].tolist(), float(out.sequences_scores[i]), trans[i, :n].tolist()))
    else:
        trans = model.compute_transition_scores(out.sequences, out.logits, normalize_logits=True)
        for i in range(out.sequences.shape[0]):
            gen = out.sequences[i, Lp:].tolist()
            n = len(gen)
            for j in range(len(gen)):
                if gen[j] in eos or any(len(w) <= j + 1 and gen[j + 1 - len(w):j + 1] == list(w) for w in stop):
                    n = j + 1
                    break
            lp = trans[i, :n].tolist()
            seqs.append((gen[:n], sum(lp), lp))
    return seqs


def check(model, prompt, p: GenerationParams, eos=(EOS,), bad=(), stop=()):
    ref = hf_generate(model, prompt, p, eos, bad, stop)
    dec = Decoder(p, prompt, eos_ids=eos, vocab_size=V, bad_words_ids=bad, stop_words_ids=stop)
    got = drive(model, dec, prompt)
    assert len(got) == len(ref) == p.num_return_sequences
    for g, (toks, score, lps) in zip(got, ref):
        assert g.token_ids == toks
        assert g.text == ""
        assert abs(g.cum_log_prob - score) < TOL, (g.cum_log_prob, score)
        assert len(g.log_probs) == len(lps)
        assert max((abs(a - b) for a, b in zip(g.log_probs, lps)), default=0.0) < TOL
    return got


BEAM_CASES = [  # beam_width, length_penalty, early_stopping, num_return_sequences, max_tokens
    (2, 1.0, False, 1, 12),
    (3, 0.0, True, 2, 10),
    (4, -1.0, "never", 4, 12),
    (5, 2.0, False, 3, 14),
    (6, 2.0, "never", 2, 10),
    (7, -1.0, False, 5, 9),
    (8, 1.0, "never", 8, 12),
    (8, 0.0, True, 3, 11),
    (4, 1.0, True, 1, 16),
]


@pytest.mark.parametrize("nb,lp,es,nrs,mt", BEAM_CASES)
@pytest.mark.parametrize("seed", [1, 2])
def test_beam_search_matches_hf(model, nb, lp, es, nrs, mt, seed):
    p = GenerationParams(max_tokens=mt, beam_width=nb, num_return_sequences=nrs, length_penalty=lp,
                         early_stopping=es)
    check(model, prompt_for(seed), p)


EOS_HEAVY = (EOS, 45, 169, 103)  # frequent ids as extra EOS: hypotheses finish early, heuristics decide the stop


@pytest.mark.parametrize("nb,lp,es", [(3, 1.0, "never"), (4, 2.0, "never"), (4, 1.0, False), (5, 2.0, False),
                                      (4, 0.0, "never"), (6, -1.0, False), (3, 1.0, True), (8, 1.0, True),
                                      (5, -1.0, "never")])
def test_beam_search_with_early_endings_matches_hf(model, nb, lp, es):
    p = GenerationParams(max_tokens=20, beam_width=nb, num_return_sequences=min(nb, 3), length_penalty=lp,
                         early_stopping=es)
    got = check(model, prompt_for(nb + 110), p, eos=EOS_HEAVY)
    assert any(g.token_ids[-1] in EOS_HEAVY for g in got)


FEATURES = {
    "min_tokens": dict(min_tokens=6),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "repetition_reward": dict(repetition_penalty=0.8),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2),
    "no_repeat_unigram": dict(no_repeat_ngram_size=1),
    "everything": dict(min_tokens=3, repetition_penalty=1.2, no_repeat_ngram_size=3),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=2.0),
    "penalties_negative": dict(presence_penalty=-0.7, frequency_penalty=-0.4),
    "penalties_with_repetition": dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=1.1,
                                      min_tokens=4),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("nb", [1, 3, 6])
def test_processors_match_hf(model, feature, nb):
    p = GenerationParams(max_tokens=12, beam_width=nb, num_return_sequences=min(nb, 2), length_penalty=1.0,
                         early_stopping=False, **FEATURES[feature])
    # the prompt repeats some ids so penalties / n-gram bans bite from the first step
    prompt = prompt_for(nb + 10) + [40, 41, 40, 41]
    check(model, prompt, p)


def test_presence_frequency_penalty_is_openais_formula():
    """logits[t] -= presence * (count[t] > 0) + frequency * count[t], counted over generated ids only."""
    from triton_vlm.engine.search import processors

    g = torch.Generator().manual_seed(0)
    scores = torch.randn((2, 11), generator=g)
    prompt = [[4, 4, 9], [4, 6, 6]]
    gen = [[3, 3, 5, 0], [7, 1, 1, 1]]
    rows = [processors.RowContext(processors.Context(p, 1.0, 0.5, 0.25, 0, []), []) for p in prompt]
    for step in range(4):  # each row's counts built up step by step, as the searches do
        processors.process(scores, rows)
        processors.commit(rows, torch.tensor([q[step] for q in gen]))
    got = processors.process(scores.clone(), rows)
    want = scores.clone()
    for r in range(2):
        for t in set(gen[r]):
            want[r, t] -= 0.5 + 0.25 * gen[r].count(t)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert got[0, 4] == scores[0, 4] and got[1, 6] == scores[1, 6]  # prompt ids are not penalised


@pytest.mark.parametrize("nb", [1, 3])
def test_penalties_change_the_output(model, nb):
    prompt = prompt_for(90 + nb)
    base = dict(max_tokens=16, beam_width=nb, num_return_sequences=1)
    free = check(model, prompt, GenerationParams(**base))[0].token_ids
    assert len(set(free)) < len(free), "the free run repeats a token (else penalties cannot bite)"
    freq = check(model, prompt, GenerationParams(**base, frequency_penalty=2.0))[0].token_ids
    assert freq != free
    assert len(set(freq)) / len(freq) > len(set(free)) / len(free)  # fewer repeats
    reward = check(model, prompt, GenerationParams(**base, presence_penalty=-2.0))[0].token_ids
    assert reward != free


@pytest.mark.parametrize("sample", [False, True])
def test_top_log_probs_match_hf(model, sample):
    """The k most likely tokens at each step: log_softmax of the raw logits, as HF's `output_logits`."""
    extra = dict(do_sample=True, temperature=0.9, top_k=40, seed=3, num_return_sequences=2) if sample else {}
    p = GenerationParams(max_tokens=10, top_log_probs=5, **extra)
    prompt = prompt_for(95)
    if sample:
        torch.manual_seed(p.seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, eos_token_id=[EOS], pad_token_id=PAD, do_sample=sample,
                             num_return_sequences=p.num_return_sequences, return_dict_in_generate=True,
                             output_logits=True, **({"temperature": 0.9, "top_k": 40} if sample else {}))
    ref = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).topk(5, dim=-1)  # [n, new, 5]
    dec = Decoder(p, prompt, eos_ids=(EOS,), vocab_size=V)
    got = drive(model, dec, prompt)
    assert len(got) == p.num_return_sequences
    for i, g in enumerate(got):
        n = len(g.token_ids)
        assert g.token_ids == out.sequences[i, len(prompt):len(prompt) + n].tolist()
        assert g.top_ids == ref.indices[i, :n].tolist()
        assert torch.allclose(torch.tensor(g.top_log_probs), ref.values[i, :n], atol=TOL)
        assert dec.token_info(i, 0, n) == (g.log_probs, g.top_log_probs, g.top_ids)  # what streaming sends
        if not sample:  # greedy: the chosen token is the most likely one
            assert [t[0] for t in g.top_ids] == g.token_ids
            assert [t[0] for t in g.top_log_probs] == g.log_probs
    beam = Decoder(GenerationParams(max_tokens=4, beam_width=2), prompt, eos_ids=(EOS,), vocab_size=V)
    assert beam.token_info(0, 0, 1) is None


@pytest.mark.parametrize("nb", [1, 2, 5])
def test_multiple_eos_and_bad_words_match_hf(model, nb):
    prompt = prompt_for(30 + nb)
    base = GenerationParams(max_tokens=14, beam_width=nb, num_return_sequences=min(nb, 2), length_penalty=1.0)
    free = check(model, prompt, base, eos=(EOS, EOS2))
    # ban the first token and a bigram the free run produced, plus an EOS id alone (HF keeps EOS allowed)
    toks = free[0].token_ids
    bad = [[toks[0]], toks[1:3] if len(toks) >= 3 else [150, 151], [11, 12, 13], [EOS], [45], [169]]
    got = check(model, prompt, base, eos=(EOS, EOS2, 45), bad=bad)  # [EOS] and [45] stay allowed (EOS ids)
    assert got[0].token_ids[:1] != toks[:1]


@pytest.mark.parametrize("nb,es", [(1, False), (3, False), (4, True), (6, "never")])
def test_stop_words_match_hf(model, nb, es):
    prompt = prompt_for(40 + nb)
    base = GenerationParams(max_tokens=14, beam_width=nb, num_return_sequences=min(nb, 3), early_stopping=es)
    free = check(model, prompt, base)
    toks = free[0].token_ids
    assert len(toks) >= 6
    stop = [toks[3:5], [toks[-1] if len(free) == 1 else free[-1].token_ids[2]], [150, 151, 152],
            [prompt[-1], toks[0]]]  # only generated ids complete a stop word: this one never fires
    got = check(model, prompt, base, stop=stop)
    assert got[0].token_ids != toks  # the stop words changed the outcome
    for g in got:  # a stop word can only sit at the very end of a sequence, where it is kept
        ids = g.token_ids
        assert not any(ids[:j + 1][-len(w):] == w for j in range(len(ids) - 1) for w in stop if len(w) <= j + 1)
    if nb <= 4:
        assert any(g.token_ids[-len(w):] == w for g in got for w in stop)


SAMPLING_CASES = [  # temperature, top_k, top_p, num_return_sequences, seed, extra
    (1.0, 0, 1.0, 1, 0, {}),
    (0.7, 20, 1.0, 3, 1, {}),
    (1.3, 0, 0.9, 4, 2, {}),
    (0.9, 50, 0.8, 2, 3, dict(repetition_penalty=1.2, min_tokens=2)),
    (1.5, 0, 1.0, 6, 4, dict(no_repeat_ngram_size=2)),
    (0.8, 0, 1.0, 3, 6, dict(presence_penalty=1.2, frequency_penalty=0.9)),
    (2.0, 5, 0.95, 5, 5, {}),
]


@pytest.mark.parametrize("temp,top_k,top_p,nrs,seed,extra", SAMPLING_CASES)
def test_sampling_matches_hf(model, temp, top_k, top_p, nrs, seed, extra):
    p = GenerationParams(max_tokens=16, num_return_sequences=nrs, temperature=temp, top_k=top_k, top_p=top_p,
                         seed=1000 + seed, do_sample=True, **extra)
    check(model, prompt_for(50 + seed), p, eos=(EOS, EOS2))


def test_sampling_with_rows_finishing_early_matches_hf(model):
    """Rows that finished are not given to the decoder any more, yet the others keep HF's random stream."""
    p = GenerationParams(max_tokens=24, num_return_sequences=8, temperature=1.6, seed=77, do_sample=True)
    got = check(model, prompt_for(60), p, eos=(EOS, EOS2), stop=[[150]])
    lengths = {len(g.token_ids) for g in got}
    assert len(lengths) > 1 and min(lengths) < 24


def test_greedy_matches_hf_and_ignores_sampling_knobs(model):
    p = GenerationParams(max_tokens=20, temperature=0.5, top_k=3, top_p=0.5)  # do_sample False: greedy
    got = check(model, prompt_for(70), p)
    assert len(got) == 1 and len(got[0].token_ids) >= 1


def test_from_inputs_params_drive_the_decoder(model):
    p = GenerationParams.from_inputs({"max_tokens": 10, "beam_width": 3, "num_return_sequences": 2,
                                      "length_penalty": 2.0, "early_stopping": 2})
    assert p.early_stopping == "never"
    check(model, prompt_for(80), p)
    p = GenerationParams.from_inputs({"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 5,
                                      "num_return_sequences": 2})
    assert p.do_sample
    check(model, prompt_for(81), p)


def test_beam_sampling_is_reproducible_and_matches_hf(model):
    p = GenerationParams(max_tokens=10, beam_width=3, num_return_sequences=2, temperature=0.9, top_k=30, seed=9,
                         do_sample=True)
    a = check(model, prompt_for(90), p)
    b = drive(model, Decoder(p, prompt_for(90), eos_ids=(EOS,), vocab_size=V), prompt_for(90))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


def test_step_contract_and_stream_prefixes(model):
    prompt = prompt_for(100)
    p = GenerationParams(max_tokens=6, beam_width=4, num_return_sequences=2)
    dec = Decoder(p, prompt, eos_ids=(EOS,), vocab_size=V)
    assert dec.num_rows == 1 and dec.stream_prefixes() == [[]]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[:, -1]
    res = dec.step(logits.to(torch.bfloat16))  # any float dtype
    assert res.parents == [0, 0, 0, 0] and len(set(res.tokens)) == 4 and not res.done
    # 4 beams with 4 different first tokens: nothing is final yet
    assert dec.num_rows == 4 and dec.stream_prefixes() == [[]]
    with pytest.raises(Internal):
        dec.step(logits)  # 1 row given, 4 expected: a scheduler bug, not the client's
    seqs = dec.finalize()  # early finalize (cancel): running beams become hypotheses
    assert len(seqs) == 2 and all(len(s.token_ids) == 1 for s in seqs)


def test_invalid_requests_are_refused_at_the_boundary():
    """`GenerationRequest.validate` is where a request is refused; the Decoder only asserts afterwards."""
    limits = ModelLimits(vocab_size=V, context_length=64, eos_ids=(EOS,))
    p = GenerationParams(max_tokens=4)

    def req(ids=(1, 2), params=p, **kw):
        return GenerationRequest(request_id="r", input_ids=list(ids), params=params, **kw)

    for bad, match in [(req(ids=()), "empty"), (req(params=dataclasses.replace(p, end_ids=(V,))), "end_id"),
                       (req(bad_words_ids=[[V + 3]]), "bad_words"), (req(stop_words_ids=[[-1]]), "stop_words"),
                       (req(params=dataclasses.replace(p, beam_width=2, num_return_sequences=3)),
                        "num_return_sequences"),
                       (req(params=dataclasses.replace(p, num_return_sequences=2)), "needs beam_width > 1"),
                       (req(params=dataclasses.replace(p, do_sample=True, temperature=0.0)), "temperature"),
                       (req(params=dataclasses.replace(p, presence_penalty=2.5)),
                        r"presence_penalty must be a finite number >= -2.0 and <= 2.0, got 2.5"),
                       (req(params=dataclasses.replace(p, frequency_penalty=float("nan"))), "frequency_penalty"),
                       (req(bad_words_ids=[[3]] * 1025), "bad_words holds 1025 words; at most 1024"),
                       (req(params=dataclasses.replace(p, top_log_probs=21)),
                        r"return_top_log_probs must be in \[0, 20\], got 21"),
                       (req(params=dataclasses.replace(p, top_log_probs=2, beam_width=2)),
                        "return_top_log_probs needs beam_width 1"),
                       (req(stop_words_ids=[[3] * 20] * 1000), "stop_words hold 20000 token ids in all; at most 16384"),
                       (req(ids=[1] * 61), "exceeds the context length 64; max_tokens can be at most 3")]:
        with pytest.raises(InvalidArgument, match=match):
            bad.validate(limits)
    req().validate(limits)
    dec = Decoder(dataclasses.replace(p, max_tokens=1), [1], eos_ids=(EOS,), vocab_size=V)
    assert dec.step(torch.randn(1, V)).done
    with pytest.raises(Internal):
        dec.step(torch.randn(1, V))


def _reference_stable_prefix(search) -> list[int]:
    """The common prefix of every running beam and kept finished hypothesis, read back whole (the definition)."""
    st = search._view()
    cands = [row[:search.t] for row in st.gen.tolist()]
    fin, lens = st.is_fin[0].tolist(), st.fin_len[0].tolist()
    cands += [st.fin_gen[i, :lens[i]].tolist() for i in range(search.nb) if fin[i]]
    prefix = cands[0]
    for c in cands[1:]:
        n = 0
        while n < min(len(prefix), len(c)) and prefix[n] == c[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


@pytest.mark.parametrize("nb,es,lp", [(2, False, 1.0), (4, True, 0.5), (3, "never", 2.0), (6, False, -1.0)])
def test_beam_stable_prefix_equals_its_definition_every_step(nb, es, lp):
    """The incremental stable prefix (only the columns after the last one compared) equals the common prefix of
    all candidates recomputed from scratch, at every step, with hypotheses finishing early (a frequent end id)."""
    vocab = 12
    for seed in range(4):
        params = GenerationParams(max_tokens=16, beam_width=nb, num_return_sequences=1, length_penalty=lp,
                                  early_stopping=es)
        dec = Decoder(params, [1, 2, 3], eos_ids=[0], vocab_size=vocab)
        g = torch.Generator().manual_seed(seed)
        while True:
            logits = torch.randn(dec.num_rows, vocab, generator=g) * 2
            logits[:, :3] += 2.0  # few distinct tokens, end id 0 often: beams tie up and finish early
            dec.step(logits)
            if dec.done:
                break
            assert dec.stream_prefixes()[0] == _reference_stable_prefix(dec._search), (seed, dec._search.t)


def test_beam_stream_prefix_is_never_retracted():
    """Whatever stream_prefix() returned at any step is a prefix of every returned beam at the end."""
    torch.manual_seed(3)
    vocab = 50
    params = GenerationParams(max_tokens=12, beam_width=4, num_return_sequences=4, length_penalty=1.0)
    dec = Decoder(params, [1, 2, 3], eos_ids=[0], vocab_size=vocab)
    seen = []
    g = torch.Generator().manual_seed(0)
    while not dec.done:
        logits = torch.randn(dec.num_rows, vocab, generator=g) * 3
        dec.step(logits)
        seen.append(dec.stream_prefixes()[0])
    final = dec.finalize()
    assert any(seen), "something was streamable before the end"
    for prefix in seen:
        for s in final:
            assert s.token_ids[:len(prefix)] == prefix
    for a, b in zip(seen, seen[1:]):
        assert b[:len(a)] == a, "the stable prefix only grows"
