"""The responder owns each live request: nothing touches a request after its final response, and cancellation
polling never holds up sending (unit, fakes)."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from triton_vlm.errors import Cancelled, InvalidArgument, Unavailable
from triton_vlm.triton.responder import Responder

FINAL = Responder.FINAL


class FakeSender:
    """Records what the real server would crash on (any use after the final response; a FINAL while an
    `is_cancelled()` of the same request is in flight) in `violations`: the responder catches what a sender
    raises, so an assertion raised in here would go unnoticed."""

    def __init__(self, cancel_after: float | None = None, fail_nonfinal: bool = False, fail_final: bool = False,
                 poll_gate: threading.Event | None = None):
        self.sent: list[tuple[object, int]] = []
        self.violations: list[str] = []
        self.closed = False
        self.polling = False
        self.polls = 0
        self.cancel_at = None if cancel_after is None else time.monotonic() + cancel_after
        self.fail_nonfinal, self.fail_final, self.poll_gate = fail_nonfinal, fail_final, poll_gate
        self.lock = threading.Lock()
        self.send_threads: set[str] = set()
        self.poll_threads: set[str] = set()

    def send(self, response=None, flags=0):
        with self.lock:
            self.send_threads.add(threading.current_thread().name)
            if self.closed:
                self.violations.append(f"send {response!r} after the final response")
            if flags == FINAL and self.polling:
                self.violations.append("final response while is_cancelled() is in flight")
            self.sent.append((response, flags))
            self.closed = self.closed or flags == FINAL
            if (self.fail_nonfinal and flags == 0) or (self.fail_final and flags == FINAL):
                raise RuntimeError("the stream is gone")

    def is_cancelled(self):
        with self.lock:
            self.poll_threads.add(threading.current_thread().name)
            if self.closed:
                self.violations.append("is_cancelled after the final response (freed response factory)")
            self.polls += 1
            self.polling = True
        try:
            if self.poll_gate is not None:
                self.poll_gate.wait(10)
            else:
                time.sleep(0.0002)  # a round trip: lets a final response race the poll
            return self.cancel_at is not None and time.monotonic() >= self.cancel_at
        finally:
            with self.lock:
                self.polling = False

    @property
    def finals(self) -> list:
        return [resp for resp, flags in self.sent if flags == FINAL]


@dataclass
class Result:
    final: bool
    text: str = ""


def make(cancelled: list | None = None, errors: list | None = None, **kw) -> Responder:
    def build(key, state, result):
        if result.text == "boom":
            raise InvalidArgument("cannot build")
        return ("ok", key, result.text), result.final

    def error(exc):
        if errors is not None:
            errors.append(exc)
        return ("error", type(exc).__name__)

    kw.setdefault("poll_s", 0.002)
    return Responder(build, error, (cancelled if cancelled is not None else []).append, **kw)


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_stress_final_and_cancellation_race_never_touch_a_finished_request():
    cancelled: list[str] = []
    r = make(cancelled, sweep_s=0.02, max_batch=64)
    r.start()
    senders = {}
    rng = random.Random(0)
    for i in range(400):
        key = f"r{i}"
        senders[key] = FakeSender(cancel_after=rng.choice([None, 0.0, 0.001, 0.003]))
        r.open(key, senders[key], None)

    order = list(senders)
    rng.shuffle(order)  # not the polling order: requests end while a batch that picked them is being polled

    def engine():  # results arrive from another thread, racing the cancellation polls
        for i, key in enumerate(order):
            for _ in range(rng.randint(0, 3)):
                r.post(key, Result(False, "piece"))
            r.post(key, Result(True, "done"))
            if i % 10 == 0:  # spread over ~100 ms: final responses race polls picked in earlier batches
                time.sleep(0.002)

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    assert wait_for(lambda: r.live_count() == 0)
    r.stop()
    for key, s in senders.items():
        assert s.violations == [], (key, s.violations)
        assert len(s.finals) == 1, (key, s.sent)  # exactly one final response each, the last thing sent
        assert s.sent[-1][1] == FINAL
        assert s.send_threads == {"llm-responder"}  # one thread sends every response
        assert s.poll_threads <= {"llm-cancel-poller"}  # and never polls
        if s.finals[0] == ("error", "Cancelled"):
            assert key in cancelled
        else:
            assert s.finals[0] == ("ok", key, "done")
    assert any(s.finals[0] == ("error", "Cancelled") for s in senders.values())
    assert any(s.polls for s in senders.values())


def test_backend_refusal_and_shutdown_answer_every_request():
    r = make()
    r.start()
    refused, running = FakeSender(), FakeSender()
    r.open("a", refused, None)
    r.open("b", running, None)
    r.fail("a", Unavailable("queue full"))
    r.post("b", Result(False, "piece"))
    assert wait_for(lambda: refused.finals and running.sent)
    r.stop()
    assert refused.sent == [(("error", "Unavailable"), FINAL)]
    assert running.sent == [(("ok", "b", "piece"), 0), (("error", "Unavailable"), FINAL)]
    assert refused.violations == running.violations == []


def test_results_after_cancellation_are_dropped_and_build_errors_end_only_that_request():
    cancelled: list[str] = []
    errors: list[BaseException] = []
    r = make(cancelled, errors)
    r.start()
    gone, bad, good = FakeSender(cancel_after=0.0), FakeSender(), FakeSender()
    r.open("gone", gone, None)
    r.open("bad", bad, None)
    r.open("good", good, None)
    assert wait_for(lambda: gone.finals)
    r.post("gone", Result(True, "late"))  # the engine's final result after the cancellation: never sent
    r.post("bad", Result(False, "boom"))
    r.post("good", Result(True, "fine"))
    assert wait_for(lambda: bad.finals and good.finals)
    r.stop()
    assert gone.sent == [(("error", "Cancelled"), FINAL)] and cancelled == ["gone"]
    assert bad.sent == [(("error", "InvalidArgument"), FINAL)]
    assert good.sent == [(("ok", "good", "fine"), FINAL)]
    # the cancelled request's response was built from a Cancelled error naming it (code CANCELLED)
    cancel_errors = [e for e in errors if isinstance(e, Cancelled)]
    assert len(cancel_errors) == 1 and cancel_errors[0].code == "CANCELLED" and "gone" in cancel_errors[0].message
    assert [type(e) for e in errors].count(InvalidArgument) == 1


def test_failed_nonfinal_send_ends_the_request_with_one_final_response():
    cancelled: list[str] = []
    errors: list[BaseException] = []
    r = make(cancelled, errors)
    r.start()
    broken, other = FakeSender(fail_nonfinal=True), FakeSender()
    r.open("broken", broken, None)
    r.open("other", other, None)
    r.post("broken", Result(False, "piece"))
    r.post("broken", Result(False, "later piece"))  # the backend had queued more: never sent
    r.post("broken", Result(True, "done"))
    r.post("other", Result(True, "fine"))
    assert wait_for(lambda: broken.finals and other.finals)  # results are handled in order: broken's are done
    r.stop()
    assert broken.sent == [(("ok", "broken", "piece"), 0), (("error", "Unavailable"), FINAL)]
    assert broken.violations == [] and cancelled == ["broken"]  # the backend stops generating for it
    assert "could not be delivered" in next(e for e in errors if isinstance(e, Unavailable)).message
    assert other.sent == [(("ok", "other", "fine"), FINAL)]


def test_final_send_is_attempted_once_and_an_unbuildable_error_still_ends_the_request():
    def error(exc):
        raise RuntimeError("cannot build an error response")

    r = Responder(lambda k, s, res: (("ok", k), res.final), error, lambda k: None, poll_s=0.002)
    r.start()
    both_fail, no_error_response = FakeSender(fail_nonfinal=True, fail_final=True), FakeSender()
    r.open("both", both_fail, None)
    r.open("plain", no_error_response, None)
    r.post("both", Result(False))
    r.fail("plain", Unavailable("queue full"))
    assert wait_for(lambda: both_fail.finals and no_error_response.finals)
    r.stop()
    assert both_fail.sent == [(("ok", "both"), 0), (None, FINAL)]  # FINAL tried once, though it raised
    assert no_error_response.sent == [(None, FINAL)]  # the flag alone ends it
    assert both_fail.violations == no_error_response.violations == []
    assert r.live_count() == 0


def test_a_poll_in_flight_delays_only_its_own_final_response():
    gate = threading.Event()
    r = make(sweep_s=0.002, max_batch=1)
    r.start()
    stuck, other = FakeSender(poll_gate=gate), FakeSender()
    r.open("stuck", stuck, None)
    assert wait_for(lambda: stuck.polling)  # the poller waits inside stuck.is_cancelled()
    r.open("other", other, None)
    r.post("other", Result(False, "piece"))
    r.post("other", Result(True, "done"))
    # sending does not wait for the poller: the other request is answered while the poll is still in flight
    assert wait_for(lambda: other.finals, timeout=5) and stuck.polling
    r.post("stuck", Result(True, "done"))
    assert wait_for(r._queue.empty)  # the responder has taken stuck's result ...
    assert not wait_for(lambda: stuck.sent, timeout=0.3)  # ... and holds its FINAL while its poll is in flight
    gate.set()
    assert wait_for(lambda: stuck.finals)
    r.stop()
    assert stuck.sent == [(("ok", "stuck", "done"), FINAL)] and stuck.violations == []
    assert other.sent == [(("ok", "other", "piece"), 0), (("ok", "other", "done"), FINAL)]


def test_polling_is_bounded_per_interval_and_sweeps_every_request():
    r = make(poll_s=0.05, sweep_s=0.5, max_batch=16)  # not started: batches are driven by hand
    senders = [FakeSender() for _ in range(100)]
    for i, s in enumerate(senders):
        r.open(f"r{i}", s, None)
    assert r._poll_batch() == 10  # 100 live, a sweep every 0.5 s in 0.05 s steps: 10 a step
    for _ in range(9):
        r._poll_batch()
    assert [s.polls for s in senders] == [1] * 100  # one sweep, each request asked once
    more = [FakeSender() for _ in range(900)]
    for i, s in enumerate(more):
        r.open(f"m{i}", s, None)
    assert r._poll_batch() == 16  # 1,000 live would want 100 a step: bounded by max_batch
    for s in senders[:50] + more[:450]:  # half of them end during the sweep ...
        r._finish(next(k for k, e in r._live.items() if e.sender is s), Unavailable("done"))
    assert r._poll_batch() == 16  # ... the batch stays as big (answered ones are skipped, not counted)
    r._drain_and_close()  # every request answered; the sweep skips them all
    assert r._poll_batch() == 0 and len(r._sweep) == 0
    assert all(s.finals == [("error", "Unavailable")] and s.violations == [] for s in senders + more)
    assert sum(s.polls for s in senders + more) == 100 + 32


def test_cancellation_stays_prompt_with_many_live_requests():
    cancelled: list[str] = []
    r = make(cancelled, poll_s=0.01, sweep_s=0.2, max_batch=200)
    r.start()
    quiet = [FakeSender() for _ in range(1000)]
    for i, s in enumerate(quiet):
        r.open(f"q{i}", s, None)
    leaving = FakeSender(cancel_after=0.0)
    r.open("leaving", leaving, None)
    t0 = time.monotonic()
    assert wait_for(lambda: leaving.finals, timeout=5)
    assert time.monotonic() - t0 < 3.0, "a full sweep of 1,001 requests is due every 0.2 s"
    r.stop()
    assert leaving.sent == [(("error", "Cancelled"), FINAL)] and cancelled == ["leaving"]
    assert all(s.finals == [("error", "Unavailable")] for s in quiet)


class _Tensor:
    """Stands for a `pb_utils.Tensor`: `alive` tells whether anything still references it."""


class _Response:
    """Like `pb_utils.InferenceResponse`: holds its tensors, and `output_tensors()` hands out references."""

    def __init__(self, n: int):
        self.tensors = [_Tensor() for _ in range(n)]

    def output_tensors(self):
        return list(self.tensors)


class _PruningSender:
    """Like the python backend's `send()`: it drops the response's tensors (PruneOutputTensors, without the
    GIL) and records which of them were freed right there."""

    def __init__(self):
        self.freed_inside: list[int] = []
        self.cancelled_asked = 0

    def send(self, response=None, flags=0):
        import gc
        import weakref

        if response is None:
            return
        refs = [weakref.ref(t) for t in response.tensors]
        response.tensors.clear()
        gc.collect()
        self.freed_inside = [i for i, r in enumerate(refs) if r() is None]

    def is_cancelled(self):
        self.cancelled_asked += 1
        return True


def test_response_sender_keeps_output_tensors_referenced_until_send_returns():
    import weakref

    from triton_vlm.triton.tensors import ResponseSender

    inner = _PruningSender()
    sender = ResponseSender(inner)
    response = _Response(3)
    refs = [weakref.ref(t) for t in response.tensors]
    sender.send(response, flags=0)
    assert inner.freed_inside == []  # nothing freed inside send(): the stub would do it without the GIL
    assert all(r() is None for r in refs)  # and nothing kept afterwards
    sender.send(None, flags=FINAL)  # a response-less FINAL passes through
    assert sender.is_cancelled() and inner.cancelled_asked == 1


def test_tick_keeps_its_own_clock_when_requests_are_shorter_than_it():
    """Back-to-back requests shorter than `tick_s` (the next one starts once the previous final response is sent,
    as one client's stream does): the tick (the llm's gauges) must see one running about as often as there is one.
    A tick run only when a result woke the responder came right after a final response, when none was."""
    running = threading.Event()
    seen: list[bool] = []
    r = make(tick=lambda: seen.append(running.is_set()), tick_s=0.05)
    r.start()
    try:
        deadline, n = time.monotonic() + 1.5, 0
        while time.monotonic() < deadline:
            sender, key = FakeSender(), f"r{n}"
            n += 1
            r.open(key, sender, None)
            running.set()
            time.sleep(0.02)  # the engine works on it, then takes it out of its running set and posts the result
            running.clear()
            r.post(key, Result(final=True))
            assert wait_for(lambda: sender.finals)
    finally:
        r.stop()
    assert len(seen) >= 10 and sum(seen) >= len(seen) / 3, f"{sum(seen)} of {len(seen)} ticks saw one running"


class SlowSender(FakeSender):
    def send(self, response=None, flags=0):
        time.sleep(0.002)  # a response that takes a while to hand over
        super().send(response, flags)


def test_tick_runs_while_results_arrive_without_a_gap():
    """A backlog of results (the queue never empty while they are sent) must not hold the tick off: it runs on
    its own clock between results, the rest waiting in the queue."""
    ticks: list[float] = []
    r = make(tick=lambda: ticks.append(time.monotonic()), tick_s=0.05)
    sender = SlowSender()
    r.open("busy", sender, None)
    for i in range(300):  # queued before the responder starts: ~0.6 s of sending with no gap
        r.post("busy", Result(final=i == 299, text=str(i)))
    r.start()
    try:
        assert wait_for(lambda: sender.finals, timeout=30)
    finally:
        r.stop()
    assert len(sender.sent) == 300 and not sender.violations
    assert len(ticks) >= 6, f"{len(ticks)} ticks while sending 300 results (~0.6 s)"
