"""Benchmarks of triton-vlm: `python -m bench.throughput` (server, engine vs transformers baseline),
`python -m bench.profile_engine` (where the engine's step time goes), `python -m bench.model` (the model)."""
