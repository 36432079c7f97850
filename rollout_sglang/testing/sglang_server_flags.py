"""SGLang's ``launch_server`` flags, read from the pinned wheel: the table that ``rollout.sglang_server_args`` is
checked against (:mod:`rollout_sglang.engines.sglang_server_args`).

The flags are SGLang's own argparse parser (``ServerArgs.add_cli_args``: the dataclass fields of
``sglang/srt/arg_groups/fields/*.py`` that carry an ``Arg``, plus the flags it adds by hand), built by importing
``sglang.srt.server_args`` from the wheel's Python sources in a subprocess. That import needs a few of SGLang's
pure-Python dependencies but no GPU; install them into a folder of their own first::

    pip install --no-deps --target DEPS msgspec orjson pybase64 triton pyzmq ipython traitlets
    python -m rollout_sglang.testing.sglang_server_flags --wheel sglang-0.5.23-*.whl --deps DEPS \\
        --out rollout_sglang/engines/sglang_server_flags_0_5_23.json

Each flag is written as ``{"flags", "dest", "kind", "type", "nargs", "choices", "default", "deprecated"}``:
``kind`` is ``switch`` (takes no value), ``bool_optional`` (``--x`` / ``--no-x``) or ``value``; ``type`` is how a
value is checked here (``int``, ``float``, ``str``, ``json``, or ``size``: an int or SGLang's ``human_readable_int``
text such as ``32k``). :func:`source_flag_names` reads the flag names from the wheel's source alone (no import), so
the tests can check the committed table against the wheel wherever the wheel can be had.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_DIR = "sglang/srt/arg_groups/fields/"

#: SGLang's value parsers, as the kind of value they take (an unlisted one is refused: the table must say)
_TYPES = {"int": "int", "float": "float", "str": "str", "nullable_str": "str", "loads": "json",
          "json_list_type": "json", "human_readable_int": "size", "parse_cuda_graph_backend_arg": "str",
          "parse_cuda_graph_config_arg": "str", None: "str"}

_DUMP = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
import sglang.version
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
out = []
for a in p._actions:
    if not a.option_strings or isinstance(a, argparse._HelpAction):
        continue
    default = a.default if isinstance(a.default, (int, float, str, bool, type(None))) else repr(a.default)
    out.append({"flags": list(a.option_strings), "dest": a.dest, "action": type(a).__name__, "nargs": a.nargs,
                "type": getattr(a.type, "__name__", None) if a.type else None,
                "choices": sorted(map(str, a.choices)) if a.choices is not None else None, "default": default,
                "new_flag": getattr(a, "new_flag", None)})
json.dump({"version": sglang.version.__version__, "actions": out}, sys.stdout)
"""


def _entry(action: dict[str, Any]) -> dict[str, Any]:
    """One flag of the table from one of SGLang's argparse actions (as :data:`_DUMP` writes it)."""
    name = action["action"]
    if name == "BooleanOptionalAction":
        kind = "bool_optional"
    elif action["nargs"] == 0:
        kind = "switch"
    else:
        kind = "value"
    if kind == "value" and action["type"] not in _TYPES:
        raise ValueError(f"{action['flags'][0]}: SGLang parses it with {action['type']!r}, which this table does not "
                         "know; add it to _TYPES with the kind of value it takes")
    deprecated = None
    if name.startswith("Deprecated"):
        deprecated = f"deprecated in SGLang; use {action['new_flag']}" if action["new_flag"] else "deprecated"
    return {"flags": action["flags"], "dest": action["dest"], "kind": kind,
            "type": _TYPES.get(action["type"], "str") if kind == "value" else None,
            "nargs": action["nargs"] if kind == "value" else None, "choices": action["choices"],
            "default": action["default"], "deprecated": deprecated}


def extract_server_flags(wheel: str | os.PathLike, deps: str | os.PathLike, timeout_s: float = 300.0) -> dict:
    """The flag table of ``wheel`` (its Python sources imported in a subprocess, ``deps`` on its path)."""
    with tempfile.TemporaryDirectory(prefix="sglang_src_") as src:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(src, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(deps)])}
        proc = subprocess.run([sys.executable, "-c", _DUMP], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=src)
    if proc.returncode != 0:
        raise RuntimeError(f"importing sglang.srt.server_args from {wheel} failed (missing dependencies go into "
                           f"--deps, see the module docstring):\n{proc.stderr[-3000:]}")
    dump = json.loads(proc.stdout)
    return {"sglang": dump["version"], "flags": [_entry(a) for a in dump["actions"]]}


def source_flag_names(wheel: str | os.PathLike) -> set[str]:
    """Every flag of SGLang's ``launch_server`` as its source spells them, read without importing it: the ``Arg``
    fields of ``arg_groups/fields/*.py`` (``cli_name`` or ``--field-name``, and ``aliases``; ``no_cli`` ones left
    out) and the literal flags of ``ServerArgs.add_cli_args``, with ``--no-`` forms of ``BooleanOptionalAction``."""
    names: set[str] = set()
    with zipfile.ZipFile(wheel) as z:
        fields = [n for n in z.namelist() if n.startswith(FIELDS_DIR) and n.endswith(".py")]
        sources = {n: z.read(n).decode() for n in [*fields, SERVER_ARGS]}
    for path, src in sources.items():
        tree = ast.parse(src)
        if path == SERVER_ARGS:  # its hand-written flags (its fields come from the fields modules)
            fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
                    names.update(a.value for a in call.args if isinstance(a, ast.Constant) and
                                 str(a.value).startswith("--"))
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation  # A[T, "help"] or A[T, Arg(...)]; any other field is no flag
            if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "A"
                    and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) == 2):
                continue
            meta = ann.slice.elts[1]
            if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
                names.add("--" + node.target.id.replace("_", "-"))
                continue
            if not (isinstance(meta, ast.Call) and getattr(meta.func, "id", "") == "Arg"):
                continue
            kw = {k.arg: k.value for k in meta.keywords}
            if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value:
                continue
            cli = kw.get("cli_name")
            flag = cli.value if isinstance(cli, ast.Constant) else "--" + node.target.id.replace("_", "-")
            flags = [flag]
            if isinstance(kw.get("aliases"), ast.List):
                flags += [e.value for e in kw["aliases"].elts if isinstance(e, ast.Constant)]
            action = kw.get("action")
            if action is not None and "BooleanOptionalAction" in ast.unparse(action):
                flags += ["--no-" + f[2:] for f in flags]
            names.update(flags)
    return names


def main(argv: list[str] | None = None) -> None:
    """``python -m rollout_sglang.testing.sglang_server_flags --wheel W --deps DIR --out JSON``."""
    ap = argparse.ArgumentParser(description="extract SGLang's launch_server flags from its wheel")
    ap.add_argument("--wheel", required=True, help="the pinned SGLang wheel")
    ap.add_argument("--deps", required=True, help="a folder with SGLang's import-time dependencies (docstring)")
    ap.add_argument("--out", required=True, help="the JSON table to write")
    args = ap.parse_args(argv)
    table = extract_server_flags(args.wheel, args.deps)
    Path(args.out).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(table['flags'])} flags of sglang {table['sglang']} -> {args.out}")


if __name__ == "__main__":
    main()
