"""Benchmarks of triton-vlm, laid out by what they drive (bench/README.md has the table of every module and its
command): `bench.server` (through the live tritonserver: `python -m bench.server.throughput`, `make bench`),
`bench.engine` (the engine in-process: `python -m bench.engine.profile_engine`), `bench.vision` (images and the
vision encoder), `bench.peers` (vLLM side by side: `python -m bench.peers.side_by_side`), `bench.gpu` (the GPU check:
`python -m bench.gpu.check`) and `bench.common` (the benchmark model, the machine, bandwidth, the report)."""
