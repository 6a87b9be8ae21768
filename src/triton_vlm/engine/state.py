"""One request inside the engine, in three parts owned by the three parts of a step.

- `Active.kv` (`KVState`): the rows and the prompt progress, owned by the runner (`runner.py`);
- `Active.streams` (`StreamState` per sequence index): what was streamed, owned by the output step
  (`output.py`);
- the budgets it holds (`width` rows, `kv.reserved` blocks, its adapter's device slot) are taken and given back
  by the policy (`policy.py`), which also preempts it (`preempt.py`: its rows freed, `kv.resume_ids` computed
  again when it runs again).
`Active` itself is the request, its decoder and the callback its results go to.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..params import GenerationRequest, GenerationResult
from .kv.kv_cache import RowKV
from .kv.prefix_cache import RequestHasher

Callback = Callable[[GenerationResult], None]
Output = tuple[Callback, GenerationResult]


@dataclass(eq=False)
class KVState:
    worst: int  # KV blocks of the request's worst case (prompt + max_tokens, every row): `kv_cache.blocks_needed`
    # KV blocks reserved now: the worst case under guaranteed_no_evict (and for requests never preempted), else
    # what its rows can hold by the end of the coming step (grown step by step: `preempt.blocks_now`)
    reserved: int = 0
    rows: list[RowKV] = field(default_factory=list)  # one per beam / sample once the prompt is cached
    prefilled: int = 0  # prompt tokens cached (resuming: positions of each row computed again)
    embeds: Optional[torch.Tensor] = None  # [P, hidden] prompt embeddings while prefilling
    next_tokens: list[int] = field(default_factory=list)  # the token each row feeds at the next decode step
    hasher: Optional[RequestHasher] = None  # prefix caching on and the request cacheable: its block hashes
    cached: int = 0  # prompt tokens found in the prefix cache at admission (not computed)
    # preempted after its first token (`preempt.py`): what its first row computes again when it runs again (one
    # row: prompt + every generated token but the last, which `next_tokens` feeds; several: the prompt), the hashes
    # of their full blocks, and with several rows each row's generated tokens but the last (computed after the
    # first row is forked into them)
    resume_ids: Optional[list[int]] = None
    resume_hashes: list = field(default_factory=list)
    resume_rows: list[list[int]] = field(default_factory=list)
    held_blocks: int = 0  # distinct KV blocks its rows held when it finished (set just before they are freed)


@dataclass(eq=False)
class StreamState:
    detok: Any  # IncrementalDetokenizer of one sequence
    sent: list[int] = field(default_factory=list)  # token ids already streamed


@dataclass(eq=False)
class Timing:
    submitted: float = field(default_factory=time.monotonic)
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    steps: int = 0  # decoder steps run (new tokens)


@dataclass(eq=False)  # compared by identity (requests hold tensors)
class Active:
    req: GenerationRequest
    on_result: Callback
    decoder: Any  # a `search.Search` behind `decoder.Decoder`
    width: int  # most rows it can ever need
    kv: KVState
    make_detok: Optional[Callable[[], Any]] = None  # streaming: a new IncrementalDetokenizer per sequence
    streams: dict[int, StreamState] = field(default_factory=dict)  # sequence index -> what was streamed
    timing: Timing = field(default_factory=Timing)
    admitted: bool = False
    lora: Any = None  # the device copy of req.adapter while admitted (`adapter_slots.DeviceAdapters`)
    arrival: int = -1  # order of arrival in the policy's queue (preemption takes the latest first)
    preemptions: int = 0  # times it was preempted

    @property
    def id(self) -> str:
        return self.req.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.req.input_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens its row computes before decoding: the prompt, or after a preemption `kv.resume_ids`."""
        ids = self.kv.resume_ids
        return self.prompt_len if ids is None else len(ids)

    @property
    def compute_len(self) -> int:
        """Positions each row computes before decoding: `prefill_len`, then (resuming several rows) their own."""
        rows = self.kv.resume_rows
        return self.prefill_len + (len(rows[0]) if rows else 0)

    @property
    def prefilling(self) -> bool:
        return self.kv.prefilled < self.compute_len
