"""Values each config section refuses at load time, and the one line a user sees for each."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_agentrl.cli import main
from megatron_agentrl.config import (
    AlgoConfig,
    ConfigError,
    LossConfig,
    ModelConfig,
    RolloutConfig,
    TaskSpec,
    TrainConfig,
    load_config,
    read_mapping_file,
)
from megatron_agentrl.hf_io import check_model_paths, load_hf_config

DEMO = "examples/configs/tiny_cpu.yaml"

BAD_OVERRIDES = [
    ("train.lr=.inf", r"train.lr=inf must be a finite number"),
    ("sft.lr=.inf", r"sft.lr=inf must be a finite number"),
    ("loss.clip_eps_low=-0.5", r"loss.clip_eps_low=-0.5 must be in \[0, 1\)"),
    ("loss.clip_eps_high=-1", r"loss.clip_eps_high=-1.0 must be >= 0"),
    ("train.weight_decay=-1", r"train.weight_decay=-1.0 must be >= 0"),
    ("train.adam_beta1=5", r"train.adam_beta1=5.0 must be in \[0, 1\)"),
    ("train.adam_beta2=1", r"train.adam_beta2=1.0 must be in \[0, 1\)"),
    ("train.grad_clip=-1", r"train.grad_clip=-1.0 must be >= 0 \(0 = no clipping\)"),
    ("train.seed=-1", r"train.seed=-1 must be in \[0, 2\*\*32\)"),
    ("algo.eps=-1", r"algo.eps=-1.0 must be > 0"),
    ("algo.eps=.nan", r"algo.eps=nan must be a finite number"),
    ("rollout.max_total_tokens=1", r"rollout.max_total_tokens=1 must be >= 2"),
    ("rollout.max_new_tokens=1e8", r"rollout.max_new_tokens=100000000.0 must be an integer; write it without a "
                                   r"decimal point or exponent \(100000000\)"),
    ("rollout.max_new_tokens=100000000", r"rollout.max_new_tokens=100000000 must be below "
                                         r"rollout.max_total_tokens=640"),
    ("rollout.temperature=.nan", r"rollout.temperature=nan must be a finite number"),
    ("rollout.engine_timeout_s=.inf", r"rollout.engine_timeout_s=inf must be a finite number"),
    ("eval.temperature=-1", r"eval.temperature=-1.0 must be > 0"),
    ("pipeline.env_timeout_s=.inf", r"pipeline.env_timeout_s=inf must be a finite number"),
    ("ray.controller_port=70000", r"ray.controller_port=70000 must be a TCP port"),
    ("ray.num_cpus=-2", r"ray.num_cpus=-2 must be >= 0"),
    ("slurm.gpus_per_node=-8", r"slurm.gpus_per_node=-8 must be >= 0"),
    ("log_every=0", r"log_every=0 must be a positive integer"),
    ("model.hf_config=", r"model.hf_config='' is empty"),
    ("model.dtype=fp8", r"model.dtype='fp8' is not one of float32, bfloat16, float16"),
    ("rollout.cross_policy=newest", r"rollout.cross_policy='newest' is not one of latest, uniform, recency "
                                    r"\(latest = on-policy"),
    ("ray.train_strategy=TIGHT", r"ray.train_strategy='TIGHT' is not one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    ("tasks=[{name: lookup, weight: .inf}]", r"tasks\[0\].weight=inf must be a finite number"),
    ("tasks=[{name: lookup}, {name: calc, weight: -1}]", r"tasks\[1\].weight=-1.0 must be > 0"),
    ("tasks=[{name: lookup, params: {bogus: 1}}]",
     r"unknown config key 'tasks\[0\].params.bogus' \(valid keys here: seed, num_samples, max_turns, num_keys\)"),
    ("tasks=[{name: calc}, {name: lookup, params: {num_keys: 99}}]",
     r"tasks\[1\].params.num_keys=99 must be an integer in 1..24"),
    ("tasks=[{name: calc, params: {low: 9, high: 3}}]", r"tasks\[0\].params.high=3 must be above low=9"),
    ("tasks=[{name: guess, params: {max_turns: 2}}]", r"tasks\[0\].params.max_turns=2 is too few"),
    ("tasks=[{name: db, params: {query_timeout_s: .inf}}]",
     r"tasks\[0\].params.query_timeout_s=inf must be a finite number"),
    ("tasks=[{name: os_shell, params: {max_processes: 2}}]",
     r"tasks\[0\].params.max_processes=2 must be an integer >= 4"),
    ("tasks=[{name: lookup}, {name: lookup}]", r"tasks: 'lookup' is listed twice"),
    ("parallel.collective_timeout_s=0", r"parallel.collective_timeout_s=0.0 must be a positive \(finite\) number of "
                                        r"seconds"),
    ("parallel.rank0_timeout_s=600", r"parallel.rank0_timeout_s=600 must exceed pipeline.batch_timeout_s=1800: "
                                     r"the other ranks wait that long for rank 0.* raise parallel.rank0_timeout_s "
                                     r"above 1800"),
]


@pytest.mark.parametrize("override, match", BAD_OVERRIDES)
def test_bad_value_is_refused_at_load_with_its_key(override, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(DEMO, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override", [o for o, _ in BAD_OVERRIDES[:12]])
def test_cli_exits_2_with_one_line(override, capsys):
    assert main(["train", "--config", DEMO, override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentrl: error: ") and err.count("\n") == 1, err


def test_tasks_behind_an_env_controller_keep_their_params():
    """Only tasks built here are checked against a built-in class: behind the env controller a task
    (even one with a built-in name) runs with the worker's own params."""
    ok = load_config(DEMO, ["env.controller_url=http://127.0.0.1:5020", "sft.steps=0",
                            "tasks=[{name: webshop, params: {bogus: 1}}, {name: lookup, params: {num_keys: 99}}]"])
    assert [t.name for t in ok.tasks] == ["webshop", "lookup"]
    with pytest.raises(ConfigError, match=r"tasks\[1\].params.num_keys=99"):
        load_config(DEMO, ["env.controller_url=http://127.0.0.1:5020", "sft.steps=5",
                           "tasks=[{name: calc}, {name: lookup, params: {num_keys: 99}}]"])  # built here for the SFT


