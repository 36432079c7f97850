"""Checkpoints of a LoRA run: the adapters and their optimizer state, the base by path and hash.

A LoRA checkpoint holds no base weight (only ``*.lora.*`` keys, a small fraction of a full checkpoint's bytes);
loaded into a fresh actor it continues exactly (TP=2: the same loss, gradient norm and adapters after the next
step), and it loads at TP=1 and PP=2 to the same merged model; a changed or missing base is refused naming it.
Whole runs: a LoRA run resumed at step 2 trains step 3 as the uninterrupted run does, and RL from a LoRA run's
(full) warm-up checkpoint is the RL of the run that saved it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_agentrl.config import TrainConfig
from megatron_agentrl.lora.options import LoraOptions
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import reinit_parallel, tiny_model
from tests.trainer.support import TINY, hf_state, make_batch
from tests.trainer.support import read_steps as _steps
from tests.trainer.support import train_tiny as _train

LORA = LoraOptions(rank=4, alpha=8.0)


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _keys(model_optim: Path) -> list[str]:
    from megatron.core import dist_checkpointing

    return list(dist_checkpointing.load_tensors_metadata(str(model_optim)))


def _adapters(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}


def _save_then_resume(rank: int, world: int, root: str) -> dict:
    """TP=2: a full step, the adapters start (the base written), two LoRA steps and a checkpoint, a third step; then
    a fresh actor (random weights) loads the checkpoint and takes the third step again. Also a full checkpoint of
    the same model, for its size."""
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.checkpoint import LORA_BASE_KEY, load_checkpoint, save_checkpoint, write_base

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(2, 1)
    train = TrainConfig(micro_batch_size=2, lr=1e-2)
    out = Path(root)
    batches = [make_batch(cfg.vocab_size, B=4, seed=s) for s in (1, 2, 3, 4)]
    actor = MegatronActor(cfg, train, adapters_later=True)
    actor.load_hf_state_dict(hf_state(hf))
    actor.train_step(actor.dp_slice(batches[0]), "grpo", temperature=1.0)
    full = save_checkpoint(out / "full", 1, actor, {"step": 1, "version": 1})
    actor.start_adapters(LORA)
    base = write_base(actor, cfg, None, out / "hf_base")
    for b in batches[1:3]:
        actor.train_step(actor.dp_slice(b), "grpo", temperature=1.0)
    ckpt = save_checkpoint(out / "lora", 3, actor, {"step": 3, "version": 3}, base=base)
    merged = {k: v.clone() for k, v in actor.export_hf_state_dict().items()}
    stats = actor.train_step(actor.dp_slice(batches[3]), "grpo", temperature=1.0)
    after = _adapters(actor)

    reinit_parallel(2, 1)
    fresh = MegatronActor(cfg, train, adapters_later=True)  # random weights: the base comes from hf_base
    torch.manual_seed(99)  # the checkpoint restores the RNG
    state = load_checkpoint(ckpt, fresh, lora=LORA)
    checked_base = state.pop(LORA_BASE_KEY)  # the base as written: its shards' stamps as recorded
    steps = fresh.optimizer_step_count
    again = fresh.train_step(fresh.dp_slice(batches[3]), "grpo", temperature=1.0)
    moved = max(float((p - after[n]).abs().max()) for n, p in _adapters(fresh).items())
    base_moved = max(float((p.detach() - q.detach()).abs().max())
                     for (_, p), (_, q) in zip(fresh.named_params, actor.named_params))
    return {"loss": (stats["loss"], again["loss"]), "grad_norm": (stats["grad_norm"], again["grad_norm"]),
            "adapters_differ": moved, "base_differ": base_moved, "state": state, "adam_steps": steps,
            "same_base": checked_base == base,
            "full": str(full), "lora": str(ckpt), "base": base.path, "sha256": base.sha256, "merged": merged}


def _merged_after_load(rank: int, world: int, ckpt: str, tp: int, pp: int) -> dict:
    """A fresh actor at ``tp`` x ``pp`` (random weights) loads the LoRA checkpoint ``ckpt``; its merged weights."""
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.checkpoint import load_checkpoint

    cfg, _ = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(tp, pp)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2), adapters_later=True)
    load_checkpoint(ckpt, actor, lora=LORA)
    return {k: v.clone() for k, v in actor.export_hf_state_dict().items()}


@pytest.mark.e2e
def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_exactly(tmp_path: Path) -> None:
    results = run_distributed(_save_then_resume, 2, str(tmp_path), timeout_s=240)
    for r in results:
        assert r["loss"][0] == r["loss"][1] and r["grad_norm"][0] == r["grad_norm"][1], r
        assert r["adapters_differ"] == 0.0 and r["base_differ"] == 0.0, r
        assert r["state"] == {"step": 3, "version": 3} and r["adam_steps"] == 2 and r["same_base"], r
    r = results[0]
    lora, full = Path(r["lora"]), Path(r["full"])
    meta = json.loads((lora / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["base"]["path"] == r["base"] and meta["base"]["sha256"] == r["sha256"]
    keys = _keys(lora / "model_optim")
    assert keys and all(".lora." in k for k in keys), keys  # no base weight, no base optimizer state
    assert any(".lora." not in k for k in _keys(full / "model_optim"))
    ratio = _bytes(lora / "model_optim") / _bytes(full / "model_optim")
    assert ratio < 0.25, ratio  # rank 4 on a 32-wide model; the whole-run test below has the demo model's ratio
    # written at TP=2, it loads at TP=1 and at PP=2 to the same model: the adapters are resharded as they train
    for world, tp, pp in ((1, 1, 1), (2, 1, 2)):
        merged = run_distributed(_merged_after_load, world, str(lora), tp, pp, timeout_s=120)[0]
        assert sorted(merged) == sorted(r["merged"])
        for name, want in r["merged"].items():
            torch.testing.assert_close(merged[name], want, rtol=0, atol=1e-6, msg=f"{name} at TP={tp} PP={pp}")


def _load(rank: int, world: int, ckpt: str, lora: dict | None) -> str:
    """Load ``ckpt`` into a fresh TP=1 actor (``lora``: the run's section); the error's text, or 'ok'."""
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.checkpoint import CheckpointError, load_checkpoint

    cfg, _ = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(1, 1)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2))
    try:
        load_checkpoint(ckpt, actor, lora=LoraOptions(**lora) if lora is not None else None)
    except CheckpointError as e:
        return str(e)
    return "ok"


def _lora_checkpoint(rank: int, world: int, root: str) -> str:
    """A TP=1 LoRA checkpoint after one step, its base in ``<root>/hf_base``."""
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.checkpoint import save_checkpoint, write_base

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(1, 1)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2))
    actor.load_hf_state_dict(hf_state(hf))
    actor.start_adapters(LORA)
    base = write_base(actor, cfg, None, Path(root) / "hf_base")
    actor.train_step(make_batch(cfg.vocab_size, B=2), "grpo", temperature=1.0)
    return str(save_checkpoint(Path(root) / "checkpoints", 1, actor, {"step": 1, "version": 1}, base=base))


def test_a_changed_or_missing_base_or_other_adapters_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    (ckpt,) = run_distributed(_lora_checkpoint, 1, str(tmp_path), timeout_s=120)
    lora = {"rank": 4, "alpha": 8.0}
    (ok,) = run_distributed(_load, 1, ckpt, lora, timeout_s=120)
    assert ok == "ok"
    (other,) = run_distributed(_load, 1, ckpt, {"rank": 8, "alpha": 8.0}, timeout_s=120)
    assert "written with lora.rank=4 and this run has lora.rank=8" in other and "resume with lora.rank=4" in other
    (full,) = run_distributed(_load, 1, ckpt, {"rank": 0}, timeout_s=120)
    assert "holds LoRA adapters (lora.rank=4)" in full, full

    base = tmp_path / "hf_base"
    expected = json.loads((Path(ckpt) / "meta.json").read_text())["base"]["sha256"]
    weights = load_file(str(base / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3  # another base of the same shapes (e.g. a re-run warm-up)
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    (changed,) = run_distributed(_load, 1, ckpt, lora, timeout_s=120)
    assert "its sha256 is " in changed and expected in changed and str(base) in changed, changed
    assert "put the original base back" in changed

    base.rename(tmp_path / "elsewhere")
    (missing,) = run_distributed(_load, 1, ckpt, lora, timeout_s=120)
    assert f"needs its base '{base}'" in missing and "does not exist" in missing, missing


def test_a_moved_run_folder_finds_its_base_next_to_its_checkpoints(tmp_path: Path) -> None:
    (ckpt,) = run_distributed(_lora_checkpoint, 1, str(tmp_path / "run"), timeout_s=120)
    (tmp_path / "run").rename(tmp_path / "moved")
    moved = tmp_path / "moved" / Path(ckpt).relative_to(tmp_path / "run")
    (ok,) = run_distributed(_load, 1, str(moved), {"rank": 4, "alpha": 8.0}, timeout_s=120)
    assert ok == "ok"


# ------------------------------------------------------------------ whole runs
LORA_RUN = ["lora.rank=4", "lora.alpha=8"]


def _same(a: dict, b: dict) -> None:
    assert a["sample_ids"] == b["sample_ids"]
    assert abs(a["loss"] - b["loss"]) <= 1e-7 * max(1.0, abs(a["loss"])), (a["loss"], b["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * max(1.0, abs(a["grad_norm"])), (a, b)


@pytest.mark.e2e
def test_a_lora_run_resumed_at_step_2_trains_step_3_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """Async TP=2 with KL and entropy (as the full-parameter resume test): the resumed run's step 3 equals the
    uninterrupted run's; its checkpoints reference the uninterrupted run's base, written once."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = TINY + LORA_RUN + ["parallel.tp=2", "pipeline.mode=async", "pipeline.staleness=1",
                                "pipeline.sim_env_latency_s=0.01", "pipeline.sim_env_latency_alpha=1.1",
                                "pipeline.sim_env_latency_max_s=0.3"]
    run_distributed(_train, 2, common + [f"output_dir={full}", "train.steps=4"], timeout_s=240)
    ckpt = full / "checkpoints" / "step_000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["base"]["path"] == str((full / "hf_base").absolute())
    summary = run_distributed(_train, 2, common + [f"output_dir={resumed}", "train.steps=3",
                                                   f"checkpoint.resume={ckpt}"], timeout_s=240)[0]
    f, r = _steps(full), _steps(resumed)
    assert sorted(r) == [3]
    _same(f[3], r[3])
    assert f[3]["loss"] != f[2]["loss"]
    assert not (resumed / "hf_base").exists()  # the base stays the one the adapters started on
    assert summary["lora_adapter"] and json.loads((Path(summary["lora_adapter"]) / "adapter_config.json")
                                                  .read_text())["base_model_name_or_path"] == meta["base"]["path"]


