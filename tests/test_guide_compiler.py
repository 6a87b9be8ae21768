"""Guides compiled off the request path, in-process (issue 34): canonical keys, single flight, the time limit, the
byte-bounded cache, the nesting bound, long string bounds kept native; the engine admits other requests while
a grammar compiles, and its results' text, made on the delivery thread, equals the text made in the step."""
from __future__ import annotations

import json
import threading
import time

import pytest
import xgrammar as xgr

from triton_vlm.engine.search.guide_compiler import MAX_NESTING, GuideCompiler, canonical
from triton_vlm.engine.search.guided_schema import PATTERN_MAX_LENGTH, string_lengths_as_patterns
from triton_vlm.errors import Cancelled, InvalidArgument
from triton_vlm.params import GenerationParams, GenerationRequest, GuidedDecoding, GuideLimits

GUIDE = json.dumps({"type": "object", "required": ["v"], "properties": {"v": {"enum": ["red", "green", "blue"]}}})


def gated(c: GuideCompiler) -> threading.Event:
    """Compiles of `c` wait for the returned event (a compile as slow as the test needs; real slow ones are in
    test_guided_compile_live.py)."""
    gate, real = threading.Event(), c._compile

    def slow(*key):
        gate.wait(30)
        return real(*key)

    c._compile = slow
    return gate


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model), local_files_only=True)


def compiler(tokenizer, **limits) -> GuideCompiler:
    return GuideCompiler(tokenizer, 384, [tokenizer.eos_token_id], limits=GuideLimits(**limits))


def test_canonical_guides_share_one_key_and_bad_ones_are_refused_before_compiling():
    a = canonical(GuidedDecoding("json_schema", '{"type": "object",  "properties": {"x": {"type": "integer"}}}'))
    b = canonical(GuidedDecoding("json_schema", '{"type":"object","properties":{"x":{"type":"integer"}}}'))
    assert a == b == ("json_schema", '{"type":"object","properties":{"x":{"type":"integer"}}}')
    assert canonical(GuidedDecoding("choice", '["a", "b", "a"]')) == ("choice", 'root ::= "a" | "b"')
    deep = "(" * (MAX_NESTING + 1) + "a" + ")" * (MAX_NESTING + 1)
    with pytest.raises(InvalidArgument, match=f"nests {MAX_NESTING + 1} levels of brackets / parentheses; at most"):
        canonical(GuidedDecoding("regex", deep))
    canonical(GuidedDecoding("regex", deep[1:-1]))  # at the bound: accepted


def test_long_string_bounds_keep_the_librarys_lengths():
    """Short bounds become control-character-free patterns; longer ones stay xgrammar's own (a `{m,n}` pattern's
    token-mask fill costs tens of ms a step from maxLength 256 on)."""
    short = {"type": "string", "maxLength": PATTERN_MAX_LENGTH}
    long = {"type": "string", "minLength": 1, "maxLength": PATTERN_MAX_LENGTH + 1}
    assert "pattern" in string_lengths_as_patterns(short) and "maxLength" not in string_lengths_as_patterns(short)
    assert string_lengths_as_patterns(long) == long


def test_single_flight_time_limit_then_cached(tokenizer):
    c = compiler(tokenizer, compile_timeout_s=0.3)
    gate = gated(c)
    answers, done = [], threading.Event()

    def on_done(grammar, error):
        answers.append((grammar, error, time.monotonic()))
        if len(answers) == 3:
            done.set()

    key = c.key(GuidedDecoding("json_schema", GUIDE))
    t0 = time.monotonic()
    for _ in range(3):
        c.request(key, on_done)
    assert done.wait(30)
    assert c.compiles == 1 and c.timeouts == 3
    for grammar, error, at in answers:
        assert grammar is None and "did not compile within the limit of 0.3 s (llm parameter " \
            "guide_compile_timeout_s)" in error.message
        assert 0.3 <= at - t0 < 5
    gate.set()
    deadline = time.monotonic() + 30
    while c.cached(key) is None and time.monotonic() < deadline:  # the compile runs on, then is cached
        time.sleep(0.05)
    assert isinstance(c.cached(key), xgr.CompiledGrammar)
    assert c.compile(GuidedDecoding("json_schema", GUIDE.replace(", ", ","))) is c.cached(key) and c.compiles == 1


