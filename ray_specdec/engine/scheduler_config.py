"""The scheduler's settings (`SchedulerConfig`) and their command-line flags: one settings object that `generate`,
`bench` and the app parse.

`add_scheduler_arguments` adds a flag per field (`kv_budget_tokens` -> `--kv-budget-tokens`; booleans as
`--prefix-cache / --no-prefix-cache`), typed, defaulted and described from the dataclass itself (the comment on each
field is its help), every value checked by SchedulerConfig's own validation as it is parsed, so a bad one is argparse's
one-line error. `--kv-budget-gib` gives the budget in GiB instead of rows, or `auto` (the app's `kv_budget_gib`): it
becomes rows once the target's bytes per token and the device's free memory are known (`kv_sizing.fitted_kv_budget`,
which checks either budget against that memory). `scheduler_config_from_args` reads the fields back from anything
that has them as attributes: argparse's namespace or the app's `AppArgs`.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
from dataclasses import dataclass, fields, replace
from typing import get_type_hints

from ray_specdec.config import MAX_LOOKUP_TOKENS


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler admits, batches and drafts (engine/scheduler.py); each field is a flag of
    `add_scheduler_arguments`, its comment the help."""

    kv_budget_tokens: int = 1 << 17  # KV rows all admitted requests may hold together (reserved at admission)
    max_running: int = 64  # requests decoding or prefilling at once
    max_waiting: int = 256  # queued requests beyond which add() raises QueueFull
    # 1024, not 2048: a CPU prefill row costs ~0.17 ms, and steps of 2048 rows held the decoding requests for ~350 ms
    # at a time (docs/BENCHMARKS.md): time to first token halved at 8 and 32 requests, tokens/s kept
    step_tokens: int = 1024  # target rows per step: verify rows first, prefill chunks in what is left (>= 1 chunk)
    prefill_chunk: int = 512  # a prompt's chunks are cut at multiples of this: its KV never depends on the batch
    min_path_prob: float = 0.0  # drafts stop at depths the drafter rates below this (DrafterSession.draft)
    lookup: int = 0  # prompt-lookup tokens added to every drafted tree of greedy requests
    # undrafted by the speculation controller's choice; never under a tree the client asked for
    plain_lookup: int = 0  # prompt-lookup tokens verified in greedy rounds that run undrafted (no drafter step)
    prefix_cache: bool = True  # keep prompt chunks' KV in unreserved budget for later prompts (engine/prefix_cache.py)
    # on: admit against the KV requests hold and grow each one's as it decodes, a request waiting a step where its
    # growth would leave some request unable to finish (never preempted: exact); off: reserve each one's most
    kv_grow: bool = True  # grow each request's KV as it decodes instead of reserving its most at admission

    def __post_init__(self) -> None:
        for name in ("kv_budget_tokens", "max_running", "step_tokens", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not 0.0 <= self.min_path_prob < 1.0:
            raise ValueError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")
        for name in ("lookup", "plain_lookup"):
            if not 0 <= getattr(self, name) <= MAX_LOOKUP_TOKENS:
                raise ValueError(f"{name} must be in [0, {MAX_LOOKUP_TOKENS}], got {getattr(self, name)}")


# `name: type = default  # comment` in the dataclass's source
_FIELD_COMMENT = re.compile(r"^\s+(\w+): [^=#\n]+=[^#\n]*#\s*(.*?)\s*$", re.MULTILINE)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_comments(cls) -> dict[str, str]:
    """Field name -> the comment on the line that declares it ({} where the source is not shipped)."""
    try:
        return dict(_FIELD_COMMENT.findall(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}


def add_scheduler_arguments(
    parser: argparse.ArgumentParser, defaults: SchedulerConfig = SchedulerConfig(), notes: dict[str, str] | None = None
) -> None:
    """A flag for every SchedulerConfig field, defaulting to `defaults`' value, plus `--kv-budget-gib`. notes: field
    name -> what the command adds to that flag's help."""
    group = parser.add_argument_group("scheduler", "the step scheduler's settings (SchedulerConfig)")
    budget = group.add_mutually_exclusive_group()
    comments, types = field_comments(SchedulerConfig), get_type_hints(SchedulerConfig)
    for name, note in (notes or {}).items():
        comments[name] = f"{comments.get(name, '')}; {note}"
    for f in fields(SchedulerConfig):
        default = getattr(defaults, f.name)
        where = budget if f.name == "kv_budget_tokens" else group
        if types[f.name] is bool:
            where.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                               help=_help(comments.get(f.name), "on" if default else "off"))
        else:
            where.add_argument(flag(f.name), type=_checked(f.name, types[f.name], defaults), default=default,
                               metavar="N" if types[f.name] is int else "X",
                               help=_help(comments.get(f.name), default))
    budget.add_argument("--kv-budget-gib", type=_gib, default=None, metavar="GIB",
                        help="the KV budget in GiB of the target's cache instead of rows, or 'auto': 90%% of the "
                             "device's memory free after loading (the app's kv_budget_gib)")


def scheduler_config_from_args(args, defaults: SchedulerConfig = SchedulerConfig()) -> SchedulerConfig:
    """SchedulerConfig from the attributes of `args` named as its fields; one missing or None keeps `defaults`'.
    ValueError on a bad value (flags were checked as they were parsed)."""
    given = {f.name: getattr(args, f.name, None) for f in fields(SchedulerConfig)}
    return replace(defaults, **{name: value for name, value in given.items() if value is not None})


def _help(comment: str | None, default) -> str:
    return f"{comment or ''} (default: {default})".replace("%", "%%").strip()


def _checked(name: str, kind: type, defaults: SchedulerConfig):
    """argparse type for one field: converts the text, then SchedulerConfig's own checks judge the value."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        try:
            replace(defaults, **{name: value})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name} ")) from None
        return value

    return parse


def _gib(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
