"""Every python-backend stub exits when its tritonserver is gone.

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
"""
from __future__ import annotations

import os
import sys
import threading

STUB_NAME = "triton_python_backend_stub"
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


def exit_with_parent(interval: float = 0.5) -> None:
    """Start the watchdog once per process."""
    global _started
    if _started:
        return
    _started = True
    parent = server_pid()

    def watch() -> None:
        ev = threading.Event()
        while True:
            if os.getppid() != parent:
                # not through Triton's logger: it talks to the dead server
                sys.stderr.write(f"triton_vlm: tritonserver (pid {parent}) is gone; stub pid {os.getpid()} exits\n")
                _remove_own_shm()
                os._exit(3)
            ev.wait(interval)

    threading.Thread(target=watch, name="triton-vlm-lifeline", daemon=True).start()
