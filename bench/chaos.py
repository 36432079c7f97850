#!/usr/bin/env python
"""Chaos: one training run whose parts fail on a schedule; per fault, the recovery time and what was lost.

Every part is a process of its own, on loopback: two SGLang stand-in servers (one per version slot:
``rollout.max_versions=2``, ``rollout.engine_urls=[[e0], [e1]]``, both serving a tiny HF checkpoint
that is also the trainer's ``model.checkpoint``), the env controller with three task workers (two for
``lookup``, so that killing one leaves one, one for ``calc``), and the trainer (``python -m
megatron_agentrl.cli train``, async pipeline, a checkpoint every ``--ckpt-interval`` steps, always
started with ``checkpoint.resume=latest``: a resume is the same command again in the same
``output_dir``).

The fault schedule is data (:data:`FAULTS`): each fault fires once the run has recorded its step
(``metrics.jsonl`` is read as it grows), then its recovery check is polled:

============== ================================================== ==============================================
fault          action                                             recovered when
============== ================================================== ==============================================
worker_kill    SIGKILL one of the two ``lookup`` workers while    the controller declared it dead, and a step
               it holds sessions                                  completes after that
controller     SIGKILL the controller; ``--controller-down-s``    it is back at its URL, every live worker
               later it starts again at the same port             registered again, and a step completes after
trainer_kill   SIGKILL the trainer; the same command again        the resumed run records a step past the one
                                                                  reached at the kill (steps redone: those since
                                                                  the checkpoint)
engine_restart SIGKILL engine 0; 2 s later a new server at the    it is healthy, holds the newest weight version
               same URL (it serves the checkpoint's weights)      (rejoined the weight sync) and a step completes
engine_kill    SIGKILL engine 1; it stays down                    two steps complete after the kill
============== ================================================== ==============================================

Then a LoRA run (``--lora-steps``; 0 skips it): the same parts, but the two engines form one slot
(``rollout.engine_urls=[[e0, e1]]``) whose live versions are LoRA adapters (``lora.rank=4``, SGLang's LoRA flags on
the servers), and engine 0 is restarted after ``--first-fault`` steps (``engine_restart``). It is recovered when the
new server is healthy, lists the adapter of a version the trainer pushed after it came back (``GET /v1/models``,
as SGLang lists loaded adapters) and a step completes: the pool restored the base to it over the weight-sync
group and loaded the live adapters again.

Then an in-flight run (``--in-flight-steps``; 0 skips it): the two engines form one slot updated in flight
(``rollout.weight_update_mode=retract``: each update pauses both servers with their running requests held, loads
the weights and continues), and after ``--first-fault`` steps engine 0 is SIGKILLed while paused mid-update
(``engine_paused_kill``: its ``/server_info`` is polled until it reports a pause with requests held, then the
kill; a new server at its URL 2 s later). It is recovered when the requests it held were generated again on the
other engine (``engines/rerouted_prompts``), neither server is left paused, the new server holds a version pushed
after it came back, and a step completes.

A fault is survived when the trainer neither exits nor stalls (``--recovery-timeout-s``) before its
recovery check passes, and no infra-failed episode was trained in the steps after it. When the trainer
dies or stalls, the fault is recorded as not survived with the tail of the trainer's log, the dead parts
are started again, and the run resumes from its latest checkpoint (the same command), so that the later
faults still run. What a fault cost: ``infra/failed_<task>`` episodes, ``infra/groups_retried`` and
``infra/groups_dropped`` of the steps recorded from the fault to the next one. Overall: steps completed,
infra-failed episodes seen, infra-failed episodes trained (every ``batches.jsonl`` row the run wrote,
also those a resume dropped; must be 0), groups re-run and dropped, and steps/s against a baseline run
of the same configuration without faults, run first in the same invocation (``--no-baseline`` skips it).

    .venv/bin/python bench/chaos.py             # all five faults, 48 steps, baseline first; the LoRA and in-flight runs
    .venv/bin/python bench/chaos.py --smoke     # worker_kill, trainer_kill, engine_kill; 12 steps, no baseline

Prints a table per fault, writes ``bench/results/chaos.json`` (``--out``); the last line is
``chaos_faults_survived: N/M``. Every process runs in its own session and its group is killed at the
end, on errors too.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from env_controller.http.net import free_port  # noqa: E402
from env_controller.servers.process import ProcessGroup, start_process, stop_process, wait_until  # noqa: E402

logger = logging.getLogger("bench.chaos")

ALL_FAULTS = "worker_kill,controller,trainer_kill,engine_restart,engine_kill"
# a restarted trainer imports torch and megatron-core again: 60 s leaves room for a machine busy with other work
SMOKE = {"steps": 12, "faults": "worker_kill,trainer_kill,engine_kill", "fault_every": 3, "first_fault": 1,
         "baseline": False, "finish_after_failure": False, "recovery_timeout_s": 60.0, "latency_ms": 20.0,
         "lora_steps": 40, "in_flight_steps": 40}
LORA_RANK = 4
# the trainer's model (tiny_test.yaml's arch at these sizes); the engines' checkpoint is built with the same
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2


# ----------------------------------------------------------------------------- HTTP
def _get(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        body = r.read()
    return json.loads(body) if body else {}


def _ok(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (OSError, ValueError, urllib.error.URLError):
        return None


def build_checkpoint(path: str | Path) -> Path:
    """A random tiny Qwen2 checkpoint with the demo tokenizer's vocab: what the engines serve and the trainer loads."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from rollout_sglang.tokenizer import load_tokenizer

    tok = load_tokenizer(str(REPO / "examples/tokenizer/tiny_agent"))
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return Path(path)


