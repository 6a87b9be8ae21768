"""The interface every search implements (greedy in `greedy.py`, sampling in `sampling_batch.py`, beam search and
beam sampling in `beam.py` / `beam_batch.py`); `decoder.Decoder` validates the parameters, builds one and
delegates to it. Each search's `step` is its batched step (`greedy.greedy_step`, `sampling_batch.sample_step`,
`beam_batch.beam_step`) with the request alone; the scheduler steps several requests' searches at once there."""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from ...params import Sequence_


class NoTokenLeft(Exception):
    """A row of the step had no finite score: every token excluded by the logits processors, or non-finite
    logits (NaN / inf). Raised by a search after its step (the row chose from uniform scores instead, so no
    sampling kernel ever saw an invalid distribution); `Decoder.step` turns it into the request's error."""

    def __init__(self, step: int, nonfinite_logits: bool):
        super().__init__(f"no finite score at generated token {step}")
        self.step = step  # 1 = the first new token
        self.nonfinite_logits = nonfinite_logits


class Search(Protocol):
    done: bool
    seed: Optional[int]  # the seed in use when sampling, else None

    @property
    def num_rows(self) -> int:
        """Rows of logits the next `step` takes: 1 before the first step (the prompt), 0 when done."""

    def step(self, logits: torch.Tensor) -> tuple[list[int], list[int], bool]:
        """logits [num_rows, vocab] (fp32) -> (parents, tokens, done) for the next step's rows; raises
        `NoTokenLeft` when a row had nothing to choose from."""

    def row_tokens(self) -> list[list[int]]:
        """Per row of the next step, the new tokens it holds, its last one the token it feeds ([] before the first
        step and when done): what a preempted request computes again (`preempt.py`)."""

    def stream_prefixes(self) -> list[list[int]]:
        """Per streamed sequence, the new tokens that are final already (never retracted). The lists may be the
        search's own (read them, never modify them)."""

    def finalize(self, n: int) -> list[Sequence_]:
        """The `n` returned sequences (text left empty), ranked (beam) or in sampling order."""
