"""Structured outputs and tool calls through the live server with the official openai client. The demo model
knows no JSON (it answers " hello", " red", " a red circle"): every valid document below comes from the
constraint. Answers are parsed and validated against their schemas: greedy, sampled (seeded), streamed, with
images, beam search; choice, regex, grammar, json_object; named and required tool calls; errors."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_openai import base_config, image_message, png, start, status_of  # noqa: F401 - fixtures

pytestmark = pytest.mark.server
MODEL = "demo-v3"
HELLO = [{"role": "user", "content": "Say hello."}]
SHAPE = {"type": "object", "additionalProperties": False, "required": ["shape", "color", "count", "solid", "tag"],
         "properties": {"shape": {"enum": ["circle", "square", "triangle"]},
                        "color": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
                        "count": {"type": "integer", "minimum": 0, "maximum": 9},
                        "solid": {"type": "boolean"},
                        "tag": {"type": "string", "maxLength": 6}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}}}}
ALARM = {"type": "function", "function": {"name": "alarm", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["on"], "properties": {"on": {"type": "boolean"}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALARM)}


@pytest.fixture(scope="module")
def client(start) -> openai.OpenAI:
    return start().client()


def chat(client, messages=HELLO, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def valid(text: str, schema: dict) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, schema)
    return doc


# --- json_schema -------------------------------------------------------------------------------------------
def test_json_schema_greedy_sampled_and_with_images(client):
    plain = chat(client)
    assert plain.choices[0].message.content == " hello"  # unconstrained: the model's own answer
    r = chat(client, response_format=FORMAT)
    assert r.choices[0].finish_reason == "stop"
    greedy = valid(r.choices[0].message.content, SHAPE)
    assert valid(chat(client, response_format=FORMAT).choices[0].message.content, SHAPE) == greedy  # deterministic
    sampled = chat(client, response_format=FORMAT, temperature=1.0, seed=7, n=4)
    docs = [valid(c.message.content, SHAPE) for c in sampled.choices]
    again = chat(client, response_format=FORMAT, temperature=1.0, seed=7, n=4)
    assert [valid(c.message.content, SHAPE) for c in again.choices] == docs  # seeded: reproducible
    for shape, color in (("circle", "red"), ("square", "blue"), ("triangle", "yellow")):
        msgs = image_message(png(shape, color, 3), "Describe the image.")
        img = chat(client, msgs, response_format=FORMAT, temperature=0.8, seed=1, n=2)
        for c in img.choices:
            valid(c.message.content, SHAPE)
        assert img.usage.prompt_tokens > 16  # the image's tokens were in the prompt


def test_json_schema_streamed_equals_unstreamed(client):
    msgs = image_message(png("circle", "green", 5), "What shape is this?")
    for kw in (dict(), dict(temperature=1.0, seed=11)):
        full = chat(client, msgs, response_format=FORMAT, **kw).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in
                  chat(client, msgs, response_format=FORMAT, stream=True, **kw) if c.choices]
        assert len(pieces) > 2 and "".join(pieces) == full
        valid(full, SHAPE)


class Shape(BaseModel):
    shape: Literal["circle", "square", "triangle"]
    color: Literal["red", "green", "blue", "yellow"]
    sides: int = Field(ge=0, le=4)


def test_the_clients_parse_helper_gets_a_valid_model(client):
    """`client.chat.completions.parse(response_format=PydanticModel)` sends the model's strict schema."""
    r = client.chat.completions.parse(model=MODEL, messages=image_message(png("square", "red"), "Describe the image."),
                                      response_format=Shape, max_tokens=80)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Shape) and 0 <= parsed.sides <= 4


def test_beam_search_with_a_schema_returns_only_valid_beams(client):
    r = chat(client, response_format=FORMAT, n=3, extra_body={"use_beam_search": True, "best_of": 4})
    texts = [c.message.content for c in r.choices]
    assert len(texts) == 3 and len(set(texts)) == 3
    for t in texts:
        valid(t, SHAPE)


def test_completions_take_the_same_constraints(client):
    prompt = "USER: Say hello. ASSISTANT:"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=80, extra_body={"guided_json": SHAPE})
    valid(r.choices[0].text, SHAPE)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, n=3, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(c.text in ("yes", "no", "maybe") for c in r.choices)


# --- choice, regex, grammar, json_object ------------------------------------------------------------------
def test_choice_regex_grammar_and_json_object(client):
    colors = [" red", " green", " blue"]  # the model's answers start with a space
    for body in ({"structured_outputs": {"choice": colors}}, {"guided_choice": colors}):
        r = chat(client, image_message(png("circle", "blue", 2), "What color is the shape?"), extra_body=body)
        assert r.choices[0].message.content == " blue"  # the model's own answer, within the choice
        sampled = chat(client, temperature=1.5, seed=5, n=6, extra_body=body)
        assert {c.message.content for c in sampled.choices} <= set(colors)
    pattern = r"[a-z]{2,5}-[0-9]{2}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        r = chat(client, temperature=1.0, seed=2, n=4, extra_body=body)
        assert all(re.fullmatch(pattern, c.message.content) for c in r.choices), [c.message.content for c in r.choices]
    # (a structural tag's JSON content takes any white space: the library has no compact option there)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<f>", "end": "</f>", "content": {"type": "regex", "pattern": "[a-z]{1,6}"}}]}}
    for c in chat(client, response_format=tag, temperature=1.0, seed=6, n=3).choices:
        assert re.fullmatch(r"Answer: <f>[a-z]{1,6}</f>", c.message.content), c.message.content
    grammar = 'root ::= "ok " ("yes" | "no") "!"'
    r = chat(client, temperature=1.0, seed=4, n=4, extra_body={"structured_outputs": {"grammar": grammar}})
    assert all(c.message.content in ("ok yes!", "ok no!") for c in r.choices)



