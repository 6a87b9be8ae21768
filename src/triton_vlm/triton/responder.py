"""One owner for every live decoupled request: the only code that touches a request after `execute()`.

Triton's python backend frees a request's response factory as soon as the final response (flag FINAL) is sent.
Asking such a request `is_cancelled()` afterwards makes tritonserver dereference freed memory and die with
SIGSEGV (`TRITONBACKEND_ResponseFactoryIsCancelled`). So a request's whole lifetime is owned here:

- `open()` (from `execute()`, before the request is handed to the backend) enters it in the table;
- the backend's thread never sends anything itself: `post()` only queues its results;
- one thread, the responder, sends every response and removes a request from the table in the same step that
  sends its final response;
- one other thread, the poller, asks `is_cancelled()`. In the python backend that call is a blocking round trip
  to the server (queued to the stub's stub-to-parent thread, answered by the server's message thread; about
  50 us on an idle 2-core machine, 150-300 us on a busy one), so it never runs on the thread that sends: asked
  there, a sweep of 1,024 live requests took 40-55 ms, every 50 ms, and every response waited behind it
  (`bench/server/cancel_poll.py`). The poller works in sweeps: each asks every request live when it starts,
  `ceil(live * poll_s / sweep_s)` of them (at most `max_batch`) every `poll_s`. So a cancellation is seen within
  `sweep_s` up to `max_batch * sweep_s / poll_s` live requests (640 by default) and within 0.85 s at the default
  limits (1,088 live: `max_queue` 1,024 waiting + `max_rows` 64 running); the round trips are bounded by
  `max_batch / poll_s` a second (1,280). A cancelled request is queued to the responder, which sends its
  CANCELLED response like any other.

The handshake between the two threads (`_lock` guards the table and each entry's `polling` flag): the poller
marks an entry `polling` under the lock only while it is still in the table, and clears it after the call;
the responder takes an entry out of the table and then waits until it is not `polling` before it sends FINAL.
So no `is_cancelled()` ever overlaps or follows a request's final response, and a request leaves the table
exactly once. The wait is at most one round trip, for that one request only. A non-final send may overlap a
poll of the same request: the python backend takes both from any thread (the send is pushed by the calling
thread, the poll goes through the stub's stub-to-parent thread), and only a FINAL frees the response factory.

Every request that was opened gets exactly one final response: its result, its error, CANCELLED when the
client cancelled it, UNAVAILABLE when a non-final response could not be delivered (its generation is stopped)
or when the model shuts down with it still running. A final response is attempted once: the python backend's
stub marks the sender closed before its round trip (`ResponseSender::UpdateStateAndCounters`, r24.10), so a
second FINAL could only fail with "Response sender has been closed", and the server deletes the response
factory after any FINAL it received, failed or not (`ResponseSendDecoupled`): a retry could reach freed memory.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
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
    result: Any = None  # a backend result (`final` attribute), or None with `error` or `cancelled`
    error: Optional[BaseException] = None
    cancelled: bool = False  # the poller saw the client cancel it


@dataclass(eq=False)
class _Entry:
    sender: Sender
    state: Any  # the caller's state, handed to `build`
    polling: bool = False  # an is_cancelled() of the poller is in flight


class Responder:
    """`build(key, state, result) -> (response, final)` turns a backend result into a Triton response;
    `error(exc) -> response` builds an error response; `on_cancel(key)` tells the backend to drop a request the
    client cancelled (or whose response could not be delivered); `tick()` runs about every `tick_s` on the
    responder thread (metrics). Cancellation: at most `max_batch` requests asked every `poll_s`, a full sweep
    every `sweep_s` while that allows."""

    FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def __init__(self, build: Callable[[str, Any, Any], tuple[Any, bool]], error: Callable[[BaseException], Any],
                 on_cancel: Callable[[str], None], *, poll_s: float = 0.05, sweep_s: float = 0.5,
                 max_batch: int = 64, tick: Optional[Callable[[], None]] = None, tick_s: float = 0.5):
        self._build, self._error, self._on_cancel = build, error, on_cancel
        self._poll_s, self._sweep_s, self._max_batch = poll_s, sweep_s, max(1, max_batch)
        self._tick, self._tick_s = tick, tick_s
        self._lock = threading.Lock()
        self._unpolled = threading.Condition(self._lock)  # notified when an entry's poll ends
        self._live: dict[str, _Entry] = {}
        self._sweep: deque[str] = deque()  # the keys the current sweep has still to ask (poller thread only)
        self._sweep_batch = 1  # requests asked per interval during the current sweep
        self._queue: "queue.SimpleQueue[Optional[_Post]]" = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm-responder", daemon=True)
        self._poller = threading.Thread(target=self._run_poller, name="llm-cancel-poller", daemon=True)

    # --- any thread -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._poller.start()

    def open(self, key: str, sender: Sender, state: Any) -> None:
        """Take ownership of a request; from now on only the responder and the poller touch `sender`."""
        with self._lock:
            if key in self._live:
                raise ValueError(f"request key {key!r} is already live")
            self._live[key] = _Entry(sender, state)

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
        """Stop polling, send what is queued, answer every request still live with UNAVAILABLE, stop."""
        self._stopping.set()
        if self._poller.is_alive():
            self._poller.join(timeout)
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive() or self._poller.is_alive():
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
        next_tick = time.monotonic()
        while True:
            try:  # the tick keeps its own clock: waking only for results would run it right after a final
                # response, when the engine had just finished that request (shorter ones were never seen running)
                wait = max(0.0, next_tick - time.monotonic()) if self._tick is not None else self._tick_s
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            while item is not None:
                self._handle(item)
                if self._tick is not None and time.monotonic() >= next_tick:
                    break  # a steady flow of results must not hold the tick off; the rest waits in the queue
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if self._stopping.is_set():
                self._drain_and_close()
                return
            now = time.monotonic()
            if self._tick is not None and now >= next_tick:
                next_tick = now + self._tick_s
                try:
                    self._tick()
                except Exception:  # noqa: BLE001 - monitoring never takes the model down
                    log.exception("llm responder tick failed")

    def _handle(self, post: _Post) -> None:
        with self._lock:
            entry = self._live.get(post.key)
        if entry is None:  # already answered (e.g. cancelled by its client): never touch it again
            return
        if post.cancelled:
            log.info("request %s cancelled by the client; its rows and KV blocks are freed", post.key)
            self._on_cancel(post.key)
            self._finish(post.key, Cancelled(f"request {post.key} was cancelled by the client"))
            return
        try:
            if post.error is not None:
                response, final = post.error, True
            else:
                response, final = self._build(post.key, entry.state, post.result)
        except Exception as e:  # noqa: BLE001 - a response we cannot build ends that request only
            response, final = e, True
        if final:
            self._finish(post.key, response)
        else:
            self._send_piece(post.key, entry.sender, response)

    def _send_piece(self, key: str, sender: Sender, response: Any) -> None:
        try:
            sender.send(response, flags=0)
        except Exception as e:  # noqa: BLE001 - the client is gone or the response is broken: end the request
            log.info("request %s: a response could not be delivered (%s); generation for it stopped", key, e)
            self._on_cancel(key)
            self._finish(key, Unavailable(f"request {key}: a response could not be delivered ({e})"))

    def _finish(self, key: str, response: Any) -> None:
        """Send `key`'s final response (an exception: as an error response) once, after taking it out of the
        table and waiting for any `is_cancelled()` in flight for it; then nothing touches it again."""
        with self._lock:
            entry = self._live.pop(key, None)
            while entry is not None and entry.polling:
                self._unpolled.wait()
        if entry is None:
            return
        try:
            if isinstance(response, BaseException):
                response = self._error(response)
        except Exception:  # noqa: BLE001 - no error response: end the request with the flag alone
            log.exception("request %s: the error response could not be built; ending it without one", key)
            response = None
        try:
            entry.sender.send(response, flags=self.FINAL)
        except Exception as e:  # noqa: BLE001 - attempted once (see the module docstring)
            log.warning("request %s: its final response could not be sent (%s); dropped", key, e)

    def _drain_and_close(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._handle(item)
        with self._lock:
            keys = list(self._live)
        for key in keys:
            self._finish(key, Unavailable("the llm model is shutting down; retry"))

    # --- the poller thread ----------------------------------------------------------------------------------
    def _run_poller(self) -> None:
        next_batch = time.monotonic() + self._poll_s
        while not self._stopping.wait(max(0.0, next_batch - time.monotonic())):
            next_batch = max(next_batch + self._poll_s, time.monotonic())  # a slow batch does not add up
            try:
                self._poll_batch()
            except Exception:  # noqa: BLE001 - a bug here must not stop cancellation for good
                log.exception("llm cancellation poller failed; carrying on")

    def _poll_batch(self) -> int:
        """Ask the next `_sweep_batch` live requests of the current sweep whether their client cancelled them
        (a new sweep of every live request starts when one ends); -> how many were asked."""
        picked: list[tuple[str, _Entry]] = []
        with self._lock:
            if not self._sweep:
                self._sweep.extend(self._live)
                # fixed for the sweep: requests answered meanwhile are skipped, they do not slow the rest
                self._sweep_batch = min(self._max_batch,
                                        max(1, math.ceil(len(self._sweep) * self._poll_s / self._sweep_s)))
            while self._sweep and len(picked) < self._sweep_batch:
                key = self._sweep.popleft()
                entry = self._live.get(key)
                if entry is not None:  # answered ones are skipped
                    picked.append((key, entry))
        for key, entry in picked:
            if self._stopping.is_set():
                break
            self._poll_one(key, entry)
        return len(picked)

    def _poll_one(self, key: str, entry: _Entry) -> None:
        with self._lock:
            if self._live.get(key) is not entry:
                return  # answered since it was picked: its final response may be sent already
            entry.polling = True
        try:
            cancelled = entry.sender.is_cancelled()
        except Exception:  # noqa: BLE001
            cancelled = False
        finally:
            with self._lock:
                entry.polling = False
                self._unpolled.notify_all()
        if cancelled:
            self._queue.put(_Post(key, cancelled=True))
