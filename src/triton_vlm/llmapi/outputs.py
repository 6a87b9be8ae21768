"""The llm's results -> the `tensorrt_llm` model's outputs, in TensorRT-LLM's words.

- `finish_reason` (TensorRT-LLM's `CompletionOutput.finish_reason`): "stop" when the sequence ended on an end id or
  a stop string, "length" when it reached max_tokens, "cancelled" when `stop` or the client ended it;
- `stop_reason`: the stop string that ended it, else "None" (the model sends `str()` of the value);
- `cumulative_logprob`: the sequence's sum of token log probs (the llm's `cum_log_probs`; beam search: its score);
- error texts name TensorRT-LLM's inputs (`sampling_param_max_tokens`), not the ensemble's the llm checked.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .. import names as N

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"
_THEIRS = {N.MAX_TOKENS: N.SP_MAX_TOKENS, N.TEMPERATURE: N.SP_TEMPERATURE, N.TOP_K: N.SP_TOP_K, N.TOP_P: N.SP_TOP_P,
           N.FREQUENCY_PENALTY: N.SP_FREQUENCY_PENALTY, N.PRESENCE_PENALTY: N.SP_PRESENCE_PENALTY,
           N.SEED: N.SP_SEED, N.STOP_WORDS: N.SP_STOP, N.IMAGES: N.IMAGE_URL, N.LORA_TASK_ID: N.LORA_ID,
           N.BEAM_WIDTH: N.SP_BEST_OF, N.NUM_RETURN_SEQUENCES: N.SP_BEST_OF}
_NAME = re.compile(r"(?<![\w])(" + "|".join(map(re.escape, _THEIRS)) + r")(?![\w])")


def their_names(message: str) -> str:
    """An error text of the pipeline with the ensemble's input names replaced by the llmapi model's."""
    return _NAME.sub(lambda m: _THEIRS[m.group(1)], message)


@dataclass
class Finished:
    """One returned sequence at its end."""

    text: str
    new_ids: list[int]
    cum_log_prob: float = 0.0
    finish_reason: str = STOP
    stop_reason: Optional[str] = None


def finish_reason(new_ids: Sequence[int], eos_ids: frozenset, stop_ids: Sequence[Sequence[int]],
                  stop: Sequence[str], max_tokens: int) -> tuple[str, Optional[str]]:
    """(finish_reason, stop_reason) of a sequence's new ids: an end id or a stop string's ids last -> "stop" (the
    string named), else max_tokens reached -> "length", else "stop" (the engine ended it on a stop word)."""
    ids = list(new_ids)
    if ids and ids[-1] in eos_ids:
        return STOP, None
    for word, ids_w in zip(stop, stop_ids):
        if ids_w and len(ids) >= len(ids_w) and ids[len(ids) - len(ids_w):] == list(ids_w):
            return STOP, word
    if len(ids) >= max_tokens:
        return LENGTH, None
    return STOP, None


@dataclass
class Accumulated:
    """What was streamed of sequence 0 so far (the llm streams the new piece of each step)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)

    def add(self, text: str, ids: Sequence[int]) -> None:
        self.text += text
        self.ids.extend(int(t) for t in ids)


def best(cum_log_probs: Sequence[float]) -> int:
    """The sequence of highest cumulative log prob (sampled best-of); the first on ties."""
    return max(range(len(cum_log_probs)), key=lambda j: (cum_log_probs[j], -j)) if cum_log_probs else 0
