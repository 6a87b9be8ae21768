"""`lora_path` (TensorRT-LLM's `llmapi` input): a PEFT adapter folder on the server's filesystem, read only from
the folders the operator configured (`lora_root`, one or more, comma separated).

A client names a folder; the server reads it. So the folder must be inside a configured root once every symlink
is followed (a symlink that leaves the roots is refused like a path outside them), must exist, and must hold a
PEFT adapter (`adapter_config.json`). Every refusal is InvalidArgument naming `lora_path`, the value sent and what
is allowed. Relative paths are taken relative to each root in turn.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ..errors import InvalidArgument

CKPT_SOURCES = ("hf",)  # TensorRT-LLM also reads "nemo" checkpoints; we read PEFT (hf) folders only


def parse_roots(value: str | Iterable[str] | None) -> tuple[Path, ...]:
    """The `lora_root` parameter ("a,b" or a list) -> the real paths of the folders that exist (others dropped:
    a root that does not exist holds no adapter)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    roots = [Path(v.strip()).resolve() for v in items if v and v.strip()]
    return tuple(r for r in roots if r.is_dir())


def check_ckpt_source(source: str | None) -> None:
    if source not in (None, "", *CKPT_SOURCES):
        raise InvalidArgument(f"lora_ckpt_source must be one of {', '.join(CKPT_SOURCES)}, got {source!r} "
                              "(NeMo checkpoints are not read; convert the adapter to PEFT)")


def resolve_lora_path(path: str, roots: tuple[Path, ...]) -> Path:
    """The real folder `path` names, inside one of `roots`, holding a PEFT adapter; else InvalidArgument."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidArgument(f"lora_path must be a folder path, got {path!r}")
    if path.startswith("file:") or "://" in path:
        raise InvalidArgument(f"lora_path {path!r} must be a folder on the server, not a URL")
    if not roots:
        raise InvalidArgument(f"lora_path {path!r}: this server reads no adapter folders (start it with a "
                              "lora_root: --set lora_root=/folder)")
    candidates = [Path(path)] if Path(path).is_absolute() else [r / path for r in roots]
    for c in candidates:
        real = c.resolve()  # every symlink followed: a link out of the roots lands outside them
        root = next((r for r in roots if r in real.parents), None)
        if root is None:
            continue
        if not real.is_dir():
            raise InvalidArgument(f"lora_path {path!r} does not exist under {root} (a PEFT adapter folder is "
                                  "needed)")
        if not (real / "adapter_config.json").is_file():
            raise InvalidArgument(f"lora_path {path!r} holds no adapter_config.json (a PEFT adapter folder is "
                                  "needed)")
        return real
    raise InvalidArgument(f"lora_path {path!r} is outside the server's adapter folders (lora_root: "
                          f"{', '.join(map(str, roots))}); symlinks are followed before this check")
