"""Async scheduling (`engine/overlap.py`): the overlapped steps give the synchronous path's results exactly, and the
stub bench's hidden fraction measures what it says (off: ~0 by construction; on: most of the host's time)."""
from __future__ import annotations

import pytest

from triton_vlm.params import GenerationParams, GenerationRequest


def _requests(tok, stop: int) -> list[GenerationRequest]:
    """Greedy and seeded sampling, streamed or not, log probs, stop words, an end id hit mid-way (a wasted row), a
    beam request and a penalty one (steps that must run synchronously), min_tokens (synchronous, then not)."""
    ids = tok("USER: What color is the circle? ASSISTANT:").input_ids
    far = (383,)  # an end id the demo model does not reach here: max_tokens ends the request
    specs = [
        dict(max_tokens=24, end_ids=far, stream=True),
        dict(max_tokens=17, end_ids=far, do_sample=True, seed=3, temperature=0.8, top_k=20, top_p=0.9),
        dict(max_tokens=20, end_ids=(stop,), stream=True),  # ends on its 4th token: one wasted row after it
        dict(max_tokens=20, end_ids=(stop,)),
        dict(max_tokens=21, end_ids=far, top_log_probs=2, return_log_probs=True, stream=True),
        dict(max_tokens=15, end_ids=far, do_sample=True, seed=5, stream=True, stop_words_ids=[[7, 9]]),
        dict(max_tokens=19, end_ids=far, min_tokens=3),
        dict(max_tokens=9, end_ids=far, beam_width=2),
        dict(max_tokens=12, end_ids=far, repetition_penalty=1.3),
    ]
    out = []
    for i, kw in enumerate(specs):
        stop_words = kw.pop("stop_words_ids", None)
        req = GenerationRequest(f"r{i}", ids[: 6 + i], GenerationParams(**kw))
        if stop_words:
            req.stop_words_ids = stop_words
        out.append(req)
    return out


def _run(demo_model, on: bool):
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(demo_model, EngineConfig(max_rows=16, kv_cache_tokens=4096, async_scheduling=on))
    eng.start()
    try:
        ids = eng.tokenizer("USER: What color is the circle? ASSISTANT:").input_ids
        probe = eng.generate([GenerationRequest("p", ids[:8], GenerationParams(max_tokens=16, end_ids=(383,)))])
        toks = probe["p"][-1].sequences[0].token_ids  # r2's tokens without its end id: it ends at the first new one
        stop = next(t for i, t in enumerate(toks) if i >= 5 and t not in toks[:i])  # past min_tokens' sync steps
        reqs = _requests(eng.tokenizer, stop)
        first = eng.generate(reqs[:7])  # overlapped from the second decode step on (with `on`)
        mixed = eng.generate(reqs)  # beam and penalty rows: synchronous steps between overlapped ones
        seen = {k: [(s.token_ids, s.text, s.log_probs, s.top_log_probs, s.top_ids, r.error, r.final)
                    for r in v for s in r.sequences or [None] if s is not None] for k, v in first.items()}
        seen.update({f"m{k}": [(s.token_ids, s.text, s.log_probs, r.final) for r in v for s in r.sequences]
                     for k, v in mixed.items()})
        # a chat's next turn: the prompt and the answer again; its cached tokens say which blocks were registered
        again = reqs[0].input_ids + first["r0"][-1].sequences[0].token_ids
        turn = eng.generate([GenerationRequest("t", again, GenerationParams(max_tokens=4, end_ids=(383,)))])
        seen["turn"] = (turn["t"][-1].cached_tokens, turn["t"][-1].sequences[0].token_ids)
        seen["stop"] = stop
        lap = eng.scheduler.overlap
        return seen, (lap.steps, lap.wasted_rows) if lap is not None else None
    finally:
        eng.shutdown()


def test_overlapped_steps_give_the_synchronous_results(demo_model):
    sync, none = _run(demo_model, False)
    overlapped, (steps, wasted) = _run(demo_model, True)
    assert none is None
    assert overlapped == sync
    assert steps >= 10, "the steady decode steps should have been overlapped"
    assert wasted >= 1, "r2 ends on an end id: its next row was launched before that was known"
    assert sync["turn"][0] >= 16, "the answer's blocks were registered in the prefix cache"


def test_stub_bench_hidden_fraction(demo_model):
    """64 rows, a 20 ms stub step: with overlap off no host time runs while the device computes (the measure's
    zero); on, most of it does (the issue's target is 90%, on a loaded 2-core CI machine less is seen)."""
    from bench.engine.overlap import measure, stub_engine

    eng, stub = stub_engine(demo_model, 64, 0.02, 28)
    try:
        off = measure(eng, stub, 64, 10, False, 28)
        on = measure(eng, stub, 64, 10, True, 28)
    finally:
        eng.shutdown()
    assert off["hidden"] < 0.05, off
    assert on["hidden"] > 0.5, on
    assert on["host_ms_per_step"] > 0 and off["host_ms_per_step"] > 0


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
