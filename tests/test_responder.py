"""The responder owns each live request: nothing touches a request after its final response (unit, fakes)."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from triton_vlm.errors import Cancelled, InvalidArgument, Unavailable
from triton_vlm.triton.responder import Responder


class FakeSender:
    """Raises (as the real server would crash) on any use after the final response."""

    def __init__(self, cancel_after: float | None = None):
        self.sent: list[tuple[object, int]] = []
        self.closed = False
        self.polls = 0
        self.cancel_at = None if cancel_after is None else time.monotonic() + cancel_after
        self.lock = threading.Lock()
        self.threads: set[str] = set()

    def send(self, response=None, flags=0):
        with self.lock:
            self.threads.add(threading.current_thread().name)
            assert not self.closed, "send after the final response"
            self.sent.append((response, flags))
            self.closed = flags == Responder.FINAL

    def is_cancelled(self):
        with self.lock:
            self.threads.add(threading.current_thread().name)
            assert not self.closed, "is_cancelled after the final response (freed response factory)"
            self.polls += 1
            return self.cancel_at is not None and time.monotonic() >= self.cancel_at


@dataclass
class Result:
    final: bool
    text: str = ""


def make(cancelled: list | None = None, **kw) -> Responder:
    def build(key, state, result):
        return ("ok", key, result.text), result.final

    def error(exc):
        return ("error", type(exc).__name__)

    return Responder(build, error, (cancelled if cancelled is not None else []).append, poll_s=0.002, **kw)


def test_stress_final_and_cancellation_race_never_touch_a_finished_request():
    cancelled: list[str] = []
    r = make(cancelled)
    r.start()
    senders = {}
    rng = random.Random(0)
    for i in range(400):
        key = f"r{i}"
        senders[key] = FakeSender(cancel_after=rng.choice([None, 0.0, 0.001, 0.003]))
        r.open(key, senders[key], None)

    def engine():  # results arrive from another thread, racing the cancellation polls
        for i in range(400):
            key = f"r{i}"
            for _ in range(rng.randint(0, 3)):
                r.post(key, Result(False, "piece"))
            r.post(key, Result(True, "done"))
            if i % 50 == 0:
                time.sleep(0.002)

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    deadline = time.monotonic() + 10
    while r.live_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    r.stop()
    assert r.live_count() == 0
    for key, s in senders.items():
        finals = [resp for resp, flags in s.sent if flags == Responder.FINAL]
        assert len(finals) == 1, (key, s.sent)  # exactly one final response each
        assert s.threads == {"llm-responder"}  # one thread owns every request
        if finals[0] == ("error", "Cancelled"):
            assert key in cancelled
        else:
            assert finals[0] == ("ok", key, "done")
    assert any(f == ("error", "Cancelled") for s in senders.values() for f, fl in s.sent if fl)


def test_backend_refusal_and_shutdown_answer_every_request():
    r = make()
    r.start()
    refused, running = FakeSender(), FakeSender()
    r.open("a", refused, None)
    r.open("b", running, None)
    r.fail("a", Unavailable("queue full"))
    r.post("b", Result(False, "piece"))
    time.sleep(0.05)
    r.stop()
    assert refused.sent == [(("error", "Unavailable"), Responder.FINAL)]
    assert running.sent == [(("ok", "b", "piece"), 0), (("error", "Unavailable"), Responder.FINAL)]


def test_results_after_cancellation_are_dropped_and_build_errors_end_only_that_request():
    cancelled: list[str] = []

    def build(key, state, result):
        if result.text == "boom":
            raise InvalidArgument("cannot build")
        return ("ok", key, result.text), result.final

    r = Responder(build, lambda e: ("error", type(e).__name__), cancelled.append, poll_s=0.002)
    r.start()
    gone, bad, good = FakeSender(cancel_after=0.0), FakeSender(), FakeSender()
    r.open("gone", gone, None)
    r.open("bad", bad, None)
    r.open("good", good, None)
    time.sleep(0.05)
    r.post("gone", Result(True, "late"))  # the engine's final result after the cancellation: never sent
    r.post("bad", Result(False, "boom"))
    r.post("good", Result(True, "fine"))
    time.sleep(0.05)
    r.stop()
    assert gone.sent == [(("error", "Cancelled"), Responder.FINAL)] and cancelled == ["gone"]
    assert bad.sent == [(("error", "InvalidArgument"), Responder.FINAL)]
    assert good.sent == [(("ok", "good", "fine"), Responder.FINAL)]
    assert Cancelled  # the error type the responder sends on cancellation
