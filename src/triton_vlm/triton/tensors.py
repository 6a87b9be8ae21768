"""Triton request tensors -> Python values, Python values -> Triton output tensors.

The only module (with `errors.py` and `config.py`) that imports `triton_python_backend_utils`; the model.py
files and the rest of the package never touch Triton types directly.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

try:  # available only inside the python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - unit tests import this module outside the server
    pb_utils = None

from ..errors import InvalidArgument
from .. import names as N
from ..names import BOOL, BYTES, FP32, INT32, UINT64, TensorSpec

_NUMPY = {BOOL: np.bool_, BYTES: np.object_, FP32: np.float32, INT32: np.int32, UINT64: np.uint64}


def input_array(request, name: str) -> np.ndarray | None:
    """The input as numpy without the batch dimension (each request is one batch row), or None if absent."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    if t.is_cpu():
        arr = t.as_numpy()
    else:  # FORCE_CPU_ONLY_INPUT_TENSORS "no": a tensor another model left on the GPU
        import torch  # noqa: PLC0415

        arr = torch.from_dlpack(t.to_dlpack()).cpu().numpy()
    if arr.ndim == 0:
        return arr.reshape(1)
    if arr.shape[0] != 1:
        raise InvalidArgument(f"input {name!r} must have batch size 1 per request, got shape {list(arr.shape)}")
    return arr[0]


def scalar(request, spec: TensorSpec) -> Any:
    """A [1] input as a Python scalar (None if absent)."""
    arr = input_array(request, spec.name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InvalidArgument(f"input {spec.name!r} must hold exactly one value, got {arr.size}")
    v = arr.reshape(-1)[0]
    if spec.dtype == BYTES:
        return _text(v, spec.name)
    if spec.dtype == BOOL:
        return bool(v)
    return v.item()


def strings(request, name: str) -> list[str]:
    arr = input_array(request, name)
    if arr is None:
        return []
    return [_text(v, name) for v in arr.reshape(-1)]


def blobs(request, name: str) -> list[bytes]:
    arr = input_array(request, name)
    if arr is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode() for v in arr.reshape(-1)]


def scalars(request, specs: Iterable[TensorSpec]) -> dict[str, Any]:
    """All scalar inputs of `specs` that the request carried."""
    out = {}
    for s in specs:
        v = scalar(request, s)
        if v is not None:
            out[s.name] = v
    return out


def _text(v, name: str) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"input {name!r} is not valid UTF-8 text: {e}") from None
    return str(v)


def output_tensor(spec: TensorSpec, value) -> "pb_utils.Tensor":
    """`value` without the batch dim; a batch dim of 1 is added."""
    if spec.dtype == BYTES:
        arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in value], dtype=np.object_)
    else:
        arr = np.asarray(value, dtype=_NUMPY[spec.dtype])
    return pb_utils.Tensor(spec.name, arr[np.newaxis, ...])


def response(outputs: dict[str, tuple[TensorSpec, Any]]) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[output_tensor(s, v) for s, v in outputs.values()])


def input_tensor(request, name: str):
    """A numeric input as a torch tensor without the batch dim, by DLPack: no copy, any dtype (BF16 included),
    on the device it arrived on (a GPU tensor when the model that produced it left it there and this model
    sets FORCE_CPU_ONLY_INPUT_TENSORS "no"); None if absent."""
    import torch  # noqa: PLC0415

    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    x = torch.from_dlpack(t.to_dlpack())
    if x.dim() == 0 or x.shape[0] != 1:
        raise InvalidArgument(f"input {name!r} must have batch size 1 per request, got shape {list(x.shape)}")
    return x[0]


def torch_response(name: str, x) -> "pb_utils.InferenceResponse":
    """One output from a torch tensor (batch dim added) by DLPack: it stays on its device, in its dtype."""
    from torch.utils.dlpack import to_dlpack  # noqa: PLC0415

    tensor = pb_utils.Tensor.from_dlpack(name, to_dlpack(x[None].contiguous()))
    return pb_utils.InferenceResponse(output_tensors=[tensor])


def lora_inputs(request) -> tuple | None:
    """(lora_task_id, lora_weights [N, W], lora_config [N, 3], lora_name), each None when absent or empty; None
    when the request sent none of them."""
    task = scalar(request, N.spec(N.LORA_TASK_ID, N.LORA_INPUTS))
    name = scalar(request, N.spec(N.LORA_NAME, N.LORA_INPUTS))
    weights = input_array(request, N.LORA_WEIGHTS)
    config = input_array(request, N.LORA_CONFIG)
    weights = None if weights is None or weights.size == 0 else weights
    config = None if config is None or config.size == 0 else config
    if task is None and name is None and weights is None and config is None:
        return None
    return None if task is None else int(task), weights, config, name or None
