"""Argument checks shared by every layer: one definition of what a count, a flag or a ratio is, and of the kinds
a dataclass's field annotations (a method's parameters) or a constructor's (a task's settings) promise."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any


def is_int(value: Any) -> bool:
    """An integer, and not a bool (True is an int to Python, not a token count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_field_kinds(instance: Any) -> None:
    """Every init field of the dataclass `instance` holds a value of the kind its annotation says, or a ValueError
    names the field, the kind and the value. `int`: a whole number (True is not one); `float`: any number; `bool`:
    true or false; `str`: text; `Literal[...]`: one of its values; `list[X]`: a list of X; `X | None`: X or null.
    Other annotations are not checked, nor is any range: those checks are the class's own."""
    hints = _field_hints(type(instance))
    for field in dataclasses.fields(instance):
        if field.init and not _is_kind(value := getattr(instance, field.name), hints[field.name]):
            raise ValueError(f"{field.name} must be {_describe(hints[field.name])}, got {value!r}")


def check_argument_kinds(function: Callable[..., Any], arguments: Mapping[str, Any]) -> None:
    """Each of `arguments` that `function`'s signature annotates holds a value of that kind (the kinds of
    `check_field_kinds`; a `Sequence[X]` is a list of X), or a ValueError names the argument, the kind and the value.
    Called before `function` runs, so a flag given as `maybe` is refused rather than read as true."""
    hints = _argument_hints(function)
    for name, value in arguments.items():
        if name in hints and not _is_kind(value, hints[name]):
            raise ValueError(f"{name} must be {_describe(hints[name])}, got {value!r}")


@functools.lru_cache(maxsize=None)
def _argument_hints(function: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function)
    except NameError:  # an annotation its module cannot resolve: left unchecked
        return {}


@functools.lru_cache(maxsize=None)
def _field_hints(cls: type) -> dict[str, Any]:
    """The fields' annotations, resolved (`from __future__ import annotations` makes them text). One naming what
    its module cannot resolve (a class defined inside a function) stays text, and unchecked."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        return {field.name: field.type for field in dataclasses.fields(cls)}


def _is_kind(value: Any, kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_is_kind(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)  # 1 is not True, nor "1"
    if origin in (list, collections.abc.Sequence):
        return isinstance(value, (list, tuple)) and all(_is_kind(item, args[0]) for item in value)
    checks = {type(None): lambda v: v is None, bool: lambda v: isinstance(v, bool), int: is_int,
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), str: lambda v: isinstance(v, str)}
    return checks[kind](value) if kind in checks else True


_KINDS = {type(None): ("null", "nulls"), bool: ("true or false", "true/false values"), int: ("an integer", "integers"),
          float: ("a number", "numbers"), str: ("text", "texts")}


def _describe(kind: Any, plural: bool = False) -> str:
    """`an integer`, `a list of integers or null`, `one of max, avg`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        described = [_describe(arg, plural) for arg in args]
        return ", ".join(described[:-1]) + " or " + described[-1]
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (list, collections.abc.Sequence):
        return f"a list of {_describe(args[0], plural=True)}"
    return _KINDS.get(kind, (getattr(kind, "__name__", str(kind)),) * 2)[plural]
