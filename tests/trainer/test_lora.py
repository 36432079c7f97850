"""LoRA on megatron-core's parallel layers against PEFT on the Hugging Face model: equal log-probs and gradients at
TP=1, TP=2 and PP=2, the frozen base, the PEFT format both ways, and the options' refusals."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from megatron_agentrl.config import ConfigError, LossConfig, TrainConfig
from megatron_agentrl.lora.options import TARGETS, LoraOptions
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import reinit_parallel, tiny_model
from tests.trainer.support import hf_state, make_batch

RANK, ALPHA = 4, 8.0
#: the projections megatron holds as one layer (one A)
FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
pytest.importorskip("peft", reason="peft is not installed (pip install '.[dev]')")


def _peft_model(hf, directory: Path | None = None):
    """PEFT's LoRA on ``hf`` (a copy): the adapters of ``directory``, or new ones with random A (shared by q/k/v and
    by gate/up, as megatron fuses them) and random B, saved there."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base = copy.deepcopy(hf)
    if directory is not None and (directory / "adapter_config.json").is_file():
        return PeftModel.from_pretrained(base, str(directory)).eval()
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                          (layer.self_attn.o_proj,), (layer.mlp.gate_proj, layer.mlp.up_proj), (layer.mlp.down_proj,)):
                a = torch.randn(group[0].lora_A["default"].weight.shape, generator=g) * 0.2
                for proj in group:
                    proj.lora_A["default"].weight.copy_(a)
                    proj.lora_B["default"].weight.copy_(torch.randn(proj.lora_B["default"].weight.shape,
                                                                    generator=g) * 0.2)
    if directory is not None:
        model.save_pretrained(str(directory))
    return model.eval()


def _logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(tokens.shape[0], 1), lp], dim=1)


def _peft_grads(model, batch) -> dict[str, torch.Tensor]:
    """PEFT's adapter gradients of the token-averaged GRPO loss, under the saved names (per projection)."""
    from megatron_agentrl.algo.losses import LossInputs, clipped_policy_loss

    model.train()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    logits = model(input_ids=batch.tokens).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], dim=1)
    loss, _ = clipped_policy_loss(LossInputs(lp, batch.behavior_logprobs, batch.advantages, batch.loss_mask),
                                  LossConfig())
    (loss / batch.loss_mask.sum()).backward()
    return {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _layouts(rank: int, world: int, directory: str) -> dict[str, float]:
    """Each layout loads the same PEFT adapter: log-probs and adapter gradients equal PEFT's, the exported
    adapter equals the loaded one, the merged HF export equals PEFT's merged model, and only the adapters have
    gradients."""
    from megatron_agentrl.lora.peft_format import export_adapters, load_adapters, save_adapters
    from megatron_agentrl.megatron.actor import MegatronActor
    from rollout_sglang.engines.adapter import Adapter

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=4)
    peft = _peft_model(hf, Path(directory))
    loaded = Adapter.load(directory, 0).tensors
    tokens = torch.randint(0, 200, (4, 12), generator=torch.Generator().manual_seed(3))
    batch = make_batch(cfg.vocab_size)
    ref_lp = _logprobs(peft, tokens)
    merged_ref = copy.deepcopy(peft).merge_and_unload().state_dict()
    ref_grads = _peft_grads(peft, batch)
    out: dict[str, float] = {}
    for tp, pp, cp in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)):  # on 2 processes TP=1 is DP=2
        reinit_parallel(tp, pp, cp=cp)
        actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2), lora=LoraOptions(rank=RANK, alpha=ALPHA))
        actor.load_hf_state_dict(hf_state(hf))
        load_adapters(actor, loaded)
        key = f"tp{tp}pp{pp}" + (f"cp{cp}" if cp > 1 else "")
        out[f"lp_{key}"] = float((actor.compute_logprobs(tokens, micro_batch_size=2) - ref_lp).abs().max())
        exported = export_adapters(actor)
        # the HF export (and the weight sync, which reads the same values) merges the adapters in
        merged = actor.export_hf_state_dict()
        out[f"merged_{key}"] = max(float((merged[k] - merged_ref[k]).abs().max()) for k in merged)
        out[f"roundtrip_{key}"] = max(float((exported[k] - loaded[k]).abs().max()) for k in loaded)
        assert set(exported) == set(loaded), sorted(set(exported) ^ set(loaded))
        trainable = [n for n, p in actor.model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora." in n for n in trainable), trainable
        actor.compute_grads(actor.dp_slice(batch), "grpo", temperature=1.0)
        actor._gather_grad_shards()
        grads = export_adapters(actor, lambda p: p.main_grad)
        worst = 0.0
        for name, g in grads.items():
            if ".lora_A." in name:
                # one A per fused layer: its gradient is the sum of PEFT's per-projection ones
                module, proj = name.removesuffix(".lora_A.weight").rsplit(".", 1)
                group = next(g for g in FUSED if proj in g)
                ref = sum(ref_grads[f"{module}.{p}.lora_A.weight"] for p in group)
            else:
                ref = ref_grads[name]
            worst = max(worst, float((g - ref).abs().max()) / max(float(ref.abs().max()), 1e-6))
        out[f"grad_{key}"] = worst
        if (tp, pp) == (2, 1):
            save_adapters(actor, actor.lora, Path(directory) / "resaved")
    return out


def test_lora_equals_peft_at_tp_and_pp(tmp_path: Path) -> None:
    """Log-probs within 1e-5 of PEFT's on the HF model with the same adapter at DP=2, TP=2, PP=2 and CP=2; adapter
    gradients equal PEFT's (a fused layer's A gets the sum of its projections'); the PEFT export re-loads in PEFT
    to the same log-probs."""
    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=4)
    _peft_model(hf, tmp_path)  # writes the adapter every layout loads
    results = run_distributed(_layouts, 2, str(tmp_path), timeout_s=240)
    for r in results:
        for key, value in r.items():
            limit = 1e-5 if key.startswith(("lp_", "roundtrip_", "merged_")) else 1e-4
            assert value < limit, (key, value, r)
    tokens = torch.randint(0, 200, (4, 12), generator=torch.Generator().manual_seed(3))
    resaved = _peft_model(hf, tmp_path / "resaved")
    original = _peft_model(hf, tmp_path)
    assert float((_logprobs(resaved, tokens) - _logprobs(original, tokens)).abs().max()) < 1e-6


