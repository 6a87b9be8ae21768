"""Guided decoding (engine/search/guided.py) against transformers' generate() with xgrammar's own logits processor.

A tiny random LLaVA checkpoint with the demo tokenizer (byte-level BPE), CPU fp32, the engine end to end: guided
greedy and seeded sampling equal `generate(logits_processor=[xgrammar.contrib.hf.LogitsProcessor(g)])` token for
token, for a JSON schema, a regex, a choice list, an EBNF grammar and any-JSON. Beam search is compared with the
same generate() and a processor that gives every row the matcher of its own tokens: xgrammar's contrib processor
keeps matcher i for row i and so assumes rows are never reordered, which beam search does (its docstring: "may
contain extra overhead"; it asserts when a reordered beam's token does not fit matcher i's history).
"""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from transformers import LogitsProcessor
from xgrammar.contrib.hf import LogitsProcessor as XgrHFProcessor

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.search.guided import GrammarGuide, GuideCompiler
from triton_vlm.errors import InvalidArgument
from triton_vlm.params import GenerationParams, GenerationRequest, GuidedDecoding

EOS = 2
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                      "maximum": 99}},
    "required": ["color", "n"], "additionalProperties": False})
GUIDES = {
    "json_schema": SCHEMA,
    "regex": r"[a-c]{2,4}-[0-9]{1,3}",
    "choice": json.dumps(["yes", "no", "maybe so"]),
    "ebnf_grammar": 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"',
    "json": "",
    "structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": json.loads(SCHEMA)}}}),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=7, max_position_embeddings=128)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so near-ties are rare
    path = save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))
    return model, processor.tokenizer, path


@pytest.fixture(scope="module")
def eng(ckpt):
    _, _, path = ckpt
    return Engine(path, EngineConfig(max_rows=32, kv_cache_tokens=4096, block_size=4, prefill_chunk=16))


@pytest.fixture(scope="module")
def reference_compiler(ckpt):
    """Grammars compiled independently of the engine's GuideCompiler, for the reference."""
    model, tok, _ = ckpt
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.text_config.vocab_size,
                                              stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def ref_grammar(compiler, kind: str, guide: str):
    if kind == "json_schema":
        return compiler.compile_json_schema(guide, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(guide)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(guide)))
    if kind == "structural_tag":
        return compiler.compile_structural_tag(guide)
    if kind == "json":  # any object, compact
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    return compiler.compile_grammar(guide)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def request(rid, ids, kind=None, max_tokens=24, **kw) -> GenerationRequest:
    guided = None if kind is None else GuidedDecoding(kind, GUIDES.get(kind, ""))
    params = GenerationParams(max_tokens=max_tokens, guided=guided, **kw)
    return GenerationRequest(request_id=rid, input_ids=list(ids), params=params)


class RowMatchers(LogitsProcessor):
    """Every row's matcher rebuilt from its own generated tokens (beam rows reorder)."""

    def __init__(self, grammar, prompt_len: int):
        self.grammar, self.prompt_len = grammar, prompt_len

    def __call__(self, input_ids, scores):
        bitmask = xgr.allocate_token_bitmask(input_ids.shape[0], self.grammar.tokenizer_info.vocab_size)
        for i, row in enumerate(input_ids[:, self.prompt_len:].tolist()):
            m = xgr.GrammarMatcher(self.grammar)
            for t in row:
                assert m.accept_token(t)
            m.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(scores, bitmask)
        return scores


def hf(model, req: GenerationRequest, processor) -> list[list[int]]:
    p = req.params
    ids = torch.tensor([req.input_ids])
    kw = dict(max_new_tokens=p.max_tokens, num_beams=p.beam_width, num_return_sequences=p.num_return_sequences,
              eos_token_id=EOS, pad_token_id=0, do_sample=p.do_sample, logits_processor=[processor])
    if p.beam_width > 1:
        kw.update(length_penalty=p.length_penalty, early_stopping=p.early_stopping)
    if p.do_sample:
        kw.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        torch.manual_seed(p.seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    seqs = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t == EOS), len(row))
        seqs.append(row[:cut])
    return seqs


def final(results):
    last = results[-1]
    assert last.final and last.error is None, last.error
    return last.sequences


