"""The domain error type. Raised anywhere in the package; the Triton adapter turns it into a `TritonError`."""
from __future__ import annotations


class VLMError(Exception):
    """A request that cannot be served as sent. `code` mirrors Triton's error codes."""

    code = "INVALID_ARG"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(VLMError):
    code = "INVALID_ARG"


class Unavailable(VLMError):
    """The server cannot take the request now (queue full, shutting down)."""

    code = "UNAVAILABLE"


class Cancelled(VLMError):
    code = "CANCELLED"


class Internal(VLMError):
    code = "INTERNAL"
