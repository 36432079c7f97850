"""SGLang's request contract, read from the pinned SGLang wheel: what each endpoint we call accepts.

The stand-in (:mod:`rollout_sglang.testing.sglang_standin`) checks every request against it, and
the tests check our client's bodies against it, so neither can drift from SGLang. It is read from
SGLang's source without importing SGLang (which needs CUDA-only modules):

* ``sglang/srt/managers/io_struct.py``: the request classes of the control endpoints (fields,
  annotations, defaults; ``BaseReq`` adds ``rid`` and ``http_worker_ipc``). SGLang ignores keys
  these classes do not name;
* ``sglang/api/v1/api_types.py``: ``GenerateRequest`` (unknown keys ignored) and
  ``SamplingParams`` (unknown keys rejected), with the type aliases they use;
* ``sglang/srt/entrypoints/http_server.py``: each route's methods, request class and auth level.
  ``/generate`` is checked twice in SGLang: the ``api/v1`` ``GenerateRequest`` gate checks the fields it
  knows and ignores the rest, then FastAPI builds ``io_struct.GenerateReqInput`` (the route's own class,
  the contract's ``target``) from the body; a field of either is understood (``return_routed_experts``
  is in ``GenerateReqInput`` only);
* routed experts (rollout routing replay): the server option that enables capture, the capturer's
  buffer (dtype, shape), the layer count and top-k it is sized by, the positions a response covers, and
  how the detokenizer encodes it (:data:`ROUTED_EXPERTS_SOURCES`), as source text the tests read;
* LoRA serving: the request classes of ``/load_lora_adapter``, ``/unload_lora_adapter`` and
  ``/load_lora_adapter_from_tensors`` (routes above), the server's LoRA flags (names, types, defaults) and the
  target modules ``--lora-target-modules`` takes (:data:`LORA_SOURCES`).

The result is committed as ``sglang_contract_<pin>.json`` next to this module. To bump the pin:
``pip download --no-deps sglang==<new> -d DIR``, then ``python -m rollout_sglang.testing.sglang_contract
--wheel DIR/sglang-<new>-*.whl --out rollout_sglang/testing/sglang_contract_<new>.json``, set
:data:`SGLANG_PIN` and the ``sglang`` extra in setup.py; ``tests/rollout/test_sglang_contract.py`` then
checks the client against the new version.
"""
from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SGLANG_PIN = "0.5.23"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
# the endpoints the project calls
PATHS = ("/generate", "/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
         "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
         "/destroy_weights_update_group", "/health", "/health_generate", "/model_info", "/server_info",
         "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors")
_API_CLASSES = ("GenerateRequest", "SamplingParams")
#: where the facts of the routed-experts response live in the wheel
ROUTED_EXPERTS_SOURCES = {
    "options": "sglang/srt/arg_groups/fields/exec_.py",
    "capturer": "sglang/srt/state_capturer/routed_experts.py",
    "buffers": "sglang/srt/state_capturer/base.py",
    "collect": "sglang/srt/managers/scheduler_components/batch_result_processor.py",
    "encode": "sglang/srt/managers/detokenizer_manager.py",
}
#: where the facts of LoRA serving live in the wheel: the server flags and the target modules the CLI takes
LORA_SOURCES = {
    "options": "sglang/srt/arg_groups/fields/lora.py",
    "common": "sglang/srt/utils/common.py",
}


class ContractError(ValueError):
    """A request body SGLang's definitions refuse (or, for unknown fields, would silently drop)."""


# ------------------------------------------------------------------------------------- extraction
def _fields(cls: ast.ClassDef, src: str) -> dict[str, dict[str, Any]]:
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            entry: dict[str, Any] = {"type": ast.unparse(node.annotation), "required": node.value is None}
            if node.value is not None:
                try:
                    entry["default"] = ast.literal_eval(node.value)
                except ValueError:
                    entry["default"] = ast.unparse(node.value)
            out[node.target.id] = entry
    return out


