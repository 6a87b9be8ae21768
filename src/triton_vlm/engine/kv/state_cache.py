"""Per-sequence state slots beside the paged KV: the fixed-size states of hybrid models' linear-attention layers.

A layer that keeps no KV (Gated DeltaNet, Mamba-like) carries, per sequence, a few tensors of a fixed shape whatever
the sequence's length (a conv window, a recurrent state). The pool holds `slots` of them for every such layer, as
one tensor per named state, [layers, slots, *shape]; a running row holds one slot. What the states are comes as data
(`StateSpec`, from the family), so this module knows nothing of any layer's math (vLLM's mamba state cache beside
its KV blocks is the model).

Rows that are reordered or forked (beam search picks parents every step; `n` samples and `num_return_sequences`
fork one prompt's row) move their states with them: `copy(src, dst)` copies whole slots by index, one indexed copy
per tensor for all rows of the step (no host round trip per row). A freed slot is zeroed when it is next allocated,
so no state leaks from one request into another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """The states every linear layer keeps per sequence: name -> (shape, dtype); `layers` how many such layers."""

    layers: int
    states: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (name, per-sequence shape, dtype)

    def slot_bytes(self) -> int:
        """Bytes one sequence's states take over all the linear layers (what the KV profile counts per slot)."""
        total = 0
        for _, shape, dtype in self.states:
            n = 1
            for d in shape:
                n *= d
            total += n * (torch.finfo(dtype).bits // 8)
        return total * self.layers


class StateCacheFull(RuntimeError):
    """No free state slot: the scheduler admits no more sequences than the profile sized slots for."""


class StateCache:
    """`slots` sequences' states for every linear layer; slot indices are what rows hold."""

    def __init__(self, spec: StateSpec, slots: int, device: torch.device | str = "cpu"):
        if slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {slots}")
        self.spec, self.slots = spec, slots
        self.tensors = {name: torch.zeros((spec.layers, slots, *shape), dtype=dtype, device=device)
                        for name, shape, dtype in spec.states}  # name -> [layers, slots, *shape]
        self._free = list(range(slots - 1, -1, -1))  # a stack: the lowest free slot is handed out first
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        """A zeroed slot for a new sequence."""
        if not self._free:
            raise StateCacheFull(f"all {self.slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        for t in self.tensors.values():
            t[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def copy(self, src: list[int] | torch.Tensor, dst: list[int] | torch.Tensor) -> None:
        """dst[i]'s states become src[i]'s (all at once: a slot may be both read and written, as beams that swap
        parents do); one indexed copy per state tensor."""
        src_t = torch.as_tensor(src, dtype=torch.long)
        dst_t = torch.as_tensor(dst, dtype=torch.long)
        if src_t.shape != dst_t.shape:
            raise ValueError(f"copy of {src_t.numel()} slots into {dst_t.numel()}")
        for t in self.tensors.values():
            idx_s, idx_d = src_t.to(t.device), dst_t.to(t.device)
            t[:, idx_d] = t[:, idx_s]  # the right side is gathered first: overlapping src/dst are safe

    def view(self, name: str, layer: int, slot: int) -> torch.Tensor:
        """Layer `layer`'s state `name` of one slot, [1, *shape], a view (updated in place by a prompt)."""
        return self.tensors[name][layer, slot:slot + 1]

    def gather(self, name: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[rows, *shape]: a copy of the rows' states of one layer (decode reads, computes, then `scatter`s)."""
        return self.tensors[name][layer].index_select(0, slots)

    def scatter(self, name: str, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.tensors[name][layer].index_copy_(0, slots, values)
