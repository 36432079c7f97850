#!/usr/bin/env python
"""On-policy distillation against RL, from the same warm-up: how many steps each needs to reach the teacher.

The teacher is the policy the CPU demo's RL trained (``examples/configs/tiny_cpu.yaml``, ``train.seed=1``: its
``hf_export``; ``--teacher DIR`` with ``--teacher-summary FILE`` reuses one, else it is trained first under the
work directory). Its held-out success per task (the demo's ``after_rl`` evaluation: the same held-out samples as
every run here) sets the target: 90 % of it.

Per student seed (``--seeds``, other warm-ups than the teacher's): the warm-up runs once (saved as
``step_000000``), then from it, each with an evaluation on the held-out samples every ``--eval-interval`` steps:

* RL: the demo's config for ``--rl-steps`` steps;
* distillation: ``examples/configs/tiny_cpu_distill.yaml`` (the teacher's per-token log-probs as the advantage,
  no task reward) for ``--distill-steps`` steps.

For each task and arm: the first evaluated step at which its success reaches the target (None: not within the
arm's steps). The claim checked: distillation reaches the target on every task within a third of the steps RL
needs (RL not reaching it in ``--rl-steps`` counts as needing more). Prints a table per seed, writes
``bench/results/distill.json`` (``--out``), and ends with ``distill_tasks_within_a_third: <tasks, over all seeds,
where the claim holds> / <tasks x seeds>``.

``--per-task-teachers`` also trains two teachers on their own tasks (the demo's RL on calc alone, and on guess and
lookup) and distils both into the first seed's warm-up (``distill.teachers`` with ``tasks``), recording each task's
success before and after (``per_task_teachers`` in the record).

A warm-up or an arm whose output is already under the work directory is reused (delete its folder to run it
again): a changed distillation setting reruns the distillation arms alone.

``--jobs N`` runs N student seeds at a time (each with cores / N threads). ``--smoke``: the tiny demo everywhere
(a teacher of 1 RL step, 1 step per arm, 2 evaluation samples per task), in seconds; its figures mean nothing.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from bench.demo_learning import SMOKE_OVERRIDES, run_seed, task_success  # noqa: E402

RL_CONFIG = "examples/configs/tiny_cpu.yaml"
DISTILL_CONFIG = "examples/configs/tiny_cpu_distill.yaml"
SMOKE = {"seeds": "2", "rl_steps": 1, "distill_steps": 1, "eval_interval": 1, "timeout": 600.0,
         "per_task_teachers": True}


def eval_curve(out_dir: Path) -> dict[int, dict[str, float]]:
    """``{step: {task: success}}`` of a run's evaluations (its ``metrics.jsonl`` rows of phase ``eval``)."""
    curve: dict[int, dict[str, float]] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("phase") == "eval":
            curve[int(row["step"])] = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("success/")}
    return curve


def steps_to(curve: dict[int, dict[str, float]], task: str, target: float) -> int | None:
    """The first evaluated step whose success on ``task`` reaches ``target``; None when none does."""
    return next((s for s in sorted(curve) if curve[s].get(task, 0.0) >= target), None)


def warm_up(seed: int, args: Any, work: Path, overrides: list[str], threads: int) -> Path:
    """The student's warm-up of ``seed`` (run once: reused when its checkpoint is there), its ``step_000000``."""
    warm = work / f"seed{seed}_warmup"
    ckpt = warm / "checkpoints" / "step_000000"
    if not (ckpt / "meta.json").is_file():
        run_seed(RL_CONFIG, seed, warm, [*overrides, "train.steps=1", "checkpoint.after_warmup=true"], args.timeout,
                 threads)
    return ckpt


