"""TensorRT-LLM's `llmapi` Triton interface (the `tensorrt_llm` model): its tensors -> the ensemble's pipeline."""
