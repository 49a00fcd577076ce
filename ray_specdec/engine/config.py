"""One settings tree for an engine (`EngineConfig`), shared by the library (`llm.SpeculativeEngine`, the scheduler),
the command line (`generate`, `bench`) and the app (deployments/app.py `AppArgs`, built from it).

Its parts: `scheduler` (`SchedulerConfig`: admission, batching, the KV budget), `speculation` (`SpeculationConfig`:
the proposers and the speculation controller) and `serving` (`ServingConfig`: the HTTP side). Field names are unique
across the parts, so each is one flag (`--max-running`) and one app argument (`max_running=...`) under its own name,
with its own default, documented once where it is declared. docs/SETTINGS.md lists them all.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields, replace

from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.serving.config import ServingConfig
from ray_specdec.settings import add_arguments, from_args
from ray_specdec.speculation.controller import SpeculationConfig


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)

    def with_fields(self, **values) -> EngineConfig:
        """A copy with fields of the parts set by their own names: `EngineConfig().with_fields(lookup=0)`."""
        parts = {}
        for part in PARTS:
            own = {name: values.pop(name) for name in part_fields(part) if name in values}
            parts[part] = replace(getattr(self, part), **own) if own else getattr(self, part)
        if values:
            raise TypeError(f"EngineConfig has no field {', '.join(sorted(values))}")
        return EngineConfig(**parts)


PARTS = tuple(f.name for f in fields(EngineConfig))
PART_CLASSES = {"scheduler": SchedulerConfig, "speculation": SpeculationConfig, "serving": ServingConfig}


def part_fields(part: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(PART_CLASSES[part]))


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: EngineConfig = EngineConfig(),
                         parts: tuple[str, ...] = ("scheduler", "speculation"),
                         notes: dict[str, str] | None = None) -> None:
    """A flag for every field of `parts`, defaulting to `defaults`' value, plus `--kv-budget-gib` (the budget in GiB
    instead of rows, or `auto`: it becomes rows once the target's bytes per token and the device's free memory are
    known, engine/kv_sizing.py). notes: field name -> what the command adds to that flag's help."""
    titles = {"scheduler": "the step scheduler's settings (SchedulerConfig)",
              "speculation": "drafting and the speculation controller (SpeculationConfig)",
              "serving": "the HTTP side (ServingConfig)"}
    for part in parts:
        group = parser.add_argument_group(part, titles[part])
        where = {}
        if part == "scheduler":
            budget = group.add_mutually_exclusive_group()
            where = {"kv_budget_tokens": budget}
            budget.add_argument("--kv-budget-gib", type=_gib, default=None, metavar="GIB",
                                help="the KV budget in GiB of the target's cache instead of rows, or 'auto': 90%% of "
                                     "the device's memory free after loading (the app's kv_budget_gib)")
        add_arguments(group, PART_CLASSES[part], getattr(defaults, part), notes, where=where)


def engine_config_from_args(args, defaults: EngineConfig = EngineConfig()) -> EngineConfig:
    """EngineConfig from the attributes of `args` named as its fields (argparse's namespace, the app's arguments);
    one missing or None keeps `defaults`'. ValueError on a bad value."""
    return EngineConfig(**{part: from_args(PART_CLASSES[part], args, getattr(defaults, part)) for part in PARTS})


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