@pytest.mark.parametrize("kind", sorted(GUIDES))
def test_guided_greedy_and_sampling_equal_hf_with_xgrammar_processor(ckpt, eng, reference_compiler, kind):
    model, tok, _ = ckpt
    reqs = [request(f"{kind}-g", prompt(7, 1), kind),
            request(f"{kind}-s", prompt(9, 2), kind, do_sample=True, temperature=1.3, top_k=50, seed=11,
                    num_return_sequences=2)]
    out = eng.generate(reqs)
    for r in reqs:
        ref = hf(model, r, XgrHFProcessor(ref_grammar(reference_compiler, kind, GUIDES[kind])))
        got = [s.token_ids for s in final(out[r.request_id])]
        assert got == ref, r.request_id
    text = tok.decode(final(out[f"{kind}-g"])[0].token_ids, skip_special_tokens=True)
    if kind == "choice":
        assert text in json.loads(GUIDES["choice"])
    if kind == "structural_tag":
        assert text.startswith('<f>{'), text  # the tag, then its JSON (the library's whitespace rules)
    if kind == "json_schema" and final(out[f"{kind}-g"])[0].token_ids[-1] == EOS:  # complete: a valid document
        doc = json.loads(text)
        assert set(doc) == {"color", "n"} and doc["color"] in ("red", "green", "blue") and 0 <= doc["n"] <= 99


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf_grammar"])
def test_guided_beam_search_equals_hf(ckpt, eng, reference_compiler, kind):
    model, _, _ = ckpt
    r = request(f"{kind}-b", prompt(8, 3), kind, max_tokens=16, beam_width=3, num_return_sequences=3,
                length_penalty=0.7)
    got = [s.token_ids for s in final(eng.generate([r])[r.request_id])]
    ref = hf(model, r, RowMatchers(ref_grammar(reference_compiler, kind, GUIDES[kind]), len(r.input_ids)))
    assert got == ref


def test_a_complete_grammar_ends_the_request_and_every_output_is_valid(ckpt, eng):
    _, tok, _ = ckpt
    reqs = [request(f"c{i}", prompt(5 + i, 20 + i), "json_schema", max_tokens=60) for i in range(4)]
    reqs += [request(f"x{i}", prompt(6, 40 + i), "choice", max_tokens=60) for i in range(2)]
    out = eng.generate(reqs)
    for r in reqs:
        seq = final(out[r.request_id])[0]
        assert seq.token_ids[-1] == EOS, r.request_id  # the grammar completed, then forced the end token
        text = tok.decode(seq.token_ids, skip_special_tokens=True)
        if r.params.guided.guide_type == "choice":
            assert text in ("yes", "no", "maybe so")
        else:
            doc = json.loads(text)
            assert doc["color"] in ("red", "green", "blue") and 0 <= doc["n"] <= 99 and set(doc) == {"color", "n"}


def test_unconstrained_rows_of_a_mixed_batch_are_unchanged(eng):
    """Unconstrained requests beside guided ones answer as alone: the same tokens (their log probs within fp32
    rounding: a batch of other shapes runs other matmul blocking, as for any batch-mates)."""
    free = [request(f"f{i}", prompt(6 + i, 60 + i), max_tokens=12, return_log_probs=True) for i in range(3)]
    free.append(request("fb", prompt(9, 70), max_tokens=10, beam_width=2, num_return_sequences=2))
    alone = {r.request_id: final(eng.generate([r])[r.request_id]) for r in free}
    mixed = free + [request(f"m{k}", prompt(8, 80), k) for k in GUIDES]
    together = eng.generate(mixed)
    for r in free:
        got, ref = final(together[r.request_id]), alone[r.request_id]
        assert [s.token_ids for s in got] == [s.token_ids for s in ref], r.request_id
        for a, b in zip(got, ref):
            assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5), r.request_id


