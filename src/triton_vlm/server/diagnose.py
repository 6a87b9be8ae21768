"""Why a tritonserver did not start, read from its log.

A failed start ends with the server's shutdown ("failed to load all models", the unload countdown); the cause
is earlier: Triton logs each model that fails with

    E1123 12:34:24.821003 6546 model_lifecycle.cc:642] "failed to load 'llm' version 1: Internal: AssertionError:
    Torch not compiled with CUDA enabled\\n\\nAt:\\n  /.../weights.py(62): take\\n ..."

(one line, the message quoted with its newlines escaped; the python backend appends the Python traceback's
frames after "At:", innermost first). `load_failures` turns those into readable text; without any, the error
lines that are not known start-up noise are the best clue.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

_FAILED = re.compile(r"""^E\S+ \S+ \d+ \S+\] "failed to load '([^']+)' version \S+: (.*)"\s*$""")
_ERROR = re.compile(r'^E\S+ \S+ \d+ \S+\] "?(.*?)"?\s*$')
# error lines of every CPU-only start, and consequences rather than causes
_NOISE = ("CudaDriverHelper has not been initialized", "depends on", "Failed to initialize NVML",
          "failed to load all models", "DCGM")
_STATUS_PREFIX = re.compile(r"^(Internal|Invalid argument|Not found|Unavailable|Unknown): ")
MAX_FRAMES = 8


def _unquote(message: str) -> str:
    try:
        return json.loads(f'"{message}"')
    except ValueError:
        return message.replace("\\n", "\n").replace('\\"', '"')


def load_failures(log_text: str) -> list[str]:
    """One text per model that failed to load: `model 'llm' failed to load: <error>` and the traceback's
    innermost frames, indented."""
    out = []
    for line in log_text.splitlines():
        m = _FAILED.match(line)
        if not m:
            continue
        error, _, frames = _unquote(m.group(2)).partition("\nAt:\n")
        lines = [f"model {m.group(1)!r} failed to load: {_STATUS_PREFIX.sub('', error.strip())}"]
        lines += [f"  at {f.strip()}" for f in frames.splitlines() if f.strip()][:MAX_FRAMES]
        out.append("\n".join(lines))
    return out


def error_lines(log_text: str, limit: int = 5) -> list[str]:
    """The log's error-level lines that are not known noise, the last `limit` of them."""
    found = []
    for line in log_text.splitlines():
        m = _ERROR.match(line)
        if m and not any(n in line for n in _NOISE):
            found.append(_unquote(m.group(1)).strip())
    return found[-limit:]


def failure_cause(log_text: str) -> str | None:
    """The models' load errors, else the notable error lines, else None."""
    failures = load_failures(log_text)
    if failures:
        return "\n".join(failures)
    errors = error_lines(log_text)
    return "\n".join(errors) if errors else None


def read_log(path: Path | None, offset: int = 0) -> str:
    """The log from byte `offset` (where the last start began writing), or "" if there is none."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
