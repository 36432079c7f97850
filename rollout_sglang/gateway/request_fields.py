"""The checks of a request's fields that the three wire formats share: unknown fields, ``model``, the sampling
numbers, flags, serial tool calls; each failure an :class:`~rollout_sglang.gateway.turn.ApiError` 400 naming the
field (:func:`~rollout_sglang.gateway.turn.bad`)."""
from __future__ import annotations

import math
from collections.abc import Container
from typing import Any

from rollout_sglang.gateway.turn import bad


def is_int(v: Any) -> bool:
    """An integer of JSON (not a boolean)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite number of JSON (not a boolean)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def refuse_unknown(body: dict[str, Any], known: Container[str], accepted: str) -> None:
    """ApiError 400 naming the first field of ``body`` outside ``known``; ``accepted`` lists the fields this
    gateway samples with, for the message."""
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad(unknown[0], f"unsupported field(s) {', '.join(unknown)}; this gateway samples with {accepted}",
                  code="unsupported_parameter")


def model(body: dict[str, Any]) -> str:
    """The request's ``model``: required, a non-empty string (any name: the gateway serves one policy)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required (a non-empty string; this gateway serves one policy whatever it is called)")
    return model


def sampling(body: dict[str, Any], max_temperature: float) -> tuple[float | None, float | None]:
    """``(temperature, top_p)`` of the request, each None when absent: a temperature in [0, ``max_temperature``],
    a top_p in (0, 1]."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and not (is_number(temperature) and 0 <= temperature <= max_temperature):
        raise bad("temperature", f"must be a number in [0, {max_temperature:g}], got {temperature!r:.60}")
    if top_p is not None and not (is_number(top_p) and 0 < top_p <= 1):
        raise bad("top_p", f"must be a number in (0, 1], got {top_p!r:.60}")
    return (None if temperature is None else float(temperature)), (None if top_p is None else float(top_p))


def flag(body: dict[str, Any], key: str) -> bool | None:
    """The boolean field ``key`` of the request, None when absent."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(key, f"must be true or false, got {value!r:.60}")
    return value


def refuse_serial_tool_calls(body: dict[str, Any]) -> None:
    """ApiError 400 for ``parallel_tool_calls: false``, which sampling cannot honour."""
    if body.get("parallel_tool_calls") is False:
        raise bad("parallel_tool_calls", "false is not supported: sampling cannot be held to one call, and the "
                                         "trajectory keeps every call the model wrote", code="unsupported_parameter")