def test_the_guide_masks_its_own_rows_and_leaves_the_logits_it_was_given(ckpt, eng):
    """The mask lands on a copy: the step's logits (other requests' rows, the raw logits the log probs come
    from) stay bit for bit; masked columns are exactly those xgrammar's bitmask forbids."""
    model, _, _ = ckpt
    V = model.config.text_config.vocab_size
    guide = GrammarGuide(eng.guide_compiler().compile(GuidedDecoding("regex", GUIDES["regex"])), prompt_len=2,
                         end_ids=[EOS], vocab_size=V)
    logits = torch.randn(5, V)
    before = logits.clone()
    ids = torch.tensor([[1, 9], [1, 9]])  # two rows of one request, nothing generated yet
    masked = guide(ids, logits[1:3])
    assert torch.equal(logits, before)  # bit for bit, every row
    allowed = {i for i in range(V) if masked[0, i] > -torch.inf}
    m = xgr.GrammarMatcher(eng.guide_compiler().compile(GuidedDecoding("regex", GUIDES["regex"])))
    bitmask = xgr.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(bitmask, 0)
    ref = torch.zeros(1, V)
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    assert allowed == {i for i in range(V) if ref[0, i] == 0} and 0 < len(allowed) < V
    assert torch.equal(masked[:, sorted(allowed)], before[1:3, sorted(allowed)])


@pytest.mark.parametrize("kind,guide,message", [
    ("json_schema", '{"type": "objectx"}', 'not a valid json_schema: Unsupported type "objectx"'),
    ("json_schema", "{bad json", "not a valid json_schema: Failed to parse JSON"),
    ("regex", "a(b", "not a valid regex: Regex parsing error at position 4: The parenthesis is not closed"),
    ("ebnf_grammar", "root ::= foo", 'not a valid ebnf_grammar: EBNF parser error at line 1, column 10: '
                                     'Rule "foo" is not defined'),
    ("choice", '"yes"', "must be a non-empty JSON list of non-empty strings"),
    ("choice", "[yes", "must be a JSON list of strings"),
])
def test_invalid_guides_are_refused(eng, kind, guide, message):
    """Refused at submit when our own checks see it (a choice list), else (what only the library can judge, on
    the compile pool) as the request's final result, the request never queued."""
    req = GenerationRequest("bad", prompt(5, 1), GenerationParams(max_tokens=4, guided=GuidedDecoding(kind, guide)))
    try:
        error = eng.generate([req])["bad"][-1].error
    except InvalidArgument as e:
        assert kind == "choice"
        error = e
    assert isinstance(error, InvalidArgument), error
    assert message in error.message and "guided_decoding_guide" in error.message
    assert "/project/" not in error.message  # the library's text, without its C++ source location


@pytest.mark.parametrize("mode", [{}, {"do_sample": True, "seed": 3}, {"beam_width": 2}])
def test_a_grammar_that_allows_nothing_ends_the_request_with_an_error(eng, mode):
    """After "a" the grammar allows only the end token, which min_tokens forbids: no token is left."""
    req = GenerationRequest("stuck", prompt(5, 1), GenerationParams(
        max_tokens=8, min_tokens=4, guided=GuidedDecoding("regex", "a"), **mode))
    last = eng.generate([req])["stuck"][-1]
    assert last.final and isinstance(last.error, InvalidArgument)
    assert "every token is excluded at generated token 2 by guided_decoding_guide" in last.error.message
    assert eng.generate([request("after", prompt(5, 2), "regex")])["after"][-1].error is None  # engine lives on


def test_compile_cache_by_guide(ckpt):
    model, tok, _ = ckpt
    c = GuideCompiler(tok, model.config.text_config.vocab_size, [EOS], cache_size=2)
    a = c.compile(GuidedDecoding("regex", "a+"))
    assert c.compile(GuidedDecoding("regex", "a+")) is a
    c.compile(GuidedDecoding("regex", "b+"))
    c.compile(GuidedDecoding("regex", "c+"))  # evicts a+ (least recently used)
    assert c.compile(GuidedDecoding("regex", "a+")) is not a
    assert c.compile(GuidedDecoding("json", "ignored")) is c.compile(GuidedDecoding("json", ""))


def test_params_from_inputs():
    p = GenerationParams.from_inputs({"max_tokens": 4, "guided_decoding_guide_type": "regex",
                                      "guided_decoding_guide": "a+"})
    assert p.guided == GuidedDecoding("regex", "a+")
    assert GenerationParams.from_inputs({"max_tokens": 4}).guided is None
    for values, message in [({"guided_decoding_guide_type": "xml"}, "must be one of json, json_schema, regex"),
                            ({"guided_decoding_guide": "a"}, "guided_decoding_guide needs guided_decoding_guide_type"),
                            ({"guided_decoding_guide_type": "regex"}, "guided_decoding_guide is empty")]:
        with pytest.raises(InvalidArgument, match=message):
            GenerationParams.from_inputs({"max_tokens": 4, **values})


