"""End to end on a tiny random LLaVA checkpoint (CPU fp32): token-identical to transformers' generate() for
concurrent greedy / beam requests arriving at different steps, batch invariance, cancellation, queueing on
a full cache, images, streaming, validation, the background thread."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.kv.kv_cache import blocks_needed
from triton_vlm.errors import Cancelled, InvalidArgument, Unavailable
from triton_vlm.params import GenerationParams, GenerationRequest

EOS = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=96)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties (and flips) are rare
    path = save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))
    return model, path


def engine(path, **kw) -> Engine:
    base = dict(max_rows=32, kv_cache_tokens=2048, block_size=4, prefill_chunk=8)
    return Engine(path, EngineConfig(**(base | kw)))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def request(rid: str, ids, max_tokens=8, beam=1, **kw) -> GenerationRequest:
    nrs = kw.pop("num_return_sequences", beam)
    image_embeds = kw.pop("image_embeds", None)
    params = GenerationParams(max_tokens=max_tokens, beam_width=beam, num_return_sequences=nrs, **kw)
    return GenerationRequest(request_id=rid, input_ids=list(ids), params=params, image_embeds=image_embeds)


def hf_generate(model, req: GenerationRequest, pixel_values=None) -> list[list[int]]:
    p = req.params
    ids = torch.tensor([req.input_ids])
    extra = {} if pixel_values is None else {"pixel_values": pixel_values}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra,
                             max_new_tokens=p.max_tokens, do_sample=False, num_beams=p.beam_width,
                             num_return_sequences=p.num_return_sequences, length_penalty=p.length_penalty,
                             early_stopping=p.early_stopping, eos_token_id=list(p.end_ids) or EOS)
    eos = set(p.end_ids or (EOS,))
    seqs = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        seqs.append(row[:cut])
    return seqs


def final(results) -> list[list[int]]:
    last = results[-1]
    assert last.final and last.error is None, last.error
    return [s.token_ids for s in last.sequences]


def run_staggered(eng: Engine, arrivals: dict[int, list[GenerationRequest]]):
    """Submit each list at its step number; drive step() until everything finished."""
    results: dict[str, list] = {}
    step = 0
    pending = sum(len(v) for v in arrivals.values())
    while step <= max(arrivals) or any(not r or not r[-1].final for r in results.values()):
        for req in arrivals.get(step, []):
            results[req.request_id] = []
            eng.submit(req, lambda res: results[res.request_id].append(res))
        eng.step()
        step += 1
        assert step < 500
    assert len(results) == pending
    return results


SPECS = [  # (prompt length, beam width, max_tokens, arrival step)
    (5, 1, 10, 0), (17, 3, 8, 0), (9, 2, 12, 1), (23, 1, 6, 3), (4, 4, 7, 4), (12, 2, 9, 6)]


def test_concurrent_greedy_and_beam_match_hf_generate(ckpt):
    model, path = ckpt
    eng = engine(path)
    arrivals: dict[int, list] = {}
    reqs = []
    for i, (n, beam, m, at) in enumerate(SPECS):
        req = request(f"r{i}", prompt(n, i), max_tokens=m, beam=beam, length_penalty=1.0 + 0.5 * (i % 2))
        reqs.append(req)
        arrivals.setdefault(at, []).append(req)
    results = run_staggered(eng, arrivals)
    for req in reqs:
        assert final(results[req.request_id]) == hf_generate(model, req), req.request_id
        assert [r.final for r in results[req.request_id]] == [True]  # no streaming asked
    assert eng.cache.used_blocks == 0 and eng.cache.reserved == 0 and not eng.scheduler.has_work()


def test_step_times_count_every_prompt_position_and_decoded_row(ckpt):
    """`StepTimes` (the `triton_vlm_engine_prefill_*` / `decode_*` gauges): prompt positions computed and rows
    decoded, exactly; the phases' seconds within the wall time of the steps."""
    _, path = ckpt
    eng = engine(path)  # prefill_chunk 8: the prompts take several steps
    specs = [(5, 6, 0), (17, 4, 0), (23, 9, 2)]  # (prompt length, new tokens, arrival step), greedy, EOS never chosen
    arrivals: dict[int, list] = {}
    for i, (n, m, at) in enumerate(specs):
        arrivals.setdefault(at, []).append(request(f"t{i}", prompt(n, 40 + i), max_tokens=m, min_tokens=m))
    start = time.perf_counter()
    run_staggered(eng, arrivals)
    wall = time.perf_counter() - start
    s = eng.stats()
    assert s.prefill_tokens == sum(n for n, _, _ in specs)
    assert s.decode_rows == sum(m - 1 for _, m, _ in specs)  # the first token of each comes from its prefill
    assert s.prefill_steps >= -(-s.prefill_tokens // 8)  # prefill_chunk: at most 8 prompt positions a step
    assert max(m for _, m, _ in specs) - 1 <= s.decode_steps <= s.steps
    assert 0 < s.prefill_seconds and 0 < s.decode_seconds and s.prefill_seconds + s.decode_seconds <= wall


def test_batch_invariance_16_requests(ckpt):
    _, path = ckpt
    eng = engine(path, prefill_chunk=16)
    reqs = [request(f"q{i}", prompt(3 + (5 * i) % 21, 100 + i), max_tokens=4 + i % 7, beam=1 + i % 4)
            for i in range(16)]
    alone = {r.request_id: eng.generate([r])[r.request_id][-1].sequences for r in reqs}
    arrivals: dict[int, list] = {}
    for i, r in enumerate(reqs):  # two at a time, every third step, widest beams mixed with greedy rows
        arrivals.setdefault(i // 2 * 3, []).append(r)
    together = run_staggered(eng, arrivals)
    for r in reqs:
        got = together[r.request_id][-1].sequences
        assert [s.token_ids for s in got] == [s.token_ids for s in alone[r.request_id]], r.request_id
        for a, b in zip(got, alone[r.request_id]):
            assert abs(a.cum_log_prob - b.cum_log_prob) < 1e-4
            assert a.text == b.text
    assert eng.cache.used_blocks == 0


def test_cancellation_frees_rows_and_blocks(ckpt):
    _, path = ckpt
    eng = engine(path, kv_cache_tokens=256)
    got: dict[str, list] = {"long": [], "queued": [], "other": []}
    eng.submit(request("long", prompt(10, 1), max_tokens=60, beam=3), got["long"].append)
    eng.submit(request("other", prompt(6, 2), max_tokens=3), got["other"].append)
    for _ in range(4):
        eng.step()
    assert eng.cache.used_blocks > 0 and got["long"] == []
    big = request("queued", prompt(10, 3), max_tokens=80, beam=2)  # cannot fit while "long" holds its reservation
    eng.submit(big, got["queued"].append)
    eng.step()
    assert [a.id for a in eng.scheduler.waiting] == ["queued"]
    eng.cancel("queued")
    eng.cancel("long")
    eng.step()
    for rid in ("long", "queued"):
        assert len(got[rid]) == 1 and got[rid][0].final and isinstance(got[rid][0].error, Cancelled)
    assert got["other"][-1].final and got["other"][-1].error is None
    assert eng.cache.used_blocks == 0 and eng.cache.reserved == 0 and eng.scheduler.rows_reserved == 0
    assert not eng.step()
    eng.cancel("long")  # unknown / finished ids are ignored
    assert not eng.step()


def test_requests_wait_in_queue_when_the_cache_budget_is_full(ckpt):
    model, path = ckpt
    a = request("a", prompt(14, 4), max_tokens=10, beam=2)
    b = request("b", prompt(9, 5), max_tokens=12, beam=3)
    need_a, need_b = blocks_needed(14, 10, 2, 4), blocks_needed(9, 12, 3, 4)
    blocks = max(need_a, need_b) + 2  # either fits alone, never both
    assert blocks < need_a + need_b
    eng = engine(path, kv_cache_tokens=blocks * 4, context_length=blocks * 4)  # one full-context request fits
    results = {"a": [], "b": []}
    eng.submit(a, results["a"].append)
    eng.submit(b, results["b"].append)
    admitted_b_while_a_ran = False
    while eng.step():
        assert eng.cache.used_blocks <= eng.cache.reserved <= eng.cache.num_blocks
        running = {x.id for x in eng.scheduler.running}
        admitted_b_while_a_ran |= running == {"a", "b"}
        if not results["a"]:
            assert [x.id for x in eng.scheduler.waiting] == ["b"]
    assert not admitted_b_while_a_ran
    assert final(results["a"]) == hf_generate(model, a)
    assert final(results["b"]) == hf_generate(model, b)
    # a request that can never fit is refused at once
    with pytest.raises(InvalidArgument, match="KV blocks"):
        eng.submit(request("c", prompt(30, 6), max_tokens=20, beam=4), print)


def test_images_match_llava_generate_and_bad_counts_fail_alone(ckpt):
    model, path = ckpt
    n, img = model.config.image_seq_length, model.config.image_token_id
    torch.manual_seed(11)
    pixels = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        feats = torch.stack(list(model.get_image_features(
            pixels, vision_feature_layer=-2, vision_feature_select_strategy="default").pooler_output))
    ids = [1, 20, 21] + [img] * n + [30, 31] + [img] * n + [40, 41, 42]
    eng = engine(path)
    good = request("img", ids, max_tokens=8, image_embeds=feats)
    beam = request("img-beam", ids, max_tokens=6, beam=2, image_embeds=feats)
    bad = request("bad", ids, max_tokens=8, image_embeds=feats[:1])
    text = request("text", prompt(8, 9), max_tokens=5)
    out = eng.generate([good, bad, beam, text])
    assert final(out["img"]) == hf_generate(model, good, pixels)
    assert final(out["img-beam"]) == hf_generate(model, beam, pixels)
    assert final(out["text"]) == hf_generate(model, text)
    err = out["bad"][-1].error
    assert out["bad"][-1].final and isinstance(err, InvalidArgument)
    assert f"tokens: {2 * n}, features: {n}" in err.message
    assert eng.cache.used_blocks == 0 and eng.cache.reserved == 0


def test_end_ids_override_and_text(ckpt):
    model, path = ckpt
    eng = engine(path)
    base = request("base", prompt(7, 12), max_tokens=10)
    toks = final(eng.generate([base])["base"])[0]
    stop_at = toks[3]
    req = request("stop", prompt(7, 12), max_tokens=10, end_ids=(stop_at,))
    res = eng.generate([req])["stop"][-1]
    assert res.sequences[0].token_ids == toks[:toks.index(stop_at) + 1] == hf_generate(model, req)[0]
    assert res.sequences[0].text == eng.tokenizer.decode(res.sequences[0].token_ids, skip_special_tokens=True)


def test_first_token_leaves_when_its_prefill_ends(ckpt):
    """Prompts prefilled in one step run as one ragged forward (one pass over the weights for all of them); each
    request's first token is delivered right after it, before the step's decode (not at the end of the step)."""
    _, path = ckpt
    eng = engine(path, prefill_chunk=64)
    events: list[tuple[str, str]] = []
    runner = eng.scheduler.runner
    real_prefill, real_ragged, real_decode = runner.prefill, runner._prefill_ragged, runner.decode
    runner.prefill = lambda chunk: (events.append(("prefill", chunk.active.id)), real_prefill(chunk))[1]
    runner._prefill_ragged = lambda chunks, x: (
        events.append(("ragged", ",".join(c.active.id for c in chunks))), real_ragged(chunks, x))[1]
    runner.decode = lambda batch: (events.append(("decode", "")), real_decode(batch))[1]
    eng.submit(request("old", prompt(5, 30), max_tokens=6, stream=True), lambda r: None)
    eng.step()  # "old" decodes in the next step, beside the new prompts' prefills
    events.clear()
    for rid, n in (("a", 9), ("b", 11), ("c", 7)):
        eng.submit(request(rid, prompt(n, 31 + n), max_tokens=4, stream=True),
                   lambda r: events.append(("result", r.request_id)))
    eng.step()
    assert events[:5] == [("ragged", "a,b,c"), ("result", "a"), ("result", "b"), ("result", "c"),
                          ("decode", "")], events
    while eng.scheduler.has_work():
        eng.step()
    assert eng.cache.used_blocks == 0


def test_streaming_sends_stable_pieces_then_the_final(ckpt):
    _, path = ckpt
    eng = engine(path)
    greedy = request("g", prompt(6, 13), max_tokens=9, stream=True)
    beam = request("b", prompt(6, 14), max_tokens=9, beam=3, stream=True)
    out = eng.generate([greedy, beam])
    for rid in ("g", "b"):
        res = out[rid]
        assert [r.final for r in res] == [False] * (len(res) - 1) + [True] and len(res) > 2
        streamed = [t for r in res[:-1] for t in r.sequences[0].token_ids]
        best = res[-1].sequences[0].token_ids
        assert best[:len(streamed)] == streamed
        assert all(r.sequence_index == 0 and len(r.sequences) == 1 for r in res[:-1])
    streamed = [t for r in out["g"][:-1] for t in r.sequences[0].token_ids]
    assert streamed == out["g"][-1].sequences[0].token_ids
    pieces = "".join(r.sequences[0].text for r in out["g"][:-1])
    assert pieces == eng.tokenizer.decode(streamed, skip_special_tokens=True)


def test_submit_validation(ckpt):
    _, path = ckpt
    eng = engine(path, max_rows=4, max_queue=2)
    with pytest.raises(InvalidArgument, match=r"exceeds the context length 96; max_tokens can be at most 86"):
        eng.submit(request("x", prompt(10, 0), max_tokens=87), print)
    with pytest.raises(InvalidArgument, match="max_rows is 4"):
        eng.submit(request("x", prompt(10, 0), beam=5), print)
    with pytest.raises(InvalidArgument, match="outside"):
        eng.submit(request("x", [1, 10_000]), print)
    with pytest.raises(InvalidArgument, match="empty"):
        eng.submit(request("x", []), print)
    eng.submit(request("x", prompt(4, 0)), print)
    with pytest.raises(InvalidArgument, match="already in use"):
        eng.submit(request("x", prompt(4, 0)), print)
    eng.submit(request("y", prompt(4, 0)), print)
    with pytest.raises(Unavailable, match="queue is full"):
        eng.submit(request("z", prompt(4, 0)), print)


def test_background_thread_idles_without_spinning_and_shuts_down(ckpt):
    model, path = ckpt
    eng = engine(path)
    steps = []
    real_step = eng.step
    eng.step = lambda: (steps.append(1), real_step())[1]
    eng.start()
    try:
        reqs = [request("t0", prompt(5, 20), max_tokens=6, beam=2), request("t1", prompt(11, 21), max_tokens=5)]
        out = eng.generate(reqs)
        for r in reqs:
            assert final(out[r.request_id]) == hf_generate(model, r)
        time.sleep(0.05)
        idle = len(steps)
        time.sleep(0.3)
        assert len(steps) == idle  # no work, no steps
        got = []
        done = threading.Event()
        eng.submit(request("late", prompt(5, 22), max_tokens=4), lambda r: (got.append(r), r.final and done.set()))
        assert done.wait(10) and got[-1].error is None
    finally:
        eng.shutdown()
    with pytest.raises(Unavailable):
        eng.submit(request("after", prompt(5, 23)), print)


def test_shutdown_fails_pending_requests(ckpt):
    _, path = ckpt
    eng = engine(path)
    got = []
    eng.submit(request("p", prompt(5, 30), max_tokens=20), got.append)
    eng.step()
    eng.shutdown()
    assert got[-1].final and isinstance(got[-1].error, Unavailable)
    assert eng.cache.used_blocks == 0


def test_seeded_sampling_rows_are_batch_invariant(ckpt):
    """Sampling with 3 sequences (rows end at different times) gives the same answer alone and in a crowd."""
    _, path = ckpt
    eng = engine(path)
    s = request("s", prompt(6, 40), max_tokens=10, do_sample=True, num_return_sequences=3, seed=1234,
                temperature=1.5, end_ids=(EOS, 10, 11, 12, 13, 14, 15))
    alone = eng.generate([s])["s"][-1].sequences
    crowd = [request(f"c{i}", prompt(4 + 3 * i, 41 + i), max_tokens=6, beam=1 + i % 3) for i in range(5)]
    out = run_staggered(eng, {0: crowd[:2], 1: [s], 2: crowd[2:]})
    got = out["s"][-1].sequences
    assert len(got) == 3 and [x.token_ids for x in got] == [x.token_ids for x in alone]
    assert eng.cache.used_blocks == 0 and eng.scheduler.rows_reserved == 0


def test_streaming_every_sampled_sequence(ckpt):
    """num_return_sequences > 1 with sampling: each sequence streams under its own index, and per index the
    pieces concatenate to that sequence's final tokens and text."""
    _, path = ckpt
    eng = engine(path)
    req = request("s", prompt(6, 21), max_tokens=10, stream=True)
    req.params = dataclasses.replace(req.params, do_sample=True, temperature=1.3, seed=7, num_return_sequences=3)
    res = eng.generate([req])["s"]
    final = res[-1]
    assert final.final and len(final.sequences) == 3
    for j, seq in enumerate(final.sequences):
        pieces = [r.sequences[0] for r in res[:-1] if r.sequence_index == j]
        assert pieces, f"sequence {j} was streamed"
        assert [t for p in pieces for t in p.token_ids] == seq.token_ids
        assert "".join(p.text for p in pieces) == eng.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