def student(seed: int, args: Any, teacher: str, work: Path, overrides: list[str], threads: int) -> dict[str, Any]:
    """One student seed: its warm-up, then RL and distillation from it; their evaluation curves."""
    ckpt = warm_up(seed, args, work, overrides, threads)
    start = [f"checkpoint.resume={ckpt}", f"eval.interval={args.eval_interval}"]
    runs = {}
    for arm, config, steps, extra in (
            ("distill", DISTILL_CONFIG, args.distill_steps, [f"distill.teachers=[{{checkpoint: {teacher}}}]"]),
            ("rl", RL_CONFIG, args.rl_steps, [])):
        out = work / f"seed{seed}_{arm}"
        if (out / "summary.json").is_file():  # an arm that ran already (delete its folder to run it again)
            summary, wall = json.loads((out / "summary.json").read_text()), 0.0
        else:
            summary, wall = run_seed(config, seed, out, [*overrides, *start, f"train.steps={steps}",
                                                         f"checkpoint.interval={steps}", *extra], args.timeout,
                                     threads)
        curve = eval_curve(out)
        curve[0] = task_success(summary, "before_rl")
        runs[arm] = {"curve": {str(k): v for k, v in sorted(curve.items())}, "wall_s": wall,
                     "after": task_success(summary, "after_rl")}
        print(f"seed {seed} {arm}: {wall:.0f}s, after {steps} steps: " + ", ".join(
            f"{t} {100 * v:.0f}%" for t, v in sorted(runs[arm]["after"].items())), flush=True)
    return runs


def per_task_teachers(args: Any, work: Path, overrides: list[str]) -> dict[str, Any]:
    """Two teachers, each the demo's RL on its own tasks (calc; guess and lookup), distilled into one student (the
    first seed's warm-up) for ``--distill-steps`` steps: each task's success before and after."""
    cores = os.cpu_count() or 1
    teachers = {}
    for name, tasks in (("calc", ["calc"]), ("rest", ["guess", "lookup"])):
        spec = ", ".join(f"{{name: {t}, weight: 1.0}}" for t in tasks)
        summary, wall = run_seed(RL_CONFIG, 1, work / f"teacher_{name}", [*overrides, f"tasks=[{spec}]"],
                                 args.timeout, cores)
        teachers[name] = {"tasks": tasks, "hf_export": summary["hf_export"],
                          "success": task_success(summary, "after_rl"), "wall_s": wall}
        print(f"teacher of {', '.join(tasks)} done in {wall:.0f}s: " + ", ".join(
            f"{t} {100 * v:.0f}%" for t, v in sorted(teachers[name]["success"].items())), flush=True)
    seed = int(str(args.seeds).split(",")[0])
    ckpt = warm_up(seed, args, work, overrides, cores)
    both = (f"distill.teachers=[{{checkpoint: {teachers['calc']['hf_export']}, tasks: [calc]}}, "
            f"{{checkpoint: {teachers['rest']['hf_export']}}}]")
    summary, wall = run_seed(DISTILL_CONFIG, seed, work / f"seed{seed}_two_teachers",
                             [*overrides, f"checkpoint.resume={ckpt}", f"train.steps={args.distill_steps}",
                              f"checkpoint.interval={args.distill_steps}", both], args.timeout, cores)
    before, after = task_success(summary, "before_rl"), task_success(summary, "after_rl")
    print(f"two teachers into seed {seed}, {args.distill_steps} steps ({wall:.0f}s): " + ", ".join(
        f"{t} {100 * before[t]:.0f} -> {100 * after[t]:.0f}%" for t in sorted(before)), flush=True)
    return {"teachers": teachers, "seed": seed, "before": before, "after": after, "wall_s": wall,
            "every_task_gains": all(after[t] > before[t] for t in before)}