def test_guided_greedy_steps_batched_and_leaves_its_step_mates_bit_for_bit(ckpt, eng):
    """Guided greedy rows step in `greedy_step` with the unconstrained ones: one bitmask for the constrained rows;
    the unconstrained rows' tokens and log probs are those of the same step without them, bit for bit."""
    from triton_vlm.engine.search.decoder import Decoder
    from triton_vlm.engine.search.greedy import GreedySearch, greedy_step

    model, _, _ = ckpt
    V = model.config.text_config.vocab_size
    grammar = eng.guide_compiler().compile(GuidedDecoding("regex", GUIDES["regex"]))
    dec = Decoder(GenerationParams(max_tokens=8, guided=GuidedDecoding("regex", GUIDES["regex"])), [1, 5],
                  eos_ids=[EOS], vocab_size=V, grammar=grammar)
    assert dec.batched_greedy

    def plain():
        return GreedySearch(max_new_tokens=8, eos_ids=[EOS], min_new_tokens=0)

    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 5
    guided = [GreedySearch(max_new_tokens=8, eos_ids=[EOS], min_new_tokens=0, matcher=xgr.GrammarMatcher(grammar))
              for _ in range(2)]
    mixed = [plain(), guided[0], plain(), guided[1], plain()]
    out = greedy_step(mixed, logits)
    alone_searches = [plain(), plain(), plain()]
    alone = greedy_step(alone_searches, logits[[0, 2, 4]])
    assert [out[i] for i in (0, 2, 4)] == alone
    assert [(mixed[i].tokens, mixed[i].log_probs) for i in (0, 2, 4)] == \
        [(s.tokens, s.log_probs) for s in alone_searches]  # floats compared exactly
    bitmask = xgr.allocate_token_bitmask(1, V)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask, 0)
    for s, row in zip(guided, (1, 3)):  # the best token the grammar allows (the regex's first character)
        ref = logits[row:row + 1].clone()
        xgr.apply_token_bitmask_inplace(ref, bitmask)
        assert s.tokens == [int(ref.argmax())] and eng.tokenizer.decode(s.tokens)[0] in "abc"
        assert s.log_probs == [float(torch.log_softmax(logits[row], -1)[s.tokens[0]])]  # of the raw logits


def test_the_transformers_baseline_refuses_guided_requests(demo_model):
    from triton_vlm.baseline.generate import HFGenerator

    req = GenerationRequest("g", [1, 5, 6], GenerationParams(max_tokens=4, guided=GuidedDecoding("regex", "a+")))
    with pytest.raises(InvalidArgument, match="does not constrain decoding; serve with backend 'engine'"):
        HFGenerator(demo_model).submit(req, lambda r: None)


def test_preempted_guided_requests_resume_with_their_grammar_state(ckpt, eng):
    """max_utilization on a cache of one full context: six guided requests (greedy, seeded sampling, beams) start
    together, some are preempted and recomputed, and each answers as alone (its matchers kept their states)."""
    _, _, path = ckpt
    small = Engine(path, EngineConfig(max_rows=32, kv_cache_tokens=128, block_size=4, prefill_chunk=16,
                                      scheduler_policy="max_utilization"))
    modes = [{}, {"do_sample": True, "temperature": 1.2, "seed": 5}, {"beam_width": 2, "num_return_sequences": 2}]
    reqs = [GenerationRequest(f"p{i}", prompt(8 + i % 3, 90 + i), GenerationParams(
        max_tokens=36, min_tokens=36, guided=GuidedDecoding("regex", "[a-z ,.]+"), **modes[i % 3]))
        for i in range(6)]
    alone = {r.request_id: [s.token_ids for s in final(eng.generate([r])[r.request_id])] for r in reqs}
    together = small.generate(reqs)
    assert small.stats().preemptions > 0
    for r in reqs:
        got = [s.token_ids for s in final(together[r.request_id])]
        assert got == alone[r.request_id], r.request_id
        assert all(len(t) == 36 and set(small.tokenizer.decode(t)) <= set("abcdefghijklmnopqrstuvwxyz ,.")
                   for t in got)