@pytest.mark.e2e
def test_rl_from_a_lora_runs_warm_up_checkpoint_is_the_rl_of_the_run_that_saved_it(tmp_path: Path) -> None:
    """``checkpoint.after_warmup`` in a LoRA run: ``step_000000`` is a full checkpoint (the warm-up trains every
    parameter); RL resumed from it with the same adapters trains the same batches with the same losses."""
    # the tests' model at its own width (TINY narrows it to 32), so that the adapters are a realistic fraction of it
    common = TINY + LORA_RUN + ["model.arch.hidden_size=128", "model.arch.intermediate_size=384", "sft.steps=3",
                                "sft.batch_size=4", "eval.samples_per_task=2", "train.steps=2"]
    full, again = tmp_path / "full", tmp_path / "again"
    whole = run_distributed(_train, 1, common + [f"output_dir={full}", "checkpoint.after_warmup=true"],
                            timeout_s=180)[0]
    warm = full / "checkpoints" / "step_000000"
    meta = json.loads((warm / "meta.json").read_text())
    assert meta["lora"] is None and any(".lora." not in k for k in _keys(warm / "model_optim"))
    assert not any(".lora." in k for k in _keys(warm / "model_optim"))
    last = full / "checkpoints" / "step_000002"  # a LoRA checkpoint of the same model, in the same run
    assert json.loads((last / "meta.json").read_text())["lora"]["rank"] == 4
    ratio = _bytes(last / "model_optim") / _bytes(warm / "model_optim")
    assert ratio < 0.1, ratio
    resumed = run_distributed(_train, 1, common + [f"output_dir={again}", f"checkpoint.resume={warm}"],
                              timeout_s=180)[0]
    f, r = _steps(full), _steps(again)
    assert sorted(r) == [1, 2]
    for step in (1, 2):
        _same(f[step], r[step])
    assert resumed["before_rl"] == whole["before_rl"]


