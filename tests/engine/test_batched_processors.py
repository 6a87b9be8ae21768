"""The context logits processors batched across rows (`engine/search/processors.py`): every row's processed scores equal,
bit for bit, transformers' own processors on that row alone (repetition penalty, no-repeat-ngram, bad words; the
presence / frequency penalty's one expression, `logits.presence_frequency_penalty`), step after step as the rows'
device state and n-gram indexes are updated; and in the engine, requests with those processors and log probs
decoded together give every result exactly as each request stepped alone."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from test_decode_batch import ckpt, each_alone  # noqa: F401 - fixture
from triton_vlm.engine.search import processors
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.search.logits import presence_frequency_penalty
from triton_vlm.params import GenerationParams, GenerationRequest

V = 53
EOS = 2


def random_context(rng: random.Random, prompt: list[int]) -> processors.Context:
    words = [tuple(rng.randrange(V) for _ in range(rng.choice([1, 1, 2, 3]))) for _ in range(rng.choice([0, 0, 2, 5]))]
    words += [tuple(prompt[-2:]) + (rng.randrange(V),)] if rng.random() < 0.3 else []  # its prefix ends the prompt
    words += [(EOS,)] if rng.random() < 0.2 else []  # an end id alone: HF drops it
    params = GenerationParams(max_tokens=8, repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.7, 2.5]),
                              presence_penalty=rng.choice([0.0, 0.0, 0.6, -0.4]),
                              frequency_penalty=rng.choice([0.0, 0.0, 0.3, 1.7]),
                              no_repeat_ngram_size=rng.choice([0, 0, 1, 2, 3, 4]))
    return processors.Context.build(params, prompt, [EOS], [list(w) for w in words], V)


def transformers_row(ctx: processors.Context, ids: list[int], scores: torch.Tensor) -> torch.Tensor:
    """One row [1, V] through transformers' processors in the engine's order (`logits.py`)."""
    input_ids = torch.tensor([ids], device=scores.device)
    if ctx.repetition != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(ctx.repetition)(input_ids, scores)
    if ctx.pf:
        scores = presence_frequency_penalty(input_ids[:, len(ctx.prompt):], scores, ctx.presence, ctx.frequency)
    if ctx.ngram:
        scores = NoRepeatNGramLogitsProcessor(ctx.ngram)(input_ids, scores)
    words = [list(w) for w in ctx.multi] + [[t] for t in ctx.single]
    if words:
        scores = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)(input_ids, scores)
    return scores


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(3))
def test_rows_equal_transformers_processors_step_after_step(seed, device):
    """64 rows with their own penalties, n-gram sizes, bad words and prompts (some rows without any processor),
    12 steps in one `process` + `commit` each: every row bit for bit transformers' processors on its own (on
    CUDA `a / python_float` is a multiplication by its fp32 reciprocal: the batched penalty must be too)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows: list = []
    for j in range(64):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 9))]
        ctx = random_context(rng, prompt)
        rows.append(None if ctx is None or j % 8 == 7 else processors.RowContext(ctx, []))
    assert 8 <= sum(r is None for r in rows) < 16
    changed = 0
    for step in range(12):
        scores = (torch.randn(64, V, generator=g) * 3).round(decimals=1)  # ties and negatives
        scores[::5] = scores[::5].abs()
        scores = scores.to(device)
        got = processors.process(scores.clone(), rows)
        for j, r in enumerate(rows):
            if r is None:
                assert torch.equal(got[j], scores[j])
                continue
            want = transformers_row(r.ctx, r.ctx.prompt + r.gen, scores[j:j + 1].clone())
            assert torch.equal(got[j:j + 1], want), (step, j)
            changed += not torch.equal(got[j], scores[j])
        # each row takes one of its few best tokens, so n-grams and bad word prefixes repeat
        tokens = torch.stack([torch.topk(got[j], 3).indices[rng.randrange(3)] for j in range(64)])
        tokens = torch.where(torch.isfinite(got.gather(1, tokens[:, None])[:, 0]), tokens, 0)
        processors.commit(rows, tokens)
        for r, t in zip(rows, tokens.tolist()):
            if r is not None:
                r.gen.append(t)
    assert changed > 64 * 12 // 2  # the processors changed most rows' scores


