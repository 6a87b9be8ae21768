"""The server's adapter registry: a folder given by `--lora-dir` / `LORA_DIR`, one adapter per subfolder.

A subfolder holds a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`) or TensorRT-LLM's converted
pair (`model.lora_weights.npy` + `model.lora_config.npy`). All-digit folder names are task ids (TensorRT-LLM's
prefetch layout); other names are names, each mapped to a stable task id:

    task_id(name) = 2**63 | (first 8 bytes of sha256(name), big-endian, with the top bit cleared)

so a name's id never changes between restarts or replicas and never collides with the small ids clients pick.
Names are confined to the folder: letters, digits, `.`, `_`, `-` only (no `/`, no `..`), and a subfolder whose
real path leaves the folder (a symlink out) is refused.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import InvalidArgument
from ..spec import TextSpec
from .format import Adapter, from_trtllm
from .peft import load_peft

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def task_id_for_name(name: str) -> int:
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return (1 << 63) | (digest & ((1 << 63) - 1))


class Registry:
    def __init__(self, root: Optional[str | Path], spec: TextSpec):
        self.root = Path(root).resolve() if root else None
        self.spec = spec
        self._index: Optional[tuple[int, dict[int, str]]] = None  # (folder mtime, task id -> name)
        if self.root is not None and not self.root.is_dir():
            raise InvalidArgument(f"lora_dir {self.root} is not a folder")

    def names(self) -> list[str]:
        if self.root is None:
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and NAME.match(p.name))

    def task_id(self, name: str) -> int:
        return int(name) if name.isdigit() else task_id_for_name(name)

    def find_id(self, task_id: int) -> Optional[str]:
        """The registry name whose task id is `task_id`, or None (an index rebuilt when the folder changes)."""
        if self.root is None:
            return None
        stamp = self.root.stat().st_mtime_ns  # adding or removing a subfolder changes it
        if self._index is None or self._index[0] != stamp:
            self._index = (stamp, {self.task_id(n): n for n in self.names()})
        return self._index[1].get(task_id)

    def path(self, name: str) -> Path:
        if not NAME.match(name):
            raise InvalidArgument(f"lora_name {name!r} is not a valid adapter name (letters, digits, '.', '_', '-')")
        if self.root is None:
            raise InvalidArgument(f"lora_name {name!r}: this server has no adapter registry (start it with "
                                  "--lora-dir)")
        p = self.root / name
        if not p.is_dir():
            raise InvalidArgument(f"lora_name {name!r} is not in the registry; available: {self.names()}")
        if self.root not in p.resolve().parents:
            raise InvalidArgument(f"lora_name {name!r} leaves the registry folder")
        return p

    def load(self, name: str) -> Adapter:
        p = self.path(name)
        if (p / "adapter_config.json").is_file():
            return load_peft(p, self.spec, name)
        w, c = p / "model.lora_weights.npy", p / "model.lora_config.npy"
        if w.is_file() and c.is_file():
            return from_trtllm(name, np.load(w), np.load(c), self.spec)
        raise InvalidArgument(f"adapter {name!r} holds neither a PEFT adapter nor model.lora_weights.npy + "
                              "model.lora_config.npy")
