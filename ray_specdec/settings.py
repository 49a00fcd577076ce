"""Declaring a settings dataclass once: each field's bounds, its documentation and its command-line flag.

A field's bounds sit in its declaration (`bounded(8, ge=0, le=32)`); `check_bounds` is the dataclass's validation, and
the app's pydantic fields (deployments/app.py) take the same bounds. A field's documentation is the comment on the line
that declares it, else the comment lines directly above it (`field_docs`): the flag's help, the app argument's
description and its row in docs/SETTINGS.md. `add_arguments` gives a dataclass's fields as flags (`kv_budget_tokens`
-> `--kv-budget-tokens`; booleans as `--prefix-cache / --no-prefix-cache`), every value checked by the dataclass's own
validation as it is parsed, so that a bad one is argparse's one-line error; `from_args` reads them back from anything
that has them as attributes (argparse's namespace, the app's arguments).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import math
import textwrap
import tokenize
import typing
from typing import Any, get_type_hints

_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


@dataclasses.dataclass(frozen=True)
class Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value) -> bool:
        if value is None:
            return True
        low = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        return low and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in _SIGNS if getattr(self, name) is not None}

    def __str__(self) -> str:
        low, high = self.ge if self.ge is not None else self.gt, self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            return f"in {'[' if self.ge is not None else '('}{low}, {high}{']' if self.le is not None else ')'}"
        return " and ".join(f"{_SIGNS[name]} {value}" for name, value in self.as_dict().items())


def bounded(default, *, ge=None, gt=None, le=None, lt=None):
    """A dataclass field with bounds: `lookup: int = bounded(8, ge=0, le=32)`."""
    return dataclasses.field(default=default, metadata={"bounds": Bounds(ge, gt, le, lt)})


def check_bounds(config) -> None:
    """ValueError naming the first field outside its bounds (NaN is outside any)."""
    for f in dataclasses.fields(config):
        bounds, value = f.metadata.get("bounds"), getattr(config, f.name)
        if bounds is not None and not (bounds.holds(value) and not (isinstance(value, float) and math.isnan(value))):
            raise ValueError(f"{f.name} must be {bounds}, got {value}")


def field_bounds(f: dataclasses.Field) -> dict[str, float]:
    bounds = f.metadata.get("bounds")
    return bounds.as_dict() if bounds is not None else {}


def field_docs(cls) -> dict[str, str]:
    """Field name -> its documentation: the comment on the line that declares it, else the comment lines directly
    above it, less a heading line that opens them (a first line without closing punctuation followed by one that
    starts a sentence: "# models"). {} where the source is not shipped."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if lines[node.end_lineno - 1].split("#")[0].strip() and node.end_lineno in comments:
            docs[node.target.id] = comments[node.end_lineno]
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        if len(above) > 1 and above[1][:1].isupper() and above[0][-1:] not in ".:;,":
            above = above[1:]
        docs[node.target.id] = " ".join(above)
    return docs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(group, cls, defaults, notes: dict[str, str] | None = None, skip: tuple[str, ...] = (),
                  where: dict[str, Any] | None = None) -> None:
    """A flag in `group` for every field of the dataclass `cls` but `skip`, defaulting to `defaults`' value, its help
    the field's documentation plus `notes[name]`; `where[name]`: another group for that flag (a mutually exclusive
    one)."""
    docs, types = field_docs(cls), get_type_hints(cls)
    for name, note in (notes or {}).items():
        docs[name] = f"{docs.get(name, '')}; {note}"
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default, target = getattr(defaults, f.name), (where or {}).get(f.name, group)
        if types[f.name] is bool:
            target.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                                help=_help(docs.get(f.name), "on" if default else "off"))
        elif typing.get_origin(types[f.name]) is typing.Literal:
            target.add_argument(flag(f.name), choices=typing.get_args(types[f.name]), default=default,
                                help=_help(docs.get(f.name), default))
        else:
            target.add_argument(flag(f.name), type=_checked(f.name, types[f.name], defaults), default=default,
                                metavar="N" if types[f.name] is int else "X", help=_help(docs.get(f.name), default))


def from_args(cls, args, defaults):
    """`defaults` with the fields of `cls` that `args` has as attributes (one missing or None keeps its default).
    ValueError on a bad value (flags were checked as they were parsed)."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    return dataclasses.replace(defaults, **{name: value for name, value in given.items() if value is not None})


def _help(doc: str | None, default) -> str:
    return f"{doc or ''} (default: {default})".replace("%", "%%").strip()


def _checked(name: str, kind: type, defaults):
    """argparse type for one field: converts the text, then the dataclass's own checks judge the value."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        try:
            dataclasses.replace(defaults, **{name: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name} ")) from None
        return value

    return parse
