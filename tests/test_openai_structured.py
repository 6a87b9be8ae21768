"""Structured outputs and tools in the OpenAI front end, without a server: request -> guided-decoding inputs,
tool_choice -> constraint, tool-call parsers, the answer -> `tool_calls` (unstreamed, and streamed deltas
accumulated by the official openai client's own stream state), chat history with tool calls through the
template."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from openai.lib.streaming.chat._completions import ChatCompletionStreamState

from triton_vlm import names as N
from triton_vlm.openai.chat_template import ChatTemplate, Turn
from triton_vlm.openai.errors import APIError
from triton_vlm.openai.responses import ChatFormat
from triton_vlm.openai.schemas import ChatCompletionRequest, CompletionRequest
from triton_vlm.openai.structured import request_guide
from triton_vlm.openai.tool_parsers import get_parser
from triton_vlm.openai.tools import ToolOutput, plan_tools, required_schema

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "description": "the time"}}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=kw.pop("messages", USER), **kw)


def guide_of(**kw):
    g = request_guide(chat(**kw))
    return None if g is None else (g.type, g.guide)


def refused(fn, needle: str) -> APIError:
    with pytest.raises(APIError) as e:
        fn()
    assert e.value.status == 400 and needle in e.value.message, e.value.message
    return e.value


# --- request -> guide ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,expected", [
    (dict(response_format={"type": "json_object"}), ("json", "")),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}),
     ("json_schema", json.dumps(SCHEMA))),
    (dict(response_format={"type": "text"}), None),
    (dict(structured_outputs={"json": SCHEMA}), ("json_schema", json.dumps(SCHEMA))),
    (dict(structured_outputs={"json": json.dumps(SCHEMA)}), ("json_schema", json.dumps(SCHEMA))),
    (dict(structured_outputs={"regex": "[a-z]+"}), ("regex", "[a-z]+")),
    (dict(structured_outputs={"choice": ["red", "é"]}), ("choice", '["red", "é"]')),
    (dict(structured_outputs={"grammar": 'root ::= "a"'}), ("ebnf_grammar", 'root ::= "a"')),
    (dict(structured_outputs={"json_object": True}), ("json", "")),
    (dict(guided_json=SCHEMA), ("json_schema", json.dumps(SCHEMA))),
    (dict(guided_regex=r"\d+"), ("regex", r"\d+")),
    (dict(guided_choice=["yes", "no"]), ("choice", '["yes", "no"]')),
    (dict(guided_grammar='root ::= "b"'), ("ebnf_grammar", 'root ::= "b"')),
    (dict(), None),
])
def test_each_constraint_maps_to_its_guide(kw, expected):
    assert guide_of(**kw) == expected
    if expected is not None:  # completions take the same fields
        g = request_guide(CompletionRequest(model="m", prompt="p", **kw))
        assert (g.type, g.guide) == expected and g.type in N.GUIDE_TYPES


def test_structural_tags_reach_the_library_in_its_form():
    import xgrammar as xgr

    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                 "content": {"type": "json_schema", "json_schema": SCHEMA}}}
    assert json.loads(guide_of(response_format=tag)[1]) == tag
    assert json.loads(guide_of(structured_outputs={"structural_tag": json.dumps(tag)})[1]) == tag
    legacy = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
              "triggers": ["<f>"]}  # vLLM's older form, which xgrammar 0.2.8 no longer compiles
    sent = guide_of(response_format=legacy)[1]
    grammar = xgr.Grammar.from_structural_tag(sent)
    assert xgr.testing._is_grammar_accept_string(grammar, 'text <f>{"color": "red"}</f> more')
    assert not xgr.testing._is_grammar_accept_string(grammar, 'text <f>{"color": "pink"}</f>')
    bounded = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>", "content": {
        "type": "json_schema", "json_schema": {"type": "string", "maxLength": 2}}}}
    assert "pattern" in guide_of(response_format=bounded)[1] and "maxLength" not in guide_of(response_format=bounded)[1]
    bounded["format"]["content"]["json_schema"] = {"not": {}}
    refused(lambda: guide_of(response_format=bounded), "'not' at #")
    refused(lambda: guide_of(response_format={"type": "structural_tag", "structures": [{"begin": "<f>"}]}),
            "structures[0] needs begin, schema and end")
    refused(lambda: guide_of(structured_outputs={"structural_tag": "{nope"}), "structural_tag is not valid JSON")


def test_guide_becomes_the_ensemble_inputs():
    g = request_guide(chat(guided_regex="ab"))
    assert g.inputs() == {N.GUIDED_DECODING_GUIDE_TYPE: "regex", N.GUIDED_DECODING_GUIDE: "ab"}


@pytest.mark.parametrize("kw,needle", [
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "response_format, guided_regex"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs.regex, structured_outputs.choice"),
    (dict(guided_json=SCHEMA, guided_choice=["a"]), "guided_json, guided_choice"),
    (dict(guided_json="{not json"), "guided_json is not valid JSON"),
    (dict(guided_json="[1, 2]"), "must be a JSON schema"),
    (dict(guided_choice=[]), "at least one"),
    (dict(guided_regex=""), "guided_regex is empty"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "schema is required"),
    (dict(response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="required"),
     "response_format, tool_choice"),
])
def test_bad_or_several_constraints_are_400(kw, needle):
    refused(lambda: request_guide(chat(**kw), plan_tools(chat(**kw), None).guide), needle)


@pytest.mark.parametrize("schema,found", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at #/properties/a"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' at #"),
    ({"anyOf": [{"type": "object", "if": {}}]}, "'if' at #/anyOf/0"),
    ({"$defs": {"x": {"type": "array", "contains": {"const": 1}}}, "$ref": "#/$defs/x"}, "'contains' at #/$defs/x"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "'allOf' with 2 subschemas at #"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at #"),
])
def test_keywords_the_library_does_not_enforce_are_400(schema, found):
    """xgrammar compiles these without enforcing them (a document breaking them is accepted): refused, as vLLM
    does, rather than answering with documents that may break the schema."""
    e = refused(lambda: guide_of(guided_json=schema), found)
    assert e.code == "unsupported_schema_keyword" and e.param == "guided_json"
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    refused(lambda: plan_tools(chat(tools=[tool], tool_choice="required"), None), "tools[0].function.parameters")
    assert plan_tools(chat(tools=[tool], tool_choice="none"), None).mode == "none"  # unconstrained: fine
    ok = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": ["then"]}},
          "oneOf": [{"required": ["not"]}, {"required": ["if"]}], "allOf": [{"required": ["not"]}]}
    assert guide_of(guided_json=ok)[0] == "json_schema"  # property names and one-branch allOf are fine


@pytest.mark.parametrize("kw", [
    dict(response_format={"type": "yaml"}),
    dict(structured_outputs={"whitespace_pattern": " "}),
    dict(response_format={"type": "json_schema", "json_schema": {"schema": {}, "frobnicate": 1}}),
    dict(tools=[{"type": "function", "function": {"parameters": {}}}]),
    dict(tools=[WEATHER], tool_choice="sometimes"),
])
def test_malformed_fields_fail_validation(kw):
    with pytest.raises(Exception) as e:
        chat(**kw)
    assert type(e.value).__name__ == "ValidationError"


# --- tool_choice -> constraint -------------------------------------------------------------------------
def test_named_choice_constrains_to_the_functions_parameters():
    t = plan_tools(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "weather"}}),
                   None)
    assert (t.mode, t.name, t.guide.type) == ("named", "weather", "json_schema")
    assert json.loads(t.guide.guide) == WEATHER["function"]["parameters"]
    t = plan_tools(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "time"}}), None)
    assert json.loads(t.guide.guide) == {"type": "object", "properties": {}}
    assert [x["function"]["name"] for x in t.tools] == ["weather", "time"]  # every tool reaches the template


def test_required_schema_accepts_exactly_a_call_of_one_tool():
    tools = chat(tools=[WEATHER, TIME]).tools
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]
    bad = [{"name": "weather", "arguments": {"days": 2}}, {"name": "other", "arguments": {}},
           {"name": "time"}, {"name": "time", "arguments": {}, "extra": 1}]
    for doc in ok:
        jsonschema.validate(doc, schema)
    for doc in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)
    t = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required"), None)
    assert t.mode == "required" and json.loads(t.guide.guide) == schema


def test_tool_choice_modes_and_refusals():
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), None).guide is None
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), None).mode == "none"
    assert plan_tools(chat(tools=[WEATHER]), "hermes").mode == "auto"  # auto is the default with tools
    assert plan_tools(chat(), None).mode == ""
    refused(lambda: plan_tools(chat(tools=[WEATHER]), None), "--tool-call-parser")
    refused(lambda: plan_tools(chat(tools=[WEATHER], tool_choice="auto"), None), "tools")
    refused(lambda: plan_tools(chat(tool_choice="required"), None), "needs tools")
    refused(lambda: plan_tools(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                               None), "'x', which is not among the tools (weather)")
    refused(lambda: plan_tools(chat(tools=[WEATHER, WEATHER], tool_choice="required"), None), "weather repeated")


# --- parsers -----------------------------------------------------------------------------------------
CALL = '{"name": "weather", "arguments": {"city": "Oslo"}}'


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", "Let me check.\n",
     [("weather", {"city": "Oslo"})]),
    ("hermes", f"<tool_call>{CALL}</tool_call><tool_call>" '{"name": "time", "arguments": {}}</tool_call>', None,
     [("weather", {"city": "Oslo"}), ("time", {})]),
    ("hermes", f"<tool_call>{CALL}", None, [("weather", {"city": "Oslo"})]),  # unclosed at the end
    ("hermes", "no call here", "no call here", []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", ' {"name": "weather", "parameters": {"city": "Oslo"}}', None, [("weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", 'The answer is {"name": "a"}', 'The answer is {"name": "a"}', []),
    ("llama3_json", '{"color": "red"}', '{"color": "red"}', []),
    ("mistral", f"[TOOL_CALLS][{CALL}]", None, [("weather", {"city": "Oslo"})]),
    ("mistral", 'ok [TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', "ok ", [("weather", {"city": "Oslo"})]),
    ("mistral", "[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
])
def test_parsers_read_their_models_format(parser, text, content, calls):
    got_content, got = get_parser(parser).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("pythonic")


# --- answers -> tool_calls, unstreamed and streamed --------------------------------------------------------
def _accumulate(fmt: ChatFormat, text: str, finish: str, rng: random.Random, n: int = 1) -> dict:
    """Feed `text` cut at random places through fmt.chunk as the service does, and let the official client's
    stream state accumulate the chunks."""
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    chunks = [fmt.chunk(i, role=True) for i in range(n)]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for p in pieces:
        chunks += [fmt.chunk(i, text=p) for i in range(n)]
    chunks += [fmt.chunk(i, finish_reason=finish) for i in range(n)]
    for c in chunks:
        if c is not None:
            state.handle_chunk(ChatCompletionChunk.model_validate(c))
    return state.get_final_completion().model_dump()


def _full(fmt: ChatFormat, text: str, finish: str) -> dict:
    from triton_vlm.openai.choices import Choice, StopMatcher

    c = Choice(0, StopMatcher([]))
    c.feed(text.encode(), [], [])
    c.finish()
    return fmt.full([c], [finish], None, {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})


def _calls(message: dict) -> list:
    """(name, arguments, type, id well formed) of each call; the ids are distinct."""
    calls = message.get("tool_calls") or []
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["type"],
             c["id"].startswith("call_") or (len(c["id"]) == 9 and c["id"].isalnum())) for c in calls]


@pytest.mark.parametrize("kw,parser,text,content,calls", [
    (dict(tool_choice={"type": "function", "function": {"name": "weather"}}), None, '{"city": "Oslo", "days": 3}',
     None, [("weather", {"city": "Oslo", "days": 3})]),
    (dict(tool_choice="required"), None, CALL, None, [("weather", {"city": "Oslo"})]),
    (dict(tool_choice="auto"), "hermes", f"Checking.<tool_call>{CALL}</tool_call>", "Checking.",
     [("weather", {"city": "Oslo"})]),
    (dict(tool_choice="auto"), "hermes", "just text <tool", "just text <tool", []),
    (dict(tool_choice="auto"), "llama3_json", '{"name": "time", "parameters": {}}', None, [("time", {})]),
    (dict(tool_choice="auto"), "mistral", f"[TOOL_CALLS][{CALL}, {CALL}]", None,
     [("weather", {"city": "Oslo"})] * 2),
    (dict(tool_choice="none"), None, "plain", "plain", []),
])
def test_answers_become_tool_calls_streamed_or_not(kw, parser, text, content, calls):
    plan = plan_tools(chat(tools=[WEATHER, TIME], **kw), parser)
    full = _full(ChatFormat("m", "id", ToolOutput(plan)), text, "stop")
    message, finish = full["choices"][0]["message"], full["choices"][0]["finish_reason"]
    expected = [(n, a, "function", True) for n, a in calls]
    assert message["content"] == content and _calls(message) == expected
    assert finish == ("tool_calls" if calls else "stop")
    rng = random.Random(0)
    for _ in range(30):  # the openai client's accumulated stream equals the unstreamed message
        got = _accumulate(ChatFormat("m", "id", ToolOutput(plan)), text, "stop", rng, n=2)
        for choice in got["choices"]:
            streamed = choice["message"]
            assert (streamed["content"] or None) == content and _calls(streamed) == expected
            assert choice["finish_reason"] == finish


def test_streamed_named_call_sends_arguments_as_they_come():
    plan = plan_tools(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}),
                      None)
    fmt = ChatFormat("m", "id", ToolOutput(plan))
    role = fmt.chunk(0, role=True)["choices"][0]["delta"]
    assert role == {"role": "assistant"}  # content stays null
    first = fmt.chunk(0, text='{"ci')["choices"][0]["delta"]["tool_calls"]
    second = fmt.chunk(0, text='ty": "A"}')["choices"][0]["delta"]["tool_calls"]
    assert first[0]["id"].startswith("call_") and first[0]["function"] == {"name": "weather", "arguments": '{"ci'}
    assert second == [{"index": 0, "function": {"arguments": 'ty": "A"}'}}]
    end = fmt.chunk(0, finish_reason="stop")["choices"][0]
    assert end["finish_reason"] == "tool_calls" and end["delta"] == {}


def test_streamed_required_call_sends_arguments_once_its_name_is_written():
    plan = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required"), None)
    fmt = ChatFormat("m", "id", ToolOutput(plan))
    assert fmt.chunk(0, role=True)["choices"][0]["delta"] == {"role": "assistant"}
    assert fmt.chunk(0, text='{"name": "wea') is None
    first = fmt.chunk(0, text='ther", "arguments": {"ci')["choices"][0]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "weather", "arguments": '{"c'}
    second = fmt.chunk(0, text='ty": "Oslo"}}')["choices"][0]["delta"]["tool_calls"]
    assert second == [{"index": 0, "function": {"arguments": 'ity": "Oslo"}'}}]  # the outer brace held back
    end = fmt.chunk(0, finish_reason="stop")["choices"][0]
    assert end == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    cut = ChatFormat("m", "id", ToolOutput(plan))
    cut.chunk(0, text='{"name": "time", "arguments": {')
    end = cut.chunk(0, finish_reason="length")["choices"][0]
    assert end["finish_reason"] == "length" and end["delta"] == {"tool_calls": [{"index": 0, "function": {
        "arguments": "{"}}]}  # a cut call is sent as far as it got


def test_auto_streams_content_and_holds_back_a_possible_marker():
    plan = plan_tools(chat(tools=[WEATHER]), "hermes")
    fmt = ChatFormat("m", "id", ToolOutput(plan))
    assert fmt.chunk(0, text="Sure <tool")["choices"][0]["delta"] == {"content": "Sure "}
    assert fmt.chunk(0, text="_call>{") is None  # inside the section: nothing yet
    assert fmt.chunk(0, text=CALL[1:] + "</tool_call>") is None
    end = fmt.chunk(0, finish_reason="stop")["choices"][0]
    assert end["finish_reason"] == "tool_calls" and end["delta"]["tool_calls"][0]["function"]["name"] == "weather"


def test_a_cut_call_keeps_finish_reason_length():
    plan = plan_tools(chat(tools=[WEATHER], tool_choice="required"), None)
    full = _full(ChatFormat("m", "id", ToolOutput(plan)), '{"name": "weather", "argu', "length")
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["choices"][0]["message"]["content"] == '{"name": "weather", "argu'
    assert full["choices"][0]["message"]["tool_calls"] == []


# --- history: tool calls and tool results through the chat template ---------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
TEMPLATE = ("{% for m in messages %}{{ m.role }}:"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
            "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
            "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
            "{% if m.content is string %}{{ m.content }}{% endif %}|{% endfor %}"
            "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}|{% endif %}A:")


def test_history_with_tool_calls_reaches_the_template(demo_model):
    from transformers import AutoTokenizer

    from triton_vlm.openai.routers.chat import _turn

    body = chat(messages=HISTORY, tools=[WEATHER])
    ids: set = set()
    turns = [_turn(i, m, ids)[0] for i, m in enumerate(body.messages)]
    tpl = ChatTemplate(TEMPLATE, AutoTokenizer.from_pretrained(str(demo_model)), "test")
    prompt = tpl.render(turns, 0, tools=plan_tools(body, "hermes").tools)
    assert prompt == ('user:Weather in Oslo?|assistant:CALL weather {"city": "Oslo"}|tool:[call_1]sunny|'
                      "TOOLS weather|A:")  # arguments reach the template as an object (HF's convention)
    demo = ChatTemplate((demo_model / "chat_template.jinja").read_text(),
                        AutoTokenizer.from_pretrained(str(demo_model)), "demo")
    assert demo.render(turns, 0, tools=[WEATHER]).endswith("TOOL: sunny ASSISTANT:")  # a template without tools


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "tool", "content": "hi"}], "role 'tool' must answer a tool call"),
    ([HISTORY[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "'call_9'"),
    ([{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}], "only assistant messages"),
    ([{"role": "user", "content": "x", "tool_call_id": "a"}], "only tool messages"),
])
def test_bad_tool_history_is_400(messages, needle):
    from triton_vlm.openai.routers.chat import _turn

    body = chat(messages=messages)
    ids: set = set()
    refused(lambda: [_turn(i, m, ids) for i, m in enumerate(body.messages)], needle)


BREAKING = {  # per refused keyword: a schema using it and a document that breaks it
    "not": ({"not": {"type": "string"}}, '"x"'),
    "if": ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
            "then": {"required": ["b"]}}, '{"a": 1}'),
    "else": ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
              "else": {"required": ["b"]}}, '{}'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "properties": {"a": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependencies": ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": ["b"]}},
                     '{"a": 1}'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}, "maxContains": 1},
                    "[5, 5]"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1"),
}


@pytest.mark.parametrize("keyword", sorted(BREAKING))
def test_the_refused_keywords_are_the_ones_xgrammar_ignores(keyword):
    """Each refused keyword: xgrammar (the engine's library) accepts a document that breaks it. When a new
    xgrammar enforces one, this fails: drop it from UNENFORCED."""
    import jsonschema
    import xgrammar as xgr

    from triton_vlm.engine.search.guided_schema import UNENFORCED, unenforced_keyword

    schema, doc = BREAKING[keyword]
    assert keyword in UNENFORCED or keyword == "allOf"
    assert unenforced_keyword(schema) is not None
    validator = jsonschema.Draft7Validator if keyword == "dependencies" else jsonschema.Draft202012Validator
    with pytest.raises(jsonschema.ValidationError):  # draft 7's name of dependentRequired / dependentSchemas
        validator(schema).validate(json.loads(doc))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert xgr.testing._is_grammar_accept_string(grammar, doc)


def test_string_lengths_are_sent_as_patterns_without_control_characters():
    """xgrammar 0.2.8 lets raw control characters into a string with minLength / maxLength (invalid JSON); the
    guide sent carries the equivalent pattern instead, which it enforces."""
    import xgrammar as xgr

    from triton_vlm.engine.search.guided_schema import string_lengths_as_patterns

    def accepts(schema, doc):
        return xgr.testing._is_grammar_accept_string(
            xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), doc)

    schema = {"type": "object", "required": ["t"], "properties": {"t": {"type": "string", "minLength": 1,
                                                                        "maxLength": 3}}}
    assert accepts(schema, '{"t": "a\x1f"}')  # the library's bug: not JSON
    sent = json.loads(guide_of(guided_json=schema)[1])
    assert sent == string_lengths_as_patterns(schema) and "maxLength" not in json.dumps(sent)
    for doc, ok in (('{"t": "a\x1f"}', False), ('{"t": ""}', False), ('{"t": "abcd"}', False),
                    ('{"t": "é✓a"}', True),
                    ('{"t": "a\\"b"}', False)):
        assert accepts(sent, doc) == ok, doc
        if ok:
            jsonschema.validate(json.loads(doc), schema)
    nested = {"anyOf": [{"type": ["string", "null"], "maxLength": 2}], "$defs": {"s": {"type": "string",
                                                                                      "minLength": 4}}}
    out = string_lengths_as_patterns(nested)
    assert out["anyOf"][0]["pattern"].endswith("{0,2}$") and out["$defs"]["s"]["pattern"].endswith("{4,}$")
    assert nested["anyOf"][0] == {"type": ["string", "null"], "maxLength": 2}  # the request's schema untouched
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        assert "maxLength" not in plan_tools(chat(tools=[tool], tool_choice=choice), None).guide.guide
    refused(lambda: guide_of(guided_json={"type": "string", "pattern": "^a+$", "maxLength": 3}),
            "'maxLength' beside 'pattern' at #")


def test_the_launcher_and_the_front_end_take_the_same_parsers(capsys):
    from triton_vlm.openai.cli import config_from_args, parser
    from triton_vlm.openai.tool_parsers import PARSERS
    from triton_vlm.server.cli import main

    args = parser().parse_args(["--tool-call-parser", "mistral"])
    assert config_from_args(args).tool_call_parser == "mistral"
    assert config_from_args(parser().parse_args([])).tool_call_parser is None
    with pytest.raises(SystemExit):
        main(["--tool-call-parser", "nope"])
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and all(p in err for p in PARSERS)
