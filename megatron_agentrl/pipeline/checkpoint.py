"""Checkpoint and exact resume of a training run.

One checkpoint is a folder ``<checkpoint.dir>/step_<k>`` holding:

* ``model_optim/``: a megatron-core distributed checkpoint (``torch_dist``) of the model
  (``model.*`` keys of ``GPTModel.sharded_state_dict``), megatron's optimizer state as its own
  ``sharded_state_dict`` gives it (Adam moments, fp32 main weights when the model is not fp32,
  step count; the distributed optimizer in its ``fully_reshardable`` layout) and the KL reference
  weights when kept (``reference.*``);
* ``rng/rank_<r>.pt``: every rank's Python, torch (CPU and CUDA) and megatron model-parallel
  RNG states;
* ``pipeline.pt`` (rank 0): the pipeline's state: step and weight version, the rollout
  manager's state (prompt sampler, the queued groups with their trajectories, which is the next
  batch, counters; None in ``step_000000``, saved before RL started), consumed sample ids, the first
  evaluation;
* ``meta.json``: step, version, layout, time; in a LoRA run ``lora`` (the adapters' options) and ``base``.

A LoRA run's checkpoint holds no weight of the frozen base: ``model_optim/`` has the adapters (``*.lora.lora_a`` /
``lora_b``, sharded over TP as they are trained) and megatron's optimizer state of them alone, and ``meta.json``
names the base (the run's ``hf_base/``, written once when the adapters start) by path and sha256
(:mod:`megatron_agentrl.lora.checkpoint`); resume checks the hash, loads the base, attaches the adapters and loads
them. Its KL reference is the base, so it is not stored either. The warm-up's checkpoint (``step_000000``) of a LoRA
run is a full one (the warm-up trains every parameter): its model and optimizer state are written before the
adapters start (:func:`write_model_state`), the rest after the evaluation before RL.

``<checkpoint.dir>/latest`` names the newest complete checkpoint (written last, atomically).
:func:`save_checkpoint` and :func:`load_checkpoint` are collective over all ranks. The files in
``pipeline.pt`` are pickles: load only checkpoints your own runs wrote.
"""
from __future__ import annotations

import dataclasses
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

from megatron_agentrl.convert.checkpoint import TRAINING_MODEL_DIR, sync_save_strategy
from megatron_agentrl.distributed import broadcast_object
from megatron_agentrl.lora.adapters import ADAPTER, is_adapter
from megatron_agentrl.lora.checkpoint import BaseError, BaseRef, check_base
from megatron_agentrl.lora.options import LoraOptions

logger = logging.getLogger(__name__)

LATEST = "latest"
MODEL_DIR = TRAINING_MODEL_DIR
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


# megatron's distributed optimizer saved in the canonical per-parameter layout (gathered per DP group
# at save, sliced per rank at load): loadable at another DP size and TP x PP. The default
# ("fully_sharded_model_space") cannot be saved with megatron-core 0.16.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _prime_optimizer_state(actor: Any) -> None:
    """Give a fresh optimizer the Adam state a load fills: moments (megatron's ``init_state_fn``) and a
    ``step`` of its own per parameter (megatron reads one common step from the torch optimizer's
    state, which a fresh ``torch.optim.AdamW`` has none of before its first step)."""
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        opt.init_state_fn(opt.optimizer, opt.config)
        for st in opt.optimizer.state.values():
            st.setdefault("step", torch.tensor(0.0))


