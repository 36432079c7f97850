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
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${AGENTRL_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
CONFIG="${CONFIG:-$ROOT/examples/configs/glm4_9b_multitask.yaml}"
REFERENCE_HF_CONFIG="$ROOT/examples/configs/glm4_9b_0414/config.json"
AGENTRL=("$PY" -m megatron_agentrl.cli)

MODE=submit
SUBMIT_FLAGS=()
OVERRIDES=()
for arg in "$@"; do
  case "$arg" in
    --check) MODE=check ;;
    --dry-run) MODE=dry-run ;;
    --wait) SUBMIT_FLAGS+=(--wait) ;;
    -h|--help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --*) echo "run_glm4_9b_multitask.sh: unknown flag $arg (see --help)" >&2; exit 2 ;;
    *=*) OVERRIDES+=("$arg") ;;
    *) echo "run_glm4_9b_multitask.sh: '$arg' is not a key=value override (see --help)" >&2; exit 2 ;;
  esac
done

# The checkpoint paths and endpoints the environment gives replace the config's.
if [ -n "${GLM4_HF_DIR:-}" ]; then
  OVERRIDES=("model.hf_config=$GLM4_HF_DIR" "model.checkpoint=$GLM4_HF_DIR" "model.tokenizer=$GLM4_HF_DIR"
             "${OVERRIDES[@]}")
fi
if [ -n "${GLM4_MEGATRON_DIR:-}" ]; then
  OVERRIDES=("model.megatron_checkpoint=$GLM4_MEGATRON_DIR" "${OVERRIDES[@]}")
fi
if [ -n "${AGENTRL_ENV_CONTROLLER_URL:-}" ]; then
  OVERRIDES=("env.controller_url=$AGENTRL_ENV_CONTROLLER_URL" "${OVERRIDES[@]}")
fi
[ -n "${SLURM_PARTITION:-}" ] && SUBMIT_FLAGS+=(--partition "$SLURM_PARTITION")
[ -n "${SLURM_ACCOUNT:-}" ] && SUBMIT_FLAGS+=(--account "$SLURM_ACCOUNT")
[ -n "${CONTAINER_IMAGE:-}" ] && SUBMIT_FLAGS+=(--container-image "$CONTAINER_IMAGE")

if [ "$MODE" = check ]; then
  # Validates config, layout, memory per GPU, paths, endpoints, the sbatch script and the tools;
  # reports what only the cluster can verify (GPUs, weights, task endpoints) without failing on it.
  exec "${AGENTRL[@]}" plan --check --config "$CONFIG" --reference-hf-config "$REFERENCE_HF_CONFIG" "${OVERRIDES[@]}"
fi

# One value of the (overridden) config, for the conversion's layout.
cfg_value() {
  "$PY" - "$CONFIG" "$1" "${OVERRIDES[@]}" <<'PYEOF'
import sys
from megatron_agentrl.config import load_config
cfg = load_config(sys.argv[1], sys.argv[3:])
obj = cfg
for part in sys.argv[2].split("."):
    obj = getattr(obj, part)
print(obj)
PYEOF
}

if [ "$MODE" = dry-run ]; then
  exec "${AGENTRL[@]}" slurm submit --dry-run --config "$CONFIG" "${SUBMIT_FLAGS[@]}" "${OVERRIDES[@]}"
fi

# 1. The HF checkpoint, converted once to a megatron distributed checkpoint at the run's TP x PP:
#    this checks the weights against the GLM-4 mapping and the layout before any GPU is allocated.
#    The trainer starts from that checkpoint (model.megatron_checkpoint; it loads at any TP x PP).
HF_DIR="$(cfg_value model.checkpoint)"
TP="$(cfg_value parallel.tp)"
PP="$(cfg_value parallel.pp)"
MEGATRON_DIR="$(cfg_value model.megatron_checkpoint)"
if [ -z "$MEGATRON_DIR" ] || [ "$MEGATRON_DIR" = None ]; then
  MEGATRON_DIR="checkpoints/GLM-4-9B-0414-megatron-tp${TP}pp${PP}"
fi
OVERRIDES+=("model.megatron_checkpoint=$MEGATRON_DIR")
if [ ! -d "$HF_DIR" ]; then
  echo "run_glm4_9b_multitask.sh: the HF checkpoint '$HF_DIR' does not exist; download GLM-4-9B-0414 there" \
       "(e.g. huggingface-cli download THUDM/GLM-4-9B-0414 --local-dir $HF_DIR) or set GLM4_HF_DIR" >&2
  exit 2
fi
if [ -d "$MEGATRON_DIR" ] && [ -n "$(ls -A "$MEGATRON_DIR")" ]; then
  echo "[glm4] megatron checkpoint already converted: $MEGATRON_DIR"
else
  echo "[glm4] converting $HF_DIR -> $MEGATRON_DIR (TP $TP, PP $PP)"
  "${AGENTRL[@]}" convert hf-to-megatron --hf-dir "$HF_DIR" --out-dir "$MEGATRON_DIR" --tp "$TP" --pp "$PP" \
    --dtype bfloat16
fi

# 2. The pre-flight check again, now with the weights in place (what only the compute nodes can
#    verify, GPUs and endpoints reachable from there, is reported, not failed on).
"${AGENTRL[@]}" plan --check --config "$CONFIG" "${OVERRIDES[@]}" || {
  echo "run_glm4_9b_multitask.sh: the pre-flight check failed; fix the FAIL lines above" >&2; exit 1; }

# 3. Submit: Ray head + worker on the 2 nodes, then agentrl train on the Ray cluster.
"${AGENTRL[@]}" slurm submit --config "$CONFIG" "${SUBMIT_FLAGS[@]}" "${OVERRIDES[@]}"