# ----------------------------------------------------------------------------- the run's parts
class Cluster:
    """Engines, controller, workers and the trainer of one run, with the actions the faults need."""

    def __init__(self, args: argparse.Namespace, work: Path, ckpt: Path, name: str, kind: str = "full") -> None:
        """``kind``: ``full`` (a slot per engine, full-weight versions), ``lora`` (one slot of both engines, versions
        as adapters) or ``in_flight`` (one slot of both engines, updated in flight: ``retract``)."""
        self.args, self.ckpt, self.name, self.kind = args, ckpt, name, kind
        self.lora = kind == "lora"
        self.dir = work / name
        self.out = self.dir / "run"
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
        self.procs = ProcessGroup(self.dir / "logs", env, cwd=REPO)
        self.engine_ports = [free_port(), free_port()]
        self.cport = free_port()
        self.api = f"http://127.0.0.1:{self.cport}/api"
        # (name, task): two lookup workers (a worker kill leaves one), one calc
        self.workers = {"lookup_a": ("lookup", free_port()), "lookup_b": ("lookup", free_port()),
                        "calc": ("calc", free_port())}
        self.trainer_starts = 0

    def python(self, name: str, args: list[str], log: str | None = None) -> None:
        """Start ``python args`` as the part ``name`` (its log: ``log`` or its name)."""
        self.procs.start(name, [sys.executable, *args], log)

    def kill(self, name: str) -> None:
        """SIGKILL the part ``name`` and what it started, and reap it."""
        self.procs.stop(name, grace_s=15.0, first_signal=signal.SIGKILL)

    # engines ---------------------------------------------------------------
    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[i]}"

    def start_engine(self, i: int) -> None:
        flags: list[str] = []
        if self.lora:  # the flags the Ray launcher gives a LoRA run's servers
            from rollout_sglang.engines.sglang_options import SGLangLaunchOptions

            flags = SGLangLaunchOptions().with_lora(LORA_RANK, ["all-linear"], 2).lora_args()
        self.python(f"engine{i}", ["-m", "rollout_sglang.testing.sglang_standin", "--model-path", str(self.ckpt),
                                   "--host", "127.0.0.1", "--port", str(self.engine_ports[i]),
                                   "--log-level", "warning", *flags])

    def engine_adapters(self, i: int) -> list[str]:
        """The LoRA adapters server ``i`` lists as loaded (SGLang's ``GET /v1/models``)."""
        cards = _ok(lambda: _get(f"{self.engine_url(i)}/v1/models")) or {}
        return [c["id"] for c in cards.get("data", []) if c.get("parent")]

    def engine_healthy(self, i: int) -> bool:
        return self.procs.alive(f"engine{i}") and _ok(lambda: _get(f"{self.engine_url(i)}/health") is not None)

    def engine_version(self, i: int) -> int | None:
        info = _ok(lambda: _get(f"{self.engine_url(i)}/server_info"))
        v = str(info.get("weight_version", "")) if info else ""
        return int(v) if v.isdigit() else None

    # env side ----------------------------------------------------------------
    def start_controller(self) -> None:
        self.python("controller", ["-m", "env_controller.cli", "controller", "--port", str(self.cport),
                                   "--heartbeat-timeout", "2", "--suspect-after", "1", "--log-level", "WARNING"])

    def start_worker(self, name: str) -> None:
        task, port = self.workers[name]
        self.python(name, ["-m", "env_controller.cli", "worker", "--task", task, "--port", str(port),
                           "--controller", self.api, "--heartbeat-interval", "0.3",
                           "--latency-ms", str(self.args.latency_ms), "--log-level", "WARNING"])

    def registered_workers(self) -> int:
        return sum(1 for t in _get(f"{self.api}/list_workers").values() for w in t["workers"].values()
                   if w["state"] == "alive")

    def live_workers(self) -> int:
        return sum(self.procs.alive(n) for n in self.workers)

    def env_ready(self) -> bool:
        return self.procs.alive("controller") and self.registered_workers() >= self.live_workers()

    # the trainer -------------------------------------------------------------
    def trainer_cmd(self) -> list[str]:
        a = self.args
        one_slot = self.kind != "full"
        urls = json.dumps([[self.engine_url(0), self.engine_url(1)]] if one_slot
                          else [[self.engine_url(0)], [self.engine_url(1)]])
        extra = {"full": [],
                 "lora": [f"lora.rank={LORA_RANK}", "lora.alpha=8", "rollout.engines_per_slot=2", "train.lr=1e-3",
                          f"lora.adapter_dir={self.dir / 'adapters'}"],
                 # one version on one slot; turns long enough that an update finds requests running to hold
                 "in_flight": ["rollout.max_versions=1", "rollout.cross_policy=latest", "rollout.engines_per_slot=2",
                               "rollout.weight_update_mode=retract", "rollout.max_new_tokens=48",
                               "rollout.max_total_tokens=640"]}[self.kind]
        return ["-m", "megatron_agentrl.cli", "train", "--config", "tests/configs/tiny_test.yaml",
                f"output_dir={self.out}", f"env.controller_url={self.api}", "tasks=[{name: lookup}, {name: calc}]",
                f"model.checkpoint={self.ckpt}", f"model.arch.hidden_size={HIDDEN}",
                f"model.arch.intermediate_size={INTER}", f"model.arch.num_hidden_layers={LAYERS}",
                f"model.arch.num_attention_heads={HEADS}", f"model.arch.num_key_value_heads={KV_HEADS}",
                "sft.steps=0", f"train.steps={a.steps}", "train.micro_batch_size=8",
                "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                "rollout.max_new_tokens=12", "rollout.max_turns=4", "eval.samples_per_task=0",
                "pipeline.mode=async", "pipeline.staleness=1", "rollout.max_versions=2",
                "rollout.cross_policy=uniform", "loss.tis_cap=2.0", f"rollout.engine_urls={urls}",
                "rollout.engine_timeout_s=20", "rollout.engine_startup_timeout_s=90",
                "rollout.engine_health_interval_s=1", "rollout.engine_health_timeout_s=5",
                "rollout.engine_unavailable_timeout_s=120",
                "rollout.weight_sync_init_timeout_s=30", "rollout.weight_sync_bucket_timeout_s=30",
                "pipeline.batch_timeout_s=90", "pipeline.env_timeout_s=30",
                f"checkpoint.interval={a.ckpt_interval}", "checkpoint.keep=2", "checkpoint.resume=latest",
                "logging.tensorboard=false", "log_every=1", *extra, *a.overrides]

    def start_trainer(self) -> None:
        self.trainer_starts += 1
        self.python("trainer", self.trainer_cmd(), log=f"trainer{self.trainer_starts}")

    def trainer_rc(self) -> int | None:
        return None if "trainer" not in self.procs.by_name else self.procs["trainer"].poll()

    # the whole ------------------------------------------------------------------
    def start(self, checkpoint: subprocess.Popen[bytes] | None = None) -> None:
        """The env side first (while ``checkpoint``, the process building the engines' checkpoint, runs), then the
        engines; the trainer may start at once: it waits for their health (``rollout.engine_startup_timeout_s``)."""
        self.start_controller()
        wait_until("controller", lambda: _get(f"{self.api}/health"), 30)
        for w in self.workers:
            self.start_worker(w)
        if checkpoint is not None and checkpoint.wait(120) != 0:
            raise RuntimeError(f"building the checkpoint failed (exit {checkpoint.returncode})")
        for i in range(2):
            self.start_engine(i)
        wait_until("three workers", lambda: self.registered_workers() >= 3, 30)

    def repair(self) -> list[str]:
        """Start again whatever part is down (at its own URL); returns their names."""
        restarted = []
        for i in range(2):
            if not self.engine_healthy(i):
                self.kill(f"engine{i}")
                self.start_engine(i)
                restarted.append(f"engine{i}")
        if not self.procs.alive("controller"):
            self.start_controller()
            restarted.append("controller")
        for w in self.workers:
            if not self.procs.alive(w):
                self.start_worker(w)
                restarted.append(w)
        wait_until("repaired parts", lambda: all(self.engine_healthy(i) for i in range(2))
                 and self.registered_workers() >= 3, 60)
        return restarted


