"""A request's LoRA inputs, checked: TensorRT-LLM's `lora_task_id` / `lora_weights` / `lora_config` and our
`lora_name`. Where a request enters: preprocess calls `check_request` (so a bad adapter is refused before any
image is encoded, without building the adapter: the wire weights are checked in place), llm `parse_request`
(the same checks, then the adapter is built; llm can also be called directly). Every problem is an
InvalidArgument naming the input, the value and what is allowed; TensorRT-LLM's texts where it has one.

Registry adapters and wire adapters are separate namespaces: weights sent under a task id the registry owns (a
name's computed id, or an all-digit folder) are refused, so no client can change what a registry name or id
resolves to. Wire ids are shared by every client, as in TensorRT-LLM: weights sent again under a wire id
replace it for later requests (the adapter cache keeps the two namespaces apart, `lora.cache`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import InvalidArgument
from ..spec import TextSpec
from .format import Adapter, check_trtllm, from_trtllm
from .registry import Registry


@dataclass(frozen=True)
class LoraRequest:
    task_id: int  # the cache key (a registry name's task id when only the name was sent)
    name: Optional[str] = None  # registry adapter name, when sent by name
    wire: Optional[Adapter] = None  # the adapter the request carries (weights + config), else None


def _route(task_id: Optional[int], weights: Optional[np.ndarray], config: Optional[np.ndarray],
           name: Optional[str], registry: Registry) -> Optional[LoraRequest]:
    """Which adapter the request asks for (without the wire adapter itself); every check but the wire tensors'."""
    if (weights is None) != (config is None):
        raise InvalidArgument("lora_weights and lora_config must be sent together (got only "
                              f"{'lora_weights' if weights is not None else 'lora_config'})")
    if name is not None:
        if weights is not None:
            raise InvalidArgument(f"lora_name {name!r} selects a registry adapter; do not send lora_weights with it")
        registry.path(name)  # refuses names outside the registry
        tid = registry.task_id(name)
        if task_id is not None and task_id != tid:
            raise InvalidArgument(f"lora_name {name!r} is task id {tid} but lora_task_id {task_id} was sent")
        return LoraRequest(tid, name=name)
    if weights is not None:
        if task_id is None:
            raise InvalidArgument("lora_weights and lora_config need a lora_task_id to cache them under")
        owner = registry.find_id(task_id)
        if owner is not None:
            raise InvalidArgument(f"lora_task_id {task_id} belongs to the registry adapter {owner!r}: registry "
                                  "adapters cannot be replaced by lora_weights; send your weights under another "
                                  "lora_task_id")
        return LoraRequest(task_id)
    if task_id is None:
        return None
    return LoraRequest(task_id, name=registry.find_id(task_id))


def check_request(task_id: Optional[int], weights: Optional[np.ndarray], config: Optional[np.ndarray],
                  name: Optional[str], spec: TextSpec, registry: Registry, max_rank: int) -> None:
    """Every check of `parse_request`, without building the adapter (the wire weights are read in place)."""
    _route(task_id, weights, config, name, registry)
    if weights is not None:
        check_trtllm(weights, config, spec, max_rank)


def parse_request(task_id: Optional[int], weights: Optional[np.ndarray], config: Optional[np.ndarray],
                  name: Optional[str], spec: TextSpec, registry: Registry, max_rank: int,
                  dtype: torch.dtype = torch.float32) -> Optional[LoraRequest]:
    """None when the request asks for no adapter (the base model); wire weights are read in `dtype`."""
    req = _route(task_id, weights, config, name, registry)
    if weights is not None:
        return LoraRequest(req.task_id, wire=from_trtllm(str(task_id), weights, config, spec, max_rank, dtype))
    return req
