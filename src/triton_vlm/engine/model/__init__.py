"""The decoder forward and what it runs on: `model.py` (Llama / Mistral / Qwen2 layers over the paged KV cache),
`weights.py`, `attention.py`, `mrope.py` (Qwen2-VL's 3-D rotary positions), `merge.py` (image features into the
prompt), `cuda_graph.py` (decode steps as CUDA graphs), `faults.py` (device
faults)."""
