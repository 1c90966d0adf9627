"""Parameter-efficient finetuning: the PEFT contract, LoRA, and merging adapters for export."""

from bridge.train.peft.base import PEFT, apply_peft
from bridge.train.peft.lora import LoRA, LoRAAdapter, merge_adapters

__all__ = ["PEFT", "LoRA", "LoRAAdapter", "apply_peft", "merge_adapters"]
