#!/usr/bin/env bash
# Qwen3-30B-A3B with LoRA on the five AgentBench-FC tasks: the multitask recipe (run_qwen3_30b_a3b_multitask.sh)
# with examples/configs/qwen3_30b_a3b_lora.yaml, which trains adapters on the attention projections of a frozen
# base, on 1 node x 8 H100.
#
#   examples/run_qwen3_30b_a3b_lora.sh --check            # pre-flight check: runs on any machine
#   examples/run_qwen3_30b_a3b_lora.sh                    # convert the checkpoint, submit to SLURM
#   examples/run_qwen3_30b_a3b_lora.sh --dry-run          # print the sbatch script, submit nothing
#   examples/run_qwen3_30b_a3b_lora.sh [flags] lora.rank=16 ...   # key=value overrides of the config
#
# Environment: as run_qwen3_30b_a3b_multitask.sh's; CONFIG defaults to examples/configs/qwen3_30b_a3b_lora.yaml.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$ROOT/examples/configs/qwen3_30b_a3b_lora.yaml}" exec "$ROOT/examples/run_qwen3_30b_a3b_multitask.sh" "$@"