def test_lora_options_refuse_what_cannot_work() -> None:
    assert not LoraOptions().enabled and LoraOptions(rank=8, alpha=16).scaling == 2.0
    assert LoraOptions(rank=4, target_modules=["q_proj", "k_proj", "v_proj"]).megatron_modules() == [
        "self_attention.linear_qkv"]
    for bad, why in ((dict(rank=-1), "lora.rank=-1 must be an integer >= 0"),
                     (dict(rank=4, target_modules=["q_proj"]), "megatron holds q_proj/k_proj/v_proj as one layer"),
                     (dict(rank=4, target_modules=["lm_head"]), "choose from q_proj"),
                     (dict(rank=4, dropout=1.0), "lora.dropout=1.0 must be in"),
                     (dict(rank=4, alpha=0), "lora.alpha=0 must be > 0")):
        with pytest.raises(ConfigError, match=why):
            LoraOptions(**bad)
    from megatron_agentrl.config import load_config

    cfg = load_config("examples/configs/tiny_cpu.yaml", ["lora.rank=8", "lora.alpha=16", "checkpoint.interval=0"])
    assert cfg.lora.enabled and cfg.lora.scaling == 2.0
    # a LoRA run checkpoints (tests/trainer/test_lora_checkpoint.py)
    cfg = load_config("examples/configs/tiny_cpu.yaml", ["lora.rank=8", "checkpoint.after_warmup=true"])
    assert cfg.lora.enabled and cfg.checkpoint.interval == 60 and cfg.checkpoint.after_warmup


def _frozen_base(rank: int, world: int) -> dict[str, float]:
    """A fresh adapter (B = 0) leaves the model as the base; one optimizer step moves the adapters only."""
    from megatron_agentrl.megatron.actor import MegatronActor

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(1, 1)
    plain = MegatronActor(cfg, TrainConfig(micro_batch_size=2))
    plain.load_hf_state_dict(hf_state(hf))
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2), lora=LoraOptions(rank=4))
    actor.load_hf_state_dict(hf_state(hf))
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    same = float((actor.compute_logprobs(tokens) - plain.compute_logprobs(tokens)).abs().max())
    before = {n: p.detach().clone() for n, p in actor.named_params}  # the base's own parameters
    adapters = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    actor.train_step(make_batch(cfg.vocab_size, B=2), "grpo", temperature=1.0)
    moved = max(float((p.detach() - adapters[n]).abs().max()) for n, p in actor.model.named_parameters()
                if p.requires_grad)
    return {"same": same, "base_moved": max(float((p.detach() - before[n]).abs().max()) for n, p in actor.named_params),
            "adapters_moved": moved}


def test_a_fresh_adapter_is_the_base_and_only_adapters_train() -> None:
    (r,) = run_distributed(_frozen_base, 1, timeout_s=120)
    assert r["same"] < 1e-6 and r["base_moved"] == 0.0 and r["adapters_moved"] > 0.0, r