def test_choices_are_matched_literally(ckpt):
    """Quotes, backslashes, control characters and characters beyond the BMP in a choice are its own text."""
    model, tok, _ = ckpt
    c = GuideCompiler(tok, model.config.text_config.vocab_size, [EOS])
    choices = ['café "x"', "a\\b", "日本", "tab\there", "emoji 😀", "nl\nx"]
    g = c.compile(GuidedDecoding("choice", json.dumps(choices)))
    for ch in choices:
        m = xgr.GrammarMatcher(g)
        assert m.accept_string(ch) and m.is_completed(), ch
    m = xgr.GrammarMatcher(g)
    assert m.accept_string("caf") and not m.accept_string("x")


@pytest.mark.parametrize("kind,schema,message", [
    ("json_schema", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     "keyword 'not' at #/properties/a is not supported"),
    ("json_schema", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "keyword 'uniqueItems' at # is not supported"),
    ("json_schema", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, "keyword 'allOf' with 2 subschemas at #"),
    ("structural_tag", None, "keyword 'maxLength' beside 'pattern' at #/properties/s"),
])
def test_schemas_with_keywords_the_library_ignores_are_refused_at_submit(eng, kind, schema, message):
    """For every entry point (the engine compiles them): an unenforced keyword is an InvalidArgument naming it
    and where it is, never a grammar that lets a breaking document through."""
    if kind == "structural_tag":
        inner = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}
        guide = json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": inner}, "end": "</f>"}})
    else:
        guide = json.dumps(schema)
    req = GenerationRequest("bad", prompt(5, 1), GenerationParams(max_tokens=4, guided=GuidedDecoding(kind, guide)))
    with pytest.raises(InvalidArgument) as e:
        eng.submit(req, lambda r: None)
    assert message in e.value.message and e.value.message.startswith("guided_decoding_guide: "), e.value.message


def test_bounded_strings_compile_without_control_characters(ckpt):
    """xgrammar 0.2.8 lets raw control characters into a string with minLength / maxLength; the engine compiles
    such a string as the equivalent control-character-free pattern (direct Triton clients included)."""
    model, tok, _ = ckpt
    c = GuideCompiler(tok, model.config.text_config.vocab_size, [EOS])
    schema = {"type": "object", "required": ["t"], "properties": {"t": {"type": "string", "minLength": 1,
                                                                        "maxLength": 3}}}
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert xgr.testing._is_grammar_accept_string(raw, '{"t": "a\x1f"}')  # the library's bug, unchanged
    for kind, guide in (("json_schema", json.dumps(schema)),
                        ("structural_tag", json.dumps({"type": "structural_tag", "format": {
                            "type": "tag", "begin": "", "content": {"type": "json_schema", "json_schema": schema},
                            "end": ""}}))):
        g = c.compile(GuidedDecoding(kind, guide))
        for doc, ok in (('{"t": "a\x1f"}', False), ('{"t": ""}', False), ('{"t": "abcd"}', False),
                        ('{"t": "é✓a"}', True)):
            m = xgr.GrammarMatcher(g)
            assert (m.accept_string(doc) and m.is_completed()) == ok, (kind, doc)


