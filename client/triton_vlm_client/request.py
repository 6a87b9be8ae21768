"""Turning a prompt, images and keyword parameters into what goes on the wire (no I/O besides reading image
files): the gRPC tensors and the JSON body of the HTTP generate extension.

Only the parameters the caller set are sent, so the server's defaults apply to the rest, with two client
defaults (documented in docs/interfaces.md): `max_tokens` (required by the server) defaults to `DEFAULT_MAX_TOKENS`,
and `exclude_input_in_output` defaults to True (only the answer is returned; pass False to get prompt +
answer, or None to leave it to the server's default, False).
"""
from __future__ import annotations

import base64
import numbers
import os
from typing import Any, Iterable, Mapping, Union

import numpy as np

from . import protocol as P

DEFAULT_MAX_TOKENS = 64
CLIENT_DEFAULTS: dict[str, Any] = {P.MAX_TOKENS: DEFAULT_MAX_TOKENS, P.EXCLUDE_INPUT_IN_OUTPUT: True}
IMAGE_MARKER = "<image>"

ImageLike = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]

_EARLY_STOPPING = {False: P.EARLY_STOPPING_FALSE, True: P.EARLY_STOPPING_TRUE, "never": P.EARLY_STOPPING_NEVER,
                   "false": P.EARLY_STOPPING_FALSE, "true": P.EARLY_STOPPING_TRUE}
_INT_RANGE = {P.INT32: (-(2**31), 2**31 - 1), P.UINT64: (0, 2**64 - 1)}
_NUMPY = {P.INT32: np.int32, P.UINT64: np.uint64, P.FP32: np.float32, P.FP16: np.float16, P.BOOL: np.bool_}


# ---------------------------------------------------------------- images