def test_cache_is_bounded_in_bytes(tokenizer):
    c = compiler(tokenizer, cache_mb=1)
    for i in range(40):
        c.compile(GuidedDecoding("regex", f"(a|b){{{i}}}x[0-9]+"))
    assert 0 < c.cached_bytes <= 2**20
    assert c.compile(GuidedDecoding("regex", "(a|b){39}x[0-9]+")) is not None


def test_the_engine_admits_plain_requests_while_a_grammar_compiles_and_cancels_the_waiting_one(demo_model):
    from triton_vlm.engine.engine import Engine, EngineConfig

    eng = Engine(demo_model, EngineConfig(max_rows=8, kv_cache_tokens=4096, guides=GuideLimits(compile_timeout_s=60)))
    eng.start()
    try:
        got: dict = {}
        final = threading.Event()

        def on_guided(res):
            got["guided"] = res
            final.set()

        gate = gated(eng.guide_compiler())
        ids = eng.tokenizer("USER: Say hello. ASSISTANT:").input_ids
        eng.submit(GenerationRequest("g", ids, GenerationParams(max_tokens=8, guided=GuidedDecoding(
            "json_schema", GUIDE))), on_guided)
        assert eng.stats().grammar_waiting == 1
        t0 = time.monotonic()
        plain = eng.generate([GenerationRequest("p", ids, GenerationParams(max_tokens=8, stream=True))])["p"]
        assert plain[-1].error is None and time.monotonic() - t0 < 5 and eng.stats().grammar_waiting == 1
        streamed = "".join(s.text for r in plain[:-1] for s in r.sequences)
        assert streamed == plain[-1].sequences[0].text and streamed  # text made on the delivery thread
        eng.cancel("g")
        assert final.wait(5) and isinstance(got["guided"].error, Cancelled) and eng.stats().grammar_waiting == 0
        gate.set()
        again = eng.generate([GenerationRequest("g2", ids, GenerationParams(max_tokens=24, guided=GuidedDecoding(
            "json_schema", GUIDE)))])["g2"][-1]
        assert again.error is None and json.loads(again.sequences[0].text)["v"] in ("red", "green", "blue")
    finally:
        eng.shutdown()


def test_text_made_on_the_delivery_thread_equals_the_text_made_in_the_step(demo_model):
    from triton_vlm.engine.engine import Engine, EngineConfig

    out = {}
    for thread in (False, True):
        eng = Engine(demo_model, EngineConfig(max_rows=8, kv_cache_tokens=4096, delivery_thread=thread))
        eng.start()
        try:
            ids = eng.tokenizer("USER: What color is the circle? ASSISTANT:").input_ids
            reqs = [GenerationRequest(f"s{i}", ids, GenerationParams(max_tokens=12, min_tokens=12, stream=True,
                                                                      do_sample=True, seed=i)) for i in range(4)]
            res = eng.generate(reqs)
            out[thread] = {k: ([s.text for r in v[:-1] for s in r.sequences], v[-1].sequences[0].text)
                           for k, v in res.items()}
        finally:
            eng.shutdown()
    assert out[True] == out[False]
    assert all("".join(pieces) == final for pieces, final in out[True].values())


def test_a_queued_compile_nobody_waits_for_is_dropped(tokenizer):
    c = compiler(tokenizer, compile_workers=1)
    gate = gated(c)
    answers: list = []
    c.request(c.key(GuidedDecoding("regex", "a+")), lambda g, e: answers.append("a"))  # holds the one worker
    wait = c.request(c.key(GuidedDecoding("regex", "b+")), lambda g, e: answers.append("b"))  # queued behind it
    c.forget(wait)  # its request was cancelled
    gate.set()
    deadline = time.monotonic() + 30
    while c.skipped == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.skipped == 1 and answers == ["a"] and c.cached(("regex", "b+")) is None
