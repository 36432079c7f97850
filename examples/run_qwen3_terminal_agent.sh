#!/usr/bin/env bash
# Qwen3-30B-A3B (mixture of experts: 128 experts, 8 per token) as a terminal agent: asynchronous GRPO on
# terminal tasks with their own images and in-container verifiers (the `terminal` task), SGLang engines,
# 2 nodes x 8 H100 for training and generation, the containers on separate worker nodes whose task
# workers register with one env controller (examples/configs/qwen3_30b_a3b_terminal.yaml says how to start them).
#
#   examples/run_qwen3_terminal_agent.sh --check            # pre-flight check: runs on any machine
#   examples/run_qwen3_terminal_agent.sh                    # convert the checkpoint, submit to SLURM
#   examples/run_qwen3_terminal_agent.sh --dry-run          # print the sbatch script, submit nothing
#   examples/run_qwen3_terminal_agent.sh [flags] train.lr=5e-7 ...   # key=value overrides of the config
#
# Environment:
#   QWEN3_MOE_HF_DIR          the Hugging Face checkpoint (default checkpoints/Qwen3-30B-A3B)
#   QWEN3_MOE_MEGATRON_DIR    where the converted megatron checkpoint goes and the trainer starts from
#                             (default: the config's model.megatron_checkpoint; it loads at any EP)
#   AGENTRL_ENV_CONTROLLER_URL  the env controller the terminal task workers register with
#   SLURM_PARTITION, SLURM_ACCOUNT, CONTAINER_IMAGE   passed to the submission when set
#   AGENTRL_PYTHON            the Python with megatron-agentrl installed (default .venv/bin/python)
#   CONFIG                    another run config (default examples/configs/qwen3_30b_a3b_terminal.yaml)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE_SCRIPT="${BASH_SOURCE[0]}"
RECIPE_TAG=qwen3-terminal
RECIPE_MODEL=Qwen3-30B-A3B
RECIPE_HF_REPO=Qwen/Qwen3-30B-A3B
RECIPE_CONFIG="$ROOT/examples/configs/qwen3_30b_a3b_terminal.yaml"
RECIPE_REFERENCE_HF_CONFIG="$ROOT/examples/configs/qwen3_30b_a3b/config.json"
RECIPE_HF_DIR_VAR=QWEN3_MOE_HF_DIR
RECIPE_MEGATRON_DIR_VAR=QWEN3_MOE_MEGATRON_DIR
# shellcheck source=lib/recipe.sh
source "$ROOT/examples/lib/recipe.sh"
recipe_main "$@"
