"""On-demand KV (scheduler policy `max_utilization`): reservations that grow step by step, and preemption by
recompute (vLLM v1's way).

Two scheduler policies, TensorRT-LLM's names (`EngineConfig.scheduler_policy`):
- `guaranteed_no_evict` (the default): admission reserves a request's worst case (`kv_cache.blocks_needed` of its
  prompt + max_tokens, every row) and nothing is ever preempted: a running request always finishes at the pace it
  started with, but a request without a tight max_tokens holds a whole context's blocks it may never use.
- `max_utilization`: a request reserves only what its rows can hold by the end of the coming step (`blocks_now`:
  its prompt, then per row one block more every `block_size` tokens), and grows its reservation before each
  step, oldest request first. When the cache has no block left for a growth,
  the running request that arrived last is preempted (`suspend`, then `Policy.preempt`): its blocks are freed
  (the full ones stay in the prefix cache, idle, so its recompute mostly hits them), its budgets given back, and it
  goes back to the waiting queue in arrival order, ahead of the requests that never ran. No request is admitted in
  a step that preempted one. When admitted again, its first row computes `kv.resume_ids` as a prefill: one row
  (greedy, one sample) its prompt and every token it generated but the last; several rows (beams as a group,
  num_return_sequences samples) the prompt, after which the row is forked into one per row (sharing the prompt's
  blocks) and each computes its own generated tokens but the last (`kv.resume_rows`, [rows, chunk] at a time).
  Those logits are not stepped: its decoder already chose each row's next token (`kv.next_tokens`), and it
  decodes on from there with the decoder state it kept (tokens, beam scores and finished hypotheses, the
  sampling generator's state, log probs, what was streamed). So it produces the tokens it produces alone (the
  recomputed keys and values are the same sums, computed by a prefill instead of decode steps; the tests check
  the tokens).

A request whose worst case exceeds the whole cache is refused at submit under both policies (`Engine.validate`):
alone it could never finish. Every other request can: the oldest running request preempts every later one before
itself, and its own worst case fits.
"""
from __future__ import annotations

from .kv.kv_cache import blocks_needed
from .state import Active

GUARANTEED_NO_EVICT = "guaranteed_no_evict"
MAX_UTILIZATION = "max_utilization"
POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION)


def blocks_now(a: Active, block_size: int) -> int:
    """KV blocks `a`'s rows can hold by the end of the coming step: a row that generated k tokens (at least the
    first one, sampled from the prefill) holds prompt + k positions after feeding its last token, i.e.
    `blocks_needed(prompt, k + 1)`; never more than its worst case."""
    k = max(a.timing.steps, 1)
    m = min(k + 1, a.req.params.max_tokens)
    return min(blocks_needed(a.prompt_len, m, a.width, block_size), a.kv.worst)


def suspend(a: Active) -> None:
    """Before `a`'s rows are freed: what its row computes again when it runs again. A request still computing (its
    prompt, or an earlier resume) keeps what it was computing; one decoding keeps its prompt and every generated
    token but the last (fed by `kv.next_tokens` at its next decode step), with the hashes of their full blocks
    (prefix caching on: they are looked up again in the prefix cache)."""
    kv = a.kv
    if a.prefilling:
        return
    rows = a.decoder.row_tokens()
    assert rows and len(rows) == len(kv.rows) and [r[-1] for r in rows] == kv.next_tokens, \
        "each decoding row feeds its last generated token"
    if len(rows) == 1:
        kv.resume_ids, kv.resume_rows = list(a.req.input_ids) + rows[0][:-1], []
    else:  # the prompt in one row, then each row's own tokens
        kv.resume_ids, kv.resume_rows = list(a.req.input_ids), [r[:-1] for r in rows]
    kv.resume_hashes = [] if kv.hasher is None else resume_hashes(kv.hasher, kv.resume_ids)


def resume_hashes(hasher, ids: list[int]) -> list:
    """Hashes of the full blocks of `ids` (a prompt and tokens generated after it), chained as the runner chains
    them when it registers decoded blocks."""
    hashes, bs = list(hasher.prompt_hashes), hasher.block_size
    for b in range(len(hashes), len(ids) // bs):
        hashes.append(hasher.block(hashes[-1] if hashes else hasher.root, b * bs, ids[b * bs:(b + 1) * bs]))
    return hashes
