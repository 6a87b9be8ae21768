"""OpenAI's presence / frequency penalties, the one expression both the engine (`processors.presence_frequency`,
per-row values) and the transformers baseline (`baseline/generate.py`'s `PresenceFrequencyPenalty`) compute.

`logits[t] -= frequency * count[t] + presence * (count[t] > 0)`, count over the GENERATED tokens only, applied as
vLLM applies them: after the repetition penalty, frequency first, before temperature. HF has no such processor;
`generate()` runs the baseline's after its own processors (no-repeat-ngram, bad words, min new tokens), whose -inf
masks commute with a finite subtraction, so the scores are the same.

The engine's other logits processors (HF's, bit for bit, batched across rows) are in `processors.py`; its stopping
criteria (HF's `EosTokenCriteria | MaxLengthCriteria` plus token-level stop words) are decided on the host by each
search (`greedy.py`, `sampling_batch.py`) or on the device for beams (`beam_batch.BeamGroup._stopped`).
"""
from __future__ import annotations

import torch


def presence_frequency_penalty(generated: torch.Tensor, scores: torch.Tensor, presence: float,
                               frequency: float) -> torch.Tensor:
    """OpenAI's penalties as vLLM computes them: generated [rows, n] ids (< V), scores [rows, V] ->
    scores - frequency * count - presence * (count > 0), count[t] = occurrences of t among the generated ids."""
    counts = torch.zeros_like(scores)  # [rows, V]
    if generated.shape[1]:
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
    scores = scores - frequency * counts
    return scores - presence * (counts > 0).to(scores.dtype)
