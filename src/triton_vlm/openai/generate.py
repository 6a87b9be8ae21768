"""One prompt's generation: the llm's responses -> choices (text, ids, log probs, finish reason) and usage.

`Generation.events()` yields what a streamed response sends, in order; `Generation.run()` drives the same
loop to the end for an unstreamed response, so streamed and unstreamed text are made by the same code. When a
stop string has ended every sequence, the stream to Triton is closed, which cancels the rest of the generation.
"""
from __future__ import annotations

import copy
import dataclasses
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from .. import names as N
from .choices import Choice, StopMatcher
from .params import Plan, tenant_salt
from .triton import TritonClient, TritonRequest


@dataclass
class Event:
    sequence: int  # the engine's sequence index (see `indices` for the choices it feeds)
    text: str = ""
    finish_reason: Optional[str] = None
    tokens: Optional[list] = None  # with logprobs: the tokens released with this text (`Choice.take_tokens`)


class Generation:
    def __init__(self, client: TritonClient, request: TritonRequest, plan: Plan, eos_ids: frozenset,
                 context_length: int, tokenizer=None, api_key: Optional[str] = None):
        salt = tenant_salt(api_key, plan.cache_salt)  # with --api-key, derived from the key (params.py)
        if salt is not None:
            request = dataclasses.replace(request, params={**request.params, N.CACHE_SALT: salt})
        self.client, self.request, self.plan = client, request, plan
        self.tokenizer = tokenizer if plan.logprobs else None  # token texts are made only for logprobs
        self.eos_ids, self.context_length = eos_ids, context_length
        matcher = StopMatcher(plan.stop)
        k = int(plan.inputs.get(N.NUM_RETURN_SEQUENCES, 1))
        self.sequences = [Choice(j, matcher) for j in range(k)]
        self.cum_log_probs: list[float] = []
        self.prompt_tokens = 0

    def indices(self, sequence: int) -> range:
        """The choice indices an engine sequence feeds: itself, or all n for n greedy copies."""
        return range(self.plan.copies) if self.plan.copies > 1 else range(sequence, sequence + 1)

    @property
    def max_tokens(self) -> Optional[int]:
        if self.plan.max_tokens is not None:
            return self.plan.max_tokens
        if self.client.route == "pipeline" and self.context_length and self.prompt_tokens:
            return self.context_length - self.prompt_tokens
        return self.client.default_max_tokens

    def _event(self, j: int, text: str) -> Optional[Event]:
        tokens = self.sequences[j].take_tokens(self.tokenizer, self.eos_ids) if self.tokenizer else None
        return Event(j, text, tokens=tokens) if text or tokens else None

    async def events(self) -> AsyncIterator[list[Event]]:
        """The events of each response from Triton, one list per response (what can be sent in one write);
        the last list ends every sequence."""
        seqs = self.sequences
        released = [""] * len(seqs)  # text released by the last response, sent with the end of its sequence
        async with aclosing(self.client.generate(self.request)) as responses:
            async for r in responses:
                if r.prompt_tokens is not None:
                    self.prompt_tokens = r.prompt_tokens
                if not r.final:
                    j = r.sequence_index
                    text = seqs[j].feed(r.texts[0], r.ids[0], r.log_probs[0] if r.log_probs else [],
                                        r.top[0] if r.top else None)
                    if all(s.stopped for s in seqs):
                        released[j] = text
                        break  # closes the stream: Triton cancels the rest
                    ev = self._event(j, text)
                    if ev:
                        yield [ev]
                    continue
                self.cum_log_probs = list(r.cum_log_probs)
                for j, piece in enumerate(r.texts[:len(seqs)]):
                    released[j] = seqs[j].feed(piece, r.ids[j] if j < len(r.ids) else [],
                                               r.log_probs[j] if j < len(r.log_probs) else [],
                                               r.top[j] if j < len(r.top) else None)
                break
        last = []
        for s in seqs:
            ev = self._event(s.index, released[s.index] + s.finish())
            if ev:
                last.append(ev)
        last += [Event(s.index, finish_reason=s.finish_reason(self.max_tokens, self.eos_ids)) for s in seqs]
        yield last

    async def run(self) -> list[Choice]:
        """Generate to the end; the request's n choices (best_of ranked, greedy copies made)."""
        async for _ in self.events():
            pass
        return self.choices()

    def choices(self) -> list[Choice]:
        seqs = self.sequences
        if self.plan.rank_best_of:  # the n most likely samples, best first (OpenAI's best_of)
            order = sorted(range(len(seqs)), key=lambda j: -self.cum_log_probs[j] if j < len(self.cum_log_probs)
                           else 0.0)
            seqs = [seqs[j] for j in order[:self.plan.n]]
        elif self.plan.copies > 1:
            seqs = [seqs[0]] + [copy.copy(seqs[0]) for _ in range(self.plan.copies - 1)]
        out = []
        for i, s in enumerate(seqs):
            s = copy.copy(s) if s.index != i else s
            s.index = i
            out.append(s)
        return out

    def completion_tokens(self) -> int:
        """Tokens generated for the request: every sequence the engine ran (best_of included), n times for the n
        greedy copies (each choice is billed, as if generated on its own)."""
        return sum(len(s.ids) for s in self.sequences) * max(1, self.plan.copies)