def test_json_object_answers_are_objects_or_cut_prefixes_of_one(client):
    """Any JSON object: nothing bounds its strings, and this model, which never saw a quote, rarely closes one.
    Answers that end are objects; answers cut by max_tokens are prefixes of one (xgrammar's JSON grammar still
    accepts them) without control characters."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    ended = 0
    for kw in (dict(), dict(temperature=2.0, frequency_penalty=2.0, seed=9, n=6)):
        r = chat(client, response_format={"type": "json_object"}, max_tokens=120, **kw)
        for c in r.choices:
            text = c.message.content
            if c.finish_reason == "stop":
                ended += 1
                assert isinstance(json.loads(text), dict), text
            else:
                assert c.finish_reason == "length" and text.startswith("{")
                assert not re.search(r"[\x00-\x1f]", text), text
                assert xgr.testing._get_matcher_from_grammar(grammar).accept_string(text), text
    assert ended >= 2  # sampled, some answers close their object


# --- tools ---------------------------------------------------------------------------------------------
def _calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_named_and_required_tool_calls_validate(client):
    named = {"type": "function", "function": {"name": "weather"}}
    for kw in (dict(), dict(temperature=1.0, seed=8, n=3)):
        r = chat(client, tools=[WEATHER, ALARM], tool_choice=named, **kw)
        for c in r.choices:
            assert c.message.content is None and c.finish_reason == "tool_calls"
            assert [name for name, _ in _calls(c.message)] == ["weather"]
        r = chat(client, tools=[WEATHER, ALARM], tool_choice="required", **kw)
        for c in r.choices:
            assert c.message.content is None and c.finish_reason == "tool_calls" and len(_calls(c.message)) == 1
    sampled = chat(client, tools=[WEATHER, ALARM], tool_choice="required", temperature=1.5, seed=1, n=8)
    assert {_calls(c.message)[0][0] for c in sampled.choices} <= {"weather", "alarm"}


def test_streamed_tool_calls_accumulate_to_the_unstreamed_ones(client):
    msgs = image_message(png("triangle", "red", 4), "Describe the image.")
    for choice in ({"type": "function", "function": {"name": "weather"}}, "required"):
        full = chat(client, msgs, tools=[WEATHER, ALARM], tool_choice=choice).choices[0]
        with client.chat.completions.stream(model=MODEL, messages=msgs, tools=[WEATHER, ALARM], tool_choice=choice,
                                            max_tokens=80) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert _calls(streamed.message) == _calls(full.message) and streamed.finish_reason == "tool_calls"
        assert streamed.message.content is None
        deltas = [c.choices[0].delta.tool_calls for c in chat(client, msgs, tools=[WEATHER, ALARM],
                                                               tool_choice=choice, stream=True)
                  if c.choices and c.choices[0].delta.tool_calls]
        assert len(deltas) > 3 and deltas[0][0].id and all(d[0].id is None for d in deltas[1:])  # incremental


def test_tool_results_in_the_history_go_through_the_template(client, start):
    history = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = chat(client, history, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls in (None, [])
    assert r.usage.prompt_tokens > chat(client, tools=[WEATHER], tool_choice="none").usage.prompt_tokens
    # the client's own message object of a call, sent back with the tool's result (as applications do)
    call = chat(client, tools=[WEATHER], tool_choice="required").choices[0].message
    follow = HELLO + [call, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "rain"}]
    assert chat(client, follow, tools=[WEATHER], tool_choice="none").choices[0].finish_reason in ("stop", "length")
    status, body = status_of(lambda: chat(client, tools=[WEATHER]))  # auto without --tool-call-parser
    assert status == 400 and "--tool-call-parser" in body["message"]
    hermes = start(tool_call_parser="hermes").client()
    r = chat(hermes, tools=[WEATHER])  # auto: the demo model writes no <tool_call>, so its text is the content
    assert r.choices[0].message.content == " hello" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in chat(hermes, tools=[WEATHER], stream=True) if c.choices]
    assert "".join(pieces) == " hello"


def test_the_ensemble_route_constrains_too(start):
    ens = start(route="ensemble").client()
    msgs = image_message(png("square", "yellow", 6), "Describe the image.")
    for c in chat(ens, msgs, response_format=FORMAT, temperature=1.0, seed=3, n=3).choices:
        valid(c.message.content, SHAPE)
    r = chat(ens, tools=[WEATHER, ALARM], tool_choice={"type": "function", "function": {"name": "alarm"}})
    assert [name for name, _ in _calls(r.choices[0].message)] == ["alarm"]


# --- errors --------------------------------------------------------------------------------------------
def test_invalid_constraints_are_400_with_the_librarys_message(client):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
         'Unsupported type "objec"'),
        (dict(extra_body={"guided_regex": "(ab"}), "parenthesis is not closed"),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= missing"}}), "missing"),
        (dict(extra_body={"guided_json": {"type": "array", "uniqueItems": True}}), "'uniqueItems' at #"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
         "response_format, guided_regex"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
    ]
    for kw, needle in cases:
        for stream in (False, True):  # a streamed request is refused before its stream starts
            status, body = status_of(lambda: chat(client, stream=stream, **kw))
            assert status == 400 and needle in body["message"], (kw, body)
    assert "weather" in chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "weather"}}).choices[0].message.tool_calls[0].function.name  # the server still answers
