"""LoRA adapters: reading PEFT's format (peft_adapter.py), the preallocated slots adapters are
copied into (slots.py), and one batch's per-row adapter deltas (batch.py, our C++ kernel on CPU)."""