def test_repetition_penalty_ignores_ids_past_the_lm_head_and_bad_words_match_across_the_prompt():
    ctx = processors.Context([1, 3, 60, 61, 7], 2.0, 0.0, 0.0, 0, [(7, 8, 9), (61, 7, 10)])  # ids >= V in the prompt
    row = processors.RowContext(ctx, [])
    scores = torch.full((1, V), 4.0)
    got = processors.process(scores, [row])
    assert got[0, 1] == got[0, 3] == got[0, 7] == 2.0 and got[0, 5] == 4.0  # only the prompt's ids < V
    assert got[0, 10] == -float("inf") and got[0, 9] == 4.0  # (61, 7) ends the prompt; (7, 8) does not
    processors.commit([row], torch.tensor([8]))
    row.gen.append(8)
    got = processors.process(scores, [row])
    assert got[0, 9] == -float("inf") and got[0, 10] == 4.0 and got[0, 8] == 2.0  # (7, 8) across prompt and output


@pytest.mark.parametrize("fills", [True, False])
def test_a_bad_words_prefix_as_long_as_the_context_follows_the_installed_transformers(fills, monkeypatch):
    """transformers 5.17 skips a word longer than the context (its prefix filling the whole context never bans),
    5.24 bans it: the engine asks the installed one, and does either; both differ only at that length."""
    assert processors._prefix_may_fill() == bool(torch.isinf(NoBadWordsLogitsProcessor([[5, 20]], eos_token_id=EOS)(
        torch.tensor([[5]]), torch.zeros(1, V))[0, 20]))
    monkeypatch.setattr(processors, "_prefix_may_fill", lambda: fills)
    ctx = processors.Context([5], 1.0, 0.0, 0.0, 0, [(5, 20), (3, 5, 21)])
    assert ctx.bad_word_hits([]) == ([20] if fills else [])  # the context [5] is the prefix of (5, 20)
    assert ctx.bad_word_hits([3, 5]) == [20, 21]  # a longer context: both versions ban both words


# --- in the engine ---------------------------------------------------------------------------------------------
def engine_run(path, batched: bool) -> dict:
    """12 greedy / sampling / beam requests with penalties, no-repeat-ngram, bad words and log probs (some
    streaming), arriving over 4 steps; every result the engine sends, per request."""
    from contextlib import nullcontext
    eng = Engine(path, EngineConfig(max_rows=64, kv_cache_tokens=64 * 48, block_size=4, prefill_chunk=32))
    results: dict[str, list] = {}
    reqs = []
    for i in range(12):
        search = [dict(), dict(do_sample=True, seed=i, temperature=0.8, num_return_sequences=2),
                  dict(beam_width=3, num_return_sequences=2)][i % 3]
        context = [dict(repetition_penalty=1.3), dict(presence_penalty=0.6, frequency_penalty=0.4),
                   dict(no_repeat_ngram_size=2, repetition_penalty=0.8), dict()][i % 4]
        logprobs = dict(return_log_probs=True, top_log_probs=i % 4) if i % 3 != 2 else dict(return_log_probs=True)
        p = GenerationParams(max_tokens=6 + i % 5, min_tokens=i % 3, stream=i % 5 == 0, **search, **context,
                             **logprobs)
        bad = [[12 + i], [30, 31 + i % 3]] if i % 4 == 3 else []
        reqs.append((i // 3, GenerationRequest(f"r{i}", [1, 10 + i, 20 + i % 7][:2 + i % 2], p, bad_words_ids=bad)))
    with nullcontext() if batched else each_alone():
        step = 0
        while step < 5 or any(not r or not r[-1].final for r in results.values()):
            for at, req in reqs:
                if at == step:
                    results[req.request_id] = []
                    eng.submit(req, lambda res: results[res.request_id].append(res))
            eng.step()
            step += 1
            assert step < 100
    return {rid: [(r.final, r.sequence_index, type(r.error), [(s.token_ids, s.text, s.cum_log_prob, s.log_probs,
                                                               s.top_log_probs, s.top_ids) for s in r.sequences])
                  for r in res] for rid, res in results.items()}


def test_engine_results_with_processors_equal_each_request_alone(ckpt):  # noqa: F811
    batched = engine_run(ckpt, True)
    assert batched == engine_run(ckpt, False)  # every streamed piece and final result, log probs bit for bit
    assert all(res[-1][0] and res[-1][2] is type(None) for res in batched.values())
    assert any(s[4] for res in batched.values() for r in res for s in r[3])  # top log probs were sent
    assert sum(not r[0] for res in batched.values() for r in res) > 2  # streamed pieces were sent
