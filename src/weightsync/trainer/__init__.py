"""Trainer side: turn a model (plain, FSDP2, PEFT LoRA) into named tensors to send."""

from weightsync.trainer.export import KINDS, ExportItem, assign_owners, export_weights, plan_export
from weightsync.trainer.lora import is_peft_model, lora_config_dict

__all__ = ["export_weights", "plan_export", "assign_owners", "ExportItem", "KINDS",
           "is_peft_model", "lora_config_dict"]
