"""Command-line options made from dataclass fields: an option is stated once, on its field.

The field's name, type, default and help are the option's; `add_options` writes them into an
argparse parser and `from_args` builds the dataclass back from what was parsed, so the library gets
the same object a notebook would build by hand. A field is an option when its metadata has "help":

    max_steps: int | None = field(default=None, metadata={"help": "train to this step"})
    max_steps: int | None = option(None, help="train to this step")        # the same field, shorter

Metadata keys: "help" (one line), "flag" ("--name"; default the field's name with _ -> -; a name
without a leading dash, e.g. "RUN_DIR", makes a positional argument, shown as its metavar, else as
that name), "choices" (for a set known only at run time; a fixed set is the annotation's
`Literal`), "metavar", "alias" (a positional's flag spelling too, e.g. "--run-dir"; with
"deprecated": True, using it prints a one-line note). Other keys are for the library (e.g. "sets":
"train.max_steps", read by `targets`).
The annotation gives the type: int, float, str, Path (a union with str or None reads as str: the
library takes either), a `Literal` of values (the option's choices); a list, tuple or Sequence of X
takes one or more values (given twice, they add up); bool is a flag that sets the field to the
opposite of its default (`progress: bool = True` with "flag": "--quiet"). A field without a default
is a required option.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import difflib
import shlex
import sys
import types
import typing
from typing import Any

from tinygpt.core.fields import literal_choices

_SEVERAL = (list, tuple, collections.abc.Sequence)
# the parsed value of a positional's flag spelling lands under the field's name + this
_ALIAS = "__alias"


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    **metadata: Any,
) -> Any:
    """A dataclass field that is a command-line option: `dataclasses.field` with "help" and the
    other metadata keys (flag, choices, metavar, ...) given as keywords."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"help": help, **metadata}
    )


def did_you_mean(word: Any, names: collections.abc.Iterable[str]) -> str:
    """ " (did you mean 'cpu-smoke'?)" for a misspelled
    `word` close to one of `names`; "" when none is."""
    close = difflib.get_close_matches(str(word), list(names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` that are command-line options (those with help), in order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_options(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Each option field of dataclass `cls` as an argument of `parser`,
    in one group titled `title` (default: the first line of the class's
    docstring). Parsed, each lands under the field's name."""
    group = parser.add_argument_group(
        title or (cls.__doc__ or cls.__name__).strip().splitlines()[0]
    )
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls):
        names, kwargs = _argument(f, hints[f.name])
        group.add_argument(*names, **kwargs)
        if alias := f.metadata.get("alias"):
            shown = f"the same as {kwargs['metavar']}"
            if f.metadata.get("deprecated"):
                shown = argparse.SUPPRESS
            group.add_argument(
                alias,
                dest=f.name + _ALIAS,
                type=kwargs.get("type"),
                metavar=kwargs["metavar"],
                help=shown,
            )


def from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """`cls` built from parsed arguments: each option field takes its parsed value (its own default
    where the option was not given), `extra` the fields that are not options (e.g. callbacks)."""
    given = {f.name: v for f in option_fields(cls) if (v := _value(f, args)) is not None}
    return cls(**given, **extra)


def _value(f: dataclasses.Field, args: argparse.Namespace) -> Any:
    """A field's parsed value: a positional's, or its alias flag's (never
    both, with the note a deprecated alias prints); a required positional
    with an alias given neither way is a ValueError that says so."""
    value, alias = getattr(args, f.name, None), getattr(args, f.name + _ALIAS, None)
    meta, command = f.metadata, f"tinygpt {getattr(args, 'command', '') or ''}".rstrip()
    if alias is not None:
        if value is not None and value != alias:
            raise ValueError(
                f"{meta['flag']} is given twice ({value} and {meta['alias']} {alias}): give it once"
            )
        if meta.get("deprecated"):
            print(
                f"note: {meta['alias']} is deprecated; give it as the first argument: {command} "
                f"{shlex.quote(str(alias))} ...",
                file=sys.stderr,
                flush=True,
            )
        return alias
    if value is None and "alias" in meta and f.default is f.default_factory is dataclasses.MISSING:
        raise ValueError(
            f"give {meta['flag']}: {command} {meta['flag']} ... (or {meta['alias']} {meta['flag']})"
        )
    return value


def targets(obj: Any) -> dict[str, dict[str, Any]]:
    """The values of `obj`'s fields whose metadata says "sets": "SECTION.FIELD", as {section:
    {field: value}}; a field left at None (or an empty string) sets nothing."""
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(obj):
        if "sets" in f.metadata and (value := getattr(obj, f.name)) not in (None, ""):
            section, name = f.metadata["sets"].split(".")
            out.setdefault(section, {})[name] = value
    return out


def _argument(f: dataclasses.Field, hint: Any) -> tuple[list[str], dict[str, Any]]:
    """add_argument's names and keywords for one option field."""
    meta = f.metadata
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    value_type, several = _value_type(hint)
    # the metadata's, else the annotation's Literal
    words = meta.get("choices", literal_choices(hint))
    kwargs: dict[str, Any] = {"metavar": meta["metavar"]} if "metavar" in meta else {}
    if words is not None:  # a misspelled choice is answered with the closest one
        kwargs["choices"] = words
        value_type = _one_of(value_type, tuple(words))
    if value_type is bool:  # a flag: present means the opposite of the default
        kwargs.update(action="store_false" if default else "store_true", default=default)
    elif several:  # None until given, so the field's own default applies (argparse would extend it)
        kwargs.update(nargs="+", type=value_type, action="extend", default=None)
    else:
        kwargs.update(type=value_type)
        if default is not dataclasses.MISSING:
            kwargs["default"] = default
    kwargs["help"] = _help(meta["help"], None if value_type is bool else default)
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    # a positional argument, shown as its metavar, else as the flag's text
    if not flag.startswith("-"):
        kwargs.setdefault("metavar", flag)
        if default is not dataclasses.MISSING or "alias" in meta:  # required: from_args checks
            kwargs["nargs"] = "?"
        if "alias" in meta:  # None when not given, so that from_args can tell it from the alias
            kwargs["default"] = None
        return [f.name], kwargs
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    # as argparse shows its own dest: --max-steps MAX_STEPS
    if value_type is not bool and words is None:
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    return [flag], {**kwargs, "dest": f.name}


def _one_of(value_type: Any, choices: tuple) -> Any:
    """`value_type` that refuses a value outside `choices`
    with argparse's message and the closest one."""

    def convert(text: str) -> Any:
        value = value_type(text)
        if value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r}{did_you_mean(text, map(str, choices))} "
                f"(choose from {', '.join(map(str, choices))})"
            )
        return value

    # argparse names the type in some errors
    convert.__name__ = getattr(value_type, "__name__", "value")
    return convert


def _value_type(hint: Any) -> tuple[type, bool]:
    """(the type of one value, whether the option takes several) from a field's annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = str if str in members else members[0]
    if typing.get_origin(hint) in _SEVERAL:
        return typing.get_args(hint)[0], True
    if typing.get_origin(hint) is typing.Literal:  # its values' type: str for Literal["a", "b"]
        return type(typing.get_args(hint)[0]), False
    return hint, False


def _help(text: str, default: Any) -> str:
    """The help line with the default added where it says something (not None, not already said);
    % doubled, as argparse formats help with it."""
    if isinstance(default, (list, tuple)):
        default = " ".join(map(str, default)) or None
    if default not in (None, dataclasses.MISSING) and "default" not in text:
        text = f"{text} (default: {default})"
    return text.replace("%", "%%")
