"""Config errors of the pipeline, loss and checkpoint fields name the key, the value and the fix."""
from __future__ import annotations

import pytest

from megatron_agentrl.config import ConfigError, load_config

BASE = "tests/configs/tiny_test.yaml"


@pytest.mark.parametrize("override, match", [
    ("pipeline.mode=fast", r"pipeline.mode='fast' is not one of sync, async"),
    ("pipeline.staleness=-1", r"pipeline.staleness=-1 must be >= 0"),
    ("pipeline.queue_size=3", r"pipeline.queue_size=3 must hold at least one batch \(12 groups\); raise it"),
    ("pipeline.cohort_groups=13", r"pipeline.cohort_groups=13 exceeds rollout.prompts_per_step=12"),
    ("pipeline.batch_timeout_s=0", r"pipeline.batch_timeout_s=0.0 must be > 0 seconds"),
    ("pipeline.sim_env_latency_alpha=0", r"sim_env_latency_alpha=0.0 must be > 0"),
    ("loss.tis_cap=0.5", r"loss.tis_cap=0.5 must be 0 \(off\) or >= 1"),
    ("loss.kl_coef=-1", r"loss.kl_coef=-1.0 must be >= 0"),
    ("train.micro_batch_tokens=100", r"train.micro_batch_tokens=100 is smaller than one episode"),
    ("checkpoint.interval=-2", r"checkpoint.interval=-2 must be >= 0"),
    ("sft.short_format_steps=-1", r"sft.short_format_steps=-1 must be >= 0"),
    ("sft.careless_fraction=1", r"sft.careless_fraction=1.0 must be in \[0, 1\)"),
    ("checkpoint.resume=/nonexistent/step_000002", r"checkpoint.resume='/nonexistent/step_000002' is not a directory"),
])
def test_pipeline_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(BASE, [override])


