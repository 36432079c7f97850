"""Checkpoint and exact resume of a training run.

One checkpoint is a folder ``<checkpoint.dir>/step_<k>`` holding:

* ``model_optim/``: a megatron-core distributed checkpoint (``torch_dist``) of the model
  (``model.*`` keys of ``GPTModel.sharded_state_dict``), the AdamW state (``optimizer.state.
  exp_avg.*``, ``optimizer.state.exp_avg_sq.*`` sharded like their parameters; step count and
  hyper-parameters in the common part), the fp32 master weights when the model is not fp32
  (``optimizer.master.*``) and the KL reference weights when kept (``reference.*``);
* ``rng/rank_<r>.pt``: every rank's Python, torch (CPU and CUDA) and megatron model-parallel
  RNG states;
* ``pipeline.pt`` (rank 0): the pipeline's state: step and weight version, the rollout
  manager's state (prompt sampler, the queued groups with their trajectories, which is the next
  batch, counters), consumed sample ids, the first evaluation;
* ``meta.json``: step, version, layout, time.

``<checkpoint.dir>/latest`` names the newest complete checkpoint (written last, atomically).
:func:`save_checkpoint` and :func:`load_checkpoint` are collective over all ranks. The files in
``pipeline.pt`` are pickles: load only checkpoints your own runs wrote.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_agentrl.convert.checkpoint import sync_save_strategy

logger = logging.getLogger(__name__)

LATEST = "latest"
MODEL_DIR = "model_optim"
PIPELINE_FILE = "pipeline.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found, read or applied; the message names it and the fix."""


def step_dir(root: str | Path, step: int) -> Path:
    """``<root>/step_<step, 6 digits>``."""
    return Path(root) / f"step_{step:06d}"


