"""A run's checkpoint through ``agentrl convert megatron-to-hf``: a full-parameter ``step_<k>/`` (model, optimizer
state and KL reference in one torch_dist checkpoint) converts to the weights the actor held when it saved; a LoRA
run's, which holds adapters and no base, is refused naming LoRA and where the run's exports are."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_agentrl.config import TrainConfig
from megatron_agentrl.convert.base import ConversionError
from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_agentrl.lora.options import LoraOptions
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import read_safetensors_dir, reinit_parallel, tiny_model
from tests.trainer.support import hf_state, make_batch


def _checkpoints(rank: int, world: int, root: str) -> dict:
    """TP=1: a GRPO step with a KL reference kept, a full checkpoint and the weights it holds; then the adapters
    start, a LoRA step and a LoRA checkpoint."""
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.checkpoint import save_checkpoint, write_base

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    hf.config.save_pretrained(Path(root) / "hf_config")
    reinit_parallel(1, 1)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2), adapters_later=True)
    actor.load_hf_state_dict(hf_state(hf))
    actor.snapshot_reference()  # a run with loss.kl_coef > 0 keeps it, and its checkpoints hold it
    actor.train_step(make_batch(cfg.vocab_size, B=2, seed=1), "grpo", temperature=1.0)
    full = save_checkpoint(Path(root) / "checkpoints", 1, actor, {"step": 1, "version": 1})
    weights = {k: v.clone() for k, v in actor.export_hf_state_dict().items()}
    actor.start_adapters(LoraOptions(rank=4, alpha=8.0))
    base = write_base(actor, cfg, None, Path(root) / "hf_base")
    actor.train_step(make_batch(cfg.vocab_size, B=2, seed=2), "grpo", temperature=1.0)
    lora = save_checkpoint(Path(root) / "checkpoints", 2, actor, {"step": 2, "version": 2}, base=base)
    return {"full": str(full), "lora": str(lora), "weights": weights, "reference": actor.has_reference}


def test_a_runs_checkpoint_converts_and_a_lora_one_is_refused_naming_lora(tmp_path: Path) -> None:
    (r,) = run_distributed(_checkpoints, 1, str(tmp_path), timeout_s=120)
    assert r["reference"]  # the checkpoint holds the KL reference too: left out like the optimizer state
    # the step folder or its model_optim/ alike
    for i, source in enumerate((Path(r["full"]), Path(r["full"]) / "model_optim")):
        out = convert_megatron_to_hf(source, tmp_path / f"hf{i}", hf_config=tmp_path / "hf_config", progress=False)
        got = read_safetensors_dir(out)
        assert sorted(got) == sorted(r["weights"])
        for name, want in r["weights"].items():
            assert torch.equal(got[name], want), name

    with pytest.raises(ConversionError, match=r"is a LoRA run's checkpoint: it holds \d+ adapter tensors .*"
                                              r"PEFT's format \(adapter/\) .* \(hf_export/\)"):
        convert_megatron_to_hf(r["lora"], tmp_path / "lora_out", hf_config=tmp_path / "hf_config", progress=False)
    assert not (tmp_path / "lora_out").exists()
