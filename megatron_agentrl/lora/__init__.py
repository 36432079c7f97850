"""LoRA: low-rank adapters trained on a frozen base (options, the adapters on megatron's layers, PEFT's format)."""
