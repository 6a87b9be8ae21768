"""The OpenAI front end's pure parts, without a server: stop strings streamed or not, token texts joining to
the text, image URLs, the request -> ensemble inputs mapping, chat templating, error mapping."""
from __future__ import annotations

import asyncio
import base64
import random

import pytest

from triton_vlm import names as N
from triton_vlm.openai.chat_template import ChatTemplate, Turn, check_text
from triton_vlm.openai.choices import Choice, StopMatcher
from triton_vlm.openai.errors import APIError, from_triton, validation_message
from triton_vlm.openai.media import MediaPolicy, decode_data_url, sniff
from triton_vlm.openai.params import make_plan
from triton_vlm.openai.schemas import ChatCompletionRequest, CompletionRequest


def _feed_all(stops, pieces) -> tuple[str, str, bool]:
    c = Choice(0, StopMatcher(stops))
    out = "".join(c.feed(p.encode(), [], []) for p in pieces) + c.finish()
    return out, c.text, c.stopped


@pytest.mark.parametrize("stops,text,expected", [
    ([" circle"], " a red circle", " a red"),
    (["abcd", "c"], "xxabcdyy", "xxab"),  # the stop that completes first wins
    (["ed", "zz"], " a red circle", " a r"),
    (["\n\n"], "one\ntwo\n\nthree", "one\ntwo"),
    (["never"], " a red circle", " a red circle"),
    (["é"], "caf\u00e9 au lait", "caf"),
])
def test_stop_strings_streamed_in_any_pieces_equal_one_shot(stops, text, expected):
    rng = random.Random(0)
    one_shot = _feed_all(stops, [text])
    assert one_shot[0] == one_shot[1] == expected
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _feed_all(stops, pieces)[0] == expected, pieces


def test_streaming_never_releases_a_possible_stop_prefix():
    c = Choice(0, StopMatcher(["STOP"]))
    assert c.feed(b"abc ST", [], []) == "abc "  # "ST" may become STOP
    assert c.feed(b"AR", [], []) == "STAR"  # it did not
    assert c.feed(b"S", [], []) == ""
    assert c.feed(b"TOP and more", [], []) == "" and c.finish() == "" and c.text == "abc STAR"  # ...S|TOP


def test_utf8_split_across_pieces_is_decoded_whole():
    c = Choice(0, StopMatcher([]))
    data = "naïve ✓".encode()
    out = "".join(c.feed(data[i:i + 1], [], []) for i in range(len(data))) + c.finish()
    assert out == "naïve ✓"


