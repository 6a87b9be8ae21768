"""Guides compiled off the request path: a small pool, a time limit, a byte-bounded single-flight cache.

`GuideCompiler.key(guided)` is the canonical guide, made on the caller's thread (cheap, pure Python): a JSON
schema or structural tag parsed, checked (`guided_schema.enforceable`: keywords xgrammar would not enforce raise
`InvalidArgument` here, synchronously) and re-serialised compactly, so that schemas differing only in whitespace
share one grammar; a choice list as its EBNF; a regex or a grammar as sent. A guide nested deeper than
`MAX_NESTING` (brackets, parentheses) is refused here too: xgrammar's parsers recurse on the C++ stack, and
deep enough nesting would end the process.

`request(key, done)` calls `done(grammar, None)` or `done(None, InvalidArgument)` exactly once: at once on a
cache hit, else when the compile ends or when the request's time limit (`GuideLimits.compile_timeout_s`,
counted from the request) passes, whichever comes first. Compiles run on `GuideLimits.compile_workers` threads
that run only on CPU time serving leaves (SCHED_IDLE; xgrammar's compiler releases the GIL, so the engine's steps
go on meanwhile); a guide already compiling is not
compiled again: later requests for it wait on the same compile (single flight; `compiles` counts the compiles
started). A compile cannot be stopped once it runs: one that outlives its requests' limits runs to its end on its
worker, and its grammar is cached then, so the next request for it is served at once; a queued compile whose
requests have all ended (time limit, cancelled) is dropped before it starts. The cache holds at most
`GuideLimits.cache_mb` MiB of compiled grammars (xgrammar's `memory_size_bytes`), least recently used first out.
"""
from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import xgrammar as xgr

from ... import names as N
from ...errors import InvalidArgument
from ...params import GuideLimits, GuidedDecoding
from .guided_schema import UnenforcedKeyword, enforceable, enforceable_tag

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept at most (LRU), besides the bytes bound
ANY_OBJECT = '{"type": "object"}'  # guide type `json`: any JSON object
MAX_NESTING = 128  # brackets / parentheses open at once in a guide
Key = tuple[str, str]  # (guide type, canonical guide)
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
Done = Callable[[Optional[xgr.CompiledGrammar], Optional[InvalidArgument]], None]


def library_message(e: Exception) -> str:
    """xgrammar's error without its C++ source location."""
    return _LOCATION.sub("", str(e).strip()).strip()


def nesting(text: str) -> int:
    """The deepest run of open brackets / braces / parentheses in `text` (quoted or escaped ones counted too:
    an upper bound of what a parser recurses into)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]})" and depth:
            depth -= 1
    return deepest


def _yield_cpu() -> None:
    """(a compile worker, once) Run only on CPU time serving leaves: Linux's SCHED_IDLE for this thread (per
    thread, inherited by threads it starts), else the lowest nice value."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):  # not allowed: the same priority as the rest
        pass


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def choice_grammar(guide: str) -> str:
    """vLLM's guided_choice: an EBNF grammar of the alternatives (the guide a JSON list of strings)."""
    try:
        choices = json.loads(guide)
    except ValueError as e:
        raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} of type 'choice' must be a JSON list of strings: {e}")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} of type 'choice' must be a non-empty JSON list of "
                              f"non-empty strings, got {guide[:200]!r}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def canonical(guided: GuidedDecoding) -> Key:
    """The guide as compiled: (type, text), equal for guides that mean the same grammar (see the module doc)."""
    kind, guide = guided.guide_type, guided.guide
    if kind == "json":
        return kind, ""
    depth = nesting(guide)
    if depth > MAX_NESTING:
        raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} nests {depth} levels of brackets / parentheses; at most "
                              f"{MAX_NESTING} are accepted")
    if kind == "choice":
        return kind, choice_grammar(guide)
    if kind not in ("json_schema", "structural_tag"):
        return kind, guide
    try:
        parsed = json.loads(guide)
    except ValueError:
        return kind, guide  # the library's parser names what is wrong with it
    try:
        return kind, _compact(enforceable(parsed) if kind == "json_schema" else enforceable_tag(parsed))
    except UnenforcedKeyword as e:
        raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE}: the JSON schema keyword {e} is not supported "
                              "(xgrammar, the guided decoding library, does not enforce it)") from None


@dataclass(eq=False)
class _Waiter:
    done: Done
    deadline: float
    fired: bool = False


@dataclass(eq=False)
class _Flight:
    waiters: list[_Waiter] = field(default_factory=list)


