"""Results leave the engine on a thread of their own, which also makes their text.

The output step (`output.py`) makes each result with its token ids and a `Deferred` callback: the text (the
incremental detokenizer's push for a streamed piece, full decodes for a final result) is made when the callback
runs, just before the caller's own callback. `Delivery` runs those callbacks on one thread, in the order the
steps made them, so a request's pieces are detokenized and sent in order, and the engine's thread goes on with
the next step meanwhile (vLLM v1 detokenizes in its front-end process, SGLang in a `DetokenizerManager`). The
engine's stop words are token ids, matched in the step; the OpenAI front end's stop strings are matched on the
text it receives (`openai/choices.py`), so moving the text here changes neither. Without a started thread (tests
that drive `Engine.step()`), `deliver` runs the callbacks at once, on the caller's thread.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from ..errors import Internal
from ..params import GenerationResult
from .state import Output

log = logging.getLogger(__name__)


class Deferred:
    """A callback that first makes its result's text (`fill(result) -> the text made`), then calls `on_result`;
    a piece with no new tokens whose text comes out empty is not sent (`skip_empty`)."""

    __slots__ = ("on_result", "fill", "skip_empty")

    def __init__(self, on_result: Callable[[GenerationResult], None], fill: Callable[[GenerationResult], str],
                 skip_empty: bool = False):
        self.on_result, self.fill, self.skip_empty = on_result, fill, skip_empty

    def __call__(self, result: GenerationResult) -> None:
        try:
            text = self.fill(result)
        except Exception as e:  # noqa: BLE001 - a decode that fails ends that request only
            log.exception("the text of request %s could not be made", result.request_id)
            if not result.final:
                return
            result = GenerationResult(result.request_id, [], final=True, stats=result.stats,
                                      error=Internal(f"the text of request {result.request_id} could not be "
                                                     f"made: {type(e).__name__}: {e}"))
            text = "error"
        if self.skip_empty and not text:
            return
        self.on_result(result)


def call(outputs: list[Output]) -> None:
    for callback, res in outputs:
        try:
            callback(res)
        except Exception:  # noqa: BLE001 - a client's callback must not kill the loop
            log.exception("result callback of request %s failed", res.request_id)


class Delivery:
    """One thread that runs result callbacks in order (`deliver`), or none: then they run at once."""

    def __init__(self):
        self._queue: "queue.Queue[Optional[list[Output]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="triton-vlm-delivery", daemon=True)
            self._thread.start()

    def deliver(self, outputs: list[Output]) -> None:
        if not outputs:
            return
        if self._thread is None:
            call(outputs)
        else:
            self._queue.put(list(outputs))

    def wait_idle(self) -> None:
        """Until every batch queued so far has been delivered."""
        if self._thread is not None:
            self._queue.join()

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, then end the thread (later deliveries run at once)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the engine's delivery thread did not stop within %.1f s", timeout)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                call(batch)
            finally:
                self._queue.task_done()