def find_latest(root: str | Path) -> Path | None:
    """The checkpoint ``<root>/latest`` names, or None when there is none."""
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    d = Path(root) / p.read_text().strip()
    return d if (d / "meta.json").is_file() else None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _ensure_optimizer_state(actor: Any) -> None:
    """Create zero AdamW state for parameters that have none yet (a fresh optimizer), so that a
    load has tensors to fill."""
    opt = actor.optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _sharded_state(actor: Any, for_load: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sharded state dict of model + optimizer (+ masters, + reference) and the torch optimizer
    state dict it was built from (its ``state`` entries become ShardedTensors)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor, optim_state_to_sharding_state
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_sd = actor.model.sharded_state_dict()
    if for_load:
        model_sd = {k: v for k, v in model_sd.items()
                    if not (isinstance(v, ShardedObject) or k.endswith("_extra_state"))}
    tensors, _ = extract_sharded_tensors_and_factories(dict(model_sd))
    by_param = {id(t.data): t for t in nested_values(tensors)}
    opt = actor.optimizer
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    opt_index = {id(m): i for i, m in enumerate(opt_params)}
    id_map: dict[int, Any] = {}
    masters: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    ref_params = getattr(actor, "_ref_params", None)
    for i, ((name, p), m) in enumerate(zip(actor.named_params, actor.masters)):
        sh = by_param.get(id(p))
        if sh is None:
            if getattr(actor, "_is_tied_copy", lambda n: False)(name):
                # the last stage's copy of a tied embedding: its state equals the embedding's (kept
                # in sync by megatron's embedding all-reduce) and is restored from there on load
                continue
            raise CheckpointError(f"parameter {name} has no entry in the model's sharded state dict; "
                                  "this model layout is not supported by the checkpoint code")
        id_map[opt_index[id(m)]] = sh
        # keyed by the parameter's position (layer tensors share one stacked key)
        if m is not p:
            masters[str(i)] = make_sharded_optimizer_tensor(sh, m, prefix="optimizer.master")
        if ref_params is not None:
            reference[str(i)] = make_sharded_optimizer_tensor(sh, ref_params[i], prefix="reference")
    if for_load:
        _ensure_optimizer_state(actor)
    optim_sd = opt.state_dict()
    step_count = 0
    for st in optim_sd["state"].values():
        if "step" in st:
            step_count = int(float(st["step"]))
            break
    optim_sd["state"] = {k: v for k, v in optim_sd["state"].items() if k in id_map}
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    sd: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd, "optimizer_step": step_count}
    if masters:
        sd["masters"] = masters
    if reference:
        sd["reference"] = reference
    return sd, optim_sd


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        state["megatron"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001 - tracker not initialised
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


def save_checkpoint(root: str | Path, step: int, actor: Any, pipeline_state: dict[str, Any] | None,
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` (see the module doc); collective over all ranks.

    pipeline_state: rank 0's pipeline state (picklable), None on other ranks. keep: how many
    newest checkpoints to keep (0 = all). Returns the checkpoint folder.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    root = Path(root)
    d = step_dir(root, step)
    rank0 = _rank() == 0
    if rank0:
        if d.exists():
            shutil.rmtree(d)
        (d / MODEL_DIR).mkdir(parents=True)
        (d / "rng").mkdir()
    _barrier()
    sd, _ = _sharded_state(actor, for_load=False)
    dist_checkpointing.save(sd, str(d / MODEL_DIR), sharded_strategy=sync_save_strategy())
    torch.save(_rng_state(), d / "rng" / f"rank_{_rank()}.pt")
    _barrier()
    if rank0:
        torch.save(pipeline_state, d / PIPELINE_FILE)
        meta = {"step": step, "version": (pipeline_state or {}).get("version", step), "tp": actor.tp, "pp": actor.pp,
                "dp": actor.dp, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "dtype": str(actor.dtype).removeprefix("torch."), "has_reference": actor.has_reference,
                "time": time.time()}
        (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(d.name + "\n")
        os.replace(tmp, root / LATEST)
        if keep > 0:
            old = sorted(p for p in root.glob("step_*") if p.is_dir() and p != d)
            for p in old[: max(0, len(old) - (keep - 1))]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier()
    logger.debug("checkpoint step %d saved to %s (%.1fs)", step, d, time.perf_counter() - t0)
    return d


def load_checkpoint(path: str | Path, actor: Any) -> dict[str, Any]:
    """Load model, optimizer, masters, reference and this rank's RNG from checkpoint ``path``;
    return the pipeline state (on every rank). Collective over all ranks.

    Raises CheckpointError naming the folder when it is not a complete checkpoint, or when it was
    written with another TP x PP x DP layout (RNG and data order would not match).
    """
    from megatron.core import dist_checkpointing

    d = Path(path)
    meta_file = d / "meta.json"
    if not meta_file.is_file() or not (d / MODEL_DIR).is_dir() or not (d / PIPELINE_FILE).is_file():
        raise CheckpointError(f"'{d}' is not a complete checkpoint (meta.json, {MODEL_DIR}/ and {PIPELINE_FILE} "
                              "expected); give a step_<k> folder written by a training run, or "
                              "checkpoint.resume=latest")
    meta = json.loads(meta_file.read_text())
    world = dist.get_world_size() if dist.is_initialized() else 1
    if (meta["tp"], meta["pp"], meta["world_size"]) != (actor.tp, actor.pp, world):
        raise CheckpointError(
            f"checkpoint '{d}' was written with tp={meta['tp']} pp={meta['pp']} on {meta['world_size']} processes; "
            f"this run has tp={actor.tp} pp={actor.pp} on {world}; resume with the same layout")
    rng_file = d / "rng" / f"rank_{_rank()}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"checkpoint '{d}' has no RNG state for rank {_rank()} ({rng_file})")
    if meta.get("has_reference") and not actor.has_reference:
        actor.snapshot_reference()  # a placeholder the load fills
    sd, optim_sd = _sharded_state(actor, for_load=True)
    has_ref = "reference" in sd
    loaded = dist_checkpointing.load(sd, str(d / MODEL_DIR))
    result = actor.model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint '{d}' left parameters unloaded: missing {missing[:8]}, "
                              f"unexpected {list(result.unexpected_keys)[:8]}")
    opt = actor.optimizer
    step_count = float(loaded["optimizer_step"])
    state = {k: {**v, "step": torch.tensor(step_count)} for k, v in loaded["optimizer"]["state"].items()}
    full = {"state": state, "param_groups": loaded["optimizer"]["param_groups"]}
    for g_loaded, g_cur in zip(full["param_groups"], optim_sd["param_groups"]):
        g_loaded["params"] = list(g_cur["params"].obj if hasattr(g_cur["params"], "obj") else g_cur["params"])
    opt.load_state_dict(full)
    with torch.no_grad():
        masters = loaded.get("masters", {})
        for i, ((_, p), m) in enumerate(zip(actor.named_params, actor.masters)):
            if m is not p:
                m.copy_(masters[str(i)] if str(i) in masters else p.detach().float())
        if has_ref:
            ref = loaded["reference"]
            actor._ref_params = [ref[str(i)].clone() if str(i) in ref else p.detach().clone()
                                 for i, (_, p) in enumerate(actor.named_params)]
    _set_rng_state(torch.load(rng_file, weights_only=False))
    state = torch.load(d / PIPELINE_FILE, weights_only=False)
    _barrier()
    logger.info("resumed from checkpoint %s (step %d)", d, meta["step"])
    return state
