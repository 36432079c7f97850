"""Converted checkpoints in megatron-core models (CPU, gloo, 2 processes), for every family.

For each of Qwen2, Qwen3, Llama, GLM-4, Qwen3-MoE and GLM-4.5 MoE a tiny random model is written with
``transformers`` and converted with ``--tp 2`` and with ``--pp 2``; a megatron ``GPTModel`` built at
TP=2, at PP=2 and at TP=1 (DP=2), and the MoE ones also at EP=2, loads each through megatron's
``dist_checkpointing.load`` and must give the ``transformers`` model's logits (fp32, rtol 1e-4). The
TP=2 model (the EP=2 one for MoE) then saves itself with ``save_megatron_checkpoint`` and that
checkpoint converts back to the original HF tensors.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import (
    FAMILIES,
    MOE_FAMILIES,
    VOCAB,
    megatron_logits,
    read_safetensors_dir,
    reinit_parallel,
    tiny_config,
    write_tiny_checkpoint,
)

RTOL = 1e-4
# (checkpoint converted with, layout loaded at TP, PP, EP): TP=2 -> TP=2 / PP=2 / TP=1; PP=2 -> PP=2 / TP=2
LOADS = (("tp2", 2, 1, 1), ("tp2", 1, 2, 1), ("tp2", 1, 1, 1), ("pp2", 1, 2, 1), ("pp2", 2, 1, 1))
# MoE models also load at EP=2 (the experts split over the two ranks), from both checkpoints
MOE_LOADS = LOADS + (("tp2", 1, 1, 2), ("pp2", 1, 1, 2))


CASES = (("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True), ("glm4", False), ("qwen3", True),
         ("qwen3_moe", False), ("glm4_moe", True))


def _loads(family: str) -> tuple[tuple[str, int, int, int], ...]:
    return MOE_LOADS if family in MOE_FAMILIES else LOADS


# the layouts whose models save themselves, and the directory suffix of each
SAVERS = {("tp2", 2, 1, 1): "", ("tp2", 1, 1, 2): "_ep2"}


def _load_and_forward(rank: int, world: int, cases: list[tuple[str, bool, dict[str, str], str]],
                      tokens: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Child: for each case and each (checkpoint, TP, PP) in LOADS build the model, load the
    checkpoint, forward; the TP=2 model of each case also saves itself."""
    from megatron.core import parallel_state as ps

    from megatron_agentrl.config import ConfigError
    from megatron_agentrl.convert.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
    from megatron_agentrl.megatron.model import build_gpt_model

    out: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, str] = {}
    for i, (family, tied, ckpts, save_dir) in enumerate(cases):
        cfg = tiny_config(family, tied)
        res = out.setdefault(f"{family}-{tied}", {})
        for src, tp, pp, ep in _loads(family):
            reinit_parallel(tp, pp, ep)
            model = build_gpt_model(cfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
            model.eval()
            if (src, tp, pp, ep) == LOADS[0]:  # the previous case's checkpoint: another family, or tying
                try:
                    load_megatron_checkpoint(model, cases[i - 1][2]["tp2"], cfg)
                except ConfigError as e:
                    errors[f"{family}-{tied}"] = str(e)
            load_megatron_checkpoint(model, ckpts[src], cfg)
            logits = megatron_logits(model, tokens, cfg.vocab_size, cfg.hidden_size)
            if logits is not None:
                res[f"{src}->tp{tp}pp{pp}ep{ep}"] = logits
            if (src, tp, pp, ep) in SAVERS:
                save_megatron_checkpoint(model, save_dir + SAVERS[src, tp, pp, ep], cfg)
    ps.destroy_model_parallel()
    out["errors"] = errors  # type: ignore[assignment]
    return out


@pytest.fixture(scope="module")
def converted(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, torch.Tensor, dict[str, torch.Tensor]]]:
    """Per case: its directory, the transformers logits and the Megatron logits of every load
    (all cases in one 2-process run)."""
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    cases, refs = [], {}
    for family, tied in CASES:
        d = tmp_path_factory.mktemp(f"{family}-{tied}")
        model = write_tiny_checkpoint(family, d / "hf", tied=tied)
        with torch.no_grad():
            refs[f"{family}-{tied}"] = (d, model(tokens).logits)
        ckpts = {"tp2": str(convert_hf_to_megatron(d / "hf", d / "tp2", tp=2, pp=1, progress=False)),
                 "pp2": str(convert_hf_to_megatron(d / "hf", d / "pp2", tp=1, pp=2, progress=False))}
        cases.append((family, tied, ckpts, str(d / "saved")))
    results = run_distributed(_load_and_forward, 2, cases, tokens, timeout_s=120)
    out: dict = {"errors": results[0]["errors"]}
    for key, (d, ref) in refs.items():
        got: dict[str, torch.Tensor] = {}
        for r in results:
            got.update(r[key])
        out[key] = (d, ref, got)
    return out