def _warm_up_then_adapters(rank: int, world: int) -> dict[str, float]:
    """A full-parameter step, then ``start_adapters`` (TP=2): the model is unchanged by the attach, the next step
    moves the adapters only, and the rebuilt gradient buffers hold the adapters alone."""
    from megatron_agentrl.megatron.actor import MegatronActor

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(2, 1)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=1e-2), adapters_later=True)
    actor.load_hf_state_dict(hf_state(hf))
    batch = make_batch(cfg.vocab_size, B=2)
    base0 = {n: p.detach().clone() for n, p in actor.named_params}
    actor.train_step(actor.dp_slice(batch), "grpo", temperature=1.0)
    warm_moved = max(float((p.detach() - base0[n]).abs().max()) for n, p in actor.named_params)
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    before = actor.compute_logprobs(tokens)
    actor.start_adapters(LoraOptions(rank=4))
    attached = float((actor.compute_logprobs(tokens) - before).abs().max())
    base1 = {n: p.detach().clone() for n, p in actor.named_params}
    adapters = {n: p.detach().clone() for n, p in actor.model.named_parameters() if p.requires_grad}
    actor.train_step(actor.dp_slice(batch), "grpo", temperature=1.0)
    return {"warm_moved": warm_moved, "attached": attached,
            "base_moved": max(float((p.detach() - base1[n]).abs().max()) for n, p in actor.named_params),
            "adapters_moved": max(float((p.detach() - adapters[n]).abs().max())
                                  for n, p in actor.model.named_parameters() if p.requires_grad),
            "buffer": float(sum(b.grad_data.numel() for b in actor.ddp.buffers)),
            "adapter_numel": float(sum(p.numel() for p in adapters.values())),
            "base_numel": float(sum(p.numel() for p in base1.values()))}


def test_a_full_warm_up_then_adapters_only() -> None:
    for r in run_distributed(_warm_up_then_adapters, 2, timeout_s=120):
        assert r["warm_moved"] > 0 and r["attached"] < 1e-6, r
        assert r["base_moved"] == 0.0 and r["adapters_moved"] > 0, r
        # megatron pads each bucket; still far from the full model's buffer
        assert r["adapter_numel"] <= r["buffer"] < r["base_numel"] / 4, r


@pytest.mark.e2e
def test_a_lora_run_exports_its_base_and_adapter_as_peft_loads_them(tmp_path: Path) -> None:
    """A shrunk demo run with LoRA (a full warm-up, then adapters at TP=2) writes ``hf_base`` (the warmed-up base),
    ``adapter`` (PEFT's format) and ``hf_export`` (merged): PEFT's model on the base equals the merged export. (A
    shrunk run may leave B at 0; the equality with trained adapters is the layouts test's.)"""
    import json

    import transformers
    from peft import PeftModel

    from tests.support.demo_run import TINY_MODEL, train_demo, trained_rl_rows

    train_demo(tmp_path, 2, *TINY_MODEL, "parallel.tp=2", "lora.rank=4", "lora.alpha=8", "checkpoint.interval=0",
               "rollout.max_versions=2", "rollout.cross_policy=uniform")
    # each RL step pushed its adapters alone to the one engine (2 live versions as adapters on it)
    rl = trained_rl_rows(tmp_path)
    full = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base").parameters())
    assert all(0 < r["weight_sync/bytes"] < 0.35 * full * 4 for r in rl), [r["weight_sync/bytes"] for r in rl]
    batches = [json.loads(line) for line in (tmp_path / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == [1, 2] and set(batches[1]["min_versions"]) <= {0, 1}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lora_adapter"] == str(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tmp_path / "hf_base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base", dtype=torch.float32)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_export", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    tokens = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    assert float((_logprobs(peft, tokens) - _logprobs(merged, tokens)).abs().max()) < 1e-5


def _reference_is_the_base(rank: int, world: int) -> dict[str, float]:
    """After the adapters start, the KL reference is the base they adapt: once the adapters trained, the reference
    log-probs are still the base's (not the adapted policy's), and no copy of the base was kept."""
    from megatron_agentrl.megatron.actor import MegatronActor

    cfg, hf = tiny_model("qwen2", False, vocab=200, layers=2)
    reinit_parallel(1, 1)
    actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2, lr=5e-2))
    actor.load_hf_state_dict(hf_state(hf))
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens, dtype=torch.float32)
    base = actor.compute_logprobs(tokens, loss_mask=mask)
    actor.start_adapters(LoraOptions(rank=4))
    actor.snapshot_reference()
    batch = make_batch(cfg.vocab_size, B=2)
    for _ in range(3):
        actor.train_step(actor.dp_slice(batch), "grpo", temperature=1.0)
    return {"ref_vs_base": float((actor.compute_ref_logprobs(tokens, mask) - base).abs().max()),
            "policy_vs_base": float((actor.compute_logprobs(tokens, loss_mask=mask) - base).abs().max()),
            "copied": float(getattr(actor, "_ref_params", None) is not None)}


def test_the_kl_reference_of_a_lora_run_is_its_base() -> None:
    (r,) = run_distributed(_reference_is_the_base, 1, timeout_s=120)
    assert r["ref_vs_base"] < 1e-6 and r["policy_vs_base"] > 1e-4 and r["copied"] == 0.0, r
