"""The training loop against the env controller over HTTP (``env.controller_url``): a controller
and two task workers (built-in lookup and calc) on loopback, an asynchronous run of 3 steps."""
from __future__ import annotations

import json

from tests.support.dist_utils import run_distributed


def _serve_and_train(rank: int, world: int, out: str) -> dict:
    import asyncio
    import threading

    from env_controller.controller.server import Controller, ControllerConfig
    from env_controller.tasks import build_task
    from env_controller.worker.options import WorkerOptions
    from env_controller.worker.server import WorkerServer
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training
    from megatron_agentrl.train_rank import setup_logging

    setup_logging(rank)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    box: dict = {}

    async def up() -> str:
        c = Controller(ControllerConfig(port=0))
        await c.start()
        box["c"], box["w"] = c, []
        for name in ("lookup", "calc"):
            w = WorkerServer(build_task(name), WorkerOptions(controller_url=c.url, heartbeat_interval_s=0.2))
            await w.start()
            await asyncio.wait_for(w.heartbeat_ok.wait(), 10)
            box["w"].append(w)
        return c.url

    async def down() -> None:
        for w in box.get("w", []):
            await w.stop()
        if "c" in box:
            await box["c"].stop()

    url = asyncio.run_coroutine_threadsafe(up(), loop).result(30)
    try:
        cfg = load_config("tests/configs/tiny_test.yaml", [
            f"output_dir={out}", f"env.controller_url={url}", "tasks=[{name: lookup}, {name: calc}]",
            "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
            "sft.steps=0", "train.steps=3", "train.micro_batch_size=4", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12", "eval.samples_per_task=2",
            "pipeline.mode=async",
        ])
        summary = run_training(cfg)
    finally:
        asyncio.run_coroutine_threadsafe(down(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return summary


def test_async_run_over_the_env_controller(tmp_path):
    out = tmp_path / "run"
    summary = run_distributed(_serve_and_train, 1, str(out), timeout_s=120)[0]
    assert summary["trained_samples"] == 3 * 2 * 2
    kinds = ("reward", "success", "episodes", "success_low", "success_high", "gen_tokens", "gen_logprob",
             "infra_failed")
    assert set(summary["after_rl"]) == {f"{m}/{t}" for m in kinds for t in ("lookup", "calc")}
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(t in ("lookup", "calc") for r in rows for t in r["tasks"])


def test_unknown_task_without_controller_is_a_config_error(tmp_path):
    import pytest

    from megatron_agentrl.config import ConfigError, load_config
    from megatron_agentrl.pipeline.rollout_side import build_env

    cfg = load_config("tests/configs/tiny_test.yaml", [f"output_dir={tmp_path}", "tasks=[{name: webshop}]"])
    with pytest.raises(ConfigError, match=r"tasks \['webshop'\] are not built-in tasks .* set env.controller_url"):
        build_env(cfg)
