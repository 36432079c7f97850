#!/usr/bin/env bash
# Qwen3-8B on the five AgentBench-FC tasks on ONE node of 8 GPUs (80 GB each): asynchronous multi-task GRPO
# with cross-policy sampling and per-task normalization; 4 GPUs train (TP 4), 4 run SGLang engines (2 version
# slots x 2 engines), placed by a local Ray that `agentrl train` starts. The task workers run elsewhere and
# register with the env controller at env.controller_url (examples/configs/qwen3_8b_one_node.yaml).
#
#   examples/run_qwen3_8b_one_node.sh --check          # pre-flight check: runs on any machine
#   examples/run_qwen3_8b_one_node.sh                  # convert the checkpoint, check, `agentrl doctor`, train here
#   examples/run_qwen3_8b_one_node.sh --slurm          # convert, check, submit as a one-node SLURM job instead
#   examples/run_qwen3_8b_one_node.sh --slurm --dry-run   # print the sbatch script, submit nothing
#   examples/run_qwen3_8b_one_node.sh [flags] train.lr=5e-7 ...   # key=value overrides of the config
#
# Environment:
#   QWEN3_HF_DIR              the Hugging Face checkpoint (default checkpoints/Qwen3-8B)
#   QWEN3_MEGATRON_DIR        where the converted megatron checkpoint goes and the trainer starts from
#                             (default: the config's model.megatron_checkpoint)
#   AGENTRL_ENV_CONTROLLER_URL  the env controller the AgentBench-FC task workers register with
#   SLURM_PARTITION, SLURM_ACCOUNT, CONTAINER_IMAGE   passed to the submission (--slurm) when set
#   AGENTRL_PYTHON            the Python with megatron-agentrl installed (default .venv/bin/python; on a GPU node:
#                             `make install-gpu`)
#   CONFIG                    another run config (default examples/configs/qwen3_8b_one_node.yaml)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE_SCRIPT="${BASH_SOURCE[0]}"
RECIPE_TAG=qwen3-8b
RECIPE_MODEL=Qwen3-8B
RECIPE_HF_REPO=Qwen/Qwen3-8B
RECIPE_CONFIG="$ROOT/examples/configs/qwen3_8b_one_node.yaml"
RECIPE_REFERENCE_HF_CONFIG="$ROOT/examples/configs/qwen3_8b/config.json"
RECIPE_HF_DIR_VAR=QWEN3_HF_DIR
RECIPE_MEGATRON_DIR_VAR=QWEN3_MEGATRON_DIR
RECIPE_LAUNCH=local
# shellcheck source=lib/recipe.sh
source "$ROOT/examples/lib/recipe.sh"
recipe_main "$@"
