# Shared body of the cluster recipes (examples/run_*_multitask.sh): flags, environment overrides,
# the pre-flight check, the checkpoint conversion and the SLURM submission. Sourced, not run.
#
# The recipe script sets, then calls `recipe_main "$@"`:
#   ROOT                        the repository root
#   RECIPE_SCRIPT               the recipe script's path (its header comment is its --help)
#   RECIPE_TAG                  prefix of progress lines, e.g. glm4
#   RECIPE_MODEL                the model's name, e.g. GLM-4-9B-0414 (messages, default checkpoint dir)
#   RECIPE_HF_REPO              where to download it from, e.g. THUDM/GLM-4-9B-0414
#   RECIPE_CONFIG               the run config (the CONFIG environment variable replaces it)
#   RECIPE_REFERENCE_HF_CONFIG  config.json with the published model's numbers, planned from by --check
#   RECIPE_HF_DIR_VAR           name of the environment variable that gives the HF checkpoint
#   RECIPE_MEGATRON_DIR_VAR     name of the one that gives the converted megatron checkpoint
#   RECIPE_LAUNCH               where the run goes after the check: slurm (default: submit) or local (train
#                               on this node, on the local Ray its config enables; --slurm submits instead)
# and the environment may set AGENTRL_ENV_CONTROLLER_URL, SLURM_PARTITION, SLURM_ACCOUNT,
# CONTAINER_IMAGE and AGENTRL_PYTHON (see the recipe's header).

