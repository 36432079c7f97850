"""SGLang server flags from a mapping, checked against the pinned SGLang's own ``launch_server`` flags before any
server starts: ``rollout.sglang_server_args`` and :class:`~rollout_sglang.engines.sglang_options.SGLangLaunchOptions`.

The table of flags (``sglang_server_flags_<pin>.json`` next to this module) is SGLang's argparse parser as the
pinned wheel builds it (:mod:`rollout_sglang.testing.sglang_server_flags` writes it; the tests check it against the
wheel). A mapping names each flag without its dashes, as a field (``mem_fraction_static``) or as the flag
(``mem-fraction-static``), with a YAML value::

    {mem_fraction_static: 0.8, context_length: 32768, max_running_requests: 128, enable_torch_compile: true,
     cuda_graph_max_bs: 256, attention_backend: fa3, json_model_override_args: {rope_scaling: {...}}}

A switch takes ``true`` (``false`` leaves it off), a ``--x / --no-x`` flag ``true`` or ``false``, a list flag a
list, a JSON flag (or a string flag that SGLang reads as JSON, such as ``json_model_override_args``) a mapping
or list (sent as JSON). A misspelt key, a value of the wrong type, a value outside the
flag's choices, a deprecated flag, or a flag that the project sets itself (the model, the port, the LoRA flags:
:data:`OWNED`) is refused with a message that names it and the fix.
"""
from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the SGLang release whose flags the table holds (the ``sglang`` extra's pin)
FLAGS_PIN = "0.5.23"
_TABLE = Path(__file__).with_name(f"sglang_server_flags_{FLAGS_PIN.replace('.', '_')}.json")

#: the flags the project sets on every server it launches (by SGLang's ``dest``), with the setting that owns each
OWNED = {
    "model_path": "model.checkpoint (the engines' model)",
    "host": "the launcher (every interface under Ray, with keys)",
    "port": "the launcher (a free port)",
    "tp_size": "ray.rollout_gpus_per_engine (an engine's GPUs are its TP size)",
    "dtype": "model.dtype",
    "skip_tokenizer_init": "always on: token ids go in and out, never text",
    "enable_return_routed_experts": "rollout.capture_routing",
    "api_key": "rollout.engine_api_key_env",
    "admin_api_key": "rollout.engine_admin_api_key_env",
    "enable_lora": "the lora section (a LoRA run serves its versions as adapters)",
    "max_lora_rank": "lora.rank",
    "lora_target_modules": "lora.target_modules",
    "max_loras_per_batch": "rollout.max_versions (every live version an adapter)",
    "max_loaded_loras": "rollout.max_versions (every live version an adapter)",
    "lora_paths": "the weight sync (adapters are loaded at run time, never from --lora-paths)",
}
# SGLang's human_readable_int: an int, or a number with an SI suffix, or an int with an IEC one
_SIZE = re.compile(r"^(\d+(\.\d+)?[kMGT]|\d+(Ki|Mi|Gi|Ti)|\d+)$")


@functools.cache
def server_flags() -> dict[str, dict[str, Any]]:
    """Every flag of the pinned SGLang's ``launch_server`` (``--x``, aliases and ``--no-x`` forms) -> its entry."""
    table = json.loads(_TABLE.read_text())
    return {flag: entry for entry in table["flags"] for flag in entry["flags"]}


def _flag_of(key: str) -> str:
    return "--" + key.strip().lstrip("-").replace("_", "-")


def field_name(key: str) -> str:
    """A key of a server-args mapping as SGLang's field name: ``--mem-fraction-static`` -> ``mem_fraction_static``."""
    return str(key).strip().lstrip("-").replace("-", "_")


def server_arg(args: Mapping[str, Any], name: str) -> Any:
    """The value ``args`` (a server-args mapping, keys spelt either way) gives field ``name``; None when none."""
    return next((v for k, v in args.items() if field_name(k) == name), None)


def _nearest(key: str) -> str:
    names = sorted({field_name(f) for f in server_flags()})
    close = difflib.get_close_matches(field_name(key), names, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else "; see `python -m sglang.launch_server --help`"


def _value(flag: str, entry: dict[str, Any], v: Any, where: str) -> str:
    """One value of a valued flag as SGLang's command line takes it; ValueError naming the rule."""
    kind = entry["type"]
    ok = {
        "int": isinstance(v, int) and not isinstance(v, bool),
        "float": isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": isinstance(v, (str, dict, list)) or (isinstance(v, (int, float)) and not isinstance(v, bool)),
        "json": isinstance(v, (dict, list)) or isinstance(v, str),
        "size": (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (isinstance(v, str)
                                                                              and bool(_SIZE.match(v))),
    }[kind]
    rule = {"int": "an integer", "float": "a number", "str": "a string (or a mapping, sent as JSON)",
            "json": "a mapping or list (sent as JSON)",
            "size": "a token count: an integer, or SGLang's 32k / 1M / 128Ki form"}[kind]
    if not ok:
        raise ValueError(f"{where}={v!r}: SGLang's {flag} takes {rule}")
    if kind in ("json", "str") and isinstance(v, (dict, list)):  # SGLang's JSON-valued string flags, too
        text = json.dumps(v)
    elif kind == "json":
        if isinstance(v, str):
            try:
                json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}={v!r}: SGLang's {flag} takes JSON, and this text is not ({e}); give a "
                                 "mapping or list instead") from None
        text = v
    else:
        text = str(v)
    if entry["choices"] is not None and text not in entry["choices"]:
        raise ValueError(f"{where}={v!r}: SGLang's {flag} takes one of {', '.join(entry['choices'])}")
    return text


def server_args_argv(args: Mapping[str, Any], where: str = "rollout.sglang_server_args") -> list[str]:
    """The SGLang command-line arguments of ``args`` (flag names without dashes -> values), in order; ValueError
    naming ``where.<key>`` and the fix for anything the pinned SGLang would refuse or that the project owns."""
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}={args!r} must be a mapping of SGLang flag names to values, e.g. "
                         "{mem_fraction_static: 0.8, context_length: 32768}")
    flags = server_flags()
    argv: list[str] = []
    for key, v in args.items():
        at = f"{where}.{key}"
        if not isinstance(key, str) or not key.strip("- "):
            raise ValueError(f"{where}: the key {key!r} is no flag name; write SGLang's flags without dashes, "
                             "e.g. mem_fraction_static")
        flag = _flag_of(key)
        entry = flags.get(flag)
        if entry is None:
            raise ValueError(f"{at}: SGLang {FLAGS_PIN} has no flag {flag}{_nearest(key)}")
        if entry["dest"] in OWNED:
            raise ValueError(f"{at}: {flag} is set by the project; it comes from {OWNED[entry['dest']]}")
        if entry["deprecated"]:
            raise ValueError(f"{at}: {flag} is {entry['deprecated']}")
        if v is None:
            raise ValueError(f"{at}=None: leave the key out for SGLang's default")
        if entry["kind"] in ("switch", "bool_optional"):
            if not isinstance(v, bool):
                raise ValueError(f"{at}={v!r}: SGLang's {flag} takes no value; write true (or false)")
            if entry["kind"] == "bool_optional":
                if flag.startswith("--no-") and flag not in entry["flags"][:1]:
                    raise ValueError(f"{at}: write {entry['flags'][0][2:].replace('-', '_')}: {str(not v).lower()}")
                argv.append(entry["flags"][0] if v else "--no-" + entry["flags"][0][2:])
            elif v:
                argv.append(flag)
            continue
        if entry["nargs"] in ("+", "*"):
            if not isinstance(v, (list, tuple)) or (entry["nargs"] == "+" and not v):
                raise ValueError(f"{at}={v!r}: SGLang's {flag} takes a list"
                                 + (" of at least one value" if entry["nargs"] == "+" else ""))
            argv += [flag, *(_value(flag, entry, x, at) for x in v)]
        else:
            argv += [flag, _value(flag, entry, v, at)]
        if entry["dest"] == "mem_fraction_static" and not 0 < float(v) < 1:
            raise ValueError(f"{at}={v!r} must be in (0, 1): the share of each GPU's memory for the weights and "
                             "the KV cache")
    return argv