def _classes(src: str) -> tuple[ast.Module, dict[str, ast.ClassDef]]:
    tree = ast.parse(src)
    return tree, {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def extract_contract(wheel_path: str | os.PathLike) -> dict[str, Any]:
    """The contract of the endpoints in :data:`PATHS` from an SGLang wheel (parsed, never imported)."""
    with zipfile.ZipFile(wheel_path) as z:
        io_src, api_src, http_src = (z.read(n).decode() for n in (IO_STRUCT, API_TYPES, HTTP_SERVER))
        version = next((n.split("/")[0].removesuffix(".dist-info").split("-")[1] for n in z.namelist()
                        if n.endswith(".dist-info/METADATA")), "?")
    _, io_classes = _classes(io_src)
    api_tree, api_classes = _classes(api_src)
    routes: dict[str, dict[str, Any]] = {}
    for node in ast.parse(http_src).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, methods, level = [], set(), "NORMAL"
        for d in node.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)):
                continue
            name = d.func.attr
            if name in ("get", "post", "put", "api_route") and d.args and isinstance(d.args[0], ast.Constant):
                paths.append(d.args[0].value)
                if name == "api_route":
                    for kw in d.keywords:
                        if kw.arg == "methods":
                            methods |= set(ast.literal_eval(kw.value))
                else:
                    methods.add(name.upper())
        for d in node.decorator_list:  # @auth_level(...) is a bare-name call
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "auth_level":
                level = ast.unparse(d.args[0]).split(".")[-1]
        request = None
        for arg in node.args.args:
            ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            for cls in (*io_classes, *api_classes, "GenerateReqInput"):
                if ann == cls or ann.startswith(f"Annotated[{cls},"):
                    request = cls
        for p in paths:
            if p in PATHS:
                r = routes.setdefault(p, {"methods": [], "request": request, "auth_level": level})
                r["methods"] = sorted(set(r["methods"]) | methods)
    # /generate's body is the api/v1 GenerateRequest (the route's contract gate decodes it), then the route's
    # own GenerateReqInput (a dataclass FastAPI fills from the body: fields the gate does not know reach it)
    if "/generate" in routes:
        routes["/generate"]["request"] = "GenerateRequest"
        routes["/generate"]["target"] = "GenerateReqInput"
    base = _fields(io_classes["BaseReq"], io_src)
    classes: dict[str, dict[str, Any]] = {}
    for r in routes.values():
        cls = r["request"]
        if cls in io_classes and cls not in classes:
            classes[cls] = {"unknown_keys": "ignored", "fields": {**base, **_fields(io_classes[cls], io_src)}}
    if "/generate" in routes:
        classes["GenerateReqInput"] = {"unknown_keys": "ignored",
                                       "fields": _fields(io_classes["GenerateReqInput"], io_src)}
    for cls in _API_CLASSES:
        doc = ast.get_docstring(api_classes[cls]) or ""
        classes[cls] = {"unknown_keys": "rejected" if "unknown keys rejected" in doc else "ignored",
                        "fields": _fields(api_classes[cls], api_src)}
    aliases = {n.targets[0].id: ast.unparse(n.value) for n in api_tree.body
               if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
               and n.targets[0].id[:1].isupper()}
    with zipfile.ZipFile(wheel_path) as z:
        routed = _routed_experts_facts({k: z.read(v).decode() for k, v in ROUTED_EXPERTS_SOURCES.items()})
        lora = _lora_facts({k: z.read(v).decode() for k, v in LORA_SOURCES.items()})
    return {"sglang": version, "routes": dict(sorted(routes.items())), "classes": classes,
            "aliases": aliases, "structs": sorted(api_classes), "routed_experts": routed, "lora": lora}


def _function(tree: ast.AST, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope: Any = tree
    if cls is not None:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)


def _assigned(fn: ast.AST, target: str) -> str:
    """The source of the first value assigned to ``target`` (a name) in ``fn``."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == target for t in n.targets):
            return ast.unparse(n.value)
    raise KeyError(target)


def _calls(fn: ast.AST, name: str) -> list[str]:
    """The source of every call of ``name`` (a function or method name) in ``fn``."""
    return [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def _routed_experts_facts(src: dict[str, str]) -> dict[str, Any]:
    """What a routed-experts response is, as the wheel's source says it (source text, for the tests to read)."""
    trees = {k: ast.parse(v) for k, v in src.items()}
    options = next(n for n in ast.walk(trees["options"]) if isinstance(n, ast.AnnAssign)
                   and isinstance(n.target, ast.Name) and n.target.id == "enable_return_routed_experts")
    capturer_init = _function(trees["capturer"], "__init__", "RoutedExpertsCapturer")
    get_topk = _function(trees["buffers"], "get_topk", "BaseTopkCapturer")
    collect = _function(trees["collect"], "_maybe_collect_routed_experts")
    return {
        # the server option (a bool field: the flag --enable-return-routed-experts) and its default
        "server_option": {"name": options.target.id, "default": ast.literal_eval(options.value)},
        # the host buffer every response is read from: its allocation (shape and dtype)
        "host_buffer": _calls(_function(trees["buffers"], "__init__", "BaseHostCache"), "alloc"),
        "num_layers": _assigned(capturer_init, "num_layers"),
        "top_k": _assigned(capturer_init, "topk_size"),
        # positions [start_len, seqlen - 1) of the request's slots, the start clamped to seqlen - 1
        "start_clamp": _assigned(get_topk, "start_len"),
        "positions": [ast.unparse(n.slice) for n in ast.walk(get_topk) if isinstance(n, ast.Subscript)
                      and isinstance(n.slice, ast.Slice)],
        "seqlen": _assigned(collect, "seqlen"),
        # the response field: base64 of the tensor's raw bytes
        "encoding": _calls(_function(trees["encode"], "_b64_encode_per_request"), "b64encode"),
        "decoding": _calls(_function(trees["capturer"], "extract_routed_experts_from_meta_info"), "frombuffer"),
    }


