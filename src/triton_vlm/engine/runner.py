"""Runs a step's forwards against the model and the KV cache; the only code that calls the model.

- `prefill(chunk)`: one forward of one request's prompt chunk (one row, causal over its own length). The
  prompt's embeddings, with image features merged in (`merge.py`), are built on its first chunk; an image
  count that does not match its placeholders raises `InvalidArgument` there. Returns the logits [1, vocab] of
  the prompt's last position when the chunk completes the prompt, else None.
- `decode(actives)`: one forward with one new token for every row of every request given (each row feeds
  `kv.next_tokens`); returns logits [rows, vocab] in that order.
- Prefix caching: after a forward returned, the full blocks it completed are registered in the cache's index
  under their hashes (`prefix_cache.py`): a prompt's from the hashes computed at submit, decoded ones from the
  row's tokens (`RowKV.tokens`), so a later request with the same prefix (a chat's next turn) reuses them.
- A preempted request (`preempt.py`) prefills `kv.resume_ids` (its prompt, then with one row the tokens it
  generated but the last, embedded as decode steps embed them) with the hashes `kv.resume_hashes`; with several
  rows the first is then forked into them and each computes its own tokens (`kv.resume_rows`, one forward of
  [rows, chunk] per chunk). Its logits are not stepped.
- M-RoPE (Qwen2-VL): a request with image positions (`GenerationRequest.rope`, `mrope.py`) prefills at its
  prompt's 3-D positions and decodes at cache position + its delta (in CUDA graphs too: the delta is an input).
- DeepStack (Qwen3-VL, `model.deepstack_levels` from the family's `TextRules`): a media token's features carry its
  embedding then one feature per level; the prompt's merged rows keep them (zeros at text tokens) and each prefill
  chunk adds its slice after the first decoder layers. Decode tokens are text: nothing to add.
- `reorder(active, parents)`: after a decoder step, row i continues row `parents[i]`: a parent kept by one
  child hands its blocks over, further children fork them (copy-on-write), rows nobody continues are freed.

Decode steps on static shapes (`cuda_graph.DecodeGraphs`, when the engine sets `graphs`: CUDA graphs on a GPU)
take every step they can (rows and keys within their largest buckets, LoRA rows from their static adapter slots);
the others run eager here.

The per-row adapter map (`lora.LoraBatch`) is built here for every forward from the rows' requests: rows of
different requests may use different LoRA adapters, or none. Each row reads its request's device copy
(`Active.lora`, taken at admission), so an adapter replaced meanwhile never changes a running request.
"""
from __future__ import annotations

from typing import Optional

import torch

