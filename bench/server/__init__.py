"""Benchmarks through the live `tritonserver` on the project's model repository, driven by real clients
(`tritonclient`, `openai`, `perf_analyzer`): throughput, loadtest, openai_load, traffic, chat, queue_stall,
guide_stall, stream_overhead, cancel_poll, lora_server, routing. Each is `python -m bench.server.<module>`."""