@pytest.mark.parametrize("argv, names", [
    (["--nproc", "3", "parallel.tp=2"], ["--nproc 3", "parallel.tp * parallel.pp", "multiple of 2"]),
    (["train.sequence_packing=true", "train.micro_batch_tokens=100"],
     ["train.micro_batch_tokens=100", "rollout.max_total_tokens=640", "longest trajectory"]),
    (["train.recompute=full", "train.recompute_num_layers=3", "parallel.pp=2"],
     ["train.recompute_num_layers=3", "num_hidden_layers=4", "parallel.pp=2", "at most 2"]),
    (["train.recompute=selective", "train.recompute_num_layers=1"],
     ["train.recompute_num_layers=1", "train.recompute=full"]),
    (["train.recompute=partial"], ["train.recompute='partial' is not one of none, selective, full"]),
    (["parallel.pp=3"], ["parallel.pp=3 does not divide", "num_hidden_layers=4"]),
])
def test_scale_path_layouts_stop_at_load_with_one_line(argv, names, capsys):
    """A layout that cannot run (processes vs TP x PP, a packed micro-batch below the longest trajectory,
    recomputing more layers than a stage has) stops before any process starts, naming the keys."""
    from megatron_agentrl.cli import main

    assert main(["train", "--config", BASE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentrl: error: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, (name, err)


def test_cross_policy_needs_staleness():
    with pytest.raises(ConfigError, match=r"rollout.max_versions=3 keeps weights up to 2 versions old.*staleness >= 2"):
        load_config(BASE, ["rollout.max_versions=3", "rollout.cross_policy=uniform", "pipeline.mode=async",
                           "pipeline.staleness=1"])
    cfg = load_config(BASE, ["rollout.max_versions=3", "rollout.cross_policy=uniform", "pipeline.mode=async",
                             "pipeline.staleness=2"])
    assert cfg.pipeline.staleness == 2


def test_task_reward_options_and_unknown_key():
    cfg = load_config(BASE, ["tasks=[{name: lookup, binary_reward: true, timeout_penalty: 0.5}]"])
    assert cfg.tasks[0].binary_reward and cfg.tasks[0].timeout_penalty == 0.5
    with pytest.raises(ConfigError, match="timeout_penalty=-0.5 must be >= 0"):
        load_config(BASE, ["tasks=[{name: lookup, timeout_penalty: -0.5}]"])
    with pytest.raises(ConfigError, match="unknown config key 'pipeline.stalenes'; did you mean 'pipeline.staleness'"):
        load_config(BASE, ["pipeline.stalenes=2"])


def _traj(reward, status="completed", success=None, error="", task="t", length=0):
    from rollout_sglang.trajectory import Trajectory

    t = Trajectory(list(range(length)), [0] * length, [0.0] * length, [-1] * length, [], task, 0, 0, reward=reward,
                   status=status, error=error)
    if success is not None:
        t.metrics["success"] = success
    return t


def test_reward_shaping():
    from megatron_agentrl.config import TaskSpec
    from megatron_agentrl.pipeline.rewards import RewardShaper

    binary = RewardShaper([TaskSpec(name="t", binary_reward=True, timeout_penalty=0.25)])
    assert binary(_traj(0.7, "completed", success=1.0)) == 1.0
    assert binary(_traj(0.7, "completed", success=0.0)) == 0.0
    assert binary(_traj(0.0, "task limit reached")) == -0.25
    assert binary(_traj(0.0, "task error", error="interact timed out after 3.0s")) == -0.25
    assert binary(_traj(0.0, "task error", error="start_sample failed")) == 0.0
    assert RewardShaper([TaskSpec(name="t", timeout_penalty=0.5)])(_traj(0.7, "agent context limit")) == \
        pytest.approx(0.2)
    assert RewardShaper()(_traj(0.7)) == 0.7


def test_overlong_shaping_is_dapos_soft_penalty():
    """Within ``overlong_buffer`` tokens of the budget the reward loses up to ``overlong_penalty``, linearly."""
    from megatron_agentrl.config import AlgoConfig, TaskSpec
    from megatron_agentrl.pipeline.rewards import RewardShaper

    shaper = RewardShaper([TaskSpec(name="t")], AlgoConfig(overlong_buffer=100, overlong_penalty=0.5), 1000)
    assert shaper(_traj(1.0, length=900)) == 1.0
    assert shaper(_traj(1.0, length=950)) == pytest.approx(0.75)
    assert shaper(_traj(1.0, length=1000)) == pytest.approx(0.5)
    assert RewardShaper([TaskSpec(name="t")], AlgoConfig(), 1000)(_traj(1.0, length=1000)) == 1.0  # off by default


def judge(traj):
    """A reward function for the tests: 1 per 10 tokens; fails on an empty trajectory; NaN past 50 tokens."""
    if not traj.token_ids:
        raise RuntimeError("the judge is down")
    return float("nan") if len(traj.token_ids) > 50 else len(traj.token_ids) / 10


def test_reward_fn_replaces_the_reward_and_its_failures_fall_back(caplog):
    """tasks[].reward_fn computes the reward from the trajectory; a failing or non-finite one falls back to the
    task's reward with a warning (a judge's outage must not end the run); a bad path is refused at load."""
    from megatron_agentrl.config import TaskSpec, load_config
    from megatron_agentrl.pipeline.rewards import RewardShaper

    shaper = RewardShaper([TaskSpec(name="t", reward_fn=f"{__name__}:judge", timeout_penalty=0.5)])
    assert shaper(_traj(0.0, length=20)) == 2.0
    assert shaper(_traj(0.0, "task limit reached", length=20)) == 1.5  # shaping still applies
    with caplog.at_level("WARNING"):
        assert shaper(_traj(0.3, length=0)) == 0.3
        assert shaper(_traj(0.4, length=60)) == 0.4
    assert shaper.reward_fn_errors == 2 and "the judge is down" in caplog.text
    with pytest.raises(ConfigError, match=rf"reward_fn='{__name__}:nope': module '{__name__}' "
                                          "has no function 'nope'"):
        load_config(BASE, [f'tasks=[{{name: lookup, reward_fn: "{__name__}:nope"}}]'])
    with pytest.raises(ConfigError, match="must be 'package.module:function'"):
        load_config(BASE, ['tasks=[{name: lookup, reward_fn: "no colon"}]'])
    with pytest.raises(ConfigError, match="binary_reward are both set"):
        load_config(BASE, ['tasks=[{name: lookup, reward_fn: "json:dumps", binary_reward: true}]'])


CALLS: list[int] = []


def counting_judge(traj):
    """A reward function that counts its calls."""
    CALLS.append(1)
    return float(len(CALLS))


def test_reward_fn_runs_once_per_trajectory():
    """Dynamic sampling (rollout thread) and the batch (trainer) shape the same trajectory: the reward
    function runs, and decides, once."""
    from megatron_agentrl.config import TaskSpec
    from megatron_agentrl.pipeline.rewards import RewardShaper

    CALLS.clear()
    shaper = RewardShaper([TaskSpec(name="t", reward_fn=f"{__name__}:counting_judge")])
    a, b = _traj(0.0, length=3), _traj(0.0, length=3)
    assert [shaper(a), shaper(a), shaper(b), shaper(a)] == [1.0, 1.0, 2.0, 1.0]
    assert len(CALLS) == 2


def test_config_refuses_settings_that_would_do_nothing():
    with pytest.raises(ConfigError, match="rollout.samples_per_prompt=1 sample always is"):
        load_config(BASE, ["algo.dynamic_sampling=true", "rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="eval.interval=2 evaluates on held-out samples"):
        load_config(BASE, ["eval.interval=2", "eval.samples_per_task=0"])