from .model.cuda_graph import DecodeGraphs
from .kv.kv_cache import KVCache, RowKV
from .lora.lora import LoraBatch, StackCache
from .model.merge import merge_image_embeds
from .model.model import LlamaModel, Segment
from .policy import PrefillChunk
from .state import Active


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache):
        self.model, self.cache = model, cache
        self.lora_stacks = StackCache()  # the adapters of recent batches, stacked per projection
        self.graphs: Optional[DecodeGraphs] = None  # bucketed static-shape decode steps (CUDA graphs), if on

    def prefill(self, chunk: PrefillChunk) -> Optional[torch.Tensor]:
        a, kv = chunk.active, chunk.active.kv
        if chunk.rows:
            return self._prefill_rows(chunk)
        x, deepstack = self._split(self._chunk_embeds(chunk))  # [1, n, hidden], [levels, 1, n, hidden] or None
        adapters = LoraBatch.build([a.lora], self.lora_stacks, self.model.device)
        rope = _prompt_rope(a, chunk.start, chunk.length)  # [3, 1, n] (M-RoPE) or None
        logits = self.model.forward(x, self.cache.plan(kv.rows, chunk.length), self.cache, adapters,
                                    rope=rope, deepstack=deepstack)  # [1, vocab]
        return self._prefilled(chunk, logits)

    def prefill_many(self, chunks: list[PrefillChunk]) -> list[tuple[PrefillChunk, object]]:
        """A step's prefill chunks -> (chunk, its `prefill` result or the exception that ends its request), in
        order. Chunks of one row with the same adapter (or none) run as one ragged forward (`forward_ragged`):
        one pass over the weights for all their tokens; a chunk whose embeddings fail (an image count that does
        not match) fails alone, a failed forward fails the chunks in it."""
        results: dict[int, object] = {}
        groups: dict[int, list[tuple[int, PrefillChunk, torch.Tensor]]] = {}  # id(adapter) -> (index, chunk, x)
        for n, chunk in enumerate(chunks):
            if chunk.rows or len(chunks) == 1:
                results[n] = _attempt(self.prefill, chunk)
                continue
            x = _attempt(self._chunk_embeds, chunk)
            if isinstance(x, Exception):
                results[n] = x
            else:
                groups.setdefault(id(chunk.active.lora), []).append((n, chunk, x))
        for group in groups.values():
            if len(group) == 1:
                results[group[0][0]] = _attempt(self.prefill, group[0][1])
                continue
            try:
                logits = self._prefill_ragged([c for _, c, _ in group], torch.cat([x for _, _, x in group], dim=1))
            except Exception as e:  # noqa: BLE001 - the scheduler ends these requests with it
                results.update({n: e for n, _, _ in group})
                continue
            for j, (n, chunk, _) in enumerate(group):
                results[n] = _attempt(self._prefilled, chunk, logits[j:j + 1])
        return [(chunk, results[n]) for n, chunk in enumerate(chunks)]

    def _prefill_ragged(self, chunks: list[PrefillChunk], x: torch.Tensor) -> torch.Tensor:
        """One forward of several one-row chunks sharing an adapter: x [1, total, hidden] -> [chunks, vocab]."""
        segments = [Segment(c.length, self.cache.plan(c.active.kv.rows, c.length),
                            _prompt_rope(c.active, c.start, c.length)) for c in chunks]
        adapters = LoraBatch.build([chunks[0].active.lora], self.lora_stacks, self.model.device)
        x, deepstack = self._split(x)
        return self.model.forward_ragged(x, segments, self.cache, adapters, deepstack)

    def _split(self, wide: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Merged rows [rows, n, hidden * (1 + levels)] -> the embeddings [rows, n, hidden] and the DeepStack
        features [levels, rows, n, hidden] (None without DeepStack, or when the rows hold no media token)."""
        levels = self.model.deepstack_levels
        if not levels:
            return wide, None
        hidden = wide.shape[-1] // (1 + levels)
        stack = wide[..., hidden:]
        if not bool(stack.any()):
            return wide[..., :hidden], None
        return wide[..., :hidden], stack.unflatten(-1, (levels, hidden)).movedim(-2, 0)

    def _chunk_embeds(self, chunk: PrefillChunk) -> torch.Tensor:
        """The chunk's embeddings [1, n, hidden] (the prompt's, image features merged, built at its first)."""
        kv = chunk.active.kv
        if kv.embeds is None:
            kv.embeds = self._embeds(chunk.active)  # [prefill_len, hidden]
        return kv.embeds[None, chunk.start:chunk.start + chunk.length]

    def _prefilled(self, chunk: PrefillChunk, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """A one-row chunk's forward returned logits [1, vocab]: its progress, its blocks into the prefix cache,
        and at the prompt's end its rows -> the logits when the chunk completes the prompt, else None."""
        a, kv = chunk.active, chunk.active.kv
        kv.prefilled = chunk.start + chunk.length
        if kv.hasher is not None:
            self._cache_prompt_blocks(a)
        if kv.prefilled == a.prefill_len:
            kv.embeds = None
            if kv.resume_rows:  # resuming several rows: each continues the first one's prompt
                kv.rows = kv.rows + [self.cache.fork(kv.rows[0]) for _ in kv.resume_rows[1:]]
        return logits if chunk.completes else None

    def _prefill_rows(self, chunk: PrefillChunk) -> Optional[torch.Tensor]:
        """A resumed request's rows (forked from its prompt's row) each compute `chunk.length` of their own tokens
        again, in one forward of [rows, length] -> logits [rows, vocab] when that completes them, else None."""
        a, kv = chunk.active, chunk.active.kv
        first = chunk.start - a.prefill_len
        ids = [r[first:first + chunk.length] for r in kv.resume_rows]  # [rows, length]
        x = self.model.embed(torch.tensor(ids, dtype=torch.long, device=self.model.device))  # [rows, length, hidden]
        adapters = LoraBatch.build([a.lora] * len(kv.rows), self.lora_stacks, self.model.device)
        batch = self.cache.plan(kv.rows, chunk.length)
        delta = _delta(a)
        logits = self.model.forward(x, batch, self.cache, adapters, rope=batch.positions + delta if delta else None)
        kv.prefilled = chunk.start + chunk.length
        if kv.hasher is not None:
            for row, tokens in zip(kv.rows, ids):
                for token in tokens:
                    self._register_token(kv.hasher, row, token)
        return logits if chunk.completes else None

    def _embeds(self, a: Active) -> torch.Tensor:
        """The prompt's embeddings with its image features merged in, then (resuming after a preemption) the
        embeddings of the generated tokens it computes again -> [prefill_len, hidden]."""
        dev = self.model.device
        ids = torch.tensor(a.req.input_ids, dtype=torch.long, device=dev)
        levels = self.model.deepstack_levels
        embeds = merge_image_embeds(ids, self.model.embed(ids), a.req.image_embeds, self.model.config.placeholder_ids,
                                    levels)  # [P, hidden * (1 + levels)]
        resume = a.kv.resume_ids
        if resume is None or len(resume) == a.prompt_len:
            return embeds
        more = torch.tensor(resume[a.prompt_len:], dtype=torch.long, device=dev)
        more = merge_image_embeds(more, self.model.embed(more).to(embeds.dtype), None, None, levels)
        return torch.cat([embeds, more])

    def decode(self, actives: list[Active]) -> torch.Tensor:
        rows = [r for a in actives for r in a.kv.rows]
        token_ids = [t for a in actives for t in a.kv.next_tokens]
        row_adapters = [a.lora for a in actives for _ in a.kv.rows]  # every row of a request: its adapter
        deltas = [_delta(a) for a in actives for _ in a.kv.rows]  # M-RoPE: rotary position - cache position
        shifted = any(deltas)
        logits = None if self.graphs is None else self.graphs.decode(rows, token_ids, row_adapters,
                                                                       deltas if shifted else None)
        if logits is None:  # eager: no graphs, or a step they do not take
            x = self.model.embed(torch.tensor(token_ids, dtype=torch.long))[:, None]  # [rows, 1, hidden]
            adapters = LoraBatch.build(row_adapters, self.lora_stacks, self.model.device)
            batch = self.cache.plan(rows, 1)
            rope = batch.positions + torch.tensor(deltas, device=batch.positions.device)[:, None] if shifted else None
            logits = self.model.forward(x, batch, self.cache, adapters, rope=rope)  # [rows, vocab]
        self._cache_decoded_blocks(actives)
        return logits

    # --- prefix caching: blocks become findable once the forward that completed them returned ---------------
    def _cache_prompt_blocks(self, a: Active) -> None:
        """Register the prompt's blocks this chunk filled (their hashes were computed at submit); at the end of
        the prompt the row keeps the tokens of its partial last block, to hash it once decoding fills it."""
        kv, bs = a.kv, self.cache.block_size
        row = kv.rows[0]
        resume = kv.resume_ids
        hashes = kv.hasher.prompt_hashes if resume is None else kv.resume_hashes
        for i in range(len(row.hashes), kv.prefilled // bs):
            self.cache.register(row, i, hashes[i], kv.hasher)
            row.hashes.append(hashes[i])
        if kv.prefilled == a.prefill_len:
            row.tokens = list((a.req.input_ids if resume is None else resume)[len(row.hashes) * bs:])

    def _cache_decoded_blocks(self, actives: list[Active]) -> None:
        """Each row fed one token: a row whose block it filled registers that block, hashed from its tokens."""
        for a in actives:
            hasher = a.kv.hasher
            if hasher is None:
                continue
            for row, token in zip(a.kv.rows, a.kv.next_tokens):
                self._register_token(hasher, row, token)

    def _register_token(self, hasher, row: RowKV, token: int) -> None:
        """`row` computed `token`'s KV: when that fills its block, the block is registered under its hash."""
        bs = self.cache.block_size
        row.tokens.append(token)
        if len(row.tokens) == bs:
            i = len(row.hashes)
            h = hasher.block(row.hashes[-1] if row.hashes else hasher.root, i * bs, row.tokens)
            self.cache.register(row, i, h, hasher)
            row.hashes.append(h)
            row.tokens = []

    def reorder(self, active: Active, parents: list[int]) -> None:
        """Rows nobody continues are freed first, then parents are handed over or forked: a request never holds
        more rows (KV blocks, hybrid models' state slots) than it has children."""
        rows: list[RowKV] = active.kv.rows
        kept = set(parents)
        for i, r in enumerate(rows):
            if i not in kept:
                self.cache.free(r)
        new, handed = [], set()
        for p in parents:
            if p in handed:
                new.append(self.cache.fork(rows[p]))
            else:
                handed.add(p)
                new.append(rows[p])
        active.kv.rows = new


def _attempt(call, *args):
    """call(*args), or the exception it raised (for a caller that ends one request with it)."""
    try:
        return call(*args)
    except Exception as e:  # noqa: BLE001
        return e


def _delta(a: Active) -> int:
    """M-RoPE: every token after the prompt is at its cache position + this (0 without image positions)."""
    return 0 if a.req.rope is None else a.req.rope.delta


def _prompt_rope(a: Active, start: int, length: int) -> Optional[torch.Tensor]:
    """The 3-D rotary positions [3, 1, length] of prefill positions [start, start + length): the prompt's own
    (`mrope.prompt_positions`), then (resuming after a preemption) cache position + delta; None without M-RoPE."""
    rope = a.req.rope
    if rope is None:
        return None
    p = rope.positions.shape[1]
    own = rope.positions[:, start:min(start + length, p)]  # [3, k]
    later = torch.arange(max(start, p), max(start + length, p)) + rope.delta  # generated tokens computed again
    return torch.cat([own, later.expand(3, -1)], dim=1)[:, None]  # [3, 1, length]