def _evaluate(rank: int, world: int, overrides: list[str]) -> dict | str:
    """Child entry point: ``run_evaluation`` (``agentrl eval``) on tests/configs/tiny_test.yaml; a CheckpointError's
    text instead of its record."""
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.checkpoint import CheckpointError
    from megatron_agentrl.pipeline.loop import run_evaluation

    try:
        return run_evaluation(load_config("tests/configs/tiny_test.yaml", overrides))
    except CheckpointError as e:
        return str(e)


@pytest.mark.e2e
def test_agentrl_eval_of_a_lora_checkpoint_gives_the_runs_own_evaluation(tmp_path: Path) -> None:
    """The base and adapters of the last checkpoint, played by the run's engines, give the run's evaluation after RL
    to the last digit; with the lora section left out the checkpoint is refused with the value to set."""
    common = TINY + LORA_RUN + ["eval.samples_per_task=2", "train.steps=2", f"output_dir={tmp_path}"]
    summary = run_distributed(_train, 1, common, timeout_s=180)[0]
    record = run_distributed(_evaluate, 1, common + ["checkpoint.resume=latest"], timeout_s=180)[0]
    assert record["step"] == 2 and record["results"] == summary["after_rl"], record
    refused = run_distributed(_evaluate, 1, TINY + ["eval.samples_per_task=2", f"output_dir={tmp_path}",
                                                    "checkpoint.resume=latest"], timeout_s=180)[0]
    assert "holds LoRA adapters (lora.rank=4)" in refused and "lora.rank=4" in refused, refused


