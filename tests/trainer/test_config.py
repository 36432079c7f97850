"""Config loading: YAML + overrides, and the messages a user sees for bad keys, values and paths."""
import re
from pathlib import Path

import pytest

from megatron_agentrl.cli import main
from megatron_agentrl.config import ConfigError, ModelConfig, load_config
from megatron_agentrl.hf_io import load_hf_config, load_hf_weights

DEMO = "examples/configs/tiny_cpu.yaml"


def test_demo_config_loads_with_overrides():
    cfg = load_config(DEMO, ["train.lr=1e-4", "parallel.tp=2", "rollout.temperature=0.7", "log_every=3"])
    assert cfg.train.lr == pytest.approx(1e-4) and cfg.parallel.tp == 2 and cfg.rollout.temperature == 0.7
    assert cfg.log_every == 3 and cfg.tasks[0].name


def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.learning_rate'.*did you mean 'train.lr'"):
        load_config(DEMO, ["train.learning_rate=1e-4"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: {}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'; did you mean 'model'"):
        load_config(bad)


@pytest.mark.parametrize("old, new", [(f"train.{k}", f"loss.{k}") for k in (
    "clip_eps_low", "clip_eps_high", "tis_cap", "kl_coef", "kl_estimator", "entropy_coef", "ratio_level", "mis_cap",
    "mis_level")] + [("algo.loss_agg", "loss.agg")])
def test_a_moved_loss_key_is_refused_naming_its_new_place(tmp_path, old, new):
    """The policy-loss settings moved from train / algo to the loss section: the old key, in an override
    or in a YAML file, is refused with one line naming the new one."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} moved to {re.escape(new)}; set it in the 'loss:' "
                                          rf"section \(override: {re.escape(new)}=2.0\)$"):
        load_config(DEMO, [f"{old}=2.0"])
    section, key = old.split(".")
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text(Path(DEMO).read_text().replace(f"\n{section}:\n", f"\n{section}:\n  {key}: 2.0\n", 1))
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} moved to {re.escape(new)}"):
        load_config(old_yaml)


def test_bad_values_name_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.tp='two' must be an integer"):
        load_config(DEMO, ["parallel.tp=two"])
    with pytest.raises(ConfigError, match=r"rollout.samples_per_prompt=0 must be a positive integer"):
        load_config(DEMO, ["rollout.samples_per_prompt=0"])
    with pytest.raises(ConfigError, match=r"model.dtype='fp8' is not one of"):
        load_config(DEMO, ["model.dtype=fp8"])
    with pytest.raises(ConfigError, match=r"override 'train.lr' is not of the form key=value"):
        load_config(DEMO, ["train.lr"])
    bad = tmp_path / "sft_weight.yaml"
    text, n = re.subn(r"\{name: calc[^}]*\}", "{name: calc, sft_weight: 0}", Path(DEMO).read_text())
    assert n == 1, "the demo config lists calc once"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"tasks\[1\].sft_weight=0.0 must be > 0"):
        load_config(bad)



def test_sft_learning_rate_schedule():
    """The warm-up's cosine decay runs from lr to min_lr within each phase and restarts at the format
    switch; bad schedule settings name the key."""
    cfg = load_config(DEMO, ["sft.steps=10", "sft.short_format_steps=4", "sft.lr=1e-3", "sft.min_lr=1e-4",
                             "sft.lr_decay_style=cosine"])
    lrs = [cfg.sft.lr_at(s) for s in range(1, 11)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[3] == pytest.approx(1e-4)  # short phase: steps 1..4
    assert lrs[4] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-4)  # full phase restarts
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))
    flat = load_config(DEMO, ["sft.lr_decay_style=constant", "sft.lr=2e-3"])
    assert {flat.sft.lr_at(s) for s in (1, 500, 900)} == {2e-3}
    with pytest.raises(ConfigError, match=r"sft.lr_decay_style='exp' is not one of constant, linear, cosine"):
        load_config(DEMO, ["sft.lr_decay_style=exp"])
    with pytest.raises(ConfigError, match=r"sft.min_lr=0.01 must be in \[0, sft.lr="):
        load_config(DEMO, ["sft.min_lr=0.01"])
    # the full-format phase may start lower than the short one, and decays from there
    split = load_config(DEMO, ["sft.steps=10", "sft.short_format_steps=4", "sft.lr=1e-3", "sft.full_format_lr=4e-4",
                               "sft.min_lr=1e-4", "sft.lr_decay_style=linear"])
    lrs = [split.sft.lr_at(s) for s in range(1, 11)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[4] == pytest.approx(4e-4) and lrs[9] == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match=r"sft.full_format_lr=5e-05 must be >= sft.min_lr=0.0001"):
        load_config(DEMO, ["sft.min_lr=1e-4", "sft.full_format_lr=5e-5"])
    with pytest.raises(ConfigError, match=r"sft.full_format_lr"):
        load_config(DEMO, ["sft.full_format_lr=0"])
    # a linear warm-up of the rate over the first phase's first steps; the second phase starts at its peak
    warm = load_config(DEMO, ["sft.steps=10", "sft.short_format_steps=4", "sft.lr=1e-3", "sft.lr_warmup_steps=2",
                              "sft.min_lr=1e-4", "sft.lr_decay_style=linear"])
    lrs = [warm.sft.lr_at(s) for s in range(1, 11)]
    assert lrs[:4] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-4]) and lrs[4] == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match=r"sft.lr_warmup_steps=700 must be an integer in \[0, 700\)"):
        load_config(DEMO, ["sft.lr_warmup_steps=700"])

def test_rl_learning_rate_schedule():
    """RL's learning rate: a linear warm-up over train.lr_warmup_steps, then the decay style down to
    train.min_lr at the last step; bad settings name the key."""
    cfg = load_config(DEMO, ["train.steps=10", "train.lr=1e-3", "train.lr_warmup_steps=2", "train.min_lr=1e-4",
                             "train.lr_decay_style=linear"])
    lrs = [cfg.train.lr_at(s) for s in range(1, 11)]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3]) and lrs[9] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    demo = [load_config(DEMO).train.lr_at(s) for s in (1, 30, 60)]  # the demo's: 1e-3 down to 1e-4 at its last step
    assert demo[0] == pytest.approx(1e-3) and demo[2] == pytest.approx(1e-4) and demo[0] > demo[1] > demo[2]
    with pytest.raises(ConfigError, match=r"train.lr_warmup_steps=10 must be in \[0, train.steps=10\)"):
        load_config(DEMO, ["train.steps=10", "train.lr_warmup_steps=10"])
    with pytest.raises(ConfigError, match=r"train.min_lr=0.1 must be in \[0, train.lr="):
        load_config(DEMO, ["train.min_lr=0.1"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' does not exist"):
        load_config("nope.yaml")


def test_missing_model_path_is_clear(tmp_path):
    with pytest.raises(ConfigError, match=r"model.hf_config='/no/such/model' does not exist"):
        load_hf_config(ModelConfig(hf_config="/no/such/model"))
    with pytest.raises(FileNotFoundError, match=r"model.checkpoint='/no/such/ckpt' is not a directory"):
        load_hf_weights("/no/such/ckpt")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors"):
        load_hf_weights(tmp_path)
    with pytest.raises(ConfigError, match=r"model_type='gpt_neox' is not supported yet"):
        load_hf_config(ModelConfig(arch={"model_type": "gpt_neox"}))


def test_cli_reports_bad_key_without_traceback(capsys):
    assert main(["train", "--config", DEMO, "train.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.lrr'" in err and "did you mean 'train.lr'" in err
    assert main(["train", "--config", DEMO, "model.hf_config=/no/such/model", "train.steps=1"]) == 2
    assert "model.hf_config='/no/such/model' does not exist" in capsys.readouterr().err


def test_engine_urls_override_and_shape():
    """rollout.engine_urls: one list of SGLang URLs per version slot, settable on the command line
    (with or without the shell's quotes); a wrong shape or a URL without a port names the key."""
    slots = [["http://127.0.0.1:3001"], ["http://127.0.0.1:3002"]]
    quoted = load_config(DEMO, ['rollout.engine_urls=[["http://127.0.0.1:3001"],["http://127.0.0.1:3002"]]'])
    bare = load_config(DEMO, ["rollout.engine_urls=[[http://127.0.0.1:3001],[http://127.0.0.1:3002]]"])
    assert quoted.rollout.engine_urls == bare.rollout.engine_urls == slots
    assert load_config(DEMO).rollout.engine_urls == []
    with pytest.raises(ConfigError, match=r"rollout.engine_urls=.* has 1 slot\(s\) of \[1\] URL\(s\), but "
                                          r"rollout.max_versions=2 slots"):
        load_config(DEMO, ["rollout.engine_urls=[[http://127.0.0.1:3001]]"])
    with pytest.raises(ConfigError, match=r"rollout.engine_urls\[1\]\[0\]='http://127.0.0.1' is not an "
                                          r"http\(s\)://host:port URL"):
        load_config(DEMO, ["rollout.engine_urls=[[http://127.0.0.1:3001],[http://127.0.0.1]]"])
    with pytest.raises(ConfigError, match=r"rollout.engine_urls\[0\]\[0\]='ftp://a:1' is not an"):
        load_config(DEMO, ["rollout.engine_urls=[[ftp://a:1],[http://b:2]]"])