def test_guided_sampling_and_beams_step_batched_with_unguided_ones(ckpt, eng, reference_compiler):
    """Guided sampling and beam requests step in `sample_step` / `beam_step` with the unguided ones of the step
    (one bitmask fill and one apply for their constrained rows): each equals HF with xgrammar's processor, the
    unguided ones answer as alone."""
    from triton_vlm.engine.search.decoder import Decoder

    model, _, _ = ckpt
    V = model.config.text_config.vocab_size
    grammar = eng.guide_compiler().compile(GuidedDecoding("regex", GUIDES["regex"]))
    sampled = dict(do_sample=True, temperature=1.3, top_k=50, seed=21, num_return_sequences=2)
    beams = dict(beam_width=3, num_return_sequences=2, length_penalty=0.7)
    for kw, flag in ((sampled, "batched_sampling"), (beams, "beam_key")):
        dec = Decoder(GenerationParams(max_tokens=8, guided=GuidedDecoding("regex", GUIDES["regex"]), **kw),
                      [1, 5], eos_ids=[EOS], vocab_size=V, grammar=grammar)
        assert getattr(dec, flag), flag
    reqs = [request("gs", prompt(7, 4), "regex", max_tokens=12, **sampled),
            request("us", prompt(9, 5), None, max_tokens=12, **sampled),
            request("gb", prompt(8, 6), "json_schema", max_tokens=12, **beams),
            request("ub", prompt(6, 7), None, max_tokens=12, **beams)]
    out = eng.generate(reqs)
    got = {r.request_id: [s.token_ids for s in final(out[r.request_id])] for r in reqs}
    assert got["gs"] == hf(model, reqs[0], XgrHFProcessor(ref_grammar(reference_compiler, "regex", GUIDES["regex"])))
    assert got["gb"] == hf(model, reqs[2], RowMatchers(ref_grammar(reference_compiler, "json_schema",
                                                                   GUIDES["json_schema"]), len(reqs[2].input_ids)))
    for r in (reqs[1], reqs[3]):
        assert got[r.request_id] == [s.token_ids for s in final(eng.generate([r])[r.request_id])], r.request_id


@pytest.mark.parametrize("mode", [dict(do_sample=True, temperature=1.2, top_k=40, seed=8, num_return_sequences=2),
                                  dict(beam_width=3, num_return_sequences=3)])
def test_guided_requests_with_penalties_equal_hf(ckpt, eng, reference_compiler, mode):
    """The per-request paths (a penalty needs each row's context): the grammar after the penalty, the rows'
    matchers from the tokens held on the host."""
    model, _, _ = ckpt
    regex = "[a-z ,.]+"  # never complete: every row runs to max_tokens (HF pads finished rows)
    r = GenerationRequest("pen", prompt(8, 9), GenerationParams(max_tokens=14, repetition_penalty=1.3,
                                                              guided=GuidedDecoding("regex", regex), **mode))
    got = [s.token_ids for s in final(eng.generate([r])["pen"])]
    grammar = ref_grammar(reference_compiler, "regex", regex)
    p = r.params
    ids = torch.tensor([r.input_ids])
    kw = dict(max_new_tokens=p.max_tokens, num_beams=p.beam_width, num_return_sequences=p.num_return_sequences,
              eos_token_id=EOS, pad_token_id=0, do_sample=p.do_sample, repetition_penalty=1.3,
              length_penalty=p.length_penalty, early_stopping=p.early_stopping,
              logits_processor=[RowMatchers(grammar, ids.shape[1])])
    if p.do_sample:
        kw.update(temperature=p.temperature, top_k=p.top_k)
        torch.manual_seed(p.seed)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[:, ids.shape[1]:].tolist()
    ref = [row[:next((i + 1 for i, t in enumerate(row) if t == EOS), len(row))] for row in ref]
    assert got == ref and all(len(t) == 14 for t in got)


def test_an_ended_beams_row_allows_only_its_stop_tokens(ckpt, reference_compiler):
    """transformers' beam search carries an ended beam (its last token a stop token, score -1e9) as a running row
    when fewer live candidates than beams remain; its matcher has terminated. Masking such a row, and replaying a
    row that continues past its stop token, allow only the stop tokens instead of raising the library's
    "GrammarMatcher has terminated" (a guided beam request failed with it)."""
    model, tok, _ = ckpt
    V = model.config.text_config.vocab_size
    compiled = reference_compiler.compile_grammar('root ::= "ab"')
    guide = GrammarGuide(compiled, prompt_len=0, end_ids=[EOS], vocab_size=V)
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    ended = tuple(ids) + (EOS,)
    rows = [(), ended, ended + (5,)]  # a row at the start, an ended one, one continued past its stop token
    scores = torch.randn(3, V)
    guide.rows = rows
    masked = guide(torch.zeros(3, 0, dtype=torch.long), scores)
    for r in (1, 2):
        allowed = torch.isfinite(masked[r]).nonzero().flatten().tolist()
        assert allowed == [EOS] and masked[r, EOS] == scores[r, EOS]
    assert torch.isfinite(masked[0]).sum() >= 1 and not torch.isfinite(masked[0, EOS])  # "ab" must come first
