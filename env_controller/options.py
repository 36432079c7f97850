"""Options: how every component of the project declares its settings and checks them, once.

A component takes one options object: a dataclass that derives from :class:`Options`, with each field
documented where it is declared. It checks its own fields when it is built (:meth:`Options.check`, extended by
each class with its ranges): non-finite floats and values outside a ``Literal`` field's choices are refused for
all. A refusal is a :class:`FieldError` whose message names the dotted key, the value and the fix, e.g.
``gateway.max_sessions=0 must be a positive integer``. Options compose by inheritance (a task's options are the
task's own fields plus :class:`~env_controller.sandbox.options.ContainerOptions`, keys flat as users write them)
or by nesting (a field whose type is another options class).

:func:`build_options` makes an options object from a plain mapping (YAML, ``--param key=value``, a request):
each value is checked against its field's type (``"3"`` is no integer), an unknown key is refused with a "did you
mean" hint and the valid keys, and a key listed in ``MOVED`` is refused naming its new place. The trainer's
config (``megatron_agentrl.config``) is built the same way, its sections being options classes.

Lowest layer on purpose: the three packages all build on it, so nothing here imports torch or the other two.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, TypeVar

T = TypeVar("T")


class OptionError(ValueError):
    """A bad setting (a config file, key or value); the message names it and the fix."""


class FieldError(OptionError):
    """A bad field of one options object: ``key`` (the object's place), ``name``, ``value`` and ``rule``.

    The object that raises it knows only its default place (``KEY``); a caller that knows where it sits
    (``tasks[2]``) says it again with :meth:`at`.
    """

    def __init__(self, key: str, name: str, value: Any, rule: str) -> None:
        self.key, self.name, self.value, self.rule = key, name, value, rule
        super().__init__(self._message())

    @property
    def where(self) -> str:
        """The dotted key of the field."""
        return f"{self.key}.{self.name}" if self.key else self.name

    def _message(self) -> str:
        return f"{self.where}={self.value!r} {self.rule}"

    def at(self, key: str) -> FieldError:
        """The same error, placed under ``key``."""
        return type(self)(key, self.name, self.value, self.rule)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved field types of a dataclass (annotations are strings under ``from __future__``)."""
    return typing.get_type_hints(cls)


class Options:
    """Base of every options class (a dataclass): it checks its own fields when it is built.

    ``KEY`` is the object's place, the prefix of its messages; ``CHOICE_HINTS`` adds a word on a choice
    field; ``MOVED`` maps a key that moved elsewhere to its dotted place there (refused, naming it).
    """

    KEY: ClassVar[str] = ""
    CHOICE_HINTS: ClassVar[dict[str, str]] = {}
    MOVED: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`FieldError` naming the first bad field; subclasses add their rules after ``super()``."""
        hints = field_types(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise self.bad(f.name, "must be a finite number")
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
            if choices and value not in choices:
                hint = self.CHOICE_HINTS.get(f.name)
                raise self.bad(f.name, f"is not one of {', '.join(map(str, choices))}" + (f" ({hint})" if hint else ""))

    def bad(self, name: str, rule: str) -> FieldError:
        """The error for field ``name`` (its current value) breaking ``rule``."""
        return FieldError(self.KEY, name, getattr(self, name), rule)

    def require(self, ok: bool, name: str, rule: str) -> None:
        """Raise :meth:`bad` unless ``ok``."""
        if not ok:
            raise self.bad(name, rule)

    def require_positive_int(self, *names: str) -> None:
        """Each field of ``names`` is an integer >= 1."""
        for name in names:
            v = getattr(self, name)
            self.require(_is_int(v) and v >= 1, name, "must be a positive integer")

    def require_int(self, name: str, low: int | None = None, high: int | None = None, why: str = "") -> None:
        """Field ``name`` is an integer in ``low..high`` (either bound may be left out); ``why`` ends the message."""
        v = getattr(self, name)
        if low is not None and high is not None:
            rule = f"must be an integer in {low}..{high}"
        elif low is not None:
            rule = f"must be an integer >= {low}"
        elif high is not None:
            rule = f"must be an integer <= {high}"
        else:
            rule = "must be an integer"
        ok = _is_int(v) and (low is None or v >= low) and (high is None or v <= high)
        self.require(ok, name, rule + (f" ({why})" if why else ""))

    def require_non_negative(self, *names: str, why: str = "") -> None:
        """Each field of ``names`` is a number >= 0; ``why`` says what 0 means."""
        for name in names:
            v = getattr(self, name)
            self.require(_is_number(v) and v >= 0, name, "must be >= 0" + (f" ({why})" if why else ""))

    def require_above_zero(self, *names: str, unit: str = "") -> None:
        """Each field of ``names`` is a number > 0 (``unit`` ends the message, e.g. "seconds")."""
        for name in names:
            v = getattr(self, name)
            self.require(_is_number(v) and v > 0, name, "must be > 0" + (f" {unit}" if unit else ""))


    def require_seconds(self, *names: str) -> None:
        """Each field of ``names`` is a positive, finite number of seconds."""
        for name in names:
            v = getattr(self, name)
            self.require(_is_number(v) and 0 < v < math.inf, name, "must be a positive (finite) number of seconds")

    def require_string(self, name: str, *, empty: bool = False, optional: bool = False) -> None:
        """Field ``name`` is a string (non-empty unless ``empty``), or None when ``optional``."""
        value = getattr(self, name)
        if value is None and optional:
            return
        kind = "a string" if empty else "a non-empty string"
        self.require(isinstance(value, str) and (empty or bool(value)), name,
                     f"must be {kind}" + (" or null" if optional else ""))

    def require_bool(self, *names: str) -> None:
        """Each field of ``names`` is true or false."""
        for name in names:
            self.require(isinstance(getattr(self, name), bool), name, "must be true or false")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def placed(key: str, check: Callable[[], T]) -> T:
    """Run ``check`` (a constructor or check), its field errors placed under ``key``."""
    try:
        return check()
    except FieldError as e:
        raise e.at(key) from None


def coerce(value: Any, hint: Any, prefix: str, name: str) -> Any:
    """Check/convert ``value`` of field ``name`` (under ``prefix``) to the annotated type ``hint``;
    :class:`FieldError` on a mismatch.

    ``Literal`` choices pass through (the options class checks them, with its hint); a dataclass type is built
    from a mapping with :func:`build_options`.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any or origin is Literal:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        first: FieldError | None = None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, prefix, name)
            except FieldError as e:
                first = first or e
        raise first or FieldError(prefix, name, value, "is not a value this key takes")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise FieldError(prefix, name, value, f"must be a mapping of {hint.__name__} fields")
        return build_options(hint, value, f"{prefix}.{name}" if prefix else name)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise FieldError(prefix, name, value, "must be a list")
        item = args[0] if args else Any
        items = [coerce(v, item, prefix, f"{name}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise FieldError(prefix, name, value, "must be a mapping")
        return dict(value)
    if hint is bool and not isinstance(value, bool):
        raise FieldError(prefix, name, value, "must be true or false")
    if hint is int and not _is_int(value):
        if isinstance(value, float) and value.is_integer():  # 1e8 is read as a float
            raise FieldError(prefix, name, value, f"must be an integer; write it without a decimal point or "
                             f"exponent ({int(value)})")
        raise FieldError(prefix, name, value, "must be an integer")
    if hint is float:
        if not _is_number(value):
            raise FieldError(prefix, name, value, "must be a number")
        return float(value)
    if hint is str and not isinstance(value, str):
        raise FieldError(prefix, name, value, "must be a string")
    return value


class UnknownKeyError(FieldError):
    """A key the options class does not have; ``rule`` names a close one and the valid ones."""

    def _message(self) -> str:
        return f"unknown config key '{self.where}'{self.rule.removeprefix(UNKNOWN)}"


#: how the rule of an :class:`UnknownKeyError` starts
UNKNOWN = "is not a key here"


def build_options(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """``cls(**data)`` with every value checked against its field's type; :class:`FieldError` (placed under
    ``prefix``) naming the dotted key of an unknown (:class:`UnknownKeyError`) or mistyped one, or of a value the
    class refuses; :class:`OptionError` for a moved key. Fields declared with ``init=False`` cannot be given."""
    hints = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    moved = getattr(cls, "MOVED", {})
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names and k in moved:
            new, section = moved[k], moved[k].split(".")[0]
            raise OptionError(f"{key} moved to {new}; set it in the '{section}:' section (override: {new}={v!r})")
        if k not in names:
            # an abbreviation (lr ~ learning_rate) is a surer guess than a merely similar spelling
            close = [n for n in names if _abbreviates(n, str(k))][:1] or \
                difflib.get_close_matches(str(k), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{(prefix + '.' if prefix else '') + close[0]}'?" if close else ""
            valid = f"(valid keys here: {', '.join(names)})"
            raise UnknownKeyError(prefix, str(k), v, f"{UNKNOWN}{hint} {valid}")
        kwargs[k] = coerce(v, hints[k], prefix, k)
    return placed(prefix, lambda: cls(**kwargs))


def _abbreviates(short: str, long: str) -> bool:
    """True when ``short`` is an abbreviation of ``long`` (same first letter, letters in order): lr ~ learning_rate."""
    it = iter(long)
    return bool(short) and short[0] == long[:1] and all(c in it for c in short)
