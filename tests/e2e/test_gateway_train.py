"""Training through the gateway (``rollout.agent: gateway``): the config keys, ``agentrl train`` on the example config
with cross-policy sampling over two versions, and ``agentrl gateway`` as a process."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_agentrl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = "examples/configs/tiny_cpu_gateway.yaml"
# the example config shrunk to seconds: a tiny model, no warm-up or evaluation, groups of 2
TINY = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
        "sft.steps=0", "eval.samples_per_task=0", "checkpoint.interval=0", "train.micro_batch_size=4",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6",
        "tasks=[{name: lookup}, {name: calc}]"]


# ------------------------------------------------------------------------------------------------ config
def test_example_config_names_the_example_agent():
    cfg = load_config(REPO / CONFIG)
    assert cfg.rollout.agent == "gateway" and cfg.rollout.agent_fn == "examples.agents.openai_tool_agent:run_agent"
    assert cfg.rollout.max_versions == 2 and cfg.rollout.cross_policy == "uniform" and cfg.gateway.host == "127.0.0.1"


def sync_agent(client, sample):
    return 1.0


@pytest.mark.parametrize("overrides, message", [
    (["rollout.agent=gateway"], "rollout.agent_fn=None is required with rollout.agent=gateway"),
    (["rollout.agent_fn=tests.e2e.test_gateway_train:sync_agent"],
     "rollout.agent=builtin runs the built-in agent loop"),
    (["rollout.agent=gateway", "rollout.agent_fn=tests.e2e.test_gateway_train:sync_agent"], "is not an async function"),
    (["rollout.agent=gateway", "rollout.agent_fn=no_such_module:fn"], "module 'no_such_module' does not import"),
    (["rollout.agent=gateway", "rollout.agent_fn=tests.e2e.test_gateway_train:missing"], "has no function 'missing'"),
    (["rollout.agent=gateway", "rollout.agent_fn=not a path"], "must be 'package.module:function'"),
    (["rollout.agent=robot"], "rollout.agent='robot' is not one of builtin, gateway"),
    (["rollout.agent_timeout_s=0"], "rollout.agent_timeout_s=0.0 must be > 0 seconds"),
    (["gateway.port=70000"], "gateway.port=70000 must be a TCP port"),
    (["gateway.host=http://0.0.0.0"], "gateway.host='http://0.0.0.0' must be a host name or IP address"),
    (["gateway.prot=1"], "unknown config key 'gateway.prot'; did you mean 'gateway.port'?"),
])
def test_config_refuses_bad_agent_and_gateway_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "tests/configs/tiny_test.yaml", overrides)
    assert message in str(e.value)


def test_a_gateway_bound_elsewhere_needs_a_token(monkeypatch):
    from megatron_agentrl.pipeline.rollout_side import gateway_token

    monkeypatch.delenv("AGENTRL_GATEWAY_TOKEN", raising=False)
    cfg = load_config(REPO / CONFIG, ["gateway.host=0.0.0.0"])
    with pytest.raises(ConfigError, match=r"set \$AGENTRL_GATEWAY_TOKEN"):
        gateway_token(cfg)
    monkeypatch.setenv("AGENTRL_GATEWAY_TOKEN", "t0ken")
    assert gateway_token(cfg) == "t0ken"


# ------------------------------------------------------------------------------------------------ agentrl train
async def until_two_versions(client, sample):
    """The first step's two groups (ids 0, 1) play two turns; later ones answer "go on" to each reply until two
    weight versions have sampled their turns (the update lands while they run), at most 60 s."""
    msgs = list(sample["messages"])
    seen: set[str] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while loop.time() < deadline:
        comp = await client.chat.completions.create(model=sample["model"], messages=msgs, max_tokens=2)
        seen.add(comp.system_fingerprint)
        if len(seen) > 1 or (sample["group_id"] < 2 and len(msgs) > 3):
            return float(len(seen))
        msgs += [comp.choices[0].message, {"role": "user", "content": "go on"}]
        await asyncio.sleep(0.05)
    return 0.0


async def answer_once(client, sample):
    """One completion, then the episode ends with reward 1 (a success); each episode it plays is recorded as a
    JSON line in ``$AGENTRL_TEST_EPISODES``."""
    await client.chat.completions.create(model=sample["model"], messages=sample["messages"], max_tokens=2)
    with open(os.environ["AGENTRL_TEST_EPISODES"], "a") as f:
        f.write(json.dumps({"task": sample["task"], "index": sample["index"], "base_url": sample["base_url"]}) + "\n")
    return 1.0


def _train(tmp_path: Path, name: str, extra: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", CONFIG, "train.steps=2",
           f"output_dir={out}", *TINY, *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300), out


def _rows(out: Path, name: str, phase: str | None = "rl") -> list[dict]:
    rows = [json.loads(x) for x in (out / name).read_text().splitlines()]
    return [r for r in rows if phase is None or r.get("phase") == phase]


def test_train_runs_the_example_agent(tmp_path):
    """`agentrl train --config examples/configs/tiny_cpu_gateway.yaml train.steps=2`: the example agent plays every
    episode through the gateway, with cross-policy sampling over two version slots."""
    proc, out = _train(tmp_path, "example", ["rollout.max_turns=3"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rl = _rows(out, "metrics.jsonl")
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["gateway/agent_errors"] == 0 for r in rl)
    assert sum(r["gateway/completions"] for r in rl) >= 2 * 2 * 2  # counted since the previous step: 8 episodes
    assert "HTTP Request" not in proc.stdout  # the agents' clients do not log a line per request


def test_evaluation_plays_the_users_agent(tmp_path, monkeypatch):
    """With rollout.agent=gateway the held-out episodes (before and after RL) are the agent function's too: the agent
    here succeeds on every episode it plays, which a random tiny model through the built-in loop never does."""
    episodes = tmp_path / "episodes.jsonl"
    monkeypatch.setenv("AGENTRL_TEST_EPISODES", str(episodes))
    proc, out = _train(tmp_path, "eval", ["rollout.agent_fn=tests.e2e.test_gateway_train:answer_once", "train.steps=2",
                                          "eval.samples_per_task=3", "eval.interval=1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = _rows(out, "metrics.jsonl", phase="eval")
    assert len(evals) >= 3 and evals[0]["step"] == 0  # before RL, during RL (eval.interval), after RL
    for row in evals:
        for task in ("lookup", "calc"):
            assert row[f"episodes/{task}"] == 3 and row[f"success/{task}"] == 1.0, row
    played = [json.loads(x) for x in episodes.read_text().splitlines()]
    ports = {p["base_url"].split("/")[2] for p in played}
    assert len(played) == len(evals) * 2 * 3 + 2 * 2 * 2 and len(ports) >= 2  # evaluations on gateways of their own


@pytest.mark.parametrize("lora", [[], ["lora.rank=4", "lora.alpha=8"]], ids=["full", "lora"])
def test_train_trajectories_carry_two_versions(tmp_path, lora):
    """Through rollout.agent_fn, with cross-policy sampling over 2 versions: the second step's episodes run while
    weight version 1 arrives, and their turns are sampled by both versions (trajectories with 2 versions). With
    LoRA the two versions are two adapters on one engine."""
    proc, out = _train(tmp_path, "versions", [
        "rollout.agent_fn=tests.e2e.test_gateway_train:until_two_versions", "pipeline.queue_size=2",
        "rollout.max_turns=400", "rollout.max_total_tokens=1024", *lora])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rl = _rows(out, "metrics.jsonl")
    assert [r["step"] for r in rl] == [1, 2]
    assert rl[0]["versions_per_traj_max"] == 1 and rl[1]["versions_per_traj_max"] == 2
    assert all(v == 2.0 for k, v in rl[1].items() if k.startswith("reward/"))  # every episode saw both
    batches = _rows(out, "batches.jsonl", phase=None)
    assert [b["min_versions"] for b in batches] == [[0, 0], [0, 0]]


async def anthropic_agent(client, sample):
    """A tool-using agent written against the anthropic SDK (Messages API, its own client on the session's Anthropic
    base URL and key): each reply goes to the task (the ``/env`` route, as an assistant message), the task's tool
    results come back as tool_result blocks, until the task ends the episode (its reward) or 3 turns passed."""
    import json as _json

    from anthropic import AsyncAnthropic

    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"].get("parameters") or {"type": "object", "properties": {}}}
             for t in sample["tools"]]
    system = "\n".join(m["content"] for m in sample["messages"] if m["role"] == "system")
    msgs = [{"role": "user", "content": m["content"]} for m in sample["messages"] if m["role"] == "user"]
    async with AsyncAnthropic(base_url=sample["anthropic_base_url"], api_key=sample["api_key"], max_retries=2) as a:
        for _ in range(3):
            m = await a.messages.create(model=sample["model"], max_tokens=8, system=system, messages=msgs,
                                        tools=tools)
            text = "".join(b.text for b in m.content if b.type == "text")
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": _json.dumps(b.input)}}
                     for b in m.content if b.type == "tool_use"]
            step = await client.post("/env", body={"messages": [
                {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]}, cast_to=object)
            if step["finish"]:
                return None  # the task's reward stands
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r["tool_call_id"],
                                                   "content": r["content"]} for r in step["messages"]]}]
    return 0.0


def test_train_runs_an_anthropic_sdk_agent(tmp_path):
    """`agentrl train` with rollout.agent_fn naming an agent written against the anthropic SDK: every episode is
    played through the gateway's Messages API, and the run trains on them for 2 steps."""
    proc, out = _train(tmp_path, "anthropic", ["rollout.agent_fn=tests.e2e.test_gateway_train:anthropic_agent",
                                               "rollout.max_turns=3"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rl = _rows(out, "metrics.jsonl")
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["gateway/agent_errors"] == 0 and r["gateway/throttled"] == 0 for r in rl)
    assert sum(r["gateway/completions"] for r in rl) >= 2 * 2 * 2


# ------------------------------------------------------------------------------------------------ agentrl gateway
def test_gateway_command_serves_until_sigterm(processes):
    """`agentrl gateway --config ... --port 0`: a session opened with a task, a completion through the openai client,
    the trajectory; SIGTERM stops it cleanly."""
    from openai import AsyncOpenAI

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_agentrl.cli", "gateway", "--config", CONFIG, "--port", "0",
                             *TINY], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    processes.append(proc)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    url, seen = None, []
    while url is None:
        line = lines.get(timeout=120)
        seen.append(line)
        m = re.search(r"gateway listening on (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None

    async def main():
        import aiohttp

        async with aiohttp.ClientSession() as h:
            async with h.post(url + "/sessions", json={"task": "lookup", "index": 0}) as r:
                info = await r.json()
            async with AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0) as c:
                comp = await c.chat.completions.create(model="p", messages=info["messages"], tools=info["tools"])
            async with h.get(f"{url}/sessions/{info['session_id']}/trajectory") as r:
                return info, comp, await r.json()

    info, comp, traj = asyncio.run(main())
    assert info["status"] == "running" and [t["function"]["name"] for t in info["tools"]] == ["lookup", "answer"]
    (s, e), = traj["turn_spans"]
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens == e - s
    assert traj["versions"][s:e] == [0] * (e - s) and traj["status"] == "running" and e == len(traj["token_ids"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "".join(seen)