def _adapter_state(actor: Any) -> dict[str, Any]:
    """The sharded state dict of the adapters alone (local parameter name -> ShardedTensor or factory).

    megatron's own entries for them are those of a replicated tensor (an adapted layer shards only its own weight
    and bias), so each is rebuilt sharded over TP as trained: ``A`` on its rank axis in a column-parallel layer and
    on its input axis in a row-parallel one, ``B`` on its output axis, a gated ``linear_fc1``'s ``B`` split into its
    gate and up halves as megatron splits the layer's weight; so that it loads at another TP too."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    out: dict[str, Any] = {}
    for key, sh in actor.model.sharded_state_dict().items():
        if not is_adapter(key) or not isinstance(sh, ShardedTensor):
            continue  # the adapters' (empty) extra state
        column = getattr(actor.model.get_submodule(key.split(f".{ADAPTER}.")[0]), ADAPTER).column
        tp_axis = 1 if key.endswith("lora_a.weight") and not column else 0
        n = sh.prepend_axis_num
        prepend = tuple((i, sh.global_offset[i], sh.global_shape[i]) for i in range(n))
        new = ShardedTensor.from_rank_offsets(sh.key, sh.data, *prepend, (tp_axis + n, actor.tp_rank, actor.tp),
                                              replica_id=(sh.replica_id[0], 0, sh.replica_id[2]), prepend_axis_num=n)
        if actor.config.gated_linear_unit and ".linear_fc1." in key and key.endswith("lora_b.weight"):
            new = apply_swiglu_sharded_factory(new, prepend)
        out[key] = new
    if not out:
        raise CheckpointError("the LoRA actor has no adapter entries in its sharded state dict; this model layout "
                              "is not supported by the checkpoint code")
    return out


def _sharded_state(actor: Any, for_load: bool) -> dict[str, Any]:
    """The sharded state dict of model + optimizer (+ the KL reference weights when kept); with LoRA the adapters
    and their optimizer state only (the base and the reference, which is the base, are not written)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    if actor.lora is not None:
        model_sd = _adapter_state(actor)
        if for_load:
            _prime_optimizer_state(actor)
        return {"model": model_sd, "optimizer": actor.optimizer.sharded_state_dict(
            model_sd, is_loading=for_load, metadata=OPTIMIZER_METADATA)}
    model_sd = actor.model.sharded_state_dict()
    if for_load:
        model_sd = {k: v for k, v in model_sd.items()
                    if not (isinstance(v, ShardedObject) or k.endswith("_extra_state"))}
    if for_load:
        _prime_optimizer_state(actor)
    sd: dict[str, Any] = {
        "model": model_sd,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=for_load, metadata=OPTIMIZER_METADATA),
    }
    ref_params = getattr(actor, "_ref_params", None)
    if ref_params is not None:
        tensors, _ = extract_sharded_tensors_and_factories(dict(model_sd))
        by_param = {id(t.data): t for t in nested_values(tensors)}
        reference: dict[str, Any] = {}
        for i, (name, p) in enumerate(actor.named_params):
            sh = by_param.get(id(p))
            if sh is None:
                if actor._is_tied_copy(name):
                    continue  # the last stage's copy of a tied embedding: restored from the embedding
                raise CheckpointError(f"parameter {name} has no entry in the model's sharded state dict; "
                                      "this model layout is not supported by the checkpoint code")
            # keyed by the parameter's position (layer tensors share one stacked key)
            reference[str(i)] = make_sharded_optimizer_tensor(sh, ref_params[i], prefix="reference")
        sd["reference"] = reference
    return sd


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


def write_model_state(root: str | Path, step: int, actor: Any, base: BaseRef | None = None) -> dict[str, Any]:
    """Start checkpoint ``step`` under ``root``: its folder (anew) and ``model_optim/``, the actor's state as it is now
    (with LoRA the adapters and their optimizer state, ``base`` the run's base: required). Collective. Returns what
    :func:`save_checkpoint` records of it in meta.json; the checkpoint is not complete before that call."""
    from megatron.core import dist_checkpointing

    if actor.lora is not None and base is None:
        raise ValueError("write_model_state: a LoRA actor's checkpoint needs the reference of its base (write_base)")
    d = step_dir(root, step)
    if _rank() == 0:
        if d.exists():
            shutil.rmtree(d)
        (d / MODEL_DIR).mkdir(parents=True)
        (d / "rng").mkdir()
    _barrier()
    sd = _sharded_state(actor, for_load=False)
    dist_checkpointing.save(sd, str(d / MODEL_DIR), sharded_strategy=sync_save_strategy())
    if actor.lora is None:
        return {"has_reference": actor.has_reference, "lora": None}
    assert base is not None
    # the reference policy of a LoRA run is its base: recorded, not written
    return {"has_reference": actor.has_reference, "lora": dataclasses.asdict(actor.lora),
            "base": base.to_meta(d)}