def test_sections_check_themselves_when_built_in_python():
    with pytest.raises(ConfigError, match=r"train.lr=0 must be > 0"):
        TrainConfig(lr=0)
    with pytest.raises(ConfigError, match=r"algo.eps=0.0 must be > 0"):
        AlgoConfig(eps=0.0)
    with pytest.raises(ConfigError, match=r"model.chat_template='chatml' is not one of auto, qwen2, glm4"):
        ModelConfig(chat_template="chatml")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"task.timeout_penalty=-1 must be >= 0"):
        TaskSpec(name="t", timeout_penalty=-1)
    with pytest.raises(ConfigError, match=r"rollout.cross_policy='uniform' needs rollout.max_versions >= 2"):
        dataclasses.replace(RolloutConfig(), cross_policy="uniform")
    assert LossConfig(tis_cap=2.0).tis_cap == 2.0


def test_a_field_set_after_loading_is_checked_again():
    cfg = load_config(DEMO)
    cfg.tasks[2].weight = float("nan")
    with pytest.raises(ConfigError, match=r"tasks\[2\].weight=nan must be a finite number"):
        cfg.validate()


def test_config_file_that_is_not_utf8_or_not_a_mapping(tmp_path, capsys):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"output_dir: out\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"config file '.*latin1.yaml' is not UTF-8 text \(byte 0xe9 at offset 21\)"):
        load_config(latin1)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping at the top level, got list"):
        load_config(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: .* at line 3, column 1$"):
        load_config(broken)
    assert main(["train", "--config", str(latin1)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("text, match", [
    ('[{"model_type": "qwen2"}]',
     r"model.hf_config: '.*config.json' must hold a JSON object at the top level, got list"),
    ("42", r"must hold a JSON object at the top level, got int"),
    ('{"model_type": ', r"model.hf_config: '.*config.json' is not valid JSON: Expecting value"),
    (b'{"name": "caf\xe9"}', r"model.hf_config: '.*config.json' is not UTF-8 text"),
])
def test_hf_config_that_is_not_a_json_object(tmp_path, text, match, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    model = ModelConfig(hf_config=str(tmp_path))
    with pytest.raises(ConfigError, match=match):
        check_model_paths(model)
    with pytest.raises(ConfigError, match=match):
        load_hf_config(model)
    assert main(["train", "--config", DEMO, f"model.hf_config={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.hf_config" in err and err.count("\n") == 1


def test_read_mapping_file_reads_json_and_yaml(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "b.yaml").write_text("")
    assert read_mapping_file(tmp_path / "a.json", "json", "a") == {"x": 1}
    assert read_mapping_file(tmp_path / "b.yaml", "yaml", "b") == {}
    with pytest.raises(ConfigError, match=r"the file 'c' does not exist or is not a file"):
        read_mapping_file(tmp_path / "c.json", "json", "the file 'c'")