def test_the_base_hash_covers_every_shard_and_checks_a_checkpoint_of_the_earlier_method(tmp_path: Path) -> None:
    """The base's hash (each shard's digest, taken at once) changes with any shard's bytes or name; a checkpoint that
    recorded the earlier one-stream method is checked with it; a method this version does not know is refused."""
    from safetensors.torch import save_file

    from megatron_agentrl.lora.checkpoint import (
        HASH_METHOD,
        STREAM_HASH_METHOD,
        BaseError,
        BaseRef,
        base_hash,
        check_base,
    )

    base = _shards(tmp_path / "hf_base", save_file)
    new, stream = base_hash(base), base_hash(base, STREAM_HASH_METHOD)
    assert new != stream and base_hash(base) == new  # deterministic whatever order the threads end in
    ckpt = tmp_path / "step_000001"
    for method, digest in ((HASH_METHOD, new), (STREAM_HASH_METHOD, stream)):
        entry = BaseRef(str(base), digest, method).to_meta(ckpt)
        assert entry["hash"] == method and check_base(entry, ckpt).path == str(base)
    save_file({"w": torch.full((64,), 9.0)}, str(base / "model-00002-of-00003.safetensors"))
    for method, digest in ((HASH_METHOD, new), (STREAM_HASH_METHOD, stream)):
        with pytest.raises(BaseError, match="has changed"):
            check_base(BaseRef(str(base), digest, method).to_meta(ckpt), ckpt)
    with pytest.raises(BaseError, match="which this version does not know"):
        base_hash(base, "md5 of something")


def _shards(base: Path, save_file: Any) -> Path:
    base.mkdir()
    for i in range(3):
        save_file({"w": torch.full((64,), float(i))}, str(base / f"model-0000{i + 1}-of-00003.safetensors"))
    return base


def test_resume_reads_the_base_only_when_its_shards_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A base whose shards have the sizes and times recorded when it was hashed is not read again; a shard rewritten
    with its old size and modification time, a copied folder or an entry without the record is hashed (and the
    rewritten one refused); a check that hashed hands on fresh stamps, so the next resume skips the read."""
    import shutil

    from safetensors.torch import save_file

    from megatron_agentrl.lora import checkpoint as lc

    reads: list[str] = []
    real_update = lc._update
    monkeypatch.setattr(lc, "_update", lambda digest, path: reads.append(path.name) or real_update(digest, path))
    base = _shards(tmp_path / "hf_base", save_file)
    ckpt = tmp_path / "step_000001"
    ref = lc.BaseRef.hashed(base)
    assert len(reads) == 3 and [f[0] for f in ref.files] == sorted(p.name for p in base.iterdir())
    reads.clear()
    entry = json.loads(json.dumps(ref.to_meta(ckpt)))  # as meta.json holds it
    assert lc.check_base(entry, ckpt) == ref and reads == []

    older = {k: v for k, v in entry.items() if k != "files"}  # a checkpoint written before the stamps
    checked = lc.check_base(older, ckpt)
    assert len(reads) == 3 and checked.files == ref.files and checked.sha256 == ref.sha256
    reads.clear()

    copy = tmp_path / "moved" / "hf_base"
    shutil.copytree(base, copy)  # copy2: sizes and modification times kept, new status-change times
    moved = lc.check_base({**entry, "path": str(copy)}, ckpt)
    assert len(reads) == 3 and moved.path == str(copy) and moved.files != ref.files
    reads.clear()
    assert lc.check_base(json.loads(json.dumps(moved.to_meta(ckpt))), ckpt) == moved and reads == []

    shard = base / "model-00002-of-00003.safetensors"
    st = shard.stat()
    save_file({"w": torch.full((64,), 7.0)}, str(shard))  # the same size
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(lc.BaseError, match="has changed"):
        lc.check_base(entry, ckpt)
    assert len(reads) == 3