def save_checkpoint(root: str | Path, step: int, actor: Any, pipeline_state: dict[str, Any] | None,
                    keep: int = 2, base: BaseRef | None = None, model_state: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` (see the module doc); collective over all ranks.

    pipeline_state: rank 0's pipeline state (picklable), None on other ranks. keep: how many
    newest checkpoints to keep (0 = all); ``step_000000`` (the warm-up's) is never deleted. base: a LoRA run's
    base (:func:`~megatron_agentrl.lora.checkpoint.write_base`). model_state: what :func:`write_model_state` returned
    when the model and optimizer were written earlier (else they are written now). Returns the checkpoint folder.
    """
    t0 = time.perf_counter()
    root = Path(root)
    d = step_dir(root, step)
    rank0 = _rank() == 0
    if model_state is None:
        model_state = write_model_state(root, step, actor, base)
    torch.save(_rng_state(), d / "rng" / f"rank_{_rank()}.pt")
    _barrier()
    if rank0:
        torch.save(pipeline_state, d / PIPELINE_FILE)
        meta = {"step": step, "version": (pipeline_state or {}).get("version", step), "tp": actor.tp, "pp": actor.pp,
                "cp": actor.cp, "ep": actor.ep, "dp": actor.dp,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "dtype": str(actor.dtype).removeprefix("torch."),
                "optimizer_format": "megatron/" + OPTIMIZER_METADATA["distrib_optim_sharding_type"],
                "use_distributed_optimizer": actor.train_cfg.use_distributed_optimizer,
                **model_state, "time": time.time()}
        (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(d.name + "\n")
        os.replace(tmp, root / LATEST)
        if keep > 0:
            old = sorted(p for p in root.glob("step_*") if p.is_dir() and p not in (d, step_dir(root, 0)))
            for p in old[: max(0, len(old) - (keep - 1))]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier()
    logger.debug("checkpoint step %d saved to %s (%.1fs)", step, d, time.perf_counter() - t0)
    return d


def _rng_file(d: Path, meta: dict[str, Any], actor: Any) -> Path:
    """This rank's RNG file in checkpoint ``d``: its own when the layout is unchanged; with another
    DP size, that of the old rank at the same TP x CP x PP position (DP rank modulo the old DP size;
    megatron's rank order is tp-cp-dp-pp); with another TP, PP, CP or EP, rank 0's (sampling and init
    streams then differ from an unbroken run)."""
    tp, pp, old_world = meta["tp"], meta["pp"], meta["world_size"]
    cp, ep = meta.get("cp", 1), meta.get("ep", 1)  # checkpoints written before CP / EP existed: 1
    world = dist.get_world_size() if dist.is_initialized() else 1
    same = (tp, pp, cp, ep, old_world) == (actor.tp, actor.pp, actor.cp, actor.ep, world)
    if same:
        rank = _rank()
    elif (tp, pp, cp, ep) == (actor.tp, actor.pp, actor.cp, actor.ep):
        old_dp = old_world // (tp * pp * cp)
        rank = actor.tp_rank + tp * (actor.cp_rank + cp * ((actor.dp_rank % old_dp) + old_dp * actor.pp_rank))
    else:
        rank = 0
    if not same and _rank() == 0:
        logger.warning("checkpoint '%s' was written with tp=%d pp=%d cp=%d ep=%d on %d processes, this run has tp=%d "
                       "pp=%d cp=%d ep=%d on %d: weights and optimizer state are resharded; RNG streams are taken from "
                       "the nearest rank", d, tp, pp, cp, ep, old_world, actor.tp, actor.pp, actor.cp, actor.ep, world)
    f = d / "rng" / f"rank_{rank}.pt"
    if not f.is_file():
        raise CheckpointError(f"checkpoint '{d}' has no RNG state for rank {rank} ({f}); it is incomplete: resume "
                              "from an earlier step_<k> folder")
    return f


def write_base(actor: Any, hf_config: Any, tokenizer: Any, directory: str | Path) -> BaseRef:
    """Write a LoRA actor's base (the model without its adapters) to ``directory`` in Hugging Face format and hash it
    (rank 0 writes and hashes; collective: the export gathers over TP and PP). The reference, on every rank."""
    from megatron_agentrl.hf_io import save_hf_checkpoint

    state = actor.export_hf_state_dict(merged=False)
    ref = None
    if _rank() == 0:
        out = save_hf_checkpoint(state, hf_config, directory, tokenizer).absolute()
        ref = BaseRef.hashed(out)
    return broadcast_object(ref)


#: the key of :func:`load_checkpoint`'s state that holds a LoRA checkpoint's base (a BaseRef), None otherwise
LORA_BASE_KEY = "lora_base"

#: the ``lora`` options that define the trained adapters (the others, e.g. dropout, are the run's to choose)
ADAPTER_SHAPE = ("rank", "alpha", "target_modules")


def _check_lora(d: Path, meta: dict[str, Any], lora: LoraOptions | None) -> LoraOptions | None:
    """The adapters' options of checkpoint ``d`` (None: full-parameter), refused when the run's ``lora`` section
    (None: take the checkpoint's) cannot continue from it."""
    saved = LoraOptions.from_saved(meta["lora"]) if meta.get("lora") else None
    if lora is None:
        return saved
    if saved is None:
        if lora.enabled and meta["step"] != 0:
            raise CheckpointError(f"checkpoint '{d}' is a full-parameter one of RL step {meta['step']} and this run "
                                  f"has lora.rank={lora.rank}: a LoRA run continues from LoRA checkpoints or from "
                                  "the warm-up's (step_000000); set lora.rank=0, or start a LoRA run from its weights "
                                  "(model.megatron_checkpoint / model.checkpoint)")
        return None
    if not lora.enabled:
        raise CheckpointError(f"checkpoint '{d}' holds LoRA adapters (lora.rank={saved.rank}) and this run has "
                              f"lora.rank=0; resume with the run's lora section (lora.rank={saved.rank}), or start a "
                              "full-parameter run from its merged weights (model.checkpoint=<the run's hf_export>)")
    for key in ADAPTER_SHAPE:
        was, now = getattr(saved, key), getattr(lora, key)
        if was != now:
            raise CheckpointError(f"checkpoint '{d}' was written with lora.{key}={was} and this run has "
                                  f"lora.{key}={now}; its adapters continue only as they were trained: resume "
                                  f"with lora.{key}={was}")
    return lora


def _load_base(d: Path, meta: dict[str, Any], actor: Any, options: LoraOptions) -> BaseRef:
    """A LoRA checkpoint's base checked (hash) and loaded into ``actor``, the adapters attached; its reference as
    checked. Collective."""
    from megatron_agentrl.hf_io import load_hf_weights

    try:
        base = check_base(meta["base"], d)
    except BaseError as e:
        raise CheckpointError(str(e)) from e
    if actor.lora is not None:
        raise CheckpointError(f"checkpoint '{d}': the actor trains adapters already; a LoRA checkpoint loads into "
                              "an actor without them (its base first)")
    actor.load_hf_state_dict(load_hf_weights(base.path))
    actor.start_adapters(options)
    if meta.get("has_reference"):
        actor.snapshot_reference()  # the reference policy of a LoRA run is its base
    return base


def load_checkpoint(path: str | Path, actor: Any, lora: LoraOptions | None = None) -> dict[str, Any]:
    """Load model, optimizer, reference and this rank's RNG from checkpoint ``path``;
    return the pipeline state (on every rank). Collective over all ranks.

    A checkpoint written at another TP x PP x DP layout is resharded (weights, Adam state, step
    count); see :func:`_rng_file` for the RNG. A LoRA run's checkpoint loads into an actor without adapters: its base
    (checked: :func:`~megatron_agentrl.lora.checkpoint.check_base`), then the adapters attached and loaded with their
    optimizer state; the state's :data:`LORA_BASE_KEY` holds the base's reference (None for a full-parameter one).
    ``lora``: the run's section, to refuse a checkpoint it cannot continue from (None: whatever the checkpoint is).
    Raises CheckpointError naming the folder when it is not a complete checkpoint, was written by an earlier checkpoint
    format, or its base is missing or changed.
    """
    from megatron.core import dist_checkpointing

    d = Path(path)
    meta_file = d / "meta.json"
    if not meta_file.is_file() or not (d / MODEL_DIR).is_dir() or not (d / PIPELINE_FILE).is_file():
        raise CheckpointError(f"'{d}' is not a complete checkpoint (meta.json, {MODEL_DIR}/ and {PIPELINE_FILE} "
                              "expected); give a step_<k> folder written by a training run, or "
                              "checkpoint.resume=latest")
    meta = json.loads(meta_file.read_text())
    if "optimizer_format" not in meta:
        raise CheckpointError(f"checkpoint '{d}' was written by an earlier version of this trainer (its own AdamW "
                              "state, not megatron's optimizer), which this version cannot resume; finish that run "
                              "with the version that wrote it, or start a new one from its weights (model.checkpoint "
                              "= the run's hf_export folder)")
    written, now = meta.get("use_distributed_optimizer"), actor.train_cfg.use_distributed_optimizer
    if written is not None and written != now:
        was = str(written).lower()
        raise CheckpointError(f"checkpoint '{d}' was written with train.use_distributed_optimizer={was} and this run "
                              f"has {str(now).lower()}: megatron's two optimizer layouts do not load into each other; "
                              f"resume with train.use_distributed_optimizer={was}")
    options = _check_lora(d, meta, lora)
    rng_file = _rng_file(d, meta, actor)
    base = None
    if options is not None:
        base = _load_base(d, meta, actor, options)
    elif actor.lora is not None:
        raise CheckpointError(f"checkpoint '{d}' is a full-parameter one and the actor trains adapters; load it "
                              "before the adapters start")
    elif meta.get("has_reference") and not actor.has_reference:
        actor.snapshot_reference()  # a placeholder the load fills
    sd = _sharded_state(actor, for_load=True)
    loaded = dist_checkpointing.load(sd, str(d / MODEL_DIR))
    if options is not None:
        params = dict(actor.model.named_parameters())
        missing = sorted(set(sd["model"]) - set(loaded["model"]))
        if missing:
            raise CheckpointError(f"checkpoint '{d}' left adapters unloaded: {missing[:8]}")
        with torch.no_grad():
            for key, value in loaded["model"].items():
                params[key].copy_(value)
    else:
        result = actor.model.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"checkpoint '{d}' left parameters unloaded: missing {missing[:8]}, "
                                  f"unexpected {list(result.unexpected_keys)[:8]}")
    actor.optimizer.load_state_dict(loaded["optimizer"])
    if "reference" in loaded:
        with torch.no_grad():
            ref = loaded["reference"]
            actor._ref_params = [ref[str(i)].clone() if str(i) in ref else p.detach().clone()
                                 for i, (_, p) in enumerate(actor.named_params)]
    _set_rng_state(torch.load(rng_file, weights_only=False))
    state = torch.load(d / PIPELINE_FILE, weights_only=False)
    state[LORA_BASE_KEY] = base
    _barrier()
    logger.info("resumed from checkpoint %s (step %d%s)", d, meta["step"],
                f", LoRA adapters on {meta['base']['path']}" if options is not None else "")
    return state