recipe_main() {
  local name
  name="$(basename "$RECIPE_SCRIPT")"
  cd "$ROOT"
  PY="${AGENTRL_PYTHON:-$ROOT/.venv/bin/python}"
  [ -x "$PY" ] || PY="$(command -v python3)"
  CONFIG="${CONFIG:-$RECIPE_CONFIG}"
  AGENTRL=("$PY" -m megatron_agentrl.cli)

  local mode=submit arg launch="${RECIPE_LAUNCH:-slurm}"
  SUBMIT_FLAGS=()
  OVERRIDES=()
  for arg in "$@"; do
    case "$arg" in
      --check) mode=check ;;
      --dry-run) mode=dry-run ;;
      --wait) SUBMIT_FLAGS+=(--wait) ;;
      --slurm) launch=slurm ;;
      -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$RECIPE_SCRIPT"; exit 0 ;;
      --*) echo "$name: unknown flag $arg (see --help)" >&2; exit 2 ;;
      *=*) OVERRIDES+=("$arg") ;;
      *) echo "$name: '$arg' is not a key=value override (see --help)" >&2; exit 2 ;;
    esac
  done

  # The checkpoint paths and endpoints the environment gives replace the config's.
  local hf_env="${!RECIPE_HF_DIR_VAR:-}" megatron_env="${!RECIPE_MEGATRON_DIR_VAR:-}"
  if [ -n "$hf_env" ]; then
    OVERRIDES=("model.hf_config=$hf_env" "model.checkpoint=$hf_env" "model.tokenizer=$hf_env" "${OVERRIDES[@]}")
  fi
  if [ -n "$megatron_env" ]; then
    OVERRIDES=("model.megatron_checkpoint=$megatron_env" "${OVERRIDES[@]}")
  fi
  if [ -n "${AGENTRL_ENV_CONTROLLER_URL:-}" ]; then
    OVERRIDES=("env.controller_url=$AGENTRL_ENV_CONTROLLER_URL" "${OVERRIDES[@]}")
  fi
  [ -n "${SLURM_PARTITION:-}" ] && SUBMIT_FLAGS+=(--partition "$SLURM_PARTITION")
  [ -n "${SLURM_ACCOUNT:-}" ] && SUBMIT_FLAGS+=(--account "$SLURM_ACCOUNT")
  [ -n "${CONTAINER_IMAGE:-}" ] && SUBMIT_FLAGS+=(--container-image "$CONTAINER_IMAGE")

  if [ "$mode" = check ]; then
    # Validates config, layout, memory per GPU, paths, endpoints, the sbatch script and the tools;
    # reports what only the cluster can verify (GPUs, weights, task endpoints) without failing on it.
    exec "${AGENTRL[@]}" plan --check --config "$CONFIG" --reference-hf-config "$RECIPE_REFERENCE_HF_CONFIG" \
      "${OVERRIDES[@]}"
  fi
  if [ "$mode" = dry-run ]; then
    exec "${AGENTRL[@]}" slurm submit --dry-run --config "$CONFIG" "${SUBMIT_FLAGS[@]}" "${OVERRIDES[@]}"
  fi

  # 1. The HF checkpoint, converted once to a megatron distributed checkpoint at the run's TP x PP:
  #    this checks the weights against the family's mapping and the layout before any GPU is
  #    allocated. The trainer starts from that checkpoint (model.megatron_checkpoint; it loads at
  #    any TP x PP, and at any EP for a mixture-of-experts model).
  local values hf_dir tp pp megatron_dir dtype
  mapfile -t values < <(recipe_config_values model.checkpoint parallel.tp parallel.pp model.megatron_checkpoint \
                                             model.dtype)
  [ "${#values[@]}" -eq 5 ] || { echo "$name: the config $CONFIG does not load (the line above says why)" >&2; exit 2; }
  hf_dir="${values[0]}" tp="${values[1]}" pp="${values[2]}" megatron_dir="${values[3]}" dtype="${values[4]}"
  if [ -z "$megatron_dir" ] || [ "$megatron_dir" = None ]; then
    megatron_dir="checkpoints/${RECIPE_MODEL}-megatron-tp${tp}pp${pp}"
  fi
  OVERRIDES+=("model.megatron_checkpoint=$megatron_dir")
  if [ ! -d "$hf_dir" ]; then
    echo "$name: the HF checkpoint '$hf_dir' does not exist; download $RECIPE_MODEL there" \
         "(e.g. huggingface-cli download $RECIPE_HF_REPO --local-dir $hf_dir) or set $RECIPE_HF_DIR_VAR" >&2
    exit 2
  fi
  if [ -d "$megatron_dir" ] && [ -n "$(ls -A "$megatron_dir")" ]; then
    echo "[$RECIPE_TAG] megatron checkpoint already converted: $megatron_dir"
  else
    echo "[$RECIPE_TAG] converting $hf_dir -> $megatron_dir (TP $tp, PP $pp)"
    "${AGENTRL[@]}" convert hf-to-megatron --hf-dir "$hf_dir" --out-dir "$megatron_dir" --tp "$tp" --pp "$pp" \
      --dtype "$dtype"
  fi

  # 2. The pre-flight check again, now with the weights in place (what only the compute nodes can
  #    verify, GPUs and endpoints reachable from there, is reported, not failed on).
  "${AGENTRL[@]}" plan --check --config "$CONFIG" "${OVERRIDES[@]}" || {
    echo "$name: the pre-flight check failed; fix the FAIL lines above" >&2; exit 1; }

  # 3. Train here (a local Ray places the trainer ranks and the engines on this node's GPUs), or submit:
  #    Ray head + workers on the allocation's nodes, then agentrl train on the Ray cluster.
  if [ "$launch" = local ]; then
    "${AGENTRL[@]}" doctor || { echo "$name: this node's GPU stack is not ready; fix the FAIL lines above" >&2; exit 1; }
    exec "${AGENTRL[@]}" train --config "$CONFIG" "${OVERRIDES[@]}"
  fi
  "${AGENTRL[@]}" slurm submit --config "$CONFIG" "${SUBMIT_FLAGS[@]}" "${OVERRIDES[@]}"
}

# Values of the (overridden) config, one line each, for the conversion's layout.
recipe_config_values() {
  "$PY" - "$CONFIG" "$#" "$@" "${OVERRIDES[@]}" <<'PYEOF'
import sys

from megatron_agentrl.config import ConfigError, load_config

n = int(sys.argv[2])
keys, overrides = sys.argv[3:3 + n], sys.argv[3 + n:]
try:
    cfg = load_config(sys.argv[1], overrides)
except ConfigError as e:
    sys.exit(f"config: {e}")
for key in keys:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    print(obj)
PYEOF
}
