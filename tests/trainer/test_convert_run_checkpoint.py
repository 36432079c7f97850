"""A run's checkpoint through ``agentrl convert megatron-to-hf``: a full-parameter ``step_<k>/`` (model, optimizer
state and KL reference in one torch_dist checkpoint) converts to the weights the actor held when it saved; a LoRA
run's, which holds adapters and names its base, converts to the base with the adapters merged, as the actor's own
merged export (saved at TP=2, so the adapters are read back resharded), or to its adapters in PEFT's format, as the
actor's own PEFT export, which PEFT loads on the base to the merged model's logits; a changed base is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from megatron_agentrl.config import TrainConfig
from megatron_agentrl.convert import get_mapping
from megatron_agentrl.convert.base import ConversionError
from megatron_agentrl.convert.checkpoint import DistCheckpointReader, check_checkpoint_matches
from megatron_agentrl.convert.cli import main_megatron_to_hf
from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_agentrl.lora.options import LoraOptions
from rollout_sglang.engines.adapter import Adapter
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import read_safetensors_dir, reinit_parallel, tiny_model
from tests.trainer.support import hf_state, make_batch


def _checkpoints(rank: int, world: int, root: str) -> dict:
    """TP=``world``: a GRPO step with a KL reference kept, a full checkpoint and the weights it holds; then the
    adapters start, two LoRA steps, a LoRA checkpoint and the merged weights it holds."""
    from megatron_agentrl.lora.peft_format import export_adapters
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.checkpoint import save_checkpoint, write_base

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    hf.config.save_pretrained(Path(root) / "hf_config")
    reinit_parallel(world, 1)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2), adapters_later=True)
    actor.load_hf_state_dict(hf_state(hf))
    actor.snapshot_reference()  # a run with loss.kl_coef > 0 keeps it, and its checkpoints hold it
    actor.train_step(make_batch(cfg.vocab_size, B=2, seed=1), "grpo", temperature=1.0)
    full = save_checkpoint(Path(root) / "checkpoints", 1, actor, {"step": 1, "version": 1})
    weights = {k: v.clone() for k, v in actor.export_hf_state_dict().items()}
    actor.start_adapters(LoraOptions(rank=4, alpha=8.0))
    base = write_base(actor, cfg, None, Path(root) / "hf_base")
    for seed in (2, 3):  # B leaves 0
        actor.train_step(make_batch(cfg.vocab_size, B=2, seed=seed), "grpo", temperature=1.0)
    lora = save_checkpoint(Path(root) / "checkpoints", 3, actor, {"step": 3, "version": 3}, base=base)
    merged = {k: v.clone() for k, v in actor.export_hf_state_dict().items()}
    peft = export_adapters(actor)
    return {"full": str(full), "lora": str(lora), "weights": weights, "merged": merged, "peft": peft,
            "base": str(base.path), "reference": actor.has_reference}


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-6, msg=name)


def test_a_runs_checkpoint_converts_full_or_lora_merged(tmp_path: Path) -> None:
    r = run_distributed(_checkpoints, 2, str(tmp_path), timeout_s=180)[0]
    assert r["reference"]  # the checkpoint holds the KL reference too: left out like the optimizer state
    config = tmp_path / "hf_config"
    # the step folder or its model_optim/ alike
    for i, source in enumerate((Path(r["full"]), Path(r["full"]) / "model_optim")):
        out = convert_megatron_to_hf(source, tmp_path / f"hf{i}", hf_config=config, progress=False)
        _same(read_safetensors_dir(out), r["weights"])

    out = convert_megatron_to_hf(r["lora"], tmp_path / "merged", hf_config=config, progress=False)
    _same(read_safetensors_dir(out), r["merged"])
    assert any(not torch.equal(r["merged"][n], r["weights"][n]) for n in r["weights"])  # the adapters are in

    # its adapters in PEFT's format: the actor's own export, for the base the checkpoint names
    adapter_dir = tmp_path / "adapter"
    assert main_megatron_to_hf(["--megatron-dir", r["lora"], "--out-dir", str(adapter_dir), "--hf-config",
                                str(config), "--peft-adapter", "--no-progress"]) == 0
    adapter = Adapter.load(adapter_dir, 0)
    _same(adapter.tensors, r["peft"])
    assert adapter.config["base_model_name_or_path"] == str(Path(r["base"]).resolve())
    assert (adapter.config["r"], adapter.config["lora_alpha"]) == (4, 8.0)
    # ... which PEFT loads on that base to the merged model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(r["base"]), str(adapter_dir))
        want = AutoModelForCausalLM.from_pretrained(out)(tokens).logits
        torch.testing.assert_close(peft_model(tokens).logits, want, rtol=0, atol=1e-5)
    with pytest.raises(ConversionError, match=r"holds no LoRA adapter .* drop peft_adapter / --peft-adapter"):
        convert_megatron_to_hf(r["full"], tmp_path / "no_adapter", hf_config=config, peft_adapter=True)

    # loaded as a model (model.megatron_checkpoint) it is refused naming LoRA and both ways on
    reader = DistCheckpointReader(Path(r["lora"]) / "model_optim")
    with pytest.raises(ConversionError, match=r"is a LoRA run's checkpoint: it holds \d+ adapter tensors .*"
                                              r"checkpoint.resume=.* `agentrl convert megatron-to-hf"):
        check_checkpoint_matches(reader, get_mapping(AutoConfig.from_pretrained(config)), "checkpoint")

    base = tmp_path / "hf_base" / "model.safetensors"
    weights = load_file(str(base))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(base), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"has changed: its sha256 is .* put the original base back"):
        convert_megatron_to_hf(r["lora"], tmp_path / "refused", hf_config=config, progress=False)
    assert not (tmp_path / "refused").exists()
