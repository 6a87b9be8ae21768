"""Triton request tensors -> Python values, Python values -> Triton output tensors.

The only module (with `errors.py` and `config.py`) that imports `triton_python_backend_utils`; the model.py
files and the rest of the package never touch Triton types directly.

Rows: a request may stack several prompts (batch dim B > 1, see `names.INPUT_IDS_PAD`). The readers take
`row=None` for "the request is one row" (batch dim 1 required, the message says so otherwise) or the row to
read; `per_row` runs a function on every row and names the row in a domain error.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import numpy as np

try:  # available only inside the python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - unit tests import this module outside the server
    pb_utils = None

from ..errors import InvalidArgument, VLMError
from .. import names as N
from ..names import BOOL, BYTES, FP32, INT32, INT64, UINT64, TensorSpec

_NUMPY = {BOOL: np.bool_, BYTES: np.object_, FP32: np.float32, INT32: np.int32, INT64: np.int64, UINT64: np.uint64}
T = TypeVar("T")


def batch_size(request, names: Iterable[str]) -> int:
    """The request's batch dim, read from the first of `names` it carries (Triton checks that every input of
    a request has the same one); 1 when it carries none of them."""
    for name in names:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is not None:
            shape = list(t.shape())
            return int(shape[0]) if shape else 1
    return 1


def per_row(rows: int, fn: Callable[[Optional[int]], T]) -> list[T]:
    """[fn(None)] for a request of one row (its messages unchanged), else fn(row) for each row; a domain error
    in a row of a batched request is re-raised naming the row."""
    if rows == 1:
        return [fn(None)]
    out = []
    for row in range(rows):
        try:
            out.append(fn(row))
        except VLMError as e:
            raise in_row(e, row, rows) from None
    return out


def in_row(error: BaseException, row: int, rows: int) -> BaseException:
    """A domain error of one row of a batched request, naming the row; other errors (and one-row requests')
    unchanged."""
    if rows == 1 or not isinstance(error, VLMError):
        return error
    return type(error)(f"row {row} of the batch: {error.message}")


def _select(arr, name: str, row: Optional[int]):
    if row is None:
        if arr.shape[0] != 1:
            raise InvalidArgument(f"input {name!r} must have batch size 1 per request, got shape {list(arr.shape)}")
        return arr[0]
    return arr[row]


def input_array(request, name: str, row: Optional[int] = None) -> np.ndarray | None:
    """The input as numpy without the batch dimension (`row` None: the request must be one row), or None if
    absent."""
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
    return _select(arr, name, row)


def scalar(request, spec: TensorSpec, row: Optional[int] = None) -> Any:
    """A [1] input as a Python scalar (None if absent)."""
    arr = input_array(request, spec.name, row)
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


def strings(request, name: str, row: Optional[int] = None) -> list[str]:
    arr = input_array(request, name, row)
    if arr is None:
        return []
    return [_text(v, name) for v in arr.reshape(-1)]


def blobs(request, name: str, row: Optional[int] = None) -> list[bytes]:
    arr = input_array(request, name, row)
    if arr is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode() for v in arr.reshape(-1)]


def scalars(request, specs: Iterable[TensorSpec], row: Optional[int] = None) -> dict[str, Any]:
    """All scalar inputs of `specs` that the request carried."""
    out = {}
    for s in specs:
        v = scalar(request, s, row)
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


def batch_response(outputs: dict[str, tuple[TensorSpec, np.ndarray]]) -> "pb_utils.InferenceResponse":
    """Outputs that already hold the batch dim (every row of a request)."""
    tensors = []
    for spec, value in outputs.values():
        arr = np.asarray(value, dtype=_NUMPY[spec.dtype])
        tensors.append(pb_utils.Tensor(spec.name, arr))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def input_tensor(request, name: str, row: Optional[int] = None):
    """A numeric input as a torch tensor without the batch dim, by DLPack: no copy, any dtype (BF16 included),
    on the device it arrived on (a GPU tensor when the model that produced it left it there and this model
    sets FORCE_CPU_ONLY_INPUT_TENSORS "no"); None if absent."""
    import torch  # noqa: PLC0415

    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    x = torch.from_dlpack(t.to_dlpack())
    if x.dim() == 0:
        raise InvalidArgument(f"input {name!r} must have a batch dim, got a scalar")
    return _select(x, name, row)


def torch_response(name: str, rows: Sequence) -> "pb_utils.InferenceResponse":
    """One output from the torch tensors of a request's rows, each [n_i, ...] (the same trailing dims), by
    DLPack: it stays on its device, in its dtype. One row: [1, n, ...] without a copy; several rows:
    [B, max n_i, ...], each row zero padded beyond its n_i."""
    return torch_outputs({name: rows})


def torch_outputs(outputs: dict[str, Sequence]) -> "pb_utils.InferenceResponse":
    """Several outputs, each from the torch tensors of the request's rows as `torch_response` builds one."""
    import torch  # noqa: PLC0415
    from torch.utils.dlpack import to_dlpack  # noqa: PLC0415

    tensors = []
    for name, rows in outputs.items():
        if len(rows) == 1:
            out = rows[0][None].contiguous()
        else:
            first = rows[0]
            out = torch.zeros((len(rows), max(r.shape[0] for r in rows), *first.shape[1:]), dtype=first.dtype,
                              device=first.device)
            for i, r in enumerate(rows):
                out[i, :r.shape[0]] = r
        tensors.append(pb_utils.Tensor.from_dlpack(name, to_dlpack(out)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def requested_outputs(request) -> Optional[frozenset[str]]:
    """The output names the request asked for (Triton lists every output when the client named none); None
    when the request cannot tell (the unit tests' fakes): build every output then."""
    names = getattr(request, "requested_output_names", None)
    return None if names is None else frozenset(names())


class ResponseSender:
    """A request's `InferenceResponseSender` whose `send()` holds the response's output tensors from Python
    until the call returns, so that the stub never frees a numpy array without the GIL.

    Why (python_backend r24.10, Triton 2.51): `ResponseSender::Send` releases the GIL first thing, then
    `InferResponse::PruneOutputTensors` erases the outputs the request did not ask for; when the response held
    the last reference to such a `pb_utils.Tensor` (the usual case: the Python list passed to
    `InferenceResponse` is gone), `~PbTensor` drops its numpy array, a Py_DECREF and pymalloc free without
    the GIL, racing every other Python thread's allocations. The stub then dies with SIGSEGV in
    `pymalloc_alloc` on some other thread. Fixed upstream in r24.12 (python_backend #390: `~PbTensor` takes
    the GIL). Holding the tensors here moves their last release to after `send()`, with the GIL held; the
    llm model also builds only the outputs the request asked for, so nothing is pruned at all."""

    __slots__ = ("_sender",)

    def __init__(self, sender):
        self._sender = sender

    def send(self, response=None, flags: int = 0) -> None:
        tensors = getattr(response, "output_tensors", None)
        held = tensors() if tensors is not None else None  # [pb_utils.Tensor]: one reference each
        self._sender.send(response, flags=flags)
        del held  # here, with the GIL: the last references may go now

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


def lora_inputs(request, row: Optional[int] = None) -> tuple | None:
    """(lora_task_id, lora_weights [N, W], lora_config [N, 3], lora_name), each None when absent or empty; None
    when the request sent none of them."""
    task = scalar(request, N.spec(N.LORA_TASK_ID, N.LORA_INPUTS), row)
    name = scalar(request, N.spec(N.LORA_NAME, N.LORA_INPUTS), row)
    weights = input_array(request, N.LORA_WEIGHTS, row)
    config = input_array(request, N.LORA_CONFIG, row)
    weights = None if weights is None or weights.size == 0 else weights
    config = None if config is None or config.size == 0 else config
    if task is None and name is None and weights is None and config is None:
        return None
    return None if task is None else int(task), weights, config, name or None
