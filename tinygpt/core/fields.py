"""What a dataclass field allows, declared once on the field and read by the checks and the CLI.

A fixed set of words is a `Literal` annotation (`literal_choices` reads it: the validators and the
command line's choices); a number's bounds are its metadata (`bounded`); `field_problem` checks a
whole dataclass against those declarations. Adding a value (a schedule, a precision, a loss mode)
is one entry in its Literal, plus the code that uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal


def bounded(default: Any, **bounds: Any) -> Any:
    """A number field with its bounds: "min" / "max" (inclusive), "above" / "below" (exclusive),
    and "why" (said after the message when they are not met)."""
    return dataclasses.field(default=default, metadata=bounds)


def literal_choices(hint: Any) -> tuple | None:
    """The values a `Literal` annotation (or a union with one, e.g. `Literal[...] | None`) allows;
    None for any other annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = (literal_choices(a) for a in typing.get_args(hint))
        return next((c for c in found if c is not None), None)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_problem(obj: Any, where: str = "") -> str | None:
    """The first field of dataclass `obj` that is not as its declaration allows, in one line: what
    `where` + the field must be, and what it got (None when every field is). A field must be one of
    its `Literal`'s values, a whole number for an int, a finite number for a float, True or False
    for a bool, within the bounds of its metadata (`bounded`); None only where the annotation
    allows it. Other types (str, paths, lists) are not checked here."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if (allowed := _allowed(hints[f.name], f.metadata, value)) is not None:
            why = f": {f.metadata['why']}" if "why" in f.metadata else ""
            return f"{where}{f.name} must be {allowed}, got {value!r}{why}"
    return None


def _allowed(hint: Any, meta: Any, value: Any) -> str | None:
    """What `value` must be, in words, when it is not what `hint` and the bounds in `meta` allow;
    None when it is."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in members:
        return None
    kind = next((m for m in members if m is not type(None)), hint)
    if (words := literal_choices(kind)) is not None:
        return None if value in words else "one of " + ", ".join(map(str, words))
    if kind is bool:
        return None if isinstance(value, bool) else "True or False"
    if kind not in (int, float):
        return None
    finite = isinstance(value, (int, float)) and math.isfinite(value)
    number = not isinstance(value, bool) and (isinstance(value, int) if kind is int else finite)
    lo, above, hi, below = (meta.get(k) for k in ("min", "above", "max", "below"))
    if (
        number
        and (lo is None or value >= lo)
        and (above is None or value > above)
        and (hi is None or value <= hi)
        and (below is None or value < below)
    ):
        return None
    noun = "whole number" if kind is int else "finite number"
    if above == 0 or (lo == 1 and kind is int):
        text = f"a positive {noun}"
    elif lo == 0:
        text = f"0 or a positive {noun}"
    else:
        text = f"a {noun}" + (f" of at least {lo}" if lo is not None else "")
        text += f" above {above}" if above is not None else ""
    text += f" up to {hi}" if hi is not None else ""
    return text + (f" below {below}" if below is not None else "")
