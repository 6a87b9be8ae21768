"""A bounded thread pool for one request's images: decoded, resized and normalised at once.

PIL's decoders and resamplers and numpy's array loops release the GIL, so a request's images spread over threads
use several cores in one preprocess instance (the instance runs one request at a time, so the pool bounds the
threads of the instance: `decode_threads`, sized by the launcher's rule, `server/front_half.py`). The media budget
is checked before anything reaches the pool (`service.Preprocessor._decode`). `map` keeps the prompt's order and
raises the error of the first failing item in that order, as the sequential loop does (later items may have been
decoded meanwhile: a cost, never a different answer). One thread (or one item) runs in the caller's thread, with
no pool at all: the sequential path.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MediaPool:
    def __init__(self, threads: int = 1):
        if int(threads) < 1:
            raise ValueError(f"decode_threads must be >= 1, got {threads}")
        self.threads = int(threads)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:  # created on first use: a server whose requests carry one image never starts it
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="preprocess-media")
            return self._pool

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """[fn(x) for x in items], on the pool when there are several items and threads."""
        if self.threads == 1 or len(items) < 2:
            return [fn(x) for x in items]
        futures = [self._executor().submit(fn, x) for x in items]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()  # after an error: the items not started yet are not paid for

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