# ----------------------------------------------------------------------------- progress of the run
class Progress:
    """Reads ``metrics.jsonl`` and ``batches.jsonl`` as they grow (a resume may shorten them) and keeps every
    RL row and batch row ever seen, with the time it was first seen."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: dict[int, dict[str, Any]] = {}  # step -> the newest RL row of it
        self.events: list[tuple[float, int]] = []  # (monotonic time, step) at each step recorded
        self.batches: list[dict[str, Any]] = []  # every batches.jsonl row seen (also those a resume dropped)
        self._seen_batches: set[str] = set()
        self._seen_rows: set[str] = set()

    @staticmethod
    def _lines(path: Path) -> list[str]:
        try:
            text = path.read_text()
        except OSError:
            return []
        return [x for x in text.split("\n")[:-1] if x.strip()]  # the last piece may be torn

    def poll(self) -> None:
        now = time.monotonic()
        for line in self._lines(self.out / "metrics.jsonl"):
            if line in self._seen_rows:
                continue
            self._seen_rows.add(line)
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("phase") == "rl":
                self.rows[int(row["step"])] = row
                self.events.append((now, int(row["step"])))
        for line in self._lines(self.out / "batches.jsonl"):
            if line not in self._seen_batches:
                self._seen_batches.add(line)
                try:
                    self.batches.append(json.loads(line))
                except ValueError:
                    pass

    def last_step(self) -> int:
        return self.events[-1][1] if self.events else 0

    def steps_after(self, t: float) -> list[int]:
        return [s for when, s in self.events if when > t]

    def first_step_after(self, t: float, above: int = 0) -> float | None:
        return next((when for when, s in self.events if when > t and s > above), None)


def infra_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The infra counters summed over metrics rows."""
    failed: dict[str, int] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("infra/failed_"):
                failed[k.removeprefix("infra/failed_")] = failed.get(k.removeprefix("infra/failed_"), 0) + int(v)
    return {"failed_episodes": failed, "failed_total": sum(failed.values()),
            "groups_retried": sum(int(r.get("infra/groups_retried", 0)) for r in rows),
            "groups_dropped": sum(int(r.get("infra/groups_dropped", 0)) for r in rows)}