def test_token_texts_join_to_the_text(demo_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    eos = frozenset({tok.eos_token_id})
    for text in (" a red circle", " hello goodbye", " The shape is a blue square."):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        c = Choice(0, StopMatcher([]))
        c.feed(tok.decode(ids, skip_special_tokens=True).encode(), ids, [-0.5] * len(ids))
        c.finish()
        tokens = c.token_texts(tok, eos)
        assert "".join(t for _, t, _, _ in tokens) == c.text == text
        assert len(tokens) == len(ids) - 1  # the end token is left out
    c = Choice(0, StopMatcher([" circle"]))  # cut by a stop string: tokens up to the cut
    ids = tok.encode(" a red circle now", add_special_tokens=False)
    c.feed(" a red circle now".encode(), ids, [0.0] * len(ids))
    c.finish()
    assert "".join(t for _, t, _, _ in c.token_texts(tok, eos)) == c.text == " a red"
    assert c.finish_reason(100, eos) == "stop"


def test_finish_reasons():
    eos = frozenset({2})
    c = Choice(0, StopMatcher([]), ids=[5, 6, 2])
    assert c.finish_reason(3, eos) == "stop"
    c = Choice(0, StopMatcher([]), ids=[5, 6, 7])
    assert c.finish_reason(3, eos) == "length" and c.finish_reason(8, eos) == "stop"


# --- images -------------------------------------------------------------------------------------------------
def test_image_formats_by_their_bytes():
    assert sniff(b"\x89PNG\r\n\x1a\n....") == "PNG" and sniff(b"\xff\xd8\xff\xe0") == "JPEG"
    assert sniff(b"RIFF\0\0\0\0WEBPVP8 ") == "WebP" and sniff(b"GIF89a..") == "GIF"
    assert sniff(b"BM......") is None and sniff(b"<svg") is None


def test_data_urls():
    png = b"\x89PNG\r\n\x1a\n" + b"x" * 20
    assert decode_data_url("data:image/png;base64," + base64.b64encode(png).decode()) == png
    for url, needle in (("data:image/png," + "abc", "base64"), ("data:text/plain;base64,aGk=", "not an image"),
                        ("data:image/png;base64,!!", "base64"),
                        ("data:image/png;base64," + base64.b64encode(b"BM...").decode(), "PNG, JPEG")):
        with pytest.raises(APIError) as e:
            decode_data_url(url)
        assert e.value.status == 400 and needle in e.value.message, url
    with pytest.raises(APIError, match="over 10 bytes"):
        decode_data_url("data:image/png;base64," + base64.b64encode(png).decode(), max_bytes=10)


def test_url_policy():
    closed = MediaPolicy()
    open_ = MediaPolicy(("example.org", "*.cdn.net"))
    for policy, url, needle in ((closed, "http://example.org/a.png", "--allowed-image-domains"),
                                (closed, "file:///etc/passwd", "not accepted"),
                                (closed, "/etc/passwd", "not accepted"),
                                (open_, "https://evil.com/a.png", "not allowed"),
                                (open_, "ftp://example.org/a.png", "not accepted")):
        with pytest.raises(APIError) as e:
            asyncio.run(policy.load(url))
        assert e.value.status == 400 and needle in e.value.message, url
    assert open_.host_allowed("example.org") and open_.host_allowed("img.cdn.net")
    assert not open_.host_allowed("cdn.net.evil.com") and not open_.host_allowed("sub.example.org")


# --- parameters ---------------------------------------------------------------------------------------------
def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_plan_maps_openai_and_vllm_fields_to_ensemble_inputs():
    p = make_plan(_chat(temperature=0.7, top_p=0.9, seed=3, presence_penalty=0.5, frequency_penalty=-0.5,
                        max_completion_tokens=9, max_tokens=99, stop="x", n=2, top_k=-1, min_tokens=2,
                        repetition_penalty=1.1), {})
    assert p.inputs == {N.TEMPERATURE: 0.7, N.TOP_P: 0.9, N.TOP_K: 0, N.SEED: 3, N.PRESENCE_PENALTY: 0.5,
                        N.FREQUENCY_PENALTY: -0.5, N.REPETITION_PENALTY: 1.1, N.MIN_TOKENS: 2,
                        N.NUM_RETURN_SEQUENCES: 2}
    assert p.max_tokens == 9 and p.stop == ["x"] and p.copies == 1
    beam = make_plan(_chat(n=2, use_beam_search=True, best_of=4, length_penalty=0.5, early_stopping="never"), {})
    assert beam.inputs == {N.BEAM_WIDTH: 4, N.NUM_RETURN_SEQUENCES: 2, N.LENGTH_PENALTY: 0.5,
                           N.EARLY_STOPPING: N.EARLY_STOPPING_NEVER}
    greedy = make_plan(_chat(n=3), {})  # no sampling asked, a greedy checkpoint: one generation, 3 copies
    assert greedy.copies == 3 and N.NUM_RETURN_SEQUENCES not in greedy.inputs
    sampled = make_plan(_chat(n=3), {"temperature": 0.6})  # the checkpoint's generation_config samples
    assert sampled.inputs == {N.TEMPERATURE: 0.6, N.NUM_RETURN_SEQUENCES: 3}
    best = make_plan(CompletionRequest(model="m", prompt="p", n=2, best_of=5, temperature=1.0), {})
    assert best.rank_best_of and best.inputs[N.NUM_RETURN_SEQUENCES] == 5 and best.inputs[N.RETURN_LOG_PROBS]
    lp = make_plan(_chat(logprobs=True, stream=True, stream_options={"include_usage": True}), {})
    assert lp.logprobs and lp.include_usage and lp.inputs[N.RETURN_LOG_PROBS]


def test_the_llm_is_asked_only_for_the_outputs_the_front_end_reads():
    from triton_vlm.openai.triton import llm_outputs

    plain = llm_outputs(make_plan(_chat(), {}).inputs)
    assert set(plain) == {N.TEXT_OUTPUT, N.OUTPUT_IDS, N.SEQUENCE_LENGTH, N.SEQUENCE_INDEX, N.CUM_LOG_PROBS}
    lp = llm_outputs(make_plan(_chat(logprobs=True), {}).inputs)
    assert set(lp) == set(plain) | {N.OUTPUT_LOG_PROBS}
    top = llm_outputs(make_plan(_chat(logprobs=True, top_logprobs=2), {}).inputs)
    assert set(top) == set(lp) | {N.OUTPUT_TOP_LOG_PROBS, N.OUTPUT_TOP_LOG_PROB_IDS}
    best = make_plan(CompletionRequest(model="m", prompt="p", n=2, best_of=5, temperature=1.0), {})
    assert N.OUTPUT_LOG_PROBS in llm_outputs(best.inputs)  # ranked by the engine's log probs
    assert set(top) <= {spec.name for spec in N.LLM_OUTPUTS}  # names the llm declares


@pytest.mark.parametrize("kw,needle", [
    (dict(n=0), "n must be"), (dict(n=17), "n must be"), (dict(seed=-1), "seed"),
    (dict(top_logprobs=3), "needs logprobs"), (dict(stop=[str(i) for i in range(17)]), "stop holds"),
    (dict(stream_options={"include_usage": True}), "only allowed when stream"),
    (dict(best_of=1, n=2, temperature=1.0), "best_of"), (dict(length_penalty=0.5), "beam search only"),
    (dict(n=2, best_of=3), "needs sampling"), (dict(top_k=-3, temperature=1.0), "top_k"),
])
def test_plan_refuses_what_the_api_does_not_allow(kw, needle):
    with pytest.raises(APIError) as e:
        make_plan(_chat(**kw), {})
    assert e.value.status == 400 and needle in e.value.message


# --- chat templates -----------------------------------------------------------------------------------------
def test_llava_template_renders_the_training_format(demo_model):
    from transformers import AutoTokenizer

    from triton_vlm.demo.checkpoint import CHAT_TEMPLATE

    t = ChatTemplate(CHAT_TEMPLATE, AutoTokenizer.from_pretrained(str(demo_model)), "demo")
    assert t.parts_format
    turns = [Turn("user", [None, "What color is the shape?"])]
    assert t.render(turns, 1) == "USER: <image>\nWhat color is the shape? ASSISTANT:"
    turns = [Turn("system", ["Be brief."]), Turn("user", ["Say hello."]), Turn("assistant", [" hello"]),
             Turn("user", [None, "Describe the image."])]
    assert t.render(turns, 1) == ("Be brief. USER: Say hello. ASSISTANT:  hello USER: <image>\nDescribe the image. "
                                  "ASSISTANT:")
    with pytest.raises(APIError, match="placed 1 <image> markers for 2 images"):
        t.render([Turn("user", [None, "x"])], 2)


def test_string_content_templates_get_image_markers_inline(demo_model):
    from transformers import AutoTokenizer

    source = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")
    t = ChatTemplate(source, AutoTokenizer.from_pretrained(str(demo_model)))
    assert not t.parts_format
    assert t.render([Turn("user", [None, "What?"])], 1) == "user: <image>\nWhat?\nassistant:"  # BOS removed


def test_text_may_not_smuggle_images():
    for text in ("see <image> here", 'x <img src="data:image/png;base64,AAAA"> y'):
        with pytest.raises(APIError):
            check_text(text, "messages[0].content")
    assert check_text("an <img> tag in prose", "m") == "an <img> tag in prose"


# --- errors -------------------------------------------------------------------------------------------------
def test_triton_errors_map_to_http_statuses():
    assert from_triton("INVALID_ARGUMENT", "in ensemble 'ensemble', max_tokens must be >= 1, got 0").message \
        == "max_tokens must be >= 1, got 0"
    assert from_triton("INVALID_ARGUMENT", "x").status == 400
    assert from_triton("UNAVAILABLE", "the request queue is full (8 waiting); retry later").status == 429
    assert from_triton("UNAVAILABLE", "Exceeds maximum queue size").status == 429
    assert from_triton("UNAVAILABLE", "the llm model is shutting down; retry").status == 503
    assert from_triton("INTERNAL", "internal error: boom").status == 500
    body = from_triton("UNAVAILABLE", "queue is full").body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == "queue_full"


def test_validation_errors_name_the_field():
    message, param = validation_message([{"loc": ("body", "temperature"), "msg": "Input should be a valid number",
                                          "type": "float_parsing"},
                                         {"loc": ("body", "foo"), "msg": "x", "type": "extra_forbidden"}])
    assert param == "temperature"
    assert message == "temperature: Input should be a valid number; foo: unrecognized request argument"


def test_cli_max_concurrent_requests_reaches_the_config():
    from triton_vlm.openai.cli import config_from_args, parser

    assert config_from_args(parser().parse_args([])).max_concurrent_requests == 1024
    assert config_from_args(parser().parse_args(["--max-concurrent-requests", "7"])).max_concurrent_requests == 7
    assert config_from_args(parser().parse_args(["--max-concurrent-requests", "0"])).max_concurrent_requests == 0
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--max-concurrent-requests", bad])
