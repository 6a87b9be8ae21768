"""The GPU check for a lent GPU: check (one command, one results file; `make gpu-check`), its big step (big) and
bookkeeping (report), and diagnose (where a decode step's host time goes). Past runs: `bench/gpu/runs/`.
Entry point: `python -m bench.gpu.check`."""
