"""Tools (function calling) in chat completions: `tools` + `tool_choice` -> a constraint and how the answer is
read back as `tool_calls`.

- `none`: no constraint, no calls; the tools are still given to the chat template (as vLLM does by default).
- a named function (`{"type": "function", "function": {"name": N}}`): the answer is constrained to N's
  `parameters` schema (an object without properties when it has none) and returned as one call of N, its
  text the call's `arguments`; `content` null, `finish_reason` "tool_calls" (unless cut by `max_tokens`).
- `required`: the answer is constrained to `{"name": <one of the tools>, "arguments": <its parameters>}`
  (vLLM's approach, one call) and returned as that call.
- `auto` (the default when tools are given): no constraint; the answer is read with the parser chosen by
  `--tool-call-parser` (`tool_parsers.py`: the model's own format, as its template teaches it). Without the
  flag `auto` is refused with a 400 (vLLM requires `--enable-auto-tool-choice` too): a client that sends tools
  expects calls, and answering them with unparsed text would hide that nothing reads them.

Streamed, a named call sends its header (id, type, name) with the first piece and then the arguments as they
are generated, and so does a required call once its name is written; auto's calls are sent whole when the
answer ends (content before an auto call's marker is streamed as it comes). The openai client's stream
helpers accumulate them into the same `tool_calls` as the unstreamed answer (a call cut by `max_tokens` is
sent as far as it got, where the unstreamed answer returns the text as content).
"""
from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .errors import bad_request
from .schemas import ChatCompletionRequest, NamedToolChoice, Tool, ToolCall
from .structured import Guide, check_schema, string_lengths_as_patterns
from .tool_parsers import ParsedCall, ToolParser, get_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str = ""  # "" (no tools), "none", "auto", "named", "required"
    tools: Optional[list[dict]] = None  # for the chat template (OpenAI's shape, as HF templates take them)
    guide: Optional[Guide] = None
    name: Optional[str] = None  # the named function
    parser: Optional[ToolParser] = None  # auto


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else dict(EMPTY_PARAMETERS)


def required_schema(tools: list[Tool]) -> dict:
    """`{"name": N, "arguments": <N's parameters>}` for any of the tools (anyOf when there are several)."""
    options = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                 "arguments": _parameters(t)},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def plan_tools(body: ChatCompletionRequest, parser_name: Optional[str]) -> ToolPlan:
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice {_choice_text(choice)} needs tools", param="tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise bad_request(f"tools: function names must be unique, {', '.join(dup)} repeated", param="tools")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan("none", rendered)
    if choice == "auto":
        parser = get_parser(parser_name)
        if parser is None:
            raise bad_request('tools with tool_choice "auto" (the default when tools are given) need the front '
                              'end started with --tool-call-parser (hermes, llama3_json or mistral: the model\'s '
                              'tool-call format); tool_choice "required" or a named function works without it',
                              param="tool_choice", code="unsupported_parameter")
        return ToolPlan("auto", rendered, parser=parser)
    if choice == "required":
        for k, t in enumerate(tools):
            check_schema(_parameters(t), f"tools[{k}].function.parameters")
        schema = json.dumps(string_lengths_as_patterns(required_schema(tools)), ensure_ascii=False)
        return ToolPlan("required", rendered, Guide("json_schema", schema, "tool_choice"))
    assert isinstance(choice, NamedToolChoice)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")
    check_schema(_parameters(tool), f"tools[{names.index(tool.function.name)}].function.parameters")
    schema = json.dumps(string_lengths_as_patterns(_parameters(tool)), ensure_ascii=False)
    return ToolPlan("named", rendered, Guide("json_schema", schema, "tool_choice"), name=tool.function.name)


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def history_calls(calls: list[ToolCall]) -> list[dict]:
    """An assistant message's earlier calls as HF chat templates take them: `arguments` an object when it is
    JSON text of one (templates apply `tojson` to it), else the text as it is."""
    out = []
    for c in calls:
        args = c.function.arguments
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return out