def main(argv: list[str] | None = None) -> None:
    """Parse the options; train or reuse the teacher; run the student seeds; print and write the comparison."""
    p = bench_parser("distill", __doc__)
    p.add_argument("--seeds", default="2,3", help="the students' train.seed values (not the teacher's 1)")
    p.add_argument("--teacher", default=None, help="the teacher's HF checkpoint (default: train the demo first)")
    p.add_argument("--teacher-summary", default=None, help="its run's summary.json (held-out success after RL)")
    p.add_argument("--rl-steps", type=int, default=60, help="RL steps from the warm-up (the demo's)")
    p.add_argument("--distill-steps", type=int, default=20, help="distillation steps from the warm-up")
    p.add_argument("--eval-interval", type=int, default=5, help="evaluate every this many steps in both arms")
    p.add_argument("--target", type=float, default=0.9, help="the share of the teacher's success to reach")
    p.add_argument("--workdir", default=None, help="runs go under here (default bench/results/distill; --smoke: a "
                                                   "temporary directory)")
    p.add_argument("--timeout", type=float, default=3600.0, help="limit on one run, seconds")
    p.add_argument("--jobs", type=int, default=1, help="student seeds run at a time")
    p.add_argument("--per-task-teachers", action="store_true",
                   help="also train a teacher of calc and one of guess and lookup, and distil both into the first "
                        "seed's warm-up")
    args = parse_bench_args(p, argv, SMOKE)
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    if not seeds or args.jobs < 1 or min(args.rl_steps, args.distill_steps, args.eval_interval) < 1:
        raise SystemExit("give --seeds, and --jobs, --rl-steps, --distill-steps, --eval-interval of at least 1")
    overrides = list(SMOKE_OVERRIDES) if args.smoke else []
    if args.smoke and args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="agentrl_distill_smoke_") as tmp:
            compare(args, seeds, overrides, Path(tmp))
    else:
        compare(args, seeds, overrides, (ROOT / (args.workdir or "bench/results/distill")).resolve())


def compare(args: Any, seeds: list[int], overrides: list[str], work: Path) -> None:
    """The teacher, the students, the table, the record."""
    cores = os.cpu_count() or 1
    if args.teacher is None:
        tdir = work / "teacher"
        print("teacher: the demo's RL (train.seed=1) ...", flush=True)
        summary, wall = run_seed(RL_CONFIG, 1, tdir, overrides, args.timeout, cores)
        teacher, teacher_success = summary["hf_export"], task_success(summary, "after_rl")
        print(f"teacher done in {wall:.0f}s", flush=True)
    else:
        if args.teacher_summary is None:
            raise SystemExit("--teacher needs --teacher-summary (its run's summary.json: the success to reach)")
        teacher = str(Path(args.teacher).resolve())
        teacher_success = task_success(json.loads(Path(args.teacher_summary).read_text()), "after_rl")
    targets = {t: args.target * v for t, v in teacher_success.items()}
    print("teacher held-out success: " + ", ".join(f"{t} {100 * v:.0f}%" for t, v in sorted(teacher_success.items()))
          + f"; target {100 * args.target:.0f}% of it", flush=True)
    jobs = min(args.jobs, len(seeds))
    threads = max(1, cores // jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(seeds, pool.map(lambda s: student(s, args, teacher, work, overrides, threads), seeds)))
    per_seed, held, total = {}, 0, 0
    print(f"\n{'seed':<6}{'task':<9}{'teacher %':>10}{'warm-up %':>10}{'RL steps':>10}{'distill steps':>14}"
          "  within 1/3")
    for seed, runs in results.items():
        rows = {}
        for task, target in sorted(targets.items()):
            curves = {arm: {int(k): v for k, v in runs[arm]["curve"].items()} for arm in runs}
            rl, ds = steps_to(curves["rl"], task, target), steps_to(curves["distill"], task, target)
            # RL that never reached it within --rl-steps needed more than that
            ok = ds is not None and 3 * ds <= (rl if rl is not None else args.rl_steps + args.eval_interval)
            held += ok
            total += 1
            rows[task] = {"target": target, "rl_steps": rl, "distill_steps": ds, "within_a_third": ok}
            print(f"{seed:<6}{task:<9}{100 * teacher_success[task]:>10.0f}{100 * curves['rl'][0].get(task, 0):>10.0f}"
                  f"{str(rl if rl is not None else f'>{args.rl_steps}'):>10}"
                  f"{str(ds if ds is not None else f'>{args.distill_steps}'):>14}  {'yes' if ok else 'no'}")
        per_seed[str(seed)] = {"tasks": rows, **runs}
    record = {"bench": "distill", "smoke": args.smoke, "commit": git_commit(),
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "teacher": teacher,
              "teacher_success": teacher_success, "targets": targets, "per_seed": per_seed}
    if args.per_task_teachers:
        record["per_task_teachers"] = per_task_teachers(args, work, overrides)
    write_record(args.out, record)
    print(f"distill_tasks_within_a_third: {held}/{total}")


if __name__ == "__main__":
    main()
