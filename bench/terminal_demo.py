#!/usr/bin/env python
"""The terminal demo on containers: held-out success per task family before and after RL, over seeds, with the
containers counted.

Starts a private Docker engine (``DockerEngine``), an env controller and one task worker per family of
``--config`` (``examples/configs/tiny_cpu_terminal.yaml``: ``agentrl worker --task terminal --name <name>``
with the entry's params, ``--max-containers`` and ``--warm-containers``), then runs ``agentrl train`` once
per seed (``train.seed=<s>``) against that controller: the scripted warm-up (demonstrations played in
containers by the trainer), held-out evaluation, async GRPO, evaluation again; every episode runs in its own
container through the controller and a worker. A thread counts the engine's sandbox containers every
second (the peak is the most live at once) and the ones sessions hold (the workers' own count), over the
whole run and during RL; after the seeds the workers stop, and the containers still in the engine are the
leaked ones.

Prints a line per seed (success before -> after RL per family), the per-family means and gains, the peak
of live containers and the leaked ones; writes ``bench/results/terminal_demo.json`` (``--out``); the last two
lines are ``terminal_peak_live_containers: N`` and ``terminal_leaked_containers: N``. A run that fails or is
stopped (SIGTERM) still writes what it measured, with ``complete: false`` and the error.

``--smoke``: one seed of a tiny run (2 warm-up steps, 1 RL step, 2 evaluation samples per family, a few
containers), in a minute or two; its figures mean nothing. Where dockerd cannot run, ``--smoke`` records
``skipped`` and exits 0.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, skip_smoke, write_record  # noqa: E402
from bench.demo_learning import task_interval, task_success  # noqa: E402
from megatron_agentrl.sigterm import sigterm_raises  # noqa: E402

SMOKE = {"seeds": "1", "timeout": 900.0, "max_containers": 8, "warm": "0:1", "num_samples": 12}
SMOKE_OVERRIDES = ["sft.steps=2", "sft.short_format_steps=1", "sft.batch_size=2", "train.steps=1",
                   "train.micro_batch_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                   "rollout.max_new_tokens=8", "eval.samples_per_task=2", "model.arch.hidden_size=32",
                   "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=1"]
LABEL = "org.agentrl.sandbox=1"


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


class Counter(threading.Thread):
    """Counts the engine's sandbox containers every ``interval_s`` (``peak``: the most seen at once) and the
    containers the workers say sessions hold (``leased``, from ``/worker_status`` of ``workers``); each sample
    is tagged with the phase of the seed being run (``rl`` between the two held-out evaluations, read from
    ``metrics`` (that seed's metrics.jsonl), else ``other``), and ``peaks[phase]`` keeps the most of each."""

    def __init__(self, client: Any, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="container-counter")
        self.client, self.interval_s = client, interval_s
        self.peak = 0
        self.peaks: dict[str, dict[str, int]] = {}
        self.samples: list[tuple[float, int, int, str]] = []  # (seconds, live, leased, phase)
        self.workers: list[str] = []
        self.metrics: Path | None = None
        self._read: tuple[Path | None, int, int] = (None, 0, 0)  # (metrics file, bytes read, evaluations seen)
        self._halt = threading.Event()

    def count(self) -> int:
        return len(self.client.api.containers(all=True, filters={"label": LABEL}, quiet=True))

    def leased(self) -> int:
        """Containers held by sessions, summed over the workers (-1 when a worker does not answer)."""
        total = 0
        for url in self.workers:
            try:
                total += int((_get(url, timeout=2.0).get("sandbox_pool") or {}).get("leased", 0))
            except Exception:  # noqa: BLE001 - a busy worker: this sample has no leased count
                return -1
        return total

    def phase(self) -> str:
        """``rl`` once the seed's metrics hold one evaluation (before RL) and until the second; read on from
        where the last call stopped (the file only grows)."""
        if self.metrics != self._read[0]:  # a new seed
            self._read = (self.metrics, 0, 0)
        path, offset, evals = self._read
        if path is not None:
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except OSError:
                chunk = b""
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written counts next time
            self._read = (path, offset + len(complete), evals + complete.count(b'"phase": "eval"'))
        return "rl" if self._read[2] == 1 else "other"

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.wait(self.interval_s):
            try:
                n = self.count()
            except Exception:  # noqa: BLE001 - a busy engine: the next sample counts
                continue
            held, phase = self.leased(), self.phase()
            self.peak = max(self.peak, n)
            peak = self.peaks.setdefault(phase, {"live": 0, "leased": 0})
            peak["live"], peak["leased"] = max(peak["live"], n), max(peak["leased"], held)
            self.samples.append((round(time.monotonic() - t0, 1), n, held, phase))

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(10)


def run(args: Any, overrides: list[str], work: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, controller and workers; run the seeds; stop everything; count leaks. ``state`` holds
    what was measured so far, also when a seed fails or the bench is stopped (it is returned at the end)."""
    import docker

    from env_controller.http.net import free_port
    from env_controller.sandbox.dockerd import DockerEngine
    from env_controller.servers.process import ProcessGroup, start_process, stop_process
    from megatron_agentrl.config import load_config

    cfg = load_config(ROOT / args.config)
    engine = DockerEngine().start()
    client = docker.DockerClient(base_url=engine.url, timeout=300)
    counter = Counter(client)
    env = {**os.environ, "DOCKER_HOST": engine.url, "PYTHONPATH": str(ROOT)}
    procs = ProcessGroup(work, env, cwd=ROOT)
    timings: dict[str, float] = {}
    per_seed: dict[int, Any] = {}
    pools: dict[str, Any] = {}
    state.update(per_seed=per_seed, pools=pools, timings_s=timings)
    try:
        port = free_port()
        controller = f"http://127.0.0.1:{port}"
        procs.start("controller", [sys.executable, "-m", "env_controller.cli", "controller", "--port", str(port)])
        for spec in cfg.tasks:
            params = dict(spec.params)
            if args.num_samples:
                params["num_samples"] = args.num_samples
            cmd = [sys.executable, "-m", "env_controller.cli", "worker", "--task", spec.task or spec.name,
                   "--name", spec.name, "--port", "0", "--controller", f"{controller}/api",
                   "--max-containers", str(args.max_containers), "--warm-containers", args.warm,
                   "--timeout", "600", *(x for k, v in params.items() for x in ("--param", f"{k}={json.dumps(v)}"))]
            procs.start(f"worker_{spec.name}", cmd)
        t0 = time.monotonic()
        names = {s.name for s in cfg.tasks}
        while True:
            try:
                listed = {name for name, t in _get(f"{controller}/api/list_workers").items() if t["workers"]}
            except Exception:  # noqa: BLE001 - not up yet
                listed = set()
            if names <= listed:
                break
            if procs.exited() or time.monotonic() - t0 > 300:
                raise SystemExit(f"the controller or a worker did not come up (logs in {work})")
            time.sleep(0.5)
        timings["workers_up_s"] = round(time.monotonic() - t0, 1)
        counter.workers = [f"{w['address'].rstrip('/')}/worker_status"
                           for name, t in _get(f"{controller}/api/list_workers").items() if name in names
                           for w in t["workers"].values()]
        counter.start()
        config = str(ROOT / args.config)
        if args.num_samples:  # list items take no key=value override: a copy of the config with the new size
            import yaml

            doc = yaml.safe_load(Path(config).read_text())
            for entry in doc["tasks"]:
                entry.setdefault("params", {})["num_samples"] = args.num_samples
            config = str(work / "config.yaml")
            Path(config).write_text(yaml.safe_dump(doc))
        for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
            out_dir = work / f"seed{seed}"
            cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", config,
                   f"train.seed={seed}", f"output_dir={out_dir}", f"env.controller_url={controller}", *overrides]
            t1 = time.monotonic()
            counter.metrics = out_dir / "metrics.jsonl"
            log = work / f"train_seed{seed}.log"
            proc = start_process(cmd, log, env=env, cwd=ROOT, group=None)
            try:
                proc.wait(args.timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"seed {seed}: ran past --timeout {args.timeout:.0f}s; log {log}") from None
            finally:
                stop_process(proc, grace_s=60.0)  # stopped or timed out: SIGTERM, then SIGKILL past 60 s
            if proc.returncode != 0:
                sys.stderr.write(log.read_text(errors="replace")[-4000:])
                raise SystemExit(f"seed {seed}: the run failed (exit {proc.returncode}); log {log}")
            summary = json.loads((out_dir / "summary.json").read_text())
            wall = round(time.monotonic() - t1, 1)
            before, after = task_success(summary, "before_rl"), task_success(summary, "after_rl")
            per_seed[seed] = {"before": before, "after": after, "wall_s": wall, "rl_wall_s": summary.get("rl_wall_s"),
                              "interval_95": {"before": task_interval(summary, "before_rl"),
                                              "after": task_interval(summary, "after_rl")}}
            print(f"seed {seed}: {wall:.0f}s | " + ", ".join(
                f"{t} {100 * before[t]:.0f}% -> {100 * after[t]:.0f}%" for t in sorted(before)), flush=True)
        for name, t in _get(f"{controller}/api/list_workers").items():  # the workers' own view, before they stop
            for w in t["workers"].values():
                spec_name = name
                if spec_name in names:
                    try:
                        status = _get(f"{w['address'].rstrip('/')}/worker_status")
                        pools[spec_name] = status.get("sandbox_pool")
                    except Exception as e:  # noqa: BLE001 - informational
                        pools[spec_name] = {"error": repr(e)}
    finally:
        t2 = time.monotonic()
        procs.close(grace_s=120.0)  # first: the workers remove their containers on SIGTERM
        counter.stop()
        timings["stop_s"] = round(time.monotonic() - t2, 1)
        try:
            leaked = counter.count()
        except Exception:  # noqa: BLE001 - the engine is gone
            leaked = -1
        state.update(peak_live_containers=counter.peak, leaked_containers=leaked,
                     peak_during_rl=counter.peaks.get("rl", {"live": 0, "leased": 0}),
                     container_samples=counter.samples[-600:])
        client.close()
        engine.stop()
    return state


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("terminal_demo", __doc__)
    p.add_argument("--config", default="examples/configs/tiny_cpu_terminal.yaml")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values (run one after another)")
    p.add_argument("--timeout", type=float, default=7200.0, help="limit on one seed's run, seconds")
    p.add_argument("--max-containers", type=int, default=160, help="each worker's --max-containers")
    # a step asks 64 per family at once: 96 at rest serve them warm, and reused containers (the families work in a
    # scratch directory the wipe empties) spare the engine a create and a removal per episode. Without reuse,
    # pools this size made dockerd 20.10 stop answering here mid-run (a create and a removal per episode)
    p.add_argument("--warm", default="96:128", help="each worker's --warm-containers (per image)")
    p.add_argument("--num-samples", type=int, default=0, help="instances per family (0: the config's)")
    p.add_argument("--workdir", default=None, help="logs and runs go here (default: a temporary directory, kept "
                   "on failure)")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for every seed")
    args = parse_bench_args(p, argv, SMOKE)
    overrides = [*SMOKE_OVERRIDES, *args.overrides] if args.smoke else args.overrides
    from env_controller.sandbox.dockerd import DockerUnavailableError, find_dockerd

    try:
        find_dockerd()
    except DockerUnavailableError as e:
        return skip_smoke(args, "terminal_demo", e, ["terminal_peak_live_containers", "terminal_leaked_containers"])
    work = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="agentrl-terminal-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    state: dict[str, Any] = {}
    try:
        # SIGTERM (a `timeout`, a job scheduler) ends the bench through its cleanup: the controller and workers run
        # in sessions of their own, so they would outlive it
        with sigterm_raises(lambda signum: SystemExit(128 + signum)):
            result = run(args, overrides, work, state)
    except BaseException as e:  # a failed seed, a wedged engine, SIGTERM: keep what was measured
        out = write_record(args.out, {"bench": "terminal_demo", "complete": False, "error": f"{type(e).__name__}: {e}",
                                      "config": args.config, "overrides": overrides, **state, "commit": git_commit(),
                                      "date": time.strftime("%Y-%m-%d")})
        print(f"stopped before the end ({type(e).__name__}: {e}); what was measured: {out}", file=sys.stderr)
        raise
    wall = round(time.monotonic() - t0, 1)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    seeds = result["per_seed"]
    families = sorted({t for s in seeds.values() for t in s["before"]})
    gains = {t: 100 * mean(s["after"][t] - s["before"][t] for s in seeds.values()) for t in families}
    print(f"\n{'family':<12}{'before RL %':>13}{'after RL %':>12}{'mean gain':>11}{'worst seed':>12}  (points)")
    for t in families:
        b = 100 * mean(s["before"][t] for s in seeds.values())
        a = 100 * mean(s["after"][t] for s in seeds.values())
        worst = 100 * min(s["after"][t] - s["before"][t] for s in seeds.values())
        print(f"{t:<12}{b:>13.1f}{a:>12.1f}{gains[t]:>11.1f}{worst:>12.1f}")
    rl = result["peak_during_rl"]
    print(f"wall: {wall:.0f}s; containers: peak {result['peak_live_containers']} live at once (during RL "
          f"{rl['live']} live, {rl['leased']} held by sessions), {result['leaked_containers']} left after the "
          "workers stopped")
    record = {"bench": "terminal_demo", "complete": True, "config": args.config, "smoke": args.smoke,
              "seeds": sorted(seeds),
              "overrides": overrides, "args": {k: v for k, v in vars(args).items() if k != "overrides"},
              "mean_gain_points": gains, "min_family_gain_points": min(gains.values()) if gains else None,
              "every_family_gains": bool(gains) and all(g > 0 for g in gains.values()), "wall_s": wall,
              **result, "commit": git_commit(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "date": time.strftime("%Y-%m-%d")}
    print(f"results: {write_record(args.out, record)}")
    print(f"terminal_peak_live_containers: {result['peak_live_containers']}")
    print(f"terminal_leaked_containers: {result['leaked_containers']}")
    return 0 if result["leaked_containers"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
