"""The one dtype-name map of the project: each torch dtype, its name and its safetensors code.

A dtype's name is torch's attribute name (``getattr(torch, name)`` inverts it): the spelling of config
files (``model.dtype``), of SGLang's weight-update requests (bucket dtypes travel by name) and of the
``dtype`` our checkpoints record. Its safetensors code (``"BF16"``) is the spelling of safetensors
headers. :func:`dtype_from_name` is the one name -> ``torch.dtype`` lookup, :func:`dtype_name` the one
``torch.dtype`` -> name. Here, below both the trainer and the engines, so that every package can use it
(``env_controller`` does not import torch).
"""
from __future__ import annotations

import torch

# (dtype, name, safetensors code), in the order of safetensors' list
_TABLE: tuple[tuple[torch.dtype, str, str], ...] = (
    (torch.float64, "float64", "F64"),
    (torch.float32, "float32", "F32"),
    (torch.float16, "float16", "F16"),
    (torch.bfloat16, "bfloat16", "BF16"),
    (torch.int64, "int64", "I64"),
    (torch.int32, "int32", "I32"),
    (torch.int16, "int16", "I16"),
    (torch.int8, "int8", "I8"),
    (torch.uint8, "uint8", "U8"),
    (torch.bool, "bool", "BOOL"),
    (torch.float8_e4m3fn, "float8_e4m3fn", "F8_E4M3"),
    (torch.float8_e5m2, "float8_e5m2", "F8_E5M2"),
)
#: dtype names -> torch dtypes
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name, _ in _TABLE}
#: other spellings that config files and command lines use, accepted by :func:`dtype_from_name`
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                                 "half": "float16", "double": "float64"}
#: safetensors header codes -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, _, code in _TABLE}
#: torch dtypes -> safetensors header codes
SAFETENSORS_CODES: dict[torch.dtype, str] = {dtype: code for dtype, _, code in _TABLE}
_NAMES: dict[torch.dtype, str] = {dtype: name for dtype, name, _ in _TABLE}


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a dtype ("bfloat16", "float32", ...); ValueError for a dtype without one here."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no name here, so it cannot be sent in a weight bucket or recorded in a "
                         f"checkpoint; supported: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a name: a key of :data:`DTYPES` or :data:`DTYPE_ALIASES`, any case, an optional
    "torch." prefix. ValueError naming the bad value and the accepted names."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)} "
                         f"(or {sorted(DTYPE_ALIASES)})") from None
