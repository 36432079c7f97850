"""Training starts from a converted megatron checkpoint (``model.megatron_checkpoint``).

A tiny random GLM-4 model is written with ``transformers`` and converted with ``agentrl convert
hf-to-megatron`` at TP=2; on 2 gloo processes a :class:`MegatronActor` is built at TP=1 (DP=2)
and at TP=2 from the config the converter stored (``<dir>/hf``), loads the checkpoint and must
give the ``transformers`` logits (fp32, rtol 1e-4); a bf16 actor's fp32 main weights (megatron's
optimizer) follow the load: an optimizer step at lr 0 leaves the loaded weights in place. A
missing directory, an HF directory and a checkpoint of another shape fail with the key,
the path and the fix.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import VOCAB, megatron_logits, reinit_parallel, tiny_config, write_tiny_checkpoint

RTOL = 1e-4


def _start_from_megatron(rank: int, world: int, ckpt: str, hf_dir: str, tokens: torch.Tensor) -> dict:
    """Child: build actors at TP=1 and TP=2 from ``ckpt`` and forward; collect the errors of bad paths."""
    from megatron.core import parallel_state as ps

    from megatron_agentrl.config import ConfigError, ModelConfig, TrainConfig
    from megatron_agentrl.hf_io import load_hf_config
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.pipeline.loop import load_start_weights

    cfg = load_hf_config(ModelConfig(megatron_checkpoint=ckpt))  # the config stored in <ckpt>/hf
    out: dict = {"model_type": cfg.model_type, "logits": {}, "errors": {}}
    for tp in (1, 2):
        reinit_parallel(tp, 1)
        actor = MegatronActor(cfg, TrainConfig())
        actor.load_megatron_checkpoint(ckpt)
        actor.model.eval()
        out["logits"][f"tp{tp}"] = megatron_logits(actor.model, tokens, cfg.vocab_size, cfg.hidden_size)
    bf16 = MegatronActor(cfg, TrainConfig(), dtype=torch.bfloat16)
    bf16.load_megatron_checkpoint(ckpt)
    loaded = [p.detach().clone() for _, p in bf16.named_params]
    bf16.set_lr(0.0)  # a step that changes nothing, except where it copies stale fp32 main weights back
    bf16.ddp.zero_grad_buffer()
    bf16.optimizer_step()
    out["masters_follow"] = all(torch.equal(a, p) for a, (_, p) in zip(loaded, bf16.named_params))

    reinit_parallel(1, 1)
    actor = MegatronActor(cfg, TrainConfig())
    other = MegatronActor(tiny_config("glm4", layers=1), TrainConfig())
    for name, a, path in (("missing", actor, str(Path(ckpt).parent / "not-converted")),
                          ("hf_dir", actor, hf_dir), ("shape", other, ckpt)):
        try:
            load_start_weights(SimpleNamespace(model=ModelConfig(megatron_checkpoint=path, hf_config=hf_dir)), a)
        except ConfigError as e:
            out["errors"][name] = str(e)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, list[dict]]:
    from megatron_agentrl.cli import main as agentrl

    d = tmp_path_factory.mktemp("glm4")
    model = write_tiny_checkpoint("glm4", d / "hf")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(tokens).logits
    rc = agentrl(["convert", "hf-to-megatron", "--hf-dir", str(d / "hf"), "--out-dir", str(d / "mcore"), "--tp", "2",
                       "--no-progress"])
    assert rc == 0
    results = run_distributed(_start_from_megatron, 2, str(d / "mcore"), str(d / "hf"), tokens, timeout_s=120)
    return d, ref, results


def test_actor_from_converted_checkpoint_matches_hf_logits_at_tp1_and_tp2(started) -> None:
    _, ref, results = started
    for r in results:
        assert r["model_type"] == "glm4"
        for layout in ("tp1", "tp2"):
            torch.testing.assert_close(r["logits"][layout], ref, rtol=RTOL, atol=1e-5, msg=layout)
        assert r["masters_follow"]


def test_bad_megatron_checkpoint_paths_fail_clearly(started) -> None:
    d, _, results = started
    errors = results[0]["errors"]
    missing = errors["missing"]
    assert f"model.megatron_checkpoint='{d / 'not-converted'}'" in missing and "is not a directory" in missing
    assert f"agentrl convert hf-to-megatron --hf-dir <HF checkpoint> --out-dir {d / 'not-converted'}" in missing
    assert "is a Hugging Face checkpoint, not a megatron one" in errors["hf_dir"]
    assert f"--hf-dir {d / 'hf'}" in errors["hf_dir"]
    shape = errors["shape"]
    assert f"model.megatron_checkpoint='{d / 'mcore'}'" in shape
    assert "has shape (2, 64), a glm4 model of this config needs (1, 64)" in shape
    assert "set model.hf_config to it" in shape and str(d / "mcore" / "hf") in shape


def test_config_and_paths_check(tmp_path: Path) -> None:
    """model.megatron_checkpoint alone is a complete model section; a missing one fails the path check."""
    from megatron_agentrl.config import ConfigError, ModelConfig, load_config
    from megatron_agentrl.hf_io import check_model_paths, load_hf_config

    c = tmp_path / "c.yaml"
    c.write_text(f"model:\n  megatron_checkpoint: {tmp_path / 'nope'}\ntasks: [{{name: lookup}}]\n")
    cfg = load_config(c)
    assert cfg.model.megatron_checkpoint == str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"model.megatron_checkpoint='.*nope' is not a directory; write it first"):
        check_model_paths(cfg.model)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"holds no hf/config.json .* set model.hf_config"):
        load_hf_config(ModelConfig(megatron_checkpoint=str(tmp_path / "plain")))