# ----------------------------------------------------------------------------- the faults
@dataclass
class FaultRun:
    """One fault as it happened."""

    name: str
    what: str
    at_step: int
    fired_at: float = 0.0
    fired_step: int = 0
    recovered_at: float | None = None
    survived: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    window_steps: list[int] = field(default_factory=list)

    def record(self, t0: float) -> dict[str, Any]:
        errors = [x.strip() for x in self.error.splitlines() if "Error" in x or "error" in x]
        return {"name": self.name, "what": self.what, "at_step": self.at_step, "fired_step": self.fired_step,
                "fired_s": round(self.fired_at - t0, 2) if self.fired_at else None,
                "recovery_s": None if self.recovered_at is None else round(self.recovered_at - self.fired_at, 2),
                "survived": bool(self.survived), "detail": self.detail, "error_tail": self.error,
                "steps_after": self.window_steps,
                "error": (errors[-1] if errors else self.error.strip().split("\n")[0])[:600]}


@dataclass(frozen=True)
class Fault:
    """A fault of the schedule: ``action(cluster, run)`` does it; ``recovered(cluster, progress, run)`` says when
    the run is whole again (both may fill ``run.detail``)."""

    name: str
    what: str
    action: Callable[[Cluster, FaultRun], None]
    recovered: Callable[[Cluster, Progress, FaultRun], bool]


def _kill_worker(c: Cluster, run: FaultRun) -> None:
    """SIGKILL ``lookup_a`` once it holds sessions of the run (up to 10 s), one in an interact if possible."""
    port = c.workers["lookup_a"][1]

    def held() -> tuple[int, int]:
        ids = {wid for wid, w in _get(f"{c.api}/list_workers").get("lookup", {}).get("workers", {}).items()
               if w["address"].endswith(f":{port}/api")}
        sessions = [s for s in _get(f"{c.api}/list_sessions").values() if str(s["worker_id"]) in ids]
        return len(sessions), sum(1 for s in sessions if s["busy"])

    deadline = time.monotonic() + 10
    n = busy = 0
    while time.monotonic() < deadline:
        n, busy = _ok(held) or (0, 0)
        if busy:
            break
        time.sleep(0.01)
    run.detail.update(killed="lookup_a", sessions_held=n, busy_sessions=busy,
                      waited_s=round(time.monotonic() - run.fired_at, 2))
    run.fired_at = time.monotonic()  # recovery counts from the kill
    c.kill("lookup_a")


def _controller_down(c: Cluster, run: FaultRun) -> None:
    c.kill("controller")
    t = time.monotonic()
    down = c.args.controller_down_s
    while time.monotonic() - t < down:  # the trainer goes on meanwhile; it may die of it
        if c.trainer_rc() is not None:
            break
        time.sleep(0.2)
    c.start_controller()
    run.detail.update(down_s=round(time.monotonic() - t, 2))


def _kill_trainer(c: Cluster, run: FaultRun) -> None:
    run.detail["killed_at_step"] = run.fired_step
    c.kill("trainer")
    c.start_trainer()  # the same command: checkpoint.resume=latest


def _restart_engine(c: Cluster, run: FaultRun) -> None:
    c.kill("engine0")
    time.sleep(2.0)
    c.start_engine(0)
    run.detail.update(engine=c.engine_url(0), restarted=True)


def _kill_engine(c: Cluster, run: FaultRun) -> None:
    c.kill("engine1")
    run.detail["engine"] = c.engine_url(1)


