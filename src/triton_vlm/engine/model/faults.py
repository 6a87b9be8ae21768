"""What the engine makes of an exception that is not a request's own error.

- `as_error(e)`: the domain error a request ends with when `e` interrupts its handling: a `VLMError` as it is;
  device memory exhausted (`torch.OutOfMemoryError`) -> `Unavailable` (the same request may fit later);
  anything else -> `Internal`, naming the exception.
- `is_device_fault(e)`: a CUDA error other than out-of-memory (`torch.AcceleratorError`, `torch.cuda.CudaError`,
  or a RuntimeError whose message says "CUDA error" / "device-side assert", as PyTorch words them). After one,
  the process's CUDA context may be unusable for good (a device-side assert poisons it), so the engine stops and
  reports it (`Engine.on_fatal`) instead of failing every later request.
- `Backoff`: the pause of the engine loop after an unexpected failure of a whole step, doubling from `first` up
  to `cap` while failures repeat, back to none after a step succeeds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...errors import Internal, Unavailable, VLMError

log = logging.getLogger(__name__)

_DEVICE_FAULT_TEXT = ("CUDA error", "device-side assert", "CUBLAS_STATUS_", "CUDNN_STATUS_")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_device_fault(e: BaseException) -> bool:
    for x in _chain(e):
        if isinstance(x, torch.OutOfMemoryError):
            return False  # recoverable: the allocation failed, the context is intact
        if isinstance(x, (getattr(torch, "AcceleratorError", ()), torch.cuda.CudaError)):
            return True
        if isinstance(x, RuntimeError) and any(t in str(x) for t in _DEVICE_FAULT_TEXT):
            return True
    return False


def as_error(e: BaseException, during: str = "") -> VLMError:
    if isinstance(e, VLMError):
        return e
    where = f" {during}" if during else ""
    if isinstance(e, torch.OutOfMemoryError):
        log.warning("out of device memory%s: %s", where, e)
        return Unavailable(f"out of device memory{where}; retry later ({e})")
    log.error("request failed%s", where, exc_info=e)
    return Internal(f"{type(e).__name__}{where}: {e}")


@dataclass
class Backoff:
    first: float = 0.01  # seconds after the first failure
    cap: float = 2.0
    failures: int = 0  # consecutive

    @property
    def delay(self) -> float:
        return 0.0 if self.failures == 0 else min(self.cap, self.first * 2.0 ** min(self.failures - 1, 60))

    def failed(self) -> float:
        """Count one more failure; the pause before the next attempt."""
        self.failures += 1
        return self.delay

    def reset(self) -> None:
        self.failures = 0
