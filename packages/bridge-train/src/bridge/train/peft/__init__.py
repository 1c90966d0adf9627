"""Parameter-efficient finetuning: the PEFT contract, LoRA, and merging adapters for export."""

from bridge.train.peft.base import PEFT, adapter_parameter_names, apply_peft
from bridge.train.peft.lora import LoRA, LoRAAdapter, merge_adapters

__all__ = ["PEFT", "LoRA", "LoRAAdapter", "adapter_parameter_names", "apply_peft", "merge_adapters"]
