"""LoRA adapters: TensorRT-LLM's tensor format (`format.py`), PEFT adapters (`peft.py`), and the engine's per-row
application (`triton_vlm.engine.lora.lora`)."""
