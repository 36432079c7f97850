#!/usr/bin/env python
"""megatron-core distributed checkpoint (any TP x PP) -> Hugging Face safetensors checkpoint.

    python tools/convert_megatron_to_hf.py --megatron-dir ckpt/qwen7b --out-dir Qwen2.5-7B-rl

Same as ``agentrl convert megatron-to-hf``; see ``megatron_agentrl/convert/megatron_to_hf.py``.
"""
import sys

from megatron_agentrl.convert.cli import main_megatron_to_hf

if __name__ == "__main__":
    sys.exit(main_megatron_to_hf())
