"""Run folders: `<tmp>/triton-vlm-run-*`, one per launcher (the filled model repository and, by default, the log).

A launcher removes its folder at a clean stop. It keeps the folder when the server failed (the log says why),
and at each start `prune()` removes the folders of dead launchers beyond the newest `KEEP`. A folder is in use
while the launcher named in its `launcher.pid` runs, or while any process's command line names it (a server,
or a launcher of a version without the pid file); folders of other users are never touched.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from . import procs

PREFIX = "triton-vlm-run-"
PID_FILE = "launcher.pid"
KEEP = 5  # folders of dead launchers kept for their logs
LEGACY_MIN_AGE_S = 3600.0  # a folder without a pid file is left alone this long (its launcher may be starting)


def create(root: Path | None = None) -> Path:
    """A new run folder, marked with this launcher's pid; older folders of dead launchers beyond `KEEP` go."""
    base = Path(root or tempfile.gettempdir())
    prune(base)
    run_dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
    (run_dir / PID_FILE).write_text(f"{os.getpid()}\n")
    return run_dir


def remove(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def _launcher_alive(run_dir: Path) -> bool | None:
    """True / False for a folder with a pid file, None without one."""
    try:
        pid = int((run_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return procs.read_proc(pid) is not None


def in_use(run_dir: Path, cmdlines: list[str] | None = None) -> bool:
    alive = _launcher_alive(run_dir)
    if alive:
        return True
    if alive is None and time.time() - run_dir.stat().st_mtime < LEGACY_MIN_AGE_S:
        return True
    named = str(run_dir)
    lines = cmdlines if cmdlines is not None else [" ".join(p.argv) for p in procs.all_procs()]
    return any(named in line for line in lines)


def prune(base: Path, keep: int = KEEP) -> list[Path]:
    """Remove this user's run folders under `base` that no process uses, all but the newest `keep`."""
    uid = os.getuid()
    mine = []
    for d in base.glob(PREFIX + "*"):
        try:
            st = d.stat()
        except OSError:
            continue
        if d.is_dir() and st.st_uid == uid:
            mine.append((st.st_mtime, d))
    cmdlines = [" ".join(p.argv) for p in procs.all_procs()]
    dead = [d for _, d in sorted(mine, reverse=True) if not in_use(d, cmdlines)]
    for d in dead[keep:]:
        remove(d)
    return dead[keep:]
