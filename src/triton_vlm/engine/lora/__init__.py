"""Per-row LoRA: the adapters of a forward's rows stacked per projection (`lora.py`) and the device slots that
hold the adapters of admitted requests (`adapter_slots.py`)."""