def call_id(mistral: bool = False) -> str:
    """A new call id: OpenAI's `call_...`; Mistral's templates want 9 alphanumeric characters."""
    if mistral:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(call: ParsedCall, cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ToolOutput:
    """How a chat answer becomes `content` and `tool_calls` under a ToolPlan."""

    plan: ToolPlan
    _streams: dict = field(default_factory=dict)

    @property
    def mistral(self) -> bool:
        return self.plan.parser is not None and self.plan.parser.name == "mistral"

    def calls(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
        mode = self.plan.mode
        if mode == "named":
            return None, [ParsedCall(self.plan.name, text)]
        if mode == "required":
            call = parse_required(text)
            return (None, [call]) if call else (text, [])
        if mode == "auto":
            return self.plan.parser.parse(text)
        return text, []

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """(the message's content and tool_calls, the finish reason)."""
        content, calls = self.calls(text)
        tool_calls = [call_dict(c, call_id(self.mistral)) for c in calls]
        if calls and finish == "stop":
            finish = "tool_calls"
        return {"content": content, "tool_calls": tool_calls}, finish

    def stream(self, index: int) -> "ToolStream":
        if index not in self._streams:
            self._streams[index] = ToolStream(self)
        return self._streams[index]


# a required call's answer up to its arguments (the constraint writes `name` first: the schema's order)
_REQUIRED_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def required_head(text: str) -> Optional[tuple[str, int]]:
    """(the call's name, where its arguments start) once the answer has written them."""
    m = _REQUIRED_HEAD.match(text)
    if m is None:
        return None
    return json.loads(m.group(1)), m.end()


def parse_required(text: str) -> Optional[ParsedCall]:
    """A required call's answer `{"name": N, "arguments": {...}}` -> the call, its arguments the text the model
    wrote (so the streamed pieces join to it), or None when the answer is not such an object (cut short)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"),
                                                                                          dict):
        return None
    head, end = required_head(text), len(text.rstrip()) - 1  # the outer object's closing brace
    if head is not None and head[0] == obj["name"]:
        raw = text[head[1]:end]
        try:
            if json.loads(raw) == obj["arguments"]:
                return ParsedCall(obj["name"], raw)
        except ValueError:
            pass
    return ParsedCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


class ToolStream:
    """One choice's streamed deltas under a ToolPlan: `feed` each text piece, `finish` at its end. Each returns
    the delta's fields (`content`, `tool_calls`) to send, or {} for nothing."""

    def __init__(self, out: ToolOutput):
        self.out, self.mode = out, out.plan.mode
        self.text, self.sent = "", 0  # the answer so far; characters sent as content (auto)
        self.section: Optional[int] = None  # auto: where the tool-call section starts
        self.header_sent = False
        self.calls_sent = 0
        self.name: Optional[str] = None  # required: the call's name once written

    def feed(self, piece: str) -> dict:
        self.text += piece
        if self.mode == "named":
            if not piece:
                return {}
            return {"tool_calls": [self._named(piece)]}
        if self.mode == "required":
            return self._required()
        if self.mode != "auto":
            return {"content": piece} if piece else {}
        if self.section is not None:
            return {}
        at, hold = self.out.plan.parser.section(self.text)
        upto = at if at is not None else len(self.text) - hold
        self.section = at
        return self._content(upto)

    def _named(self, piece: str, name: Optional[str] = None) -> dict:
        if self.header_sent:
            return {"index": 0, "function": {"arguments": piece}}
        self.header_sent, self.calls_sent = True, 1
        return {"index": 0, "id": call_id(), "type": "function",
                "function": {"name": name or self.out.plan.name, "arguments": piece}}

    def _required(self) -> dict:
        """Once the name is written: the call's header, then its arguments as they come, the answer's last
        non-blank character held back (it may be the outer object's closing brace)."""
        if not self.header_sent:
            head = required_head(self.text)
            if head is None:
                return {}
            self.name, self.sent = head
            first = True
        else:
            first = False
        upto = max(self.sent, len(self.text.rstrip()) - 1)
        piece, self.sent = self.text[self.sent:upto], upto
        if not piece and not first:
            return {}
        return {"tool_calls": [self._named(piece, self.name)]}

    def _content(self, upto: int) -> dict:
        if upto <= self.sent:
            return {}
        out, self.sent = self.text[self.sent:upto], upto
        return {"content": out}

    def finish(self, reason: str) -> tuple[dict, str]:
        """The rest of the answer's delta, and the finish reason ("tool_calls" when calls were made)."""
        delta: dict = {}
        if self.mode == "named" and not self.header_sent:
            delta = {"tool_calls": [self._named("")]}
        elif self.mode == "required" and self.header_sent:
            call = parse_required(self.text)
            sent = self.text[required_head(self.text)[1]:self.sent]  # the arguments sent so far
            if call is None:
                rest = self.text[self.sent:]  # cut short: what is left
            else:
                rest = call.arguments[len(sent):] if call.arguments.startswith(sent) else ""
            if rest:
                delta = {"tool_calls": [self._named(rest)]}
            if call is None:
                self.calls_sent = 0  # not a complete call: finish_reason stays (length)
        elif self.mode in ("required", "auto"):
            rest = self.text[self.sent:]
            if self.mode == "auto" and self.section is None:
                delta = self._content(len(self.text))
            else:
                content, calls = self.out.calls(rest)
                if calls:
                    delta = {"tool_calls": [dict(call_dict(c, call_id(self.out.mistral)), index=k)
                                            for k, c in enumerate(calls)]}
                    self.calls_sent = len(calls)
                    if content:  # auto: content before the section (already sent) or none
                        delta["content"] = content
                else:
                    delta = self._content(len(self.text))
        if self.calls_sent and reason == "stop":
            reason = "tool_calls"
        return delta, reason
