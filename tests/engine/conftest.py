"""The engine's unit tests check the C kernels' results wherever they build and check (switch "1"): whether they
are also the faster path on this machine (switch "auto", the default) is tested in test_kernels_anywhere.py."""
from __future__ import annotations

import pytest

from triton_vlm.engine import cpu_decode, cpu_forward, gemv


@pytest.fixture(autouse=True)
def kernels_wherever_checked(monkeypatch):
    for env in (gemv.ENV, cpu_decode.ENV, cpu_forward.ENV):
        monkeypatch.setenv(env, "1")
