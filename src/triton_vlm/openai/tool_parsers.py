"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`, vLLM's names): the model's own tool-call
format, as its chat template teaches it, -> (content, calls).

- `hermes` (Hermes, Qwen2.5 / Qwen2-VL / Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call; the text before the first block is the content.
- `llama3_json` (Llama 3.1 / 3.2): the answer is a JSON object `{"name": ..., "parameters": {...}}` (or
  `arguments`), optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`.

Text that does not parse as the format's calls is returned as content (no call), as vLLM does. Each parser
also says where a tool-call section starts in partial text, and how much of the text's end could still become
its marker, so streaming sends content before the section and holds the section back until it is complete.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

PARSERS = ("hermes", "llama3_json", "mistral")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call(obj, args_keys=("arguments",)) -> Optional[ParsedCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as JSON text
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
    return ParsedCall(obj["name"], "{}")


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    name = ""
    marker = ""

    def section(self, text: str) -> tuple[Optional[int], int]:
        """(where the tool-call section starts in `text`, or None; characters at the end held back)."""
        at = text.find(self.marker)
        if at >= 0:
            return at, 0
        return None, _partial_marker(text, self.marker)

    def parse(self, text: str) -> tuple[Optional[str], list[ParsedCall]]:
        """(content, calls) of a complete answer; no calls: the whole text is the content."""
        at, _ = self.section(text)
        if at is None:
            return text, []
        calls = self.calls(text[at:])
        if not calls:
            return text, []
        content = text[:at]
        return (content if content.strip() else None), calls

    def calls(self, section: str) -> list[ParsedCall]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name, marker = "hermes", "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def calls(self, section: str) -> list[ParsedCall]:
        out = []
        for m in self._BLOCK.finditer(section):
            body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            try:
                call = _call(json.loads(body))
            except ValueError:
                return []
            if call is None:
                return []
            out.append(call)
        return out


class Llama3JSONParser(ToolParser):
    name, marker = "llama3_json", "<|python_tag|>"

    def section(self, text: str) -> tuple[Optional[int], int]:
        """Only an answer that starts (after white space) with `{` or the python tag is a call."""
        stripped = text.lstrip()
        at = len(text) - len(stripped)
        if not stripped:
            return None, len(text)
        if stripped.startswith("{") or stripped.startswith(self.marker):
            return at, 0
        if self.marker.startswith(stripped):
            return None, len(text)
        return None, 0

    def calls(self, section: str) -> list[ParsedCall]:
        text = section.strip()
        if text.startswith(self.marker):
            text = text[len(self.marker):].lstrip()
        out, i = [], 0
        while i < len(text):
            try:
                obj, end = _DECODER.raw_decode(text, i)
            except ValueError:
                return []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return []
            out.append(call)
            rest = text[end:].lstrip()
            if rest and not rest.startswith(";"):
                return []
            i = len(text) - len(rest[1:].lstrip()) if rest else len(text)
        return out


class MistralParser(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def calls(self, section: str) -> list[ParsedCall]:
        body = section[len(self.marker):].strip()
        if body.startswith("["):
            try:
                items = json.loads(body)
            except ValueError:
                return []
            calls = [_call(x) for x in items] if isinstance(items, list) else []
            return calls if calls and all(calls) else []
        out = []  # name[ARGS]{...}, possibly repeated after further [TOOL_CALLS] markers
        for part in body.split(self.marker):
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                return []
            call = _call({"name": name.strip(), "arguments": args.strip()})
            if call is None:
                return []
            out.append(call)
        return out


def get_parser(name: Optional[str]) -> Optional[ToolParser]:
    if name is None:
        return None
    for cls in (HermesParser, Llama3JSONParser, MistralParser):
        if cls.name == name:
            return cls()
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