class GuideCompiler:
    """Compiles guides for one tokenizer; thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int], cache_size: int = CACHE_SIZE,
                 limits: Optional[GuideLimits] = None, compile_threads: int = 1):
        self.vocab_size = int(vocab_size)
        self.limits = limits or GuideLimits()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=[int(i) for i in stop_ids])
        # our cache is the cache; each compile may use `compile_threads` threads of xgrammar's own
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=compile_threads, cache_enabled=False)
        self.cache_size = cache_size
        self.cache_bytes = self.limits.cache_mb * 2**20
        self._cache: OrderedDict[Key, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._bytes = 0
        self._flights: dict[Key, _Flight] = {}
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[Optional[tuple[Key, _Flight]]]" = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"guide-compile-{i}", daemon=True)
                         for i in range(self.limits.compile_workers)]  # daemons: a compile never holds up an exit
        for w in self._workers:
            w.start()
        self._deadlines: list[tuple[float, int, _Waiter, Key]] = []  # heap
        self._seq = itertools.count()
        self._timer = threading.Condition(self._lock)
        self._watchdog: Optional[threading.Thread] = None
        self.compiles = 0  # compiles started (a guide requested N times at once compiles once)
        self.timeouts = 0  # requests that waited past the time limit
        self.skipped = 0  # queued compiles dropped: every request for them had ended

    # --- the caller's side ----------------------------------------------------------------------------------
    def key(self, guided: GuidedDecoding) -> Key:
        return canonical(guided)

    def cached(self, key: Key) -> Optional[xgr.CompiledGrammar]:
        with self._lock:
            return self._get(key)

    def request(self, key: Key, done: Done) -> Optional[_Waiter]:
        """`done(grammar, None)` or `done(None, error)` once: now on a hit, else from a worker or the watchdog;
        -> the wait, for `forget` (None on a hit)."""
        waiter = None
        with self._lock:
            hit = self._get(key)
            if hit is None:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = _Flight()
                    self.compiles += 1
                    self._jobs.put((key, flight))
                waiter = _Waiter(done, time.monotonic() + self.limits.compile_timeout_s)
                flight.waiters.append(waiter)
                self._arm(waiter, key)
        if hit is not None:
            done(hit, None)
        return waiter

    def forget(self, waiter: Optional[_Waiter]) -> None:
        """The request behind `waiter` ended (cancelled): `done` is not called, and a compile still queued that no
        other request waits for is dropped before it starts."""
        if waiter is not None:
            with self._lock:
                waiter.fired = True

    def compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """The grammar of `guided`, waiting for it (the time limit applies); raises InvalidArgument."""
        got: list = []
        ready = threading.Event()

        def done(grammar, error) -> None:
            got.append((grammar, error))
            ready.set()

        self.request(self.key(guided), done)
        ready.wait()
        grammar, error = got[0]
        if error is not None:
            raise error
        return grammar

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """The workers end once the compiles queued before are done."""
        for _ in self._workers:
            self._jobs.put(None)

    # --- the cache (under the lock) -------------------------------------------------------------------------
    def _get(self, key: Key) -> Optional[xgr.CompiledGrammar]:
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        return hit[0]

    def _put(self, key: Key, grammar: xgr.CompiledGrammar) -> None:
        size = int(getattr(grammar, "memory_size_bytes", 0)) + len(key[1])
        if size > self.cache_bytes:
            return  # larger than the whole cache: served to its waiters, not kept
        self._cache[key] = (grammar, size)
        self._bytes += size
        while len(self._cache) > self.cache_size or self._bytes > self.cache_bytes:
            _, (_, dropped) = self._cache.popitem(last=False)
            self._bytes -= dropped

    # --- the workers ----------------------------------------------------------------------------------------
    def _work(self) -> None:
        _yield_cpu()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run(*job)
            except Exception:  # noqa: BLE001 - a worker never dies
                log.exception("guide compile worker failed")

    def _run(self, key: Key, flight: _Flight) -> None:
        with self._lock:
            if all(w.fired for w in flight.waiters):  # every request for it gave up while it was queued
                self._flights.pop(key, None)
                self.skipped += 1
                return
        t0 = time.monotonic()
        grammar, error = None, None
        try:
            grammar = self._compile(*key)
        except InvalidArgument as e:
            error = e
        except BaseException as e:  # noqa: BLE001 - never leave a waiter without an answer
            error = InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} could not be compiled: {type(e).__name__}: {e}")
        took = time.monotonic() - t0
        with self._lock:
            self._flights.pop(key, None)
            if grammar is not None:
                self._put(key, grammar)
            waiters = list(flight.waiters)
        if took > self.limits.compile_timeout_s:
            log.warning("a %s guide of %d characters took %.1f s to compile (limit %.1f s); cached now", key[0],
                        len(key[1]), took, self.limits.compile_timeout_s)
        for w in waiters:
            self._fire(w, grammar, error)

    def _compile(self, guide_type: str, guide: str) -> xgr.CompiledGrammar:
        c = self.compiler
        try:
            if guide_type == "json":
                return c.compile_json_schema(ANY_OBJECT, any_whitespace=False)
            if guide_type == "json_schema":
                return c.compile_json_schema(guide, any_whitespace=False)
            if guide_type == "regex":
                return c.compile_regex(guide)
            if guide_type in ("ebnf_grammar", "choice"):
                return c.compile_grammar(guide)
            if guide_type == "structural_tag":
                return c.compile_structural_tag(guide)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
            raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} is not a valid {guide_type}: "
                                  f"{library_message(e)}") from None
        raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE_TYPE} must be one of {', '.join(N.GUIDE_TYPES)}, "
                              f"got {guide_type!r}")

    def _fire(self, w: _Waiter, grammar, error) -> None:
        with self._lock:
            if w.fired:
                return
            w.fired = True
        try:
            w.done(grammar, error)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop a worker or the watchdog
            log.exception("a guide's callback failed")

    # --- the time limit -------------------------------------------------------------------------------------
    def _arm(self, waiter: _Waiter, key: Key) -> None:
        """(under the lock) Watch `waiter`'s deadline; the watchdog thread starts on first use."""
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter, key))
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="guide-deadlines", daemon=True)
            self._watchdog.start()
        self._timer.notify()

    def _watch(self) -> None:
        while True:
            with self._lock:
                while not self._deadlines or self._deadlines[0][0] > time.monotonic():
                    self._timer.wait(self._deadlines[0][0] - time.monotonic() if self._deadlines else None)
                _, _, waiter, key = heapq.heappop(self._deadlines)
                if waiter.fired:
                    continue
                self.timeouts += 1
            limit = self.limits.compile_timeout_s
            self._fire(waiter, None, InvalidArgument(
                f"{N.GUIDED_DECODING_GUIDE}: the {key[0]} guide ({len(key[1])} characters) did not compile within "
                f"the limit of {limit:g} s (llm parameter guide_compile_timeout_s); send a smaller or simpler "
                "one"))
