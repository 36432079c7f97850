#!/usr/bin/env bash
# Qwen3-30B-A3B with LoRA on the five AgentBench-FC tasks: the multitask recipe training adapters on the
# attention projections of a frozen base, on 1 node x 8 H100 (examples/configs/qwen3_30b_a3b_lora.yaml).
#
#   examples/run_qwen3_30b_a3b_lora.sh --check            # pre-flight check: runs on any machine
#   examples/run_qwen3_30b_a3b_lora.sh                    # convert the checkpoint, submit to SLURM
#   examples/run_qwen3_30b_a3b_lora.sh --dry-run          # print the sbatch script, submit nothing
#   examples/run_qwen3_30b_a3b_lora.sh [flags] lora.rank=16 ...   # key=value overrides of the config
#
# Environment:
#   QWEN3_MOE_HF_DIR          the Hugging Face checkpoint (default checkpoints/Qwen3-30B-A3B)
#   QWEN3_MOE_MEGATRON_DIR    where the converted megatron checkpoint goes and the trainer starts from
#                             (default: the config's model.megatron_checkpoint; it loads at any EP)
#   AGENTRL_ENV_CONTROLLER_URL  the env controller the AgentBench-FC task workers register with
#   SLURM_PARTITION, SLURM_ACCOUNT, CONTAINER_IMAGE   passed to the submission when set
#   AGENTRL_PYTHON            the Python with megatron-agentrl installed (default .venv/bin/python)
#   CONFIG                    another run config (default examples/configs/qwen3_30b_a3b_lora.yaml)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE_SCRIPT="${BASH_SOURCE[0]}"
RECIPE_TAG=qwen3-moe
RECIPE_MODEL=Qwen3-30B-A3B
RECIPE_HF_REPO=Qwen/Qwen3-30B-A3B
RECIPE_CONFIG="$ROOT/examples/configs/qwen3_30b_a3b_lora.yaml"
RECIPE_REFERENCE_HF_CONFIG="$ROOT/examples/configs/qwen3_30b_a3b/config.json"
RECIPE_HF_DIR_VAR=QWEN3_MOE_HF_DIR
RECIPE_MEGATRON_DIR_VAR=QWEN3_MOE_MEGATRON_DIR
# shellcheck source=lib/recipe.sh
source "$ROOT/examples/lib/recipe.sh"
recipe_main "$@"
