"""queue_tinker: a self-hosted, Tinker-style LoRA fine-tuning service."""

__version__ = "0.1.0"