def _lora_facts(src: dict[str, str]) -> dict[str, Any]:
    """The LoRA server options (each field of the ``Lora`` namespace: its type and default) and the target module
    names the CLI accepts (``SUPPORTED_LORA_TARGET_MODULES`` and ``LORA_TARGET_ALL_MODULES``)."""
    options = next(n for n in ast.walk(ast.parse(src["options"])) if isinstance(n, ast.ClassDef) and n.name == "Lora")
    fields = {}
    for node in options.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_"):
            ann = node.annotation
            typ = ann.slice.elts[0] if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple) else ann
            fields[node.target.id] = {"type": ast.unparse(typ),
                                      "default": ast.literal_eval(node.value) if node.value is not None else None}
    consts = {t.id: ast.literal_eval(n.value) for n in ast.parse(src["common"]).body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)
              and t.id in ("SUPPORTED_LORA_TARGET_MODULES", "LORA_TARGET_ALL_MODULES")}
    return {"server_options": fields,
            "target_modules": [*consts["SUPPORTED_LORA_TARGET_MODULES"], consts["LORA_TARGET_ALL_MODULES"]]}


# --------------------------------------------------------------------------------------- checking
class Contract:
    """The contract of one SGLang version (see :func:`load_contract`)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.pin: str = data["sglang"]
        self.paths = frozenset(data["routes"])
        self._aliases: dict[str, str] = data["aliases"]
        self._structs = frozenset(data["structs"])

    def route(self, path: str) -> dict[str, Any]:
        try:
            return self.data["routes"][path]
        except KeyError:
            raise ContractError(f"{path} is not an endpoint of SGLang {self.pin} that the project calls "
                                f"(known: {sorted(self.paths)})") from None

    def methods(self, path: str) -> list[str]:
        """HTTP methods of ``path``."""
        return list(self.route(path)["methods"])

    def auth_level(self, path: str) -> str:
        """"NORMAL", "ADMIN_OPTIONAL" or "ADMIN_FORCE" (SGLang's ``@auth_level``)."""
        return str(self.route(path)["auth_level"])

    def fields(self, path: str) -> set[str]:
        """The body fields ``path`` accepts (empty for a route without a request body): its request class's and,
        for ``/generate``, its target's (``GenerateReqInput``)."""
        route = self.route(path)
        out: set[str] = set()
        for cls in (route["request"], route.get("target")):
            if cls:
                out |= set(self.data["classes"][cls]["fields"])
        return out

    def check_request(self, path: str, body: Any, method: str = "POST", allow_extra: Any = ()) -> None:
        """ContractError naming the endpoint, field, value and SGLang's expectation when ``body`` breaks
        the contract; unknown fields are refused too (SGLang would drop them without a word) unless
        listed in ``allow_extra``."""
        route = self.route(path)
        if method.upper() not in route["methods"]:
            raise ContractError(f"{method} {path}: SGLang {self.pin} serves it with {route['methods']} only")
        cls = route["request"]
        if cls is None:
            if body not in (None, {}):
                raise ContractError(f"{path} takes no request body in SGLang {self.pin} (got {str(body)[:80]})")
            return
        extra = set(allow_extra)
        target = route.get("target")
        if target and isinstance(body, dict):  # fields the gate ignores but the route's own class takes
            spec, gate = self.data["classes"][target]["fields"], self.data["classes"][cls]["fields"]
            for name in set(body) & set(spec) - set(gate):
                if not self._matches(body[name], spec[name]["type"]):
                    raise ContractError(f"{path}: {name}={body[name]!r} does not match {target}.{name}: "
                                        f"{spec[name]['type']} in SGLang {self.pin}")
                extra.add(name)
        self._check_object(path, cls, {} if body is None else body, extra)
        if cls == "GenerateRequest" and isinstance(body, dict) and body.get("sampling_params") is not None:
            sps = body["sampling_params"]
            for i, sp in enumerate(sps if isinstance(sps, list) else [sps]):
                self._check_object(f"{path} sampling_params[{i}]", "SamplingParams", sp, set())

    def _check_object(self, where: str, cls: str, body: Any, allow_extra: set[str]) -> None:
        spec = self.data["classes"][cls]
        if not isinstance(body, dict):
            raise ContractError(f"{where}: the body must be a JSON object ({cls}), got {type(body).__name__}")
        fields = spec["fields"]
        unknown = sorted(set(body) - set(fields) - allow_extra)
        if unknown:
            how = "rejects" if spec["unknown_keys"] == "rejected" else "would silently ignore"
            raise ContractError(f"{where}: {unknown} are not fields of SGLang {self.pin}'s {cls}, which {how} them; "
                                f"known fields: {sorted(fields)}")
        for name, f in fields.items():
            if name not in body:
                if f["required"]:
                    raise ContractError(f"{where}: required field {name!r} ({f['type']}) of {cls} is missing")
                continue
            if not self._matches(body[name], f["type"]):
                raise ContractError(f"{where}: {name}={body[name]!r} does not match {cls}.{name}: {f['type']} "
                                    f"in SGLang {self.pin}")

    def _matches(self, value: Any, annotation: str) -> bool:
        return self._match(value, ast.parse(annotation, mode="eval").body)

    def _match(self, v: Any, t: ast.expr) -> bool:
        if isinstance(t, ast.Constant) and t.value is None:
            return v is None
        if isinstance(t, ast.Name):
            n = t.id
            if n in self._aliases:
                return self._matches(v, self._aliases[n])
            simple = {"int": lambda: isinstance(v, int) and not isinstance(v, bool),
                      "float": lambda: isinstance(v, (int, float)) and not isinstance(v, bool),
                      "str": lambda: isinstance(v, str), "bool": lambda: isinstance(v, bool),
                      "Any": lambda: True, "dict": lambda: isinstance(v, dict), "list": lambda: isinstance(v, list)}
            if n in simple:
                return simple[n]()
            return isinstance(v, dict) if n in self._structs else True  # a struct: an object; else not checked
        if isinstance(t, ast.Subscript):
            head = ast.unparse(t.value).split(".")[-1]
            args = list(t.slice.elts) if isinstance(t.slice, ast.Tuple) else [t.slice]
            if head == "Optional":
                return v is None or self._match(v, args[0])
            if head == "Union":
                return any(self._match(v, a) for a in args)
            if head in ("List", "list", "Set", "set"):
                return isinstance(v, list) and all(self._match(x, args[0]) for x in v)
            if head in ("Tuple", "tuple"):
                return isinstance(v, list) and (len(args) == 2 and isinstance(args[1], ast.Constant)
                                                or len(v) == len(args))
            if head in ("Dict", "dict"):
                return isinstance(v, dict) and all(self._match(x, args[1]) for x in v.values())
            if head == "Literal":
                return v in [ast.literal_eval(a) for a in args]
            if head == "Annotated":
                return self._match(v, args[0])
        return True  # forms this checker does not know are left to SGLang


def load_contract(path: str | os.PathLike | None = None) -> Contract:
    """The committed contract of :data:`SGLANG_PIN` (or the JSON at ``path``)."""
    default = Path(__file__).with_name(f"sglang_contract_{SGLANG_PIN.replace('.', '_')}.json")
    return Contract(json.loads((Path(path) if path is not None else default).read_text()))


def cache_dir() -> Path:
    """``$AGENTRL_CACHE_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/agentrl``, plus ``/wheels``."""
    root = os.environ.get("AGENTRL_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl"
    return Path(root) / "wheels"


def find_wheel(pin: str = SGLANG_PIN, fetch: bool = False, timeout_s: float = 300.0) -> Path | None:
    """The SGLang wheel of ``pin``: ``$AGENTRL_SGLANG_WHEEL``, else the cache (:func:`cache_dir`); with
    ``fetch``, downloaded there by ``pip download --no-deps`` when missing. None when unavailable."""
    env = os.environ.get("AGENTRL_SGLANG_WHEEL")
    if env:
        return Path(env) if Path(env).is_file() else None
    cache = cache_dir()
    found = sorted(cache.glob(f"sglang-{pin}-*.whl"))
    if found or not fetch:
        return found[0] if found else None
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={pin}", "-d", str(cache)]
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s, capture_output=True, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        logger.warning("could not download sglang==%s: %s", pin, getattr(e, "stderr", None) or e)
        return None
    found = sorted(cache.glob(f"sglang-{pin}-*.whl"))
    return found[0] if found else None


def main(argv: list[str] | None = None) -> None:
    """``python -m rollout_sglang.testing.sglang_contract --wheel W --out JSON``: regenerate a contract."""
    ap = argparse.ArgumentParser(description="extract SGLang's request contract from its wheel")
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    Path(args.out).write_text(json.dumps(extract_contract(args.wheel), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
