"""SGLang server flags: every flag the project passes to ``sglang.launch_server`` and every flag a user sets in
``rollout.sglang_server_args`` is one the pinned SGLang takes (its own parser, as the wheel builds it), checked
before any server or GPU is touched."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_agentrl.config import ConfigError, load_config
from rollout_sglang.engines.sglang_client import launch_flags
from rollout_sglang.engines.sglang_options import SGLangClientOptions, SGLangLaunchOptions
from rollout_sglang.engines.sglang_server_args import FLAGS_PIN, server_args_argv, server_flags
from rollout_sglang.testing.sglang_contract import SGLANG_PIN
from rollout_sglang.testing.sglang_server_flags import source_flag_names

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests/configs/tiny_test.yaml"


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's ``launch_server`` parser rebuilt from the table: its flags, arities, value types and choices."""
    p = argparse.ArgumentParser(exit_on_error=False)
    seen = set()
    types = {"int": int, "float": float, "str": str, "json": json.loads, "size": str}
    for entry in server_flags().values():
        if entry["dest"] in seen:
            continue
        seen.add(entry["dest"])
        if entry["kind"] == "switch":
            p.add_argument(*entry["flags"], dest=entry["dest"], action="store_true")
        elif entry["kind"] == "bool_optional":
            p.add_argument(entry["flags"][0], dest=entry["dest"], action=argparse.BooleanOptionalAction)
        else:
            p.add_argument(*entry["flags"], dest=entry["dest"], nargs=entry["nargs"], type=types[entry["type"]],
                           choices=entry["choices"] if entry["type"] == "str" else None)
    return p


def test_the_flag_table_is_the_pinned_wheels(wheel):
    """The committed table holds exactly the flags the pinned wheel's source declares (its ``Arg`` fields and the
    flags ``ServerArgs.add_cli_args`` adds), so a flag SGLang renames or drops fails here first."""
    assert FLAGS_PIN == SGLANG_PIN
    assert set(server_flags()) == source_flag_names(wheel)


def test_every_flag_the_project_passes_parses_with_sglangs_flags():
    """The fullest launch the project makes (LoRA, routed experts, keys, user flags): SGLang's parser takes it."""
    opts = SGLangLaunchOptions(host="0.0.0.0", dtype="bfloat16", capture_routing=True,
                               server_args={"mem_fraction_static": 0.8, "context_length": "32k",
                                            "max_running_requests": 64, "enable_torch_compile": True,
                                            "json_model_override_args": {"rope_scaling": {"factor": 2.0}},
                                            "enable_tf32_matmul": False, "attention_backend": "fa3"})
    opts = opts.with_lora(8, ["all-linear"], live_versions=2)
    argv = launch_flags("/models/qwen3-8b", opts, SGLangClientOptions(api_key="a", admin_api_key="b"), tp=2,
                        port=30000)
    args = sglang_parser().parse_args(argv)
    assert args.tp_size == 2 and args.skip_tokenizer_init and args.enable_return_routed_experts
    assert args.enable_lora and args.max_lora_rank == 8 and args.max_loras_per_batch == 4
    assert args.mem_fraction_static == 0.8 and args.context_length == "32k" and args.enable_tf32_matmul is False
    assert json.loads(args.json_model_override_args if isinstance(args.json_model_override_args, str)
                      else json.dumps(args.json_model_override_args)) == {"rope_scaling": {"factor": 2.0}}
    for token in argv:
        assert not token.startswith("--") or token in server_flags(), token


