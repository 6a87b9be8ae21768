"""Every throughput results file names the machine it was measured on: CPU model, ISA, measured bandwidth and
the C kernels' switches and races (`bench/common/machine.py`)."""
from __future__ import annotations

import json

from bench.common import machine, report


def test_results_name_the_cpu_its_isa_the_bandwidth_and_the_kernel_races(tmp_path, monkeypatch):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "gemv-0123456789abcdef.aaaaaaaaaaaa.race.json").write_text(
        json.dumps({"kernel_s": 0.0021, "torch_s": 0.0034}))
    monkeypatch.setenv("TRITON_VLM_CACHE", str(tmp_path))
    meta = {"machine": machine.describe(), "kernel_races": machine.kernel_races(), "bandwidth": {"gb_s": 16.5, "method": "copy", "passes_gb_s": [16.5]}}
    md = report.markdown([], meta)
    cpu = machine.cpu_model()
    assert cpu and f"- cpu: {cpu} (" in md and "bandwidth 16.50 GB/s" in md
    assert machine.isa().split()[0] in md
    assert "'gemv': '2.100 vs 3.400 ms'" in md
