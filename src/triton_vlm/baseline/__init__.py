"""The `transformers` / `peft` reference: `generate.py` (`HFGenerator`, llm parameter `backend: hf`, the baseline
the benchmarks and tests compare with) and `peft.py` (its LoRA adapters through PEFT)."""
