"""Every python-backend stub exits when its tritonserver is gone, and a crashing stub leaves its tracebacks.

The stub's own parent check runs the model's `finalize()` first, and a model whose threads wait on the dead
server (a decoupled model's responder blocked in `send`) never gets through it: that stub stayed forever
with its memory and shared-memory region. This watchdog does not depend on any of that: a daemon thread
checks every `interval` seconds whether the server that started the stub is still its parent (a process whose
parent dies is handed to init or a subreaper, so `getppid()` changes) and ends the process with `os._exit`
otherwise: no finalizer, no thread join, nothing that can wait on the dead server. It first removes the
shared-memory region it shared with that server (the server, killed, could not).

The server's pid comes from the stub's command line (the python backend starts it as `stub <model.py> <shm
region> <shm size> <shm growth> <server pid> ...`), so a server that died while the stub was still importing
its model is noticed too. Each model.py starts this first thing, before its heavy imports.

The watchdog waits on a pidfd of the server (readable the moment the server exits, before it is reaped), with a
`getppid()` check every `interval` as the fallback. Being first matters: the stub's own health thread notices
a dead parent once `kill(pid, 0)` fails (after the reap, checked every 300 ms) and then destroys the stub,
unmapping the shared memory that the stub's main thread is still blocked on; that main thread then dies with
SIGSEGV in `pthread_mutex_lock` (python_backend r24.10 `pb_stub.cc` main(): `stub.reset(); exit(1)`).

A failed load ends its stub (`loading`): the python backend waits for the stub of a failed `initialize` to exit
(`StubLauncher::Launch`: `waitpid`, no timeout), and the stub's interpreter, on its way out, joins every non-daemon
thread (a `ThreadPoolExecutor` worker busy or waiting, a library's thread). One such thread, started before the
failure, kept the whole server loading forever (seen under load; `tests/test_load_failure.py` reproduces it). So a
failed `initialize` arms faulthandler's watchdog, a C thread that needs no GIL: unless the stub has exited within
`LOAD_FAILURE_GRACE_S`, it prints every thread's stack to the log and ends the process (`_exit(1)`).

Crash tracebacks: `faulthandler` is enabled for all threads, writing to the stub's stderr (tritonserver's log).
A SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL in the stub prints every Python thread's stack there ("Fatal Python
error: Segmentation fault", then "Thread 0x... (most recent call first)" per thread, the crashing one marked
"Current thread") before the process dies as it would have.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import sys
import threading
import traceback
from typing import Iterator

from ..server.procs import STACKS_SIGNAL  # stdlib only: cheap before the model's heavy imports

STUB_NAME = "triton_python_backend_stub"
LOAD_FAILURE_GRACE_S = 10.0  # a failed stub answers the server, then exits; this bounds the exit
_started = False


def _stub_argv() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return argv if argv and argv[0].endswith(STUB_NAME) and len(argv) > 5 and argv[5].isdigit() else []


def server_pid() -> int:
    """The pid of the tritonserver that launched this stub (from its argv), else the current parent."""
    argv = _stub_argv()
    return int(argv[5]) if argv else os.getppid()


def _remove_own_shm() -> None:
    """The shared-memory region this stub shared with its (now dead) server: nobody else uses it any more."""
    argv = _stub_argv()
    name = argv[2] if argv else ""
    if name and "/" not in name:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def enable_crash_tracebacks() -> None:
    """Every thread's Python traceback on stderr (tritonserver's log) when the stub dies of a fatal signal, and on
    `STACKS_SIGNAL` (SIGUSR1: the launcher sends it to the stubs of a server that did not become ready in time,
    before stopping it, so the log says where each stub was)."""
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)  # the launcher's ask (`procs`)


def _parent_fd(parent: int) -> int | None:
    """A pidfd of `parent` (readable once it exits), or None where pidfds are unavailable."""
    try:
        return os.pidfd_open(parent)
    except (AttributeError, OSError):
        return None


def exit_with_parent(interval: float = 0.1) -> None:
    """Enable crash tracebacks and start the watchdog, once per process; defer the cyclic collector until the
    model has loaded (`settle_heap` collects once and turns it back on)."""
    global _started
    if _started:
        return
    _started = True
    enable_crash_tracebacks()
    defer_collections()
    parent = server_pid()
    fd = _parent_fd(parent)  # opened before the getppid() check below: it is this server, not a reused pid
    waiter = None
    if fd is not None:
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        return waiter is not None and bool(waiter.poll(int(interval * 1000)))

    def watch() -> None:
        ev = threading.Event()
        while True:
            if gone():
                try:  # not through Triton's logger: it talks to the dead server
                    sys.stderr.write(f"triton_vlm: tritonserver (pid {parent}) is gone; stub pid {os.getpid()} "
                                     "exits\n")
                    sys.stderr.flush()
                except Exception:  # noqa: BLE001 - nothing may stop the exit
                    pass
                _remove_own_shm()
                os._exit(3)
            if waiter is None:
                ev.wait(interval)

    threading.Thread(target=watch, name="triton-vlm-lifeline", daemon=True).start()


@contextlib.contextmanager
def loading(model: str, grace: float = LOAD_FAILURE_GRACE_S) -> Iterator[None]:
    """Wrap a model's `initialize`: any exception is written to the log with its traceback, re-raised (the server
    reports the failed load), and the stub is ended `grace` seconds later unless it has exited by then."""
    try:
        yield
    except BaseException as e:
        try:  # the stub's own log line is one line; the whole traceback is what a user needs
            sys.stderr.write(f"triton_vlm: {model} failed to load ({type(e).__name__}: {e}); its stub (pid "
                             f"{os.getpid()}) exits within {grace:.0f} s\n")
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
        finally:
            faulthandler.dump_traceback_later(grace, exit=True, file=sys.stderr)
        raise


def defer_collections() -> None:
    """No cyclic collection while the stub imports torch, transformers and its model: the collector ran dozens of
    times over a growing heap of long-lived objects, ~8% of a stub's start-up CPU. `settle_heap` (the end of
    `initialize`) collects once and turns the collector back on; a stub whose load fails exits anyway."""
    import gc

    gc.disable()


def settle_heap() -> None:
    """After a model loads, and again in its `finalize`: collect once, then move every live object to the
    collector's permanent generation (`gc.freeze`, as vLLM does after start-up).

    The stub holds millions of long-lived objects (torch, transformers, tokenizers); a full collection walks them
    all. At run time that is a pause of the engine's thread; at shutdown the interpreter's final collections took
    7-10 s per stub, past tritonserver's exit timeout, so a clean stop never finished cleanly. Frozen objects are
    never scanned again (they are freed by reference counting as before)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.enable()  # deferred while the model loaded (`defer_collections`)
