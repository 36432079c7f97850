"""JSON under limits, with no HTTP dependency: a nesting check that never recurses, parsing that refuses
what is too deep (and ``NaN``), and compact UTF-8 output. The HTTP services and the tool-call parser use it.

Parsing tries msgspec first (faster than ``json``; what it accepts it parses as ``json`` does) and leaves
to ``json.loads`` whatever it refuses, so the values and the errors are ``json``'s.
Output is msgspec's (faster than ``json.dumps``, the same bytes for JSON values), with one
difference that is JSON's own rule: a float that is not finite is written ``null`` (``json.dumps`` writes
``NaN``, which no strict parser, ours included, accepts)."""
from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

import msgspec

#: deepest nesting of arrays and objects accepted in a JSON body (the protocol needs under 10 levels;
#: the parser recurses once per level, so an unbounded depth would exhaust the stack)
MAX_JSON_DEPTH = 100

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_RUNS = re.compile(rb"\[+|\]+")


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects deeper than ``limit`` (brackets inside
    strings do not count). Never recurses; C-speed passes, well under a second for 32 MiB."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(_TO_SQUARE, _NOT_BRACKET)
    if b"[" * (limit + 1) in brackets:
        return True
    # each pass removes the innermost pairs, lowering the peak by one; after k passes every run of
    # openers left stands for a subtree of 2(k+1) bytes or more, so few runs remain to add up
    passes = 0
    for _ in range(min(limit, 8)):
        reduced = brackets.replace(b"[]", b"")
        if len(reduced) == len(brackets):
            break
        brackets, passes = reduced, passes + 1
    lengths = [len(run) for run in _RUNS.findall(brackets)]
    if not lengths:
        return passes > limit
    closers = 1 if brackets.startswith(b"[") else 0  # runs alternate: openers, closers, openers, ...
    lengths[closers::2] = [-n for n in lengths[closers::2]]
    return max(itertools.accumulate(lengths)) + passes > limit


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


#: made once (``json.loads`` / ``json.dumps`` with options build a new decoder / encoder per call)
_STRICT = json.JSONDecoder(parse_constant=_no_constant)
_LAX = json.JSONDecoder()
_ENCODER = msgspec.json.Encoder()
_COMPACT_ASCII = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
#: msgspec's decoder gives what json.loads gives for every text it accepts (RFC 8259 JSON in UTF-8); it
#: refuses the rest (NaN, Infinity, numbers past a float, lone surrogate escapes, other encodings, a BOM)
_MSGSPEC = msgspec.json.Decoder()


def loads_json(raw: bytes | str, limit: int = MAX_JSON_DEPTH, strict: bool = True) -> Any:
    """Parse JSON with a nesting limit; ValueError saying what is wrong. ``strict`` refuses
    ``NaN`` and ``Infinity`` (not JSON, though Python writes them)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if json_too_deep(data, limit):
        raise ValueError(f"JSON nested deeper than {limit} levels of arrays and objects")
    try:
        if isinstance(raw, str):
            return json.loads(raw, parse_constant=_no_constant) if strict else json.loads(raw)
        try:  # msgspec first, the faster; whatever it refuses, json.loads decides (its values, its errors)
            return _MSGSPEC.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            pass
        # as json.loads does for bytes: UTF-8, -16 or -32 by the first bytes
        text = data.decode(json.detect_encoding(data), "surrogatepass")
        return (_STRICT if strict else _LAX).decode(text)
    except RecursionError:  # only when the stack is already deep: the limit keeps parsing shallow
        raise ValueError(f"JSON nested too deep to parse (limit {limit} levels)") from None


def dumps_json(body: Any) -> bytes:
    """Compact JSON in UTF-8, non-ASCII text as is (escaping it as ``\\uXXXX`` can triple its size), floats
    that are not finite as ``null``; TypeError for what JSON cannot hold."""
    try:
        return _ENCODER.encode(body)
    except UnicodeEncodeError:  # a lone surrogate (sent as "\ud800") has no UTF-8 form: keep escapes
        return _COMPACT_ASCII.encode(_finite(body)).encode()


def _finite(value: Any) -> Any:
    """``value`` with floats that are not finite made None (for the rare escaped path)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