@pytest.mark.parametrize("family,tied", CASES)
def test_converted_checkpoint_logits_at_tp2_pp2_tp1(family: str, tied: bool, converted) -> None:
    """Converted at TP=2 (and at PP=2), loaded at TP=2, PP=2 and TP=1 (and EP=2 for MoE): logits equal
    transformers'."""
    _, ref, got = converted[f"{family}-{tied}"]
    assert set(got) == {f"{s}->tp{t}pp{p}ep{e}" for s, t, p, e in _loads(family)}, sorted(got)
    diffs = {k: float((v - ref).abs().max()) for k, v in got.items()}
    logging.getLogger(__name__).info("%s tied=%s max |logits - transformers| (max |logits| %.2f): %s",
                                     family, tied, float(ref.abs().max()), diffs)
    for k, v in got.items():
        torch.testing.assert_close(v, ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()),
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("family,tied", CASES)
def test_model_saved_checkpoint_converts_back(family: str, tied: bool, converted, tmp_path: Path) -> None:
    """The checkpoint a TP=2 model (and a MoE model at EP=2) saved itself (save_megatron_checkpoint) converts to
    the original HF tensors."""
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    d, _, _ = converted[f"{family}-{tied}"]
    orig = read_safetensors_dir(d / "hf")
    for saved in ["saved", "saved_ep2"] if family in MOE_FAMILIES else ["saved"]:
        convert_megatron_to_hf(d / saved, tmp_path / saved, progress=False)
        back = read_safetensors_dir(tmp_path / saved)
        assert set(back) == set(orig), saved
        assert all(torch.equal(back[k], orig[k]) for k in orig), saved


@pytest.mark.parametrize("family,tied", CASES)
def test_converter_writes_what_megatron_saves(family: str, tied: bool, converted) -> None:
    """hf-to-megatron --tp 2 stores the same keys, global shapes, dtypes and chunks as megatron's
    own save of a TP=2 model (its ``_extra_state`` objects aside)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    d, _, _ = converted[f"{family}-{tied}"]

    def layout(ckpt: Path) -> dict:
        md = FileSystemReader(str(ckpt)).read_metadata()
        return {k: (tuple(v.size), v.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
                for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    assert layout(d / "tp2") == layout(d / "saved")


def test_loading_a_checkpoint_of_another_family_fails_clearly(converted) -> None:
    """load_megatron_checkpoint refuses a checkpoint of another family (or another tying), naming both."""
    errors = converted["errors"]
    assert "is a glm4_moe (Glm4MoeForCausalLM) checkpoint, but the model config is qwen2" in errors["qwen2-False"]
    assert "does not hold a qwen2 model of this config" in errors["qwen2-True"]  # untied checkpoint, tied config
    assert "is a qwen2 (Qwen2ForCausalLM) checkpoint, but the model config is llama" in errors["llama-False"]
    assert "does not hold a llama model" in errors["llama-True"] and "output_layer.weight" in errors["llama-True"]
    assert "is a llama (LlamaForCausalLM) checkpoint, but the model config is glm4" in errors["glm4-False"]
    assert "is a glm4 (Glm4ForCausalLM) checkpoint, but the model config is qwen3" in errors["qwen3-True"]
    assert "is a qwen3 (Qwen3ForCausalLM) checkpoint, but the model config is qwen3_moe" in errors["qwen3_moe-False"]
    assert ("is a qwen3_moe (Qwen3MoeForCausalLM) checkpoint, but the model config is glm4_moe"
            in errors["glm4_moe-True"])


def test_families_are_covered() -> None:
    """Every family the converters know is exercised by CASES."""
    from megatron_agentrl.convert import MAPPINGS

    assert set(MAPPINGS) == set(FAMILIES) == {f for f, _ in CASES}
