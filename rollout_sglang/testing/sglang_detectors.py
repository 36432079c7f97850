"""SGLang's own tool-call detectors, loaded from its wheel without installing SGLang: the differential check of our
Hermes / Qwen parser (``tests/rollout/test_sglang_tool_calls.py``).

:func:`load_detectors` executes ``sglang/srt/function_call/{core_types,utils,base_format_detector,qwen25_detector,
hermes_detector}.py`` from the wheel in a private module namespace, with stand-ins for what they import but never
use on the one-shot path (``detect_and_parse``): orjson (as json), partial_json_parser (streaming only), the
OpenAI ``Tool`` models (the detectors read ``tool.function.name`` only) and SGLang's environment switches
(``SGLANG_FORWARD_UNKNOWN_TOOLS`` at its default, off). pydantic is the one real dependency. ``sys.modules`` is
left as it was.
"""
from __future__ import annotations

import enum
import json
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

_SOURCES = ("core_types", "utils", "base_format_detector", "qwen25_detector", "hermes_detector")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


class _Allow(enum.IntFlag):
    """partial_json_parser's ``Allow`` flags (used by the streaming path only)."""

    STR = 1
    NUM = 2
    ARR = 4
    OBJ = 8
    NULL = 16
    BOOL = 32
    NAN = 64
    INFINITY = 128
    _INFINITY = 256
    INF = 384
    SPECIAL = 496
    ATOM = 499
    COLLECTION = 12
    ALL = 511


class _EnvBool:
    def __init__(self, value: bool) -> None:
        self.value = value

    def get(self) -> bool:
        return self.value


def _stand_ins() -> dict[str, types.ModuleType]:
    def orjson_dumps(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")

    class Tool:  # the detectors read tool.function.name only
        pass

    class MalformedJSON(Exception):
        pass

    pjp = _module("partial_json_parser", loads=json.loads)
    return {
        "orjson": _module("orjson", loads=json.loads, dumps=orjson_dumps, JSONDecodeError=json.JSONDecodeError),
        "partial_json_parser": pjp,
        "partial_json_parser.core": _module("partial_json_parser.core"),
        "partial_json_parser.core.exceptions": _module("partial_json_parser.core.exceptions",
                                                       MalformedJSON=MalformedJSON),
        "partial_json_parser.core.options": _module("partial_json_parser.core.options", Allow=_Allow),
        "sglang": _module("sglang", __path__=[]),
        "sglang.srt": _module("sglang.srt", __path__=[]),
        "sglang.srt.entrypoints": _module("sglang.srt.entrypoints", __path__=[]),
        "sglang.srt.entrypoints.openai": _module("sglang.srt.entrypoints.openai", __path__=[]),
        "sglang.srt.entrypoints.openai.protocol": _module("sglang.srt.entrypoints.openai.protocol", Tool=Tool,
                                                          ToolChoice=Tool),
        "sglang.srt.environ": _module("sglang.srt.environ", envs=types.SimpleNamespace(
            SGLANG_FORWARD_UNKNOWN_TOOLS=_EnvBool(False))),
        "sglang.srt.function_call": _module("sglang.srt.function_call", __path__=[]),
    }


def load_detectors(wheel: str | Path) -> types.SimpleNamespace:
    """``Qwen25Detector`` and ``HermesDetector`` (classes) from the SGLang wheel at ``wheel``."""
    stand_ins = _stand_ins()
    saved = {name: sys.modules.get(name) for name in [*stand_ins, *(f"sglang.srt.function_call.{s}" for s in
                                                                     _SOURCES)]}
    loaded: dict[str, types.ModuleType] = {}
    try:
        sys.modules.update(stand_ins)
        with zipfile.ZipFile(wheel) as z:
            for short in _SOURCES:
                name = f"sglang.srt.function_call.{short}"
                mod = types.ModuleType(name)
                mod.__file__ = f"{wheel}!sglang/srt/function_call/{short}.py"
                sys.modules[name] = mod
                code = compile(z.read(f"sglang/srt/function_call/{short}.py"), mod.__file__, "exec")
                exec(code, mod.__dict__)  # noqa: S102 - SGLang's pinned source, the point of the check
                loaded[short] = mod
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return types.SimpleNamespace(Qwen25Detector=loaded["qwen25_detector"].Qwen25Detector,
                                 HermesDetector=loaded["hermes_detector"].HermesDetector)


def tools_for(names: list[str]) -> list[Any]:
    """Tool objects as the detectors read them (``tool.function.name``)."""
    return [types.SimpleNamespace(function=types.SimpleNamespace(name=n)) for n in names]


def sglang_calls(detector: Any, text: str, names: list[str]) -> list[tuple[str, Any]]:
    """``(name, arguments)`` of each call SGLang's one-shot ``detect_and_parse`` reads from ``text``."""
    result = detector.detect_and_parse(text, tools_for(names))
    return [(c.name, json.loads(c.parameters)) for c in result.calls]
