"""The serving core both generation endpoints share: run one or more prompts and answer in one body or as
Server-Sent Events.

A streamed answer waits for its first event before the HTTP response starts, so a request the server refuses
(INVALID_ARG, queue full, unknown adapter) gets its HTTP status and OpenAI error body, not a 200 with an error
inside. Once streaming, an error is sent as a `data: {"error": ...}` event (as vLLM does; the openai client
raises it), then `data: [DONE]`. The SSE order is OpenAI's: each choice's role first (chat), its text deltas,
its finish reason, the usage chunk when `stream_options.include_usage`, `[DONE]`.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union

from .aio import gather_all
from .errors import APIError, internal
from .generate import Event, Generation
from .media import MediaPolicy
from .metrics import FrontendMetrics
from .params import Plan
from .responses import DONE, ChatFormat, CompletionFormat, sse, usage
from .served import ServedModel
from .triton import TritonClient, TritonRequest

Format = Union[ChatFormat, CompletionFormat]


@dataclass
class Frontend:
    client: TritonClient
    served: ServedModel
    media: MediaPolicy
    metrics: FrontendMetrics
    api_key: Optional[str] = None
    max_concurrent_requests: int = 0  # engine requests at once; 0: no limit (FrontendConfig)
    engine_requests: int = 0  # engine requests (one per prompt) of the requests being served
    tool_call_parser: Optional[str] = None  # tool_choice "auto"'s parser (tool_parsers.py); None: auto refused

    def generations(self, jobs: list[TritonRequest], plan: Plan) -> list[Generation]:
        return [Generation(self.client, job, plan, self.served.eos_ids, self.served.context_length,
                           self.served.tokenizer, api_key=self.api_key) for job in jobs]

    # --- one body ---------------------------------------------------------------------------------------
    async def complete(self, fmt: Format, jobs: list[TritonRequest], plan: Plan,
                       prefixes: Optional[list[str]] = None) -> dict:
        gens = self.generations(jobs, plan)
        results = await gather_all(g.run() for g in gens)
        choices, finish, logprobs = [], [], []
        for i, (g, cs) in enumerate(zip(gens, results)):
            for c in cs:
                c.index += i * plan.n
                choices.append(c)
                finish.append(c.finish_reason(g.max_tokens, self.served.eos_ids))
                if plan.logprobs:
                    logprobs.append(c.token_texts(self.served.tokenizer, self.served.eos_ids))
        use = self._usage(gens)
        if prefixes is not None:  # completions with echo: each choice starts with its prompt
            return fmt.full(choices, finish, logprobs or None, use, [prefixes[c.index // plan.n] for c in choices])
        return fmt.full(choices, finish, logprobs or None, use)

    def _usage(self, gens: list[Generation]) -> dict:
        prompt = sum(g.prompt_tokens for g in gens)
        completion = sum(g.completion_tokens() for g in gens)
        self.metrics.tokens(prompt, completion)
        return usage(prompt, completion)

    # --- Server-Sent Events -----------------------------------------------------------------------------
    async def stream(self, fmt: Format, jobs: list[TritonRequest], plan: Plan,
                     prefixes: Optional[list[str]] = None) -> AsyncIterator[bytes]:
        """The SSE body, already started: errors before the first event are raised here (HTTP status)."""
        gens = self.generations(jobs, plan)
        source = self._chunks(fmt, gens, plan, prefixes)
        try:
            first = await source.__anext__()
        except BaseException:
            await source.aclose()
            raise
        return self._framed(first, source)

    async def _framed(self, first: bytes, source) -> AsyncIterator[bytes]:
        async with aclosing(source):
            yield first
            try:
                async for chunk in source:
                    yield chunk
            except APIError as e:
                yield sse(e.body()) + DONE
            except Exception as e:  # noqa: BLE001 - our bug: still a well-formed stream
                yield sse(internal(e).body()) + DONE

    async def _chunks(self, fmt: Format, gens: list[Generation], plan: Plan,
                      prefixes: Optional[list[str]]) -> AsyncIterator[bytes]:
        """One write per response from Triton: the first with every choice's role (chat) or echo, the last with
        the finish reasons, the usage chunk and [DONE]."""
        t0 = time.perf_counter()
        source = _merged(gens) if plan.stream_engine else self._replayed(gens)  # replayed: log probs per token
        async with aclosing(source):
            head = await anext(source, None)  # the first events (or the refusal) before anything is sent
            out, offsets = [], {}
            for i in range(len(gens)):
                for k in range(plan.n):
                    index = i * plan.n + k
                    if isinstance(fmt, ChatFormat):
                        out.append(sse(fmt.chunk(index, role=True)))
                    elif prefixes and prefixes[i]:  # echo: the prompt first
                        out.append(sse(fmt.chunk(index, text=prefixes[i])))
                        offsets[index] = len(prefixes[i])
            ended = 0  # generations whose last events were seen (the last list of each ends its sequences)
            if head is not None:
                self.metrics.first_token(time.perf_counter() - t0)
                out += self._event_chunks(fmt, gens, plan, *head, offsets)
                ended += _ends(head[1])
            if ended < len(gens):
                yield b"".join(out)
                out = []
                async for i, events in source:
                    out += self._event_chunks(fmt, gens, plan, i, events, offsets)
                    ended += _ends(events)
                    if ended < len(gens):  # else the last write: usage and [DONE] go with it
                        yield b"".join(out)
                        out = []
        use = self._usage(gens)
        if plan.include_usage:
            out.append(sse(fmt.usage_chunk(use)))
        out.append(DONE)
        yield b"".join(out)

    @staticmethod
    def _event_chunks(fmt: Format, gens: list[Generation], plan: Plan, i: int, events: list[Event],
                      offsets: dict[int, int]) -> list[bytes]:
        """`offsets`: per choice index, where its next token's text starts in its text (the completions
        endpoint's `text_offset`, continuous across chunks; the echoed prompt counts)."""
        g, out = gens[i], []
        use = usage(g.prompt_tokens, g.completion_tokens()) if plan.continuous_usage else None
        for ev in events:
            for k in g.indices(ev.sequence):
                index = i * plan.n + k
                if ev.finish_reason is not None:
                    chunk = fmt.chunk(index, finish_reason=ev.finish_reason, usage_=use)
                elif isinstance(fmt, CompletionFormat):
                    at = offsets.get(index, 0)
                    offsets[index] = at + sum(len(t[1]) for t in ev.tokens or ())
                    chunk = fmt.chunk(index, text=ev.text, logprobs=ev.tokens, usage_=use, offset=at)
                else:  # None: a tool-call parser holds the text back
                    chunk = fmt.chunk(index, text=ev.text, logprobs=ev.tokens, usage_=use)
                if chunk is not None:
                    out.append(sse(chunk))
        return out

    async def _replayed(self, gens: list[Generation]):
        """Unstreamed generations, replayed as events: one per token with its log prob."""
        await gather_all(g.run() for g in gens)
        for i, g in enumerate(gens):
            for s in g.sequences:
                for token in s.token_texts(self.served.tokenizer, self.served.eos_ids):
                    yield i, [Event(s.index, token[1], tokens=[token])]
            yield i, [Event(s.index, finish_reason=s.finish_reason(g.max_tokens, self.served.eos_ids))
                      for s in g.sequences]


def _ends(events: list[Event]) -> bool:
    return any(ev.finish_reason is not None for ev in events)


async def _merged(gens: list[Generation]):
    """(generation index, events) from every generation as they come."""
    if len(gens) == 1:
        async with aclosing(gens[0].events()) as events:
            async for ev in events:
                yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation):
        try:
            async with aclosing(g.events()) as events:
                async for ev in events:
                    await queue.put((i, ev))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, ev = await queue.get()
            if ev is None:
                left -= 1
            elif isinstance(ev, BaseException):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
