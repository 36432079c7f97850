#!/usr/bin/env bash
# GLM-4-9B-0414 on the five AgentBench-FC tasks (ALFWorld, DB, KG, OS, WebShop): asynchronous
# multi-task GRPO with cross-policy sampling and per-task normalization, 2 nodes x 8 H100.
#
#   examples/run_glm4_9b_multitask.sh --check            # pre-flight check: runs on any machine
#   examples/run_glm4_9b_multitask.sh                    # convert the checkpoint, submit to SLURM
#   examples/run_glm4_9b_multitask.sh --dry-run          # print the sbatch script, submit nothing
#   examples/run_glm4_9b_multitask.sh [flags] train.lr=5e-7 ...   # key=value overrides of the config
#
# Environment:
#   GLM4_HF_DIR               the Hugging Face checkpoint (default checkpoints/GLM-4-9B-0414)
#   GLM4_MEGATRON_DIR         where the converted megatron checkpoint goes and the trainer starts from
#                             (default: the config's model.megatron_checkpoint)
#   AGENTRL_ENV_CONTROLLER_URL  the env controller the AgentBench-FC task workers register with
#   SLURM_PARTITION, SLURM_ACCOUNT, CONTAINER_IMAGE   passed to the submission when set
#   AGENTRL_PYTHON            the Python with megatron-agentrl installed (default .venv/bin/python)
#   CONFIG                    another run config (default examples/configs/glm4_9b_multitask.yaml)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE_SCRIPT="${BASH_SOURCE[0]}"
RECIPE_TAG=glm4
RECIPE_MODEL=GLM-4-9B-0414
RECIPE_HF_REPO=THUDM/GLM-4-9B-0414
RECIPE_CONFIG="$ROOT/examples/configs/glm4_9b_multitask.yaml"
RECIPE_REFERENCE_HF_CONFIG="$ROOT/examples/configs/glm4_9b_0414/config.json"
RECIPE_HF_DIR_VAR=GLM4_HF_DIR
RECIPE_MEGATRON_DIR_VAR=GLM4_MEGATRON_DIR
# shellcheck source=lib/recipe.sh
source "$ROOT/examples/lib/recipe.sh"
recipe_main "$@"
