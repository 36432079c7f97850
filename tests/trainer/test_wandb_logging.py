"""Weights & Biases logging (``logging.wandb``): offline runs under ``output_dir/wandb`` with the metrics and the
config, ``wandb`` imported only when asked for, and a clear error when it is missing."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_agentrl.config import ConfigError, LoggingConfig
from megatron_agentrl.metrics import MetricsLogger, require_wandb


def wandb_records(run_dir: Path) -> Iterator[object]:
    """The protobuf records of an offline W&B run's ``run-<id>.wandb`` file: W&B's LevelDB-style log, a 7-byte
    file header (``:W&B``, magic, version), then 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last), 7-byte chunk headers."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def finished_records(run_dir: Path, timeout_s: float = 60.0) -> list[object]:
    """The records of an offline run once its ``exit`` record is on disk: ``run.finish()`` returns when the
    W&B service has handled the exit, and the service may write the file's tail a moment later."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(wandb_records(run_dir))
        except (DecodeError, ValueError):  # a chunk still being written
            records = []
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"no exit record in {run_dir} after {timeout_s} s; records: {kinds}")
        time.sleep(0.2)


def history(run_dir: Path) -> list[dict[str, object]]:
    """The logged rows (key -> decoded value) of a finished offline run."""
    rows = []
    for r in finished_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def run_config(run_dir: Path) -> dict[str, object]:
    """The config the run recorded (from its run record)."""
    for r in finished_records(run_dir):
        if r.WhichOneof("record_type") == "run":
            return {u.key: json.loads(u.value_json) for u in r.run.config.update}
    raise AssertionError("no run record")


def test_metrics_logger_writes_an_offline_run(tmp_path):
    pytest.importorskip("wandb")
    settings = LoggingConfig(wandb=True, wandb_project="tests", wandb_run_name="unit")
    m = MetricsLogger(tmp_path, tensorboard=False, wandb=settings, run_config={"train": {"lr": 0.5}})
    run_dir = m.wandb_dir
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    m.log(1, {"loss": 2.0}, phase="sft")
    m.log(1, {"loss": 1.5, "reward/lookup": 0.25})
    m.histogram(1, "staleness", [0.0, 1.0, 1.0])
    m.log(2, {"loss": 1.0, "reward/lookup": 0.5})
    m.log(0, {"success/lookup": 0.5}, phase="eval")
    m.close()
    m.close()  # idempotent
    rows = history(run_dir)
    rl = [r for r in rows if "rl/loss" in r]
    assert [(r["rl/step"], r["rl/loss"], r["rl/reward/lookup"]) for r in rl] == [(1, 1.5, 0.25), (2, 1.0, 0.5)]
    assert any(r.get("sft/loss") == 2.0 and r["sft/step"] == 1 for r in rows)
    assert any(r.get("eval/success/lookup") == 0.5 and r["eval/step"] == 0 for r in rows)
    hist = next(r for r in rows if "rl/staleness/_type" in r)
    assert hist["rl/staleness/_type"] == "histogram" and sum(hist["rl/staleness/values"]) == 3
    assert run_config(run_dir)["train"] == {"lr": 0.5}
    # metrics.jsonl gets the same rows
    jsonl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["step"]) for r in jsonl] == [("sft", 1), ("rl", 1), ("rl", 2), ("eval", 0)]


def test_a_missing_wandb_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    with pytest.raises(ConfigError, match=r"logging\.wandb=true but the wandb package is not installed; install it "
                                          r"\(\.venv/bin/pip install 'wandb.*'\) or set logging\.wandb=false"):
        require_wandb()
    with pytest.raises(ConfigError, match=r"logging\.wandb=true .*set logging\.wandb=false"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=LoggingConfig(wandb=True))
    MetricsLogger(tmp_path, tensorboard=False, wandb=LoggingConfig(wandb=False)).close()  # off: not needed


def test_agentrl_train_refuses_wandb_without_the_package_and_imports_it_only_when_asked(tmp_path):
    """`agentrl train ... logging.wandb=true` without wandb: exit status 2 and the one-line message, before any
    model is built; with logging.wandb=false the training code never imports wandb."""
    script = ("import sys; sys.modules['wandb'] = None; from megatron_agentrl.cli import main; "
              f"sys.exit(main(['train', '--config', 'tests/configs/tiny_test.yaml', 'output_dir={tmp_path / 'run'}', "
              "'logging.wandb=true']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "agentrl: error: logging.wandb=true but the wandb package is not installed" in proc.stderr
    assert not (tmp_path / "run").exists()
    lazy = ("import sys; from megatron_agentrl.pipeline import loop; from megatron_agentrl.config import "
            "LoggingConfig; from megatron_agentrl.metrics import MetricsLogger; "
            f"MetricsLogger('{tmp_path / 'm'}', wandb=LoggingConfig()).close(); print('wandb' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]


def _run(rank: int, world: int, overrides: list[str]) -> dict:
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training
    from megatron_agentrl.train_rank import setup_logging

    setup_logging(rank)
    return run_training(load_config("tests/configs/tiny_test.yaml", overrides))


@pytest.mark.e2e
def test_a_run_with_wandb_writes_its_metrics_and_config_under_output_dir(tmp_path):
    """A tiny run (SFT warm-up, 2 RL steps, evaluations) with logging.wandb=true in offline mode, no network:
    the W&B run under output_dir/wandb holds the config and every phase's metrics; TensorBoard off."""
    pytest.importorskip("wandb")
    from tests.support.dist_utils import run_distributed

    out = tmp_path / "run"
    overrides = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
                 "sft.steps=1", "sft.batch_size=4", "train.steps=2", "train.micro_batch_size=4",
                 "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
                 "rollout.max_turns=3", "eval.samples_per_task=1", f"output_dir={out}", "logging.wandb=true",
                 "logging.tensorboard=false"]
    # no W&B credentials or settings from the machine, and no network to reach
    env = {"WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_CONFIG_DIR": str(tmp_path / "cfg")}
    summary = run_distributed(_run, 1, overrides, timeout_s=180, env=env)[0]
    run_dir = Path(summary["wandb"])
    assert run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")
    run = next(r.run for r in finished_records(run_dir) if r.WhichOneof("record_type") == "run")
    assert run.display_name == "run" and run.project == "megatron-agentrl"  # the output folder's name by default
    assert not (out / "tensorboard").exists()
    rows = history(run_dir)
    jsonl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for phase in ("sft", "rl", "eval"):
        logged = [r for r in jsonl if r["phase"] == phase]
        assert logged
        for rec in logged:  # every metrics.jsonl value is in W&B, on the phase's step axis
            match = [r for r in rows if r.get(f"{phase}/step") == rec["step"] and
                     all(r.get(f"{phase}/{k}") == pytest.approx(v) for k, v in rec.items()
                         if k not in ("phase", "step"))]
            assert match, (phase, rec["step"])
    assert any("rl/staleness/_type" in r for r in rows)
    config = run_config(run_dir)
    assert config["train"]["steps"] == 2 and config["logging"]["wandb"] is True