def load_image(image: ImageLike) -> bytes:
    """The encoded bytes of one image: a file path (str or os.PathLike) is read; bytes are taken as they are."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            data = f.read()
    else:
        raise TypeError(f"an image must be a file path or bytes, got {type(image).__name__}")
    if not data:
        raise ValueError(f"image {image if isinstance(image, (str, os.PathLike)) else '(bytes)'} is empty")
    return data


def inline_image(image: ImageLike, mime: str = "image/jpeg") -> str:
    """`<img src="data:image/jpeg;base64,...">` for one image, to put inside a prompt.

    The label defaults to image/jpeg whatever the file is (as text-generation-webui does); the server decodes
    the image by its content.
    """
    b64 = base64.b64encode(load_image(image)).decode("ascii")
    return f'<img src="data:{mime};base64,{b64}">'


def ensure_image_markers(prompt: str, n_images: int) -> str:
    """Prepend `<image>\\n` for every image the prompt has no `<image>` marker for (the CLI does this)."""
    missing = n_images - prompt.count(IMAGE_MARKER)
    return (IMAGE_MARKER + "\n") * missing + prompt if missing > 0 else prompt


# ---------------------------------------------------------------- parameters


def early_stopping_wire(value: Any) -> int:
    """True / False / "never" (or 1 / 0 / 2, or "true" / "false") -> 1 / 0 / 2."""
    if isinstance(value, str):
        key: Any = value.strip().lower()
    elif isinstance(value, (bool, np.bool_)):
        key = bool(value)
    elif isinstance(value, numbers.Integral) and int(value) in (0, 1, 2):
        return int(value)
    else:
        key = None
    if key not in _EARLY_STOPPING:
        raise ValueError(f"early_stopping must be True, False or 'never' (or 1, 0, 2), got {value!r}")
    return _EARLY_STOPPING[key]


def _file_bytes(name: str, value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        from pathlib import Path  # noqa: PLC0415

        return Path(value).read_bytes()
    raise TypeError(f"{name} must hold file paths or encoded file bytes, got an item of {type(value).__name__}")


def _words(name: str, value: Any) -> list[str]:
    words = [value] if isinstance(value, str) else list(value)
    for w in words:
        if not isinstance(w, str):
            raise TypeError(f"{name} must be a string or a list of strings, got an item {w!r}")
    return words


def _scalar(name: str, dtype: str, value: Any) -> Any:
    if dtype == P.BOOL:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise TypeError(f"{name} must be True or False, got {value!r}")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if dtype == P.FP32:
        if not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    lo, hi = _INT_RANGE[dtype]
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}] ({dtype}), got {value}")
    return int(value)


def normalize_params(params: Mapping[str, Any], defaults: Mapping[str, Any] = CLIENT_DEFAULTS) -> dict[str, Any]:
    """Keyword parameters -> {input name: Python value} of the inputs to send, in protocol order.

    A parameter that is absent takes the client default if there is one; a parameter set to None is not sent.
    Unknown names raise TypeError, values of the wrong type TypeError / ValueError (range checks beyond the
    wire type are the server's).
    """
    unknown = sorted(set(params) - set(P.PARAM_NAMES))
    if unknown:
        raise TypeError(f"unknown generation parameter(s) {', '.join(unknown)}; allowed: {', '.join(P.PARAM_NAMES)}")
    merged = {**defaults, **params}
    out: dict[str, Any] = {}
    for name in P.PARAM_NAMES:
        value = merged.get(name)
        if value is None:
            continue
        dtype = P.INPUTS_BY_NAME[name].dtype
        if name == P.EARLY_STOPPING:
            out[name] = early_stopping_wire(value)
        elif name == P.VIDEOS:  # files or their bytes -> base64 text (the server decodes it; JSON has no bytes)
            out[name] = [base64.b64encode(_file_bytes(name, v)).decode("ascii") for v in
                         ([value] if isinstance(value, (bytes, str)) else value)]
        elif dtype == P.BYTES:
            words = _words(name, value)
            if words:
                out[name] = words
        else:
            out[name] = _scalar(name, dtype, value)
    return out


def wire_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """`normalize_params`, plus `lora_dir`: an adapter folder (TensorRT-LLM's .npy pair or a PEFT adapter) read
    into `lora_weights` [N, W] / `lora_config` [N, 3], sent with the `lora_task_id` the caller picks (the server
    caches the adapter under it: later requests may send the id alone)."""
    params = dict(params)
    lora_dir = params.pop("lora_dir", None)
    out = normalize_params(params)
    if lora_dir is not None:
        if P.LORA_TASK_ID not in out:
            raise ValueError("lora_dir needs a lora_task_id to cache the adapter under")
        if P.LORA_NAME in out:
            raise ValueError("send either lora_dir or lora_name, not both")
        from .adapter import read_adapter  # noqa: PLC0415

        out[P.LORA_WEIGHTS], out[P.LORA_CONFIG] = read_adapter(lora_dir)
    return out


# ---------------------------------------------------------------- wire formats


def _bytes_row(items: Iterable[bytes]) -> np.ndarray:
    items = list(items)
    arr = np.empty((1, len(items)), dtype=object)  # [1, n]
    for i, b in enumerate(items):
        arr[0, i] = b
    return arr


def build_tensors(prompt: str, images: Iterable[bytes], params: Mapping[str, Any],
                  stream: bool = False) -> list[tuple[str, str, np.ndarray]]:
    """(name, Triton dtype, array) of every input to send over gRPC, batch dim included.

    `params` is the output of `normalize_params`; `images` are encoded image bytes.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt must be a str, got {type(prompt).__name__}")
    values: dict[str, Any] = dict(params)
    values[P.TEXT_INPUT] = [prompt]
    images = list(images)
    if images:
        values[P.IMAGES] = images
    if stream:
        values[P.STREAM] = True
    out = []
    for info in P.INPUTS:  # protocol order
        if info.name not in values:
            continue
        v = values[info.name]
        if isinstance(v, np.ndarray):  # lora_weights / lora_config
            arr = v[None].astype(_NUMPY[info.dtype])  # [1, N, W]
        elif info.dtype == P.BYTES:
            arr = _bytes_row(x if isinstance(x, bytes) else x.encode("utf-8") for x in v)  # [1, n]
        else:
            arr = np.array([[v]], dtype=_NUMPY[info.dtype])  # [1, 1]
        out.append((info.name, info.dtype, arr))
    return out


def build_json(prompt: str, images: Iterable[bytes], params: Mapping[str, Any], stream: bool = False) -> dict:
    """The JSON body of `POST /v2/models/<model>/generate[_stream]`: input name -> value.

    Triton makes a scalar a [1, 1] tensor and a list a [1, n] tensor; images travel as base64 text (JSON has
    no bytes) and the server decodes them.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt must be a str, got {type(prompt).__name__}")
    body: dict[str, Any] = {P.TEXT_INPUT: prompt}
    images = list(images)
    if images:
        body[P.IMAGES] = [base64.b64encode(b).decode("ascii") for b in images]
    for name, v in params.items():
        body[name] = list(v) if isinstance(v, list) else v
    if stream:
        body[P.STREAM] = True
    return body