def _kill_engine_while_paused(c: Cluster, run: FaultRun) -> None:
    """Poll engine 0's ``/server_info`` until it is paused with requests held and its update open (up to
    ``--pause-wait-s``), SIGKILL it there, and start a new server at its URL 2 s later."""
    before = _rerouted(c)  # read before the kill: the run may record the rerouting of what it held at once
    deadline = time.monotonic() + c.args.pause_wait_s
    polls, seen = 0, None
    while time.monotonic() < deadline:
        info = _ok(lambda: _get(f"{c.engine_url(0)}/server_info", timeout_s=1.0))
        polls += 1
        if info and info.get("paused") and info.get("weight_update_session") and info.get("running_requests", 0) > 0:
            seen = info
            break
        time.sleep(0.002)
    if seen is None:
        raise RuntimeError(f"engine 0 was not seen paused with requests held within {c.args.pause_wait_s:.0f} s "
                           f"({polls} polls)")
    c.kill("engine0")
    run.fired_at = time.monotonic()  # recovery counts from the kill
    run.detail.update(engine=c.engine_url(0), pause_mode=seen.get("pause_mode"), held_requests=seen["running_requests"],
                      version_at_kill=seen.get("weight_version"), rerouted_before=before)
    time.sleep(2.0)
    c.start_engine(0)


def _rerouted(c: Cluster) -> float:
    """Prompts the run has generated again on another engine, as its last recorded step counted them."""
    rows = Progress(c.out)
    rows.poll()
    return rows.rows[max(rows.rows)].get("engines/rerouted_prompts", 0.0) if rows.rows else 0.0


def _paused_engine_back(c: Cluster, p: Progress, run: FaultRun) -> bool:
    """What engine 0 held went to engine 1, no server is left paused, and the new engine 0 holds a version pushed
    after it came back, with a step completed after."""
    last = p.rows[max(p.rows)] if p.rows else {}
    run.detail["rerouted_prompts"] = last.get("engines/rerouted_prompts", 0.0) - run.detail["rerouted_before"]
    if run.detail["rerouted_prompts"] < 1:
        return False
    if not _engine_rejoined(c, p, run):
        return False
    infos = [_ok(lambda i=i: _get(f"{c.engine_url(i)}/server_info")) or {} for i in range(2)]
    run.detail["left_paused"] = [i for i, info in enumerate(infos) if info.get("paused", True)]
    return not run.detail["left_paused"]


def _worker_gone(c: Cluster, p: Progress, run: FaultRun) -> bool:
    """The controller declared the killed worker dead, and a step completed after that."""
    if "declared_dead_s" not in run.detail:
        port = c.workers["lookup_a"][1]
        if any(w["state"] != "dead" for t in _get(f"{c.api}/list_workers").values() for w in t["workers"].values()
               if w["address"].endswith(f":{port}/api")):
            return False
        run.detail["declared_dead_s"] = round(time.monotonic() - run.fired_at, 2)
        run.detail["declared_dead_at"] = time.monotonic()
    return p.first_step_after(run.detail["declared_dead_at"]) is not None


def _controller_back(c: Cluster, p: Progress, run: FaultRun) -> bool:
    if "back_s" not in run.detail:
        if not _ok(c.env_ready):
            return False
        run.detail["back_s"] = round(time.monotonic() - run.fired_at, 2)
        run.detail["back_at"] = time.monotonic()
    return p.first_step_after(run.detail["back_at"]) is not None


def _trainer_resumed(c: Cluster, p: Progress, run: FaultRun) -> bool:
    first = p.first_step_after(run.fired_at)
    if first is not None and "first_step_s" not in run.detail:
        run.detail["first_step_s"] = round(first - run.fired_at, 2)
        run.detail["resumed_from_step"] = next(s for when, s in p.events if when == first) - 1
        run.detail["steps_redone"] = run.fired_step - run.detail["resumed_from_step"]
    return p.first_step_after(run.fired_at, above=run.fired_step) is not None


def _engine_rejoined(c: Cluster, p: Progress, run: FaultRun) -> bool:
    if not c.engine_healthy(0):
        return False
    run.detail.setdefault("healthy_s", round(time.monotonic() - run.fired_at, 2))
    v = c.engine_version(0)
    run.detail["engine_version"] = v
    latest = p.last_step()
    # it holds a version the trainer pushed after it came back (the checkpoint's weights are version 0)
    return v is not None and v > 0 and v >= latest - 1 and p.first_step_after(run.fired_at + 2.0) is not None


def _adapter_restored(c: Cluster, p: Progress, run: FaultRun) -> bool:
    """The restarted server (a LoRA run) is healthy, holds the adapter of a version pushed after it came back, and a
    step completed after that."""
    if not c.engine_healthy(0):
        return False
    run.detail.setdefault("healthy_s", round(time.monotonic() - run.fired_at, 2))
    names = c.engine_adapters(0)
    run.detail["adapters"] = names
    versions = [int(n[1:]) for n in names if n[1:].isdigit()]
    if not versions or max(versions) <= run.fired_step:
        return False
    run.detail.setdefault("restored_s", round(time.monotonic() - run.fired_at, 2))
    run.detail["adapter_version"] = max(versions)
    return p.first_step_after(run.fired_at + run.detail["restored_s"]) is not None


