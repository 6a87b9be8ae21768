"""The one error type of the client: the server (or the transport) refused or failed a request."""
from __future__ import annotations

from typing import Optional, Union

# HTTP status -> gRPC-style code name, so callers can branch on `code` whatever the protocol.
_HTTP_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 409: "ALREADY_EXISTS",
               429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
               503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class VLMClientError(Exception):
    """`status` is what the transport reported: the gRPC status string (``"StatusCode.INVALID_ARGUMENT"``),
    the HTTP status code (``400``), a client-side condition (``"StatusCode.DEADLINE_EXCEEDED"`` /
    ``"DEADLINE_EXCEEDED"`` when the timeout expired, ``"...UNAVAILABLE"`` when the server cannot be reached)
    or ``None`` when Triton sent an error without a code (errors inside a gRPC stream carry only a message).
    `message` is the server's message, unchanged.
    """

    def __init__(self, status: Optional[Union[str, int]], message: str):
        super().__init__(f"[{status}] {message}" if status is not None else message)
        self.status = status
        self.message = message

    @property
    def code(self) -> str:
        """Protocol-independent code name: INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, DEADLINE_EXCEEDED,
        INTERNAL, ... or UNKNOWN."""
        s = self.status
        if isinstance(s, int):
            return _HTTP_CODES.get(s, "UNKNOWN" if s < 500 or s > 599 else "INTERNAL")
        if isinstance(s, str) and s:
            return s.rsplit(".", 1)[-1]
        return "UNKNOWN"

    def __reduce__(self):  # picklable (multiprocessing, pytest-xdist)
        return (type(self), (self.status, self.message))
