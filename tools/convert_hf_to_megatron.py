#!/usr/bin/env python
"""Hugging Face safetensors checkpoint -> megatron-core distributed checkpoint (streaming).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-7B --out-dir ckpt/qwen7b --tp 4 --pp 2

Same as ``agentrl convert hf-to-megatron``; see ``megatron_agentrl/convert/hf_to_megatron.py``.
"""
import sys

from megatron_agentrl.convert.cli import main_hf_to_megatron

if __name__ == "__main__":
    sys.exit(main_hf_to_megatron())
