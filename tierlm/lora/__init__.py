"""PEFT LoRA adapters merged into base weights tensor by tensor.

spec.py: `--lora DIR[:WEIGHT]`; adapter.py: reading an adapter; patterns.py: peft's module-name
rules; merge.py: `LoraMerger`. Import the submodules directly (torch loads only when used).
"""
