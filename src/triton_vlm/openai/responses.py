"""OpenAI's response bodies, as plain dicts: chat completions and their chunks, text completions and theirs,
usage and log probs in both endpoints' formats, and Server-Sent Events framing."""
from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from .choices import Choice
from .tools import ToolOutput

DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# --- log probs ------------------------------------------------------------------------------------------
def chat_logprobs(tokens: list[tuple]) -> dict:
    """Chat's format: one entry per token (`token`, `logprob`, `bytes`, `top_logprobs`); tokens are
    (id, text, log prob, [(text, log prob), ...])."""
    return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                         "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in top]}
                        for _, text, lp, top in tokens], "refusal": None}


def completion_logprobs(tokens: list[tuple], offset: int = 0) -> dict:
    """The completions endpoint's format: parallel lists, `text_offset` counting from the choice's text,
    `top_logprobs` one {token: log prob} per token (None when none were asked)."""
    offsets, pos = [], offset
    for _, text, _, _ in tokens:
        offsets.append(pos)
        pos += len(text)
    tops = [dict(top) for _, _, _, top in tokens]
    return {"tokens": [t for _, t, _, _ in tokens], "token_logprobs": [lp for _, _, lp, _ in tokens],
            "top_logprobs": tops if any(tops) else None, "text_offset": offsets}


# --- chat ------------------------------------------------------------------------------------------------
class ChatFormat:
    """`tools`: how answers become `content` and `tool_calls` (tools.py); None: the text is the content."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, request_id: Optional[str] = None, tools: Optional[ToolOutput] = None):
        self.id = request_id or new_id("chatcmpl")
        self.model, self.created = model, int(time.time())
        self.tools = tools

    def _message(self, text: str, finish: str) -> tuple[dict, str]:
        if self.tools is None:
            return {"content": text, "tool_calls": []}, finish
        return self.tools.message(text, finish)

    def full(self, choices: list[Choice], finish: list[str], logprobs: Optional[list], usage_: dict) -> dict:
        out = []
        for i, c in enumerate(choices):
            message, reason = self._message(c.text, finish[i])
            out.append({"index": c.index, "message": {"role": "assistant", "refusal": None, **message},
                        "logprobs": chat_logprobs(logprobs[i]) if logprobs else None, "finish_reason": reason})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": usage_, "system_fingerprint": None}

    def chunk(self, index: int, *, text: Optional[str] = None, role: bool = False,
              finish_reason: Optional[str] = None, logprobs: Optional[list] = None,
              usage_: Optional[dict] = None) -> Optional[dict]:
        """One chunk, or None when it would carry nothing (text held back by a tool-call parser)."""
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
            if self.tools is None or self.tools.plan.mode not in ("named", "required"):
                delta["content"] = ""  # content stays null for a forced call
        if text is not None:
            if self.tools is None:
                delta["content"] = text
            else:
                delta.update(self.tools.stream(index).feed(text))
                if not delta and logprobs is None and usage_ is None:
                    return None
        if finish_reason is not None and self.tools is not None:
            rest, finish_reason = self.tools.stream(index).finish(finish_reason)
            delta.update(rest)
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": [{"index": index, "delta": delta,
                            "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                            "finish_reason": finish_reason}]}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_}


# --- completions -----------------------------------------------------------------------------------------
class CompletionFormat:
    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: str, request_id: Optional[str] = None):
        self.id = request_id or new_id("cmpl")
        self.model, self.created = model, int(time.time())

    def full(self, choices: list[Choice], finish: list[str], logprobs: Optional[list], usage_: dict,
             prefixes: Optional[list[str]] = None) -> dict:
        out = []
        for i, c in enumerate(choices):
            prefix = prefixes[i] if prefixes else ""
            out.append({"index": c.index, "text": prefix + c.text,
                        "logprobs": completion_logprobs(logprobs[i], len(prefix)) if logprobs else None,
                        "finish_reason": finish[i]})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": usage_, "system_fingerprint": None}

    def chunk(self, index: int, *, text: Optional[str] = None, role: bool = False,
              finish_reason: Optional[str] = None, logprobs: Optional[list] = None,
              usage_: Optional[dict] = None, offset: int = 0) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": [{"index": index, "text": text or "",
                            "logprobs": completion_logprobs(logprobs, offset) if logprobs is not None else None,
                            "finish_reason": finish_reason}]}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_}
