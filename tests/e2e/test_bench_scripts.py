"""Every bench script runs end to end in its smoke mode (``--smoke``: tiny sizes, CPU, seconds), writes
its JSON where ``--out`` says and ends with the ``name: value`` line that docs/BENCHMARKS.md quotes.

The scripts are found by glob, so a new script without a smoke mode fails here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
LAST_LINE = re.compile(r"^[A-Za-z0-9_./-]+: \S+")
TIMEOUT_S = 300


def _check_gpu_advantages(lines: list[str], rec: dict[str, Any]) -> None:
    m = re.fullmatch(r"fused_norm_copy_bw_fraction_100k: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) > 0, lines[-3:]
    row = rec["results"]["100k"]
    assert row["tokens"] == 100_000 and row["rows"] == 200
    for name in ("copy", "fused", "previous", "unfused"):
        assert row[f"{name}_ms"] > 0
    # the correctness check ran against the loop on the smallest size
    assert rec["results"]["20k"]["max_abs_err_fused"] < 1e-4


def _check_gpu_train(lines: list[str], rec: dict[str, Any]) -> None:
    m = re.fullmatch(r"gpu_mfu_tiny: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) > 0, lines[-3:]
    row = rec["results"]["tiny"]
    for side in ("megatron", "transformers"):
        r = row[side]
        assert r["params"] == row["params"], (side, r["params"], row["params"])  # the FLOP count's N is the model's
        assert r["step_s"] > 0 and r["optimizer_s"] > 0 and r["forward_s"] > 0 and r["tokens_per_s"] > 0
        assert abs(r["mfu"] - row["flops_per_token"] * r["tokens_per_s"] / 0.05e12) < 1e-9
    assert row["megatron_over_transformers"] > 0


def _check_routing_replay(lines: list[str], rec: dict[str, Any]) -> None:
    bf16, fp32 = rec["results"]["bf16"], rec["results"]["fp32"]
    # the fp32 engine computes what the trainer does: no flip, and replay changes nothing
    assert fp32["own"]["routing/flip_rate"] == 0.0
    assert abs(fp32["own"]["mismatch/abs_lag0"] - fp32["replay"]["mismatch/abs_lag0"]) < 1e-6
    assert fp32["own"]["mismatch/abs_lag0"] < 1e-4 < bf16["own"]["mismatch/abs_lag0"]
    ratio = bf16["replay"]["mismatch/abs_lag0"] / bf16["own"]["mismatch/abs_lag0"]
    assert rec["routing_replay_abs_mismatch_ratio"] == pytest.approx(ratio)
    assert lines[-1] == f"routing_replay_abs_mismatch_ratio: {ratio:.4f}"


def _check_async_vs_sync(lines: list[str], rec: dict[str, Any]) -> None:
    sync, async_ = rec["results"]["sync"], rec["results"]["async"]
    assert sync["trained_samples"] == async_["trained_samples"] > 0  # the same work in both modes
    assert sync["staleness_max"] == 0
    assert rec["async_speedup"] == pytest.approx(async_["samples_per_s"] / sync["samples_per_s"])


def _check_chaos(lines: list[str], rec: dict[str, Any]) -> None:
    chaos, faults = rec["chaos"], rec["chaos"]["faults"]
    assert [f["name"] for f in faults] == [s["fault"] for s in rec["schedule"]] != []
    lora = rec["lora"]["faults"]  # the LoRA run's engine restart: the new server serves the current adapter
    assert [f["name"] for f in lora] == ["engine_restart"] and lora[0]["survived"], lora
    assert lora[0]["detail"]["adapter_version"] > lora[0]["fired_step"] and rec["lora"]["infra_failed_trained"] == 0
    # the in-flight run: engine 0 killed while paused for an update with requests held; they are generated again
    # elsewhere, no server stays paused, and the new server takes the weights
    paused = rec["in_flight"]["faults"]
    assert [f["name"] for f in paused] == ["engine_paused_kill"] and paused[0]["survived"], paused
    detail = paused[0]["detail"]
    assert detail["pause_mode"] == "retract" and detail["held_requests"] >= 1 and detail["rerouted_prompts"] >= 1
    assert detail["left_paused"] == [] and detail["engine_version"] > paused[0]["fired_step"], detail
    assert rec["in_flight"]["infra_failed_trained"] == 0
    total = faults + lora + paused
    assert rec["faults_survived"] == sum(f["survived"] for f in total) and rec["faults_total"] == len(total)
    assert lines[-1] == f"chaos_faults_survived: {rec['faults_survived']}/{len(total)}"
    assert chaos["infra_failed_trained"] == 0 and chaos["batch_rows_seen"] >= chaos["steps_completed"] > 0
    for f in faults:  # each fault fired and says how it ended: recovered, or the error that ended the run
        assert f["fired_s"] is not None and (f["recovery_s"] is not None) == f["survived"], f
        assert f["survived"] or f["error"], f
    # what today's code survives (the engine faults wait for health checks, re-routing and re-joining the sync)
    by_name = {f["name"]: f for f in faults}
    assert by_name["worker_kill"]["survived"], by_name["worker_kill"]
    trainer = by_name["trainer_kill"]
    assert trainer["survived"] and 0 <= trainer["detail"]["steps_redone"] <= rec["args"]["ckpt_interval"], trainer
    if rec["baseline"] is not None:
        assert rec["steps_per_s_ratio"] == pytest.approx(chaos["steps_per_s"] / rec["baseline"]["steps_per_s"])


def _check_convert(lines: list[str], rec: dict[str, Any]) -> None:
    assert rec["roundtrip_identical"] and rec["tensors"] == sum(r["tensors"] for r in rec["runs"]) > 0
    assert sorted(r["moe"] for r in rec["runs"]) == [False, True]  # a dense and a MoE model
    for run in rec["runs"]:
        assert run["roundtrip_identical"] and run["tensors"] > 0 and (run["experts"] > 0) == run["moe"]
        assert [d["direction"] for d in run["directions"]] == ["hf2mg", "mg2hf"]
        assert run["convert_peak_rss_gb"] == max(d["peak_above_bare_gb"] for d in run["directions"])
    m = re.fullmatch(r"convert_peak_rss_gb: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(rec["convert_peak_rss_gb"], abs=1e-3)


def _check_demo_learning(lines: list[str], rec: dict[str, Any]) -> None:
    # the smoke warms up once and runs RL from that warm-up's checkpoint
    assert rec["warmup"]["checkpoint"].endswith("step_000000") and rec["warmup"]["seed"] == 1
    run = rec["per_run"]["run1"]
    assert set(run["before"]) == set(run["after"]) == set(rec["mean_gain_points"]) != set()
    for phase in ("before", "after"):  # each success rate comes with its interval, around it
        for task, (low, high) in run["interval_95"][phase].items():
            assert 0.0 <= low <= run[phase][task] <= high <= 1.0
    assert run["collapse_steps"] == 0  # one RL step cannot raise the alarm (it needs a history)
    assert set(rec["worst_seed_gain_points"]) == set(rec["mean_gain_points"])


def _check_ablation(lines: list[str], rec: dict[str, Any]) -> None:
    assert set(rec["table"]) == set(rec["variants"]) == {"shipped", "latest", "no_task_norm", "dynamic"}
    assert len(rec["gain_points_per_run"]) == len(rec["variants"]) * len(rec["seeds"])
    assert rec["table"]["shipped"]["vs_shipped_points"] is None
    for v, row in rec["table"].items():  # each variant against the shipped one, seed by seed
        if v != "shipped":
            s = rec["seeds"][0]
            for task, d in row["vs_shipped_points"].items():
                ours, ship = (rec["gain_points_per_run"][f"{x}/seed{s}"][task] for x in (v, "shipped"))
                assert d["mean"] == pytest.approx(ours - ship)
    assert lines[-1] == f"ablation_runs: {len(rec['gain_points_per_run'])}"


def _check_env_controller(lines: list[str], rec: dict[str, Any]) -> None:
    s = rec["sessions"]
    assert s["started"] == s["planned"] > 0 and s["lost"] == 0 and s["left_open_on_controller"] == 0
    # every failure is a session of the killed worker, and each got a reason
    assert s["failed"] == s["failed_on_killed_worker"] == sum(s["failed_reasons"].values())
    assert s["completed"] + s["failed"] == s["started"]


def _check_controller_front(lines: list[str], rec: dict[str, Any]) -> None:
    assert {r["front"] for r in rec["runs"]} == {"fast", "aiohttp", "relay"}
    assert all(r["interacts_per_s"] > 0 for r in rec["runs"])
    # the relay (the floor) may stay below one clock tick of CPU in a smoke run; the controller's fronts cannot
    assert all(r["interact_us_per_request"] > 0 for r in rec["runs"] if r["front"] != "relay")
    assert "fast_over_relay" in rec
    assert lines[-1] == f"controller_front_cpu_ratio: {rec['cpu_ratio']}"


def _check_gloo_transport(lines: list[str], rec: dict[str, Any]) -> None:
    assert set(rec["seconds"]) == {"flat", "broadcast", "send_recv"}
    assert all(len(t) == rec["repeats"] and min(t) > 0 for t in rec["seconds"].values())
    # the smoke runs the model's layout: its tensors at least the packing threshold, then one packed tensor
    assert rec["model"] and len(rec["tensor_bytes"]) == rec["tensors"] > 2
    assert set(rec["median_round_ratio_to_flat"]) == {"broadcast", "send_recv"}


def _check_weight_sync(lines: list[str], rec: dict[str, Any]) -> None:
    assert rec["weights_verified"]  # the engine's weights equal what was sent, after a zeroing
    assert set(rec["seconds"]) == {"raw", "bucketed", "bucketed_broadcast"}
    # the headline is SGLang's transport (what a real server receives); the stand-in's is beside it
    assert rec["weight_sync_bandwidth_ratio"] == pytest.approx(rec["ratio_to_raw_best"]["bucketed_broadcast"])
    assert rec["standin_transport_ratio"] == pytest.approx(rec["ratio_to_raw_best"]["bucketed"])
    for path in ("bucketed", "bucketed_broadcast"):  # every bucket's timeline, in order, all of it measured
        rows = rec["timelines_best_s"][path]
        assert rows and all(r["taken"] <= r["packed"] <= r["posted"] <= r["wire_done"] <= r["acked"] for r in rows)


def _check_lora(lines: list[str], rec: dict[str, Any]) -> None:
    trainer, sampling, ratios = rec["trainer"], rec["sampling"], rec["ratios"]
    # an update moves the adapters alone, the gradients and Adam's moments are the adapters' alone
    assert 0 < trainer["lora"]["update_bytes"] < trainer["full"]["update_bytes"]
    assert trainer["lora"]["trainable_params"] < trainer["full"]["trainable_params"]
    assert 0 < ratios["optimizer_grad_bytes"] < 1
    # three versions as adapters on one engine hold less than three engines of full weights, and every version samples
    assert ratios["engine_weight_bytes"] < 1
    assert sampling["adapters"]["versions_sampled"] == sampling["full"]["versions_sampled"] == [1, 2, 3]
    m = re.fullmatch(r"lora_update_bytes_ratio: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(ratios["update_bytes"], abs=1e-5)


def _check_in_flight(lines: list[str], rec: dict[str, Any]) -> None:
    res = rec["results"]
    assert list(res) == ["drain", "retract", "in_place"]
    for r in res.values():
        assert r["trained_samples"] == rec["args"]["steps"] * rec["args"]["batch"] and r["update_s"] > 0
        assert 0 <= r["update_idle_frac"] <= 1 and r["staleness_max"] >= 0
    assert res["drain"]["crossed_samples_frac"] == 0  # a drained update crosses no request
    m = re.fullmatch(r"in_flight_speedup: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(res["retract"]["speedup_vs_drain"], abs=1e-3)


def _check_distill(lines: list[str], rec: dict[str, Any]) -> None:
    # the smoke trains a teacher, then one student seed's warm-up, RL and distillation arms from it
    seed = rec["per_seed"]["2"]
    tasks = set(rec["teacher_success"])
    assert tasks and set(seed["tasks"]) == tasks and Path(rec["teacher"]).name == "hf_export"
    for arm in ("rl", "distill"):  # evaluated before (step 0) and after each step
        assert [int(k) for k in seed[arm]["curve"]] == [0, 1] and set(seed[arm]["curve"]["1"]) == tasks
    two = rec["per_task_teachers"]  # a teacher of calc and one of guess and lookup, distilled into seed 2
    assert [t["tasks"] for t in two["teachers"].values()] == [["calc"], ["guess", "lookup"]]
    assert set(two["before"]) == set(two["after"]) == tasks
    m = re.fullmatch(r"distill_tasks_within_a_third: (\d+)/(\d+)", lines[-1])
    assert m and int(m.group(2)) == len(tasks) and int(m.group(1)) == sum(
        t["within_a_third"] for t in seed["tasks"].values())


def _check_train_scale(lines: list[str], rec: dict[str, Any]) -> None:
    m = re.fullmatch(r"dist_opt_state_ratio_dp2: (\d+\.\d+)", lines[-2])
    assert m and float(m.group(1)) == pytest.approx(rec["dist_opt_state_ratio_dp2"], abs=1e-3)
    m = re.fullmatch(r"packing_speedup: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(rec["packing_speedup"], abs=1e-3)
    layouts = rec["packing"]["layouts"]
    # packed micro-batches compute no padding; padded ones do on trajectories of uneven lengths
    assert layouts["packed"]["pad_fraction"] == 0 and layouts["packed_budget"]["pad_fraction"] == 0
    assert layouts["padded"]["pad_fraction"] > 0.05
    assert all(r["tokens_per_s"] > 0 for r in layouts.values())
    assert len(rec["dp2"]) == 2 and rec["dp1"]["state_bytes"] > 0
    # the two layouts train the same model on the same batch: same loss, every rank stepped
    assert all(abs(r["loss"] - rec["dp1"]["loss"]) < 1e-4 for r in rec["dp2"])
    assert all(r["adam_steps"] == rec["spec"]["steps"] for r in (rec["dp1"], *rec["dp2"]))
    assert 0.4 < rec["dist_opt_state_ratio_dp2"] <= 0.6  # each DP rank holds about half


def _check_containers(lines: list[str], rec: dict[str, Any]) -> None:
    if "skipped" in rec:  # --smoke where dockerd cannot run
        return
    c, s, k = rec["containers"], rec["sessions"], rec["killed_worker"]
    assert s["lost"] == 0 and c["leaked"] == 0 and c["after_sessions"] == c["pools_live_after_sessions"]
    assert c["peak_live"] >= rec["config"]["sessions"] and k["dead_owner_containers_after_restart"] == 0
    assert lines[-2:] == [f"containers_peak: {c['peak_live']}", f"containers_leaked: {c['leaked']}"]


def _check_terminal_demo(lines: list[str], rec: dict[str, Any]) -> None:
    if "skipped" in rec:  # --smoke where dockerd cannot run
        return
    assert rec["complete"] and rec["leaked_containers"] == 0 and rec["peak_live_containers"] >= 1
    rl = rec["peak_during_rl"]  # the counter saw the RL phase, and the workers' count of held containers
    assert rec["peak_live_containers"] >= rl["live"] >= 0 and rl["leased"] >= 0, rl
    assert lines[-2:] == [f"terminal_peak_live_containers: {rec['peak_live_containers']}",
                          f"terminal_leaked_containers: {rec['leaked_containers']}"]
    (seed,) = rec["per_seed"].values()
    assert set(seed["before"]) == set(seed["after"]) == {"term_files", "term_copy", "term_count"}
    assert set(rec["pools"]) == {"term_files", "term_copy", "term_count"}
    for pool in rec["pools"].values():  # each family's worker served from its own image's pool
        assert pool["served_warm"] + pool["served_cold"] >= 1 and len(pool["images"]) == 1, pool


def _check_gateway(lines: list[str], rec: dict[str, Any]) -> None:
    m = re.fullmatch(r"gateway_overhead_p99_ms: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(rec["gateway_overhead_p99_ms"], abs=1e-3)
    res, a = rec["results"], rec["args"]
    assert set(res) == {"stub_with_tool_time", "stub_responses", "stub_messages", "stub_saturated", "local_engine"}
    for name, n in (("stub_with_tool_time", a["sessions"] * a["turns"]), ("stub_saturated", a["sessions"] * a["turns"]),
                    ("stub_responses", a["sessions"] * a["turns"]), ("stub_messages", a["sessions"] * a["turns"]),
                    ("local_engine", a["local_sessions"] * a["local_turns"])):
        assert res[name]["completions_per_s"] > 0 and res[name]["added"]["n"] == res[name]["client"]["n"] == n
    assert rec["gateway_overhead_p99_ms"] == res["stub_with_tool_time"]["added"]["p99_ms"]
    assert rec["added_p99_ms_by_api"] == {"chat": rec["gateway_overhead_p99_ms"],
                                          "responses": res["stub_responses"]["added"]["p99_ms"],
                                          "messages": res["stub_messages"]["added"]["p99_ms"]}


def _check_gpu_suite(lines: list[str], rec: dict[str, Any]) -> None:
    parts = rec["parts"]
    assert list(parts) == ["env", "tests", "advantages", "logprobs", "train"] and rec["smoke"]
    assert all(p["exit"] == 0 for p in parts.values()), parts
    assert parts["env"]["env"]["megatron-core"] and parts["env"]["env"]["transformers"]
    assert re.search(r"\b3 (skipped|passed)\b", parts["tests"]["last_line"])  # skipped without CUDA
    assert parts["train"]["last_line"].startswith("gpu_mfu_tiny: ")
    assert parts["advantages"]["last_line"].startswith("fused_norm_copy_bw_fraction_")
    assert parts["logprobs"]["last_line"].startswith("logprob_peak_memory_ratio: ")
    assert lines[-1] == "gpu_suite_parts_passed: 5/5"


def _check_logprob_memory(lines: list[str], rec: dict[str, Any]) -> None:
    m = re.fullmatch(r"logprob_peak_memory_ratio: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) == pytest.approx(rec["logprob_peak_memory_ratio"], abs=1e-3)
    assert set(rec["results"]) == {"plain", "chunked"} and rec["max_abs_diff"] < 1e-4
    assert rec["results"]["plain"]["peak_added_mb"] > 0 and rec["results"]["chunked"]["peak_added_mb"] >= 0
    assert all(r["step_ms"] > 0 for r in rec["results"].values())


def _check_rollout_http(lines: list[str], rec: dict[str, Any]) -> None:
    res = rec["results"]
    # the shipped pools have every request at the server at once; httpx's default can hold at most 100
    assert res["sglang_pooled"]["peak"] == res["agents_aiohttp"]["peak"] == rec["requests"], res
    assert all(r["peak"] <= 100 for r in res["sglang_httpx_default"]["rounds"])
    ratio = res["sglang_httpx"]["cpu_ms_per_request"] / res["sglang_pooled"]["cpu_ms_per_request"]
    assert lines[-1] == f"rollout_http_cpu_ratio_httpx_over_pooled: {ratio:.2f}"


def _check_local_waits(lines: list[str], rec: dict[str, Any]) -> None:
    med, waiters = rec["median"], rec["args"]["waiters"]
    assert set(rec["runs"]) == {"alone", "woken", "polled"} and all(m["wall_s"] > 0 for m in med.values())
    assert waiters > 0 and rec["slowdown_polled_over_woken"] == med["polled"]["wall_s"] / med["woken"]["wall_s"]
    assert lines[-1] == f"local_waits_slowdown_polled_over_woken: {rec['slowdown_polled_over_woken']:.2f}"


def _check_warmup_layouts(lines: list[str], rec: dict[str, Any]) -> None:
    runs = rec["results"]["strict"]
    assert set(runs) == {"default", "padded"} and all(len(r["losses"]) == 3 for r in runs.values())
    # in MKL's strict reproducible mode (agentrl train's default), where tensors lie in memory does not move the losses
    assert runs["padded"]["losses"] == runs["default"]["losses"]
    assert lines[-1] == "warmup_layout_divergent_runs: 0"


CHECKS: dict[str, Callable[[list[str], dict[str, Any]], None]] = {
    "ablation.py": _check_ablation,
    "gpu_advantages.py": _check_gpu_advantages,
    "gpu_train.py": _check_gpu_train,
    "gpu_suite.py": _check_gpu_suite,
    "logprob_memory.py": _check_logprob_memory,
    "lora.py": _check_lora,
    "in_flight.py": _check_in_flight,
    "distill.py": _check_distill,
    "async_vs_sync.py": _check_async_vs_sync,
    "chaos.py": _check_chaos,
    "containers.py": _check_containers,
    "controller_front.py": _check_controller_front,
    "convert.py": _check_convert,
    "demo_learning.py": _check_demo_learning,
    "env_controller.py": _check_env_controller,
    "gateway.py": _check_gateway,
    "gloo_transport.py": _check_gloo_transport,
    "local_waits.py": _check_local_waits,
    "routing_replay.py": _check_routing_replay,
    "rollout_http.py": _check_rollout_http,
    "terminal_demo.py": _check_terminal_demo,
    "train_scale.py": _check_train_scale,
    "warmup_layouts.py": _check_warmup_layouts,
    "weight_sync.py": _check_weight_sync,
}


def test_every_script_has_its_record_checked():
    """A new bench script gets a check of its JSON record here, not only of its exit code."""
    assert set(CHECKS) == set(SCRIPTS), (sorted(set(SCRIPTS) - set(CHECKS)), sorted(set(CHECKS) - set(SCRIPTS)))


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_smoke(script, tmp_path):
    out = tmp_path / f"{Path(script).stem}.json"
    # a crash in native code (an abort at exit) prints every thread's Python stack
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, f"bench/{script}", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and LAST_LINE.match(lines[-1]), lines[-3:]
    assert out.is_file(), f"{script} --smoke wrote no JSON at --out {out}"
    rec = json.loads(out.read_text())
    check = CHECKS.get(script)
    if check is not None:
        check(lines, rec)
