"""One owner for every live decoupled request: the only code that touches a request after `execute()`.

Triton's python backend frees a request's response factory as soon as the final response (flag FINAL) is sent.
Asking such a request `is_cancelled()` afterwards makes tritonserver dereference freed memory and die with
SIGSEGV (`TRITONBACKEND_ResponseFactoryIsCancelled`). So a request's whole lifetime is owned in one place:

- `open()` (from `execute()`, before the request is handed to the backend) enters it in the table;
- the backend's thread never sends anything itself: `post()` only queues its results;
- one thread, the responder, sends every response, asks every `is_cancelled()`, and removes a request from
  the table in the same step that sends its final response. Nothing is ever asked of a request after that:
  a request leaves the table exactly once, and only this thread looks at the senders in the table.

Every request that was opened gets exactly one final response: its result, its error, CANCELLED when the
client cancelled it, or UNAVAILABLE when the model shuts down with it still running.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ..errors import Cancelled, Unavailable

log = logging.getLogger("triton_vlm")


class Sender(Protocol):
    """What Triton's `InferenceResponseSender` offers (and the unit tests' fake)."""

    def send(self, response: Any = None, flags: int = 0) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class _Post:
    key: str
    result: Any = None  # a backend result (`final` attribute), or None with `error`
    error: Optional[BaseException] = None


class Responder:
    """`build(key, state, result) -> (response, final)` turns a backend result into a Triton response;
    `error(exc) -> response` builds an error response; `on_cancel(key)` tells the backend to drop a request the
    client cancelled; `tick()` runs about every `tick_s` on this thread (metrics)."""

    FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def __init__(self, build: Callable[[str, Any, Any], tuple[Any, bool]], error: Callable[[BaseException], Any],
                 on_cancel: Callable[[str], None], *, poll_s: float = 0.05, tick: Optional[Callable[[], None]] = None,
                 tick_s: float = 0.5):
        self._build, self._error, self._on_cancel = build, error, on_cancel
        self._poll_s, self._tick, self._tick_s = poll_s, tick, tick_s
        self._lock = threading.Lock()
        self._live: dict[str, tuple[Sender, Any]] = {}  # key -> (sender, caller's state)
        self._queue: "queue.SimpleQueue[Optional[_Post]]" = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm-responder", daemon=True)

    # --- any thread -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def open(self, key: str, sender: Sender, state: Any) -> None:
        """Take ownership of a request; from now on only the responder touches `sender`."""
        with self._lock:
            if key in self._live:
                raise ValueError(f"request key {key!r} is already live")
            self._live[key] = (sender, state)

    def post(self, key: str, result: Any) -> None:
        """Queue a backend result (thread-safe, never blocks: the engine thread calls it)."""
        self._queue.put(_Post(key, result))

    def fail(self, key: str, error: BaseException) -> None:
        """Queue a final error for an opened request (e.g. the backend refused it)."""
        self._queue.put(_Post(key, None, error))

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued, answer every request still live with UNAVAILABLE, stop the thread."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("llm responder did not stop within %.1f s", timeout)

    # --- the responder thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception:  # noqa: BLE001 - a bug here must not leave every live request hanging
                log.exception("llm responder failed; carrying on")
                time.sleep(self._poll_s)

    def _serve(self) -> None:
        next_poll = next_tick = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self._poll_s)
            except queue.Empty:
                item = None
            while item is not None:
                self._handle(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if self._stopping.is_set():
                self._drain_and_close()
                return
            now = time.monotonic()
            if now >= next_poll:
                self._poll_cancellations()
                next_poll = now + self._poll_s
            if self._tick is not None and now >= next_tick:
                next_tick = now + self._tick_s
                try:
                    self._tick()
                except Exception:  # noqa: BLE001 - monitoring never takes the model down
                    log.exception("llm responder tick failed")

    def _handle(self, post: _Post) -> None:
        with self._lock:
            entry = self._live.get(post.key)
        if entry is None:  # already answered (cancelled by its client): never touch it again
            return
        sender, state = entry
        try:
            if post.error is not None:
                response, final = self._error(post.error), True
            else:
                response, final = self._build(post.key, state, post.result)
        except Exception as e:  # noqa: BLE001 - a response we cannot build ends that request only
            response, final = self._error(e), True
        self._send(post.key, sender, response, final)

    def _send(self, key: str, sender: Sender, response: Any, final: bool) -> None:
        if final:
            with self._lock:
                self._live.pop(key, None)  # leaves the table in the same step as its final response
        try:
            sender.send(response, flags=self.FINAL if final else 0)
        except Exception as e:  # noqa: BLE001 - the client is gone: stop generating for it
            if not final:
                with self._lock:
                    self._live.pop(key, None)
                self._on_cancel(key)
            log.info("request %s: response not delivered (%s); generation for it stopped", key, e)

    def _poll_cancellations(self) -> None:
        with self._lock:
            live = list(self._live.items())
        for key, (sender, _state) in live:
            try:
                cancelled = sender.is_cancelled()
            except Exception:  # noqa: BLE001
                cancelled = False
            if cancelled:
                log.info("request %s cancelled by the client; its rows and KV blocks are freed", key)
                self._on_cancel(key)
                self._send(key, sender, self._error(Cancelled(f"request {key} was cancelled by the client")), True)

    def _drain_and_close(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._handle(item)
        with self._lock:
            live = list(self._live.items())
        for key, (sender, _state) in live:
            self._send(key, sender, self._error(Unavailable("the llm model is shutting down; retry")), True)