@pytest.mark.parametrize("args, message", [
    ({"mem_fraction_statc": 0.8}, "no flag --mem-fraction-statc; did you mean mem_fraction_static"),
    ({"max_runing_requests": 8}, "did you mean max_running_requests"),
    ({"tp_size": 2}, "ray.rollout_gpus_per_engine"),
    ({"model-path": "/x"}, "model.checkpoint"),
    ({"max_lora_rank": 8}, "lora.rank"),
    ({"context_length": "long"}, "takes a token count"),
    ({"max_running_requests": 8.5}, "takes an integer"),
    ({"max_running_requests": True}, "takes an integer"),
    ({"attention_backend": "fast"}, "takes one of"),
    ({"enable_torch_compile": "yes"}, "takes no value; write true"),
    ({"disable_cuda_graph": True}, "deprecated in SGLang; use --cuda-graph-backend"),
    ({"no_enable_tf32_matmul": True}, "write enable_tf32_matmul: false"),
    ({"mem_fraction_static": 1.2}, "must be in (0, 1)"),
    ({"preferred_sampling_params": "{not json"}, "is not"),
    ({"mem_fraction_static": None}, "leave the key out"),
])
def test_a_bad_server_flag_is_refused_naming_it_and_the_fix(args, message):
    with pytest.raises(ValueError, match="rollout.sglang_server_args") as err:
        server_args_argv(args)
    assert message in str(err.value), str(err.value)


def test_flags_render_as_sglangs_command_line():
    assert server_args_argv({"mem-fraction-static": 0.8, "enable_torch_compile": True, "disable_radix_cache": False,
                             "enable_tf32_matmul": False, "context_length": 32768,
                             "preferred_sampling_params": {"temperature": 0.7}}) == [
        "--mem-fraction-static", "0.8", "--enable-torch-compile", "--no-enable-tf32-matmul", "--context-length",
        "32768", "--preferred-sampling-params", '{"temperature": 0.7}']


def test_the_config_checks_server_args_at_load_and_knows_where_they_apply(tmp_path):
    gpu = ["ray.rollout_gpus_per_engine=1", f"output_dir={tmp_path}"]
    cfg = load_config(TINY, [*gpu, "rollout.sglang_server_args={mem_fraction_static: 0.7, context_length: 4096}"])
    assert cfg.rollout.sglang_server_args == {"mem_fraction_static": 0.7, "context_length": 4096}
    with pytest.raises(ConfigError, match="did you mean mem_fraction_static"):
        load_config(TINY, [*gpu, "rollout.sglang_server_args={mem_fraction: 0.7}"])
    with pytest.raises(ConfigError, match="context_length=64 is shorter than an episode"):
        load_config(TINY, [*gpu, "rollout.sglang_server_args={context_length: 64}"])
    with pytest.raises(ConfigError, match="local engine in trainer rank 0"):
        load_config(TINY, [f"output_dir={tmp_path}", "rollout.sglang_server_args={mem_fraction_static: 0.7}"])


def test_the_standin_refuses_a_flag_sglang_lacks_and_reports_the_ones_it_ignores(tmp_path):
    """The stand-in, launched as SGLang is, exits as SGLang's parser does on a flag the pinned SGLang lacks."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "rollout_sglang.testing.sglang_standin", "--model-path",
                           str(tmp_path), "--mem-fraction-statc", "0.8"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments: --mem-fraction-statc" in proc.stderr


def test_gpu_engines_without_a_launcher_that_places_them_are_refused_with_the_fix(tmp_path):
    """``agentrl train`` of a config that asks for SGLang engines on GPUs, off Ray, stops before building anything
    (it would otherwise load every engine's model into trainer rank 0); on Ray, or with running servers, it is fine."""
    import subprocess
    import sys

    gpu = [f"output_dir={tmp_path}", "ray.rollout_gpus_per_engine=1"]
    cfg = load_config(TINY, gpu)
    assert "ray.enabled=true" in cfg.engine_placement_problem(on_ray=False)
    assert cfg.engine_placement_problem(on_ray=True) is None
    assert load_config(TINY, [*gpu, "rollout.engine_urls=[[http://10.0.0.5:30000]]"]).engine_placement_problem(
        on_ray=False) is None
    proc = subprocess.run([sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", str(TINY), *gpu],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "only the Ray launcher places" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()