def _two_steps_done(c: Cluster, p: Progress, run: FaultRun) -> bool:
    return len(p.steps_after(run.fired_at)) >= 2


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("worker_kill", "SIGKILL a lookup worker (one of two) while it holds sessions", _kill_worker, _worker_gone),
    Fault("controller", "SIGKILL the controller, start it again at its port after --controller-down-s",
          _controller_down, _controller_back),
    Fault("trainer_kill", "SIGKILL the trainer, run the same command (checkpoint.resume=latest)", _kill_trainer,
          _trainer_resumed),
    Fault("engine_restart", "SIGKILL engine 0, a new server at the same URL 2 s later", _restart_engine,
          _engine_rejoined),
    Fault("engine_kill", "SIGKILL engine 1 for good", _kill_engine, _two_steps_done),
)}
#: the LoRA run's fault: engine 0 restarted; recovered once it serves the current adapter
LORA_RESTART = Fault("engine_restart", "LoRA run: SIGKILL engine 0, a new server at the same URL 2 s later",
                     _restart_engine, _adapter_restored)

#: the in-flight run's fault: engine 0 SIGKILLed while paused mid-update, holding requests
PAUSED_KILL = Fault("engine_paused_kill", "in-flight run: SIGKILL engine 0 while paused mid-update (retract) "
                    "holding requests, a new server at its URL 2 s later", _kill_engine_while_paused,
                    _paused_engine_back)


# ----------------------------------------------------------------------------- one run
def drive(c: Cluster, schedule: list[tuple[int, Fault]], args: argparse.Namespace) -> dict[str, Any]:
    """Run the trainer to ``args.steps`` through the faults of ``schedule`` ((step, fault) in order)."""
    progress = Progress(c.out)
    runs = [FaultRun(f.name, f.what, step) for step, f in schedule]
    pending = list(zip(runs, (f for _, f in schedule), strict=True))
    active: tuple[FaultRun, Fault] | None = None
    resumes_after_failure: list[dict[str, Any]] = []
    t0 = time.monotonic()
    c.start_trainer()
    deadline = t0 + args.run_timeout_s
    final_rc: int | None = None
    resolved_step = 0
    while True:
        time.sleep(0.1)
        progress.poll()
        now = time.monotonic()
        if now > deadline:
            final_rc = None
            logger.error("the run did not finish within %.0f s", args.run_timeout_s)
            if active is not None:
                active[0].survived, active[0].error = False, "the run hit --run-timeout-s\n" + c.procs.tail("trainer")
            break
        rc = c.trainer_rc()
        if active is not None:
            run, fault = active
            if rc in (None, 0) and _ok(lambda f=fault, r=run: f.recovered(c, progress, r)):
                run.recovered_at = now
                run.survived = True
                active, resolved_step = None, progress.last_step()
                print(f"  [{now - t0:6.1f}s] {run.name}: recovered in {run.recovered_at - run.fired_at:.1f} s",
                      flush=True)
            elif rc == 0 and progress.last_step() >= args.steps:  # the run ended before the check could pass
                run.survived, run.error = False, f"the run ended before its recovery check passed ({run.detail})"
                print(f"  [{now - t0:6.1f}s] {run.name}: not seen to recover before the run ended", flush=True)
                active, resolved_step = None, progress.last_step()
                final_rc = rc
                break
            elif rc is not None or now - run.fired_at > args.recovery_timeout_s:
                why = (f"the trainer exited with {rc}" if rc is not None
                       else f"no recovery within {args.recovery_timeout_s:.0f} s")
                run.survived, run.error = False, why + "\n" + c.procs.tail("trainer")
                print(f"  [{now - t0:6.1f}s] {run.name}: NOT survived ({why})", flush=True)
                active, resolved_step = None, progress.last_step()
                c.kill("trainer")
                progress.poll()
                if not pending and not args.finish_after_failure:
                    break
                restarted = c.repair()
                resumes_after_failure.append({"after": run.name, "restarted": restarted,
                                              "at_step": progress.last_step()})
                c.start_trainer()
                continue
        if rc is not None:
            final_rc = rc
            if active is None:
                break
            continue
        # a fault fires at its step, and never before a step completed since the previous one was resolved
        if active is None and pending and progress.last_step() >= max(pending[0][0].at_step, resolved_step + 1):
            run, fault = pending.pop(0)
            run.fired_at, run.fired_step = time.monotonic(), progress.last_step()
            print(f"  [{run.fired_at - t0:6.1f}s] step {run.fired_step}: {run.name}", flush=True)
            try:
                fault.action(c, run)
            except Exception as e:  # noqa: BLE001 - a fault that could not be done is a failed fault
                run.survived, run.error = False, f"the fault's action failed: {e!r}"
                continue
            active = (run, fault)
    t_end = time.monotonic()
    progress.poll()
    for r in runs:  # faults the run never reached
        if r.survived is None:
            why = f"not reached: the run ended before its step (exit {final_rc})"
            r.survived, r.error = False, r.error or (why + "\n" + c.procs.tail("trainer"))
    # what each fault cost: the steps recorded from its firing to the next fault's
    fired = [r for r in runs if r.fired_at]
    for i, r in enumerate(fired):
        end = fired[i + 1].fired_at if i + 1 < len(fired) else float("inf")
        window = [s for when, s in progress.events if r.fired_at < when <= end]
        r.window_steps = window
        r.detail["lost"] = infra_of([progress.rows[s] for s in sorted(set(window)) if s in progress.rows])
    trained_infra = infra_trained(progress.batches)
    for r in runs:  # a survived fault: no infra-failed episode trained in the steps after it
        if r.survived and any(trained_infra.get(s) for s in r.window_steps):
            r.survived, r.error = False, f"infra-failed episodes trained at steps {sorted(trained_infra)}"
    summary = _ok(lambda: json.loads((c.out / "summary.json").read_text())) or {}
    steps = sorted(progress.rows)
    last_time = progress.events[-1][0] if progress.events else t_end
    wall = last_time - t0
    return {
        "completed": final_rc == 0 and progress.last_step() == args.steps,
        "final_rc": final_rc,
        "steps_completed": len(steps),
        "last_step": progress.last_step(),
        "steps_recorded_total": len(progress.events),
        "wall_s": round(t_end - t0, 2),
        "steps_per_s": len(steps) / wall if wall > 0 and steps else 0.0,
        "trainer_starts": c.trainer_starts,
        "resumes_after_failure": resumes_after_failure,
        "infra": infra_of([progress.rows[s] for s in steps]),
        "infra_failed_trained": sum(trained_infra.values()),
        "batch_rows_seen": len(progress.batches),
        "summary_infra": summary.get("infra"),
        "faults": [r.record(t0) for r in runs],
    }


