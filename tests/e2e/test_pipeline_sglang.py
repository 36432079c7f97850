"""The training loop with SGLang engines (stand-in servers on loopback, backed by local engines),
handed over as the Ray launcher does (``rollout.engine_urls``): a version pool of two slots,
cross-policy sampling, asynchronous mode, weights over a gloo weight-sync group. After the run
the newest slot's engine holds exactly the trained weights. A LoRA run puts both versions on one slot of two
servers, as adapters."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.dist_utils import run_distributed

TINY = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
        "sft.steps=0", "train.steps=3", "train.micro_batch_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12", "eval.samples_per_task=0", "pipeline.mode=async",
        "pipeline.staleness=1", "rollout.max_versions=2", "rollout.cross_policy=uniform", "loss.tis_cap=2.0"]


def _train_on_standins(out: str, overrides: list[str], options: Any, slots: list[list[int]]) -> tuple[list, list, dict]:
    """Two stand-in servers with ``options``, handed to a run as ``rollout.engine_urls`` (``slots``: server indices
    per version slot); the local engines behind them, the servers and the run's summary."""
    from megatron_agentrl.config import load_config
    from megatron_agentrl.hf_io import load_hf_config
    from megatron_agentrl.pipeline.loop import run_training
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.testing.sglang_standin import StandInServer
    from rollout_sglang.tokenizer import load_tokenizer

    overrides = [f"output_dir={out}", *TINY, *overrides]
    cfg = load_config("tests/configs/tiny_test.yaml", overrides)
    hf_config = load_hf_config(cfg.model, load_tokenizer(cfg.model.tokenizer))
    engines = [LocalEngine.from_config(hf_config, init_seed=0) for _ in range(2)]
    servers = [StandInServer(e, options) for e in engines]
    urls = [s.start() for s in servers]
    try:
        by_slot = json.dumps([[urls[i] for i in slot] for slot in slots])
        cfg = load_config("tests/configs/tiny_test.yaml", overrides + [f"rollout.engine_urls={by_slot}"])
        summary = run_training(cfg)
    finally:
        for s in servers:
            s.stop()
    return engines, servers, summary


def _run(rank: int, world: int, out: str) -> dict:
    from megatron_agentrl.hf_io import load_hf_weights
    from megatron_agentrl.train_rank import setup_logging
    from rollout_sglang.testing.standin_options import StandInOptions

    setup_logging(rank)
    engines, servers, summary = _train_on_standins(out, [], StandInOptions(group_timeout_s=60), [[0], [1]])
    final = load_hf_weights(summary["hf_export"])
    newest = max(engines, key=lambda e: e.version)
    named = dict(newest.model.named_parameters())
    diff = max(float((named[k] - final[k]).abs().max()) for k in final if k in named)
    return {"versions": sorted(e.version for e in engines), "diff": diff, "summary": summary,
            "updates": [len(s.update_log) for s in servers]}


def test_async_run_with_sglang_standins_and_a_version_pool(tmp_path):
    out = run_distributed(_run, 1, str(tmp_path / "run"), timeout_s=150)[0]
    assert out["versions"] == [2, 3]  # each sync updates the oldest slot: the pool holds the latest two
    assert out["diff"] == 0.0
    assert out["summary"]["trained_samples"] == 12
    rows = [json.loads(x) for x in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    assert max(s for r in rows for s in r["staleness"]) <= 1


def _run_lora(rank: int, world: int, out: str) -> dict:
    """A LoRA run on one slot of two stand-in servers: every live version an adapter on them."""
    from megatron_agentrl.hf_io import load_hf_weights
    from megatron_agentrl.train_rank import setup_logging
    from rollout_sglang.engines.adapter import Adapter
    from rollout_sglang.testing.standin_options import StandInOptions

    setup_logging(rank)
    lora = ["rollout.engines_per_slot=2", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2", "checkpoint.interval=0"]
    options = StandInOptions(group_timeout_s=60).with_lora(4, ["all-linear"], 2)
    engines, servers, summary = _train_on_standins(out, lora, options, [[0, 1]])
    base = load_hf_weights(str(Path(out) / "hf_base"))
    final = Adapter.load(summary["lora_adapter"], 3).modules()
    diffs = []
    for e in engines:
        named = dict(e.model.named_parameters())
        diffs.append(max(float((named[k] - base[k]).abs().max()) for k in base if k in named))
        _, _, modules = e._adapters._loaded[e.adapters[-1]]
        diffs += [float((modules[m][i] - final[m][i]).abs().max()) for m in final for i in (0, 1)]
    return {"adapters": [sorted(e.adapters) for e in engines], "diff": max(diffs),
            "updates": [len(s.update_log) for s in servers], "summary": summary,
            "adapter_dirs": sorted(p.name for p in (Path(out) / "adapters").iterdir())}


def test_lora_run_serves_its_versions_as_adapters_on_sglang_standins(tmp_path):
    """Both servers of the one slot hold the trained base once (one full update each) and the live versions as
    adapters read from the run's adapter directory; the newest equals the exported adapter exactly."""
    out = run_distributed(_run_lora, 1, str(tmp_path / "run"), timeout_s=180)[0]
    assert out["updates"] == [1, 1], out["updates"]  # the base alone went over the weight-sync group
    assert out["adapters"] == [["v2", "v3"], ["v2", "v3"]], out["adapters"]  # the two live versions
    assert out["diff"] == 0.0
    assert out["summary"]["trained_samples"] == 12
    rows = [json.loads(x) for x in (tmp_path / "run" / "batches.jsonl").read_text().splitlines()]
    assert max(s for r in rows for s in r["staleness"]) <= 1
    assert set(out["adapter_dirs"]) <= {"v1", "v2", "v3"} and "v3" in out["adapter_dirs"]
