"""LoRA adapters: reading and checking PEFT's files (adapter.py, torch) and the resident set
(registry.py, torch-free). The batched product is engine.layers.lora's."""
