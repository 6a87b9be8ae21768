"""Benchmarks of the engine in-process (`triton_vlm.engine`, no Triton): profile_engine, lora_overhead, lora_check,
detok_thread, guided, fp8, roofline. Each is `python -m bench.engine.<module>`."""
