"""Helpers shared by the benchmark subpackages: model (the benchmark model), machine (the machine named in every
results file), bandwidth (memory bandwidth, bytes per decoded token), report (the throughput table, markdown, plot)."""
