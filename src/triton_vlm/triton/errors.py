"""Domain errors -> `TritonError` at the boundary; anything unexpected becomes INTERNAL with a short message."""
from __future__ import annotations

import logging
import traceback

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover
    pb_utils = None

from ..errors import VLMError

log = logging.getLogger("triton_vlm")


def to_triton_error(exc: BaseException) -> "pb_utils.TritonError":
    if isinstance(exc, VLMError):
        code = getattr(pb_utils.TritonError, exc.code, pb_utils.TritonError.INVALID_ARG)
        return pb_utils.TritonError(exc.message, code)
    # not the client's fault: keep the traceback in the server log, send a one-line message
    log.error("internal error: %s", "".join(traceback.format_exception(exc)))
    return pb_utils.TritonError(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=to_triton_error(exc))