def infra_trained(batches: list[dict[str, Any]]) -> dict[int, int]:
    """Per step, the trained samples whose end status is an infrastructure failure (must be none)."""
    from rollout_sglang.trajectory import INFRA_STATUSES

    out: dict[int, int] = {}
    for b in batches:
        n = sum(1 for s in b.get("statuses", []) if s in INFRA_STATUSES)
        if n:
            out[int(b["step"])] = out.get(int(b["step"]), 0) + n
    return out


def one_run(args: argparse.Namespace, work: Path, ckpt: Path, name: str, schedule: list[tuple[int, Fault]],
            checkpoint: subprocess.Popen[bytes] | None = None, kind: str = "full") -> dict[str, Any]:
    c = Cluster(args, work, ckpt, name, kind)
    try:
        c.start(checkpoint)
        return drive(c, schedule, args)
    finally:
        c.procs.close()
        if args.keep:
            print(f"  {name}: logs and outputs kept under {c.dir}")


def print_table(chaos: dict[str, Any]) -> None:
    cols = f"{'fault':<15}{'step':>5}{'survived':>10}{'recovery_s':>12}{'failed_ep':>11}{'retried':>9}" \
           f"{'dropped':>9}  detail"
    print(cols)
    for f in chaos["faults"]:
        lost = f["detail"].get("lost", {})
        keep = {k: v for k, v in f["detail"].items() if k not in ("lost", "back_at", "declared_dead_at")}
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"
        print(f"{f['name']:<15}{f['fired_step']:>5}{'yes' if f['survived'] else 'NO':>10}{rec:>12}"
              f"{lost.get('failed_total', 0):>11}{lost.get('groups_retried', 0):>9}{lost.get('groups_dropped', 0):>9}"
              f"  {json.dumps(keep)}")
    for f in chaos["faults"]:
        if not f["survived"]:
            print(f"{f['name']} not survived: {f['error']}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("chaos", __doc__)
    p.add_argument("--steps", type=int, default=48, help="RL steps of the run (train.steps)")
    p.add_argument("--faults", default=ALL_FAULTS, help=f"the faults, in order (of {ALL_FAULTS})")
    p.add_argument("--first-fault", type=int, default=3, help="the step the first fault fires after")
    p.add_argument("--fault-every", type=int, default=8, help="steps between faults")
    p.add_argument("--ckpt-interval", type=int, default=2, help="checkpoint.interval")
    p.add_argument("--latency-ms", type=float, default=50.0, help="the workers' latency per call, ms")
    p.add_argument("--controller-down-s", type=float, default=15.0, help="how long the controller stays down")
    p.add_argument("--recovery-timeout-s", type=float, default=120.0,
                   help="a fault not recovered within this is not survived")
    p.add_argument("--run-timeout-s", type=float, default=1500.0, help="limit on one run, s")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="first the same run without faults (steps/s ratio)")
    p.add_argument("--finish-after-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="after the last fault failed, still repair and resume the run to its last step (so that "
                        "its steps/s compares with the baseline's)")
    p.add_argument("--lora-steps", type=int, default=30,
                   help="steps of the LoRA run with an engine restart after --first-fault steps (0: no LoRA run)")
    p.add_argument("--in-flight-steps", type=int, default=40,
                   help="steps of the in-flight run (one slot, retract) with engine 0 killed while paused mid-update "
                        "after --first-fault steps (0: no in-flight run)")
    p.add_argument("--pause-wait-s", type=float, default=120.0,
                   help="how long the in-flight fault waits to see engine 0 paused with requests held, s")
    p.add_argument("--keep", action="store_true", help="keep the logs and outputs (printed path)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("overrides", nargs="*", help="more key=value config overrides of the trainer (after the bench's: "
                   "e.g. rollout.prompts_per_step=4 pipeline.env_timeout_s=60)")
    args = parse_bench_args(p, argv, SMOKE)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    names = [n for n in args.faults.split(",") if n]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"--faults: unknown {unknown} (known: {ALL_FAULTS})")
    schedule = [(args.first_fault + i * args.fault_every, FAULTS[n]) for i, n in enumerate(names)]
    if schedule and schedule[-1][0] >= args.steps:
        p.error(f"--steps {args.steps}: the last fault fires after step {schedule[-1][0]}; give more steps")

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="agentrl_chaos_"))
    try:
        ckpt = work / "hf"
        # built in a process of its own (torch and transformers load there) while the first run's env side starts
        build: subprocess.Popen[bytes] | None = start_process(
            [sys.executable, "-c", f"from bench.chaos import build_checkpoint; build_checkpoint({str(ckpt)!r})"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        baseline = lora_run = in_flight_run = None
        try:
            if args.baseline:
                print(f"baseline: {args.steps} steps without faults", flush=True)
                baseline = one_run(args, work, ckpt, "baseline", [], build)
                build = None
                print(f"  {baseline['steps_completed']} steps, {baseline['steps_per_s']:.3f} steps/s", flush=True)
            print(f"chaos: {args.steps} steps, faults {[f'{s}:{f.name}' for s, f in schedule]}", flush=True)
            chaos = one_run(args, work, ckpt, "chaos", schedule, build)
            build = None
            if args.lora_steps:
                print(f"lora: {args.lora_steps} steps, engine_restart after step {args.first_fault}", flush=True)
                lora_args = argparse.Namespace(**{**vars(args), "steps": args.lora_steps})
                lora_run = one_run(lora_args, work, ckpt, "lora", [(args.first_fault, LORA_RESTART)],
                                   kind="lora")
            if args.in_flight_steps:
                print(f"in-flight: {args.in_flight_steps} steps, engine_paused_kill after step {args.first_fault}",
                      flush=True)
                in_flight_args = argparse.Namespace(**{**vars(args), "steps": args.in_flight_steps})
                in_flight_run = one_run(in_flight_args, work, ckpt, "in_flight", [(args.first_fault, PAUSED_KILL)],
                                        kind="in_flight")
        finally:
            stop_process(build, grace_s=0.0, first_signal=signal.SIGKILL)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    faults = chaos["faults"] + [f for r in (lora_run, in_flight_run) if r for f in r["faults"]]
    survived = sum(f["survived"] for f in faults)
    ratio = (chaos["steps_per_s"] / baseline["steps_per_s"]) if baseline and baseline["steps_per_s"] else None
    print()
    print_table(chaos)
    print()
    rc = "none: stopped after the last fault" if chaos["final_rc"] is None else chaos["final_rc"]
    print(f"steps completed: {chaos['steps_completed']}/{args.steps} (trainer starts {chaos['trainer_starts']}, "
          f"final exit {rc}) | infra-failed episodes seen {chaos['infra']['failed_total']}, "
          f"trained {chaos['infra_failed_trained']} | groups re-run {chaos['infra']['groups_retried']}, "
          f"dropped {chaos['infra']['groups_dropped']}")
    for r in chaos["resumes_after_failure"]:
        print(f"resumed after {r['after']} failed, at step {r['at_step']}, with {r['restarted'] or 'nothing'} "
              "started again")
    if lora_run is not None:
        print("\nLoRA run (versions as adapters on one slot of two servers):")
        print_table(lora_run)
    if in_flight_run is not None:
        print("\nIn-flight run (one slot of two servers, updated in flight with retract):")
        print_table(in_flight_run)
    print(f"steps/s: chaos {chaos['steps_per_s']:.3f}" + (
        f", baseline {baseline['steps_per_s']:.3f}, ratio {ratio:.2f}" if ratio is not None else " (no baseline)"))
    record = {
        "benchmark": "chaos", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit(), "args": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "schedule": [{"step": s, "fault": f.name} for s, f in schedule],
        "baseline": baseline, "chaos": chaos, "lora": lora_run, "in_flight": in_flight_run, "steps_per_s_ratio": ratio,
        "faults_survived": survived, "faults_total": len(faults),
        "bench_wall_s": round(time.monotonic() - t_start, 1),
    }
    write_record(args.out, record)
    print(f"bench wall {record['bench_wall_s']:.0f} s | results: {args.out}")
    print(f"chaos_faults_survived: {survived}/{len(faults)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
