"""Every python-backend stub exits when its tritonserver is gone.

The stub's own parent check runs the model's `finalize()` first, and a model whose threads wait on the dead
server (a decoupled model's responder blocked in `send`) never gets through it: that stub stayed forever
with its memory and shared-memory region. This watchdog does not depend on any of that: a daemon thread
checks every `interval` seconds whether the stub's parent is still the server that started it (a process
whose parent dies is handed to init or a subreaper, so `getppid()` changes) and ends the process with
`os._exit` otherwise: no finalizer, no thread join, nothing that can wait on the dead server.
"""
from __future__ import annotations

import os
import sys
import threading

_started = False


def exit_with_parent(interval: float = 0.5) -> None:
    """Start the watchdog once per process (every model's `initialize()` calls this)."""
    global _started
    if _started:
        return
    _started = True
    parent = os.getppid()

    def watch() -> None:
        ev = threading.Event()
        while not ev.wait(interval):
            if os.getppid() != parent:
                # not through Triton's logger: it talks to the dead server
                sys.stderr.write(f"triton_vlm: tritonserver (pid {parent}) is gone; stub pid {os.getpid()} exits\n")
                os._exit(3)

    threading.Thread(target=watch, name="triton-vlm-lifeline", daemon=True).start()
