"""Another server side by side with ours: side_by_side (vLLM, both driven by `vllm bench serve`; `make bench-peers`),
affinity_ab (ours with and without vLLM's CPU layout); vllm_env and procs are their helpers.
Entry point: `python -m bench.peers.side_by_side`."""
