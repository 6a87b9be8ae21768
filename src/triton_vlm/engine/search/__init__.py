"""Choosing tokens: one batched implementation per search algorithm (`greedy.py`, `sampling_batch.py`,
`beam_batch.py` with `beam.py`'s phases), the logits processors and warpers (`processors.py`), a request's
`decoder.py`, guided decoding (`guided.py`, `guided_schema.py`) and incremental detokenization (`detok.py`)."""
