"""SchedulerConfig as flags: one flag per field, typed and defaulted from the dataclass, checked by its own validation;
the app's AppArgs reads the same fields the same way."""

from __future__ import annotations

from dataclasses import fields

import pytest

from ray_specdec.cli import OneLineParser, UsageError
from ray_specdec.engine.scheduler_config import (SchedulerConfig, add_scheduler_arguments, field_comments, flag,
                                                 scheduler_config_from_args)

# a value other than the default for every field
CHANGED = {"kv_budget_tokens": 4096, "max_running": 8, "max_waiting": 3, "step_tokens": 768, "prefill_chunk": 128,
           "min_path_prob": 0.05, "lookup": 4, "plain_lookup": 3, "prefix_cache": False, "kv_grow": False}
ARGV = ["--kv-budget-tokens", "4096", "--max-running", "8", "--max-waiting", "3", "--step-tokens", "768",
        "--prefill-chunk", "128", "--min-path-prob", "0.05", "--lookup", "4", "--plain-lookup", "3",
        "--no-prefix-cache", "--no-kv-grow"]


def parser(defaults: SchedulerConfig = SchedulerConfig()) -> OneLineParser:
    p = OneLineParser()
    add_scheduler_arguments(p, defaults)
    return p


def test_every_field_is_a_flag_with_its_default_and_comment():
    comments = field_comments(SchedulerConfig)
    assert comments["max_running"] == "requests decoding or prefilling at once"
    defaults = SchedulerConfig(max_running=5, lookup=8)
    actions = {a.dest: a for a in parser(defaults)._actions}
    for f in fields(SchedulerConfig):
        action = actions[f.name]
        assert flag(f.name) in action.option_strings
        assert action.default == getattr(defaults, f.name)
        assert action.help.startswith(comments[f.name].replace("%", "%%"))
    assert actions["prefix_cache"].option_strings == ["--prefix-cache", "--no-prefix-cache"]
    assert scheduler_config_from_args(parser(defaults).parse_args([]), defaults) == defaults


def test_flags_parse_to_the_config():
    assert set(CHANGED) == {f.name for f in fields(SchedulerConfig)}  # a new field needs a case here
    args = parser().parse_args(ARGV)
    assert scheduler_config_from_args(args) == SchedulerConfig(**CHANGED)
    assert args.kv_budget_gib is None
    assert parser().parse_args(["--kv-budget-gib", "0.5"]).kv_budget_gib == 0.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-running", "0"], "argument --max-running: must be >= 1, got 0"),
        (["--max-waiting", "-1"], "argument --max-waiting: must be >= 0, got -1"),
        (["--lookup", "33"], "argument --lookup: must be in [0, 32], got 33"),
        (["--plain-lookup", "-1"], "argument --plain-lookup: must be in [0, 32], got -1"),
        (["--min-path-prob", "1"], "argument --min-path-prob: must be in [0, 1), got 1.0"),
        (["--min-path-prob", "nan"], "argument --min-path-prob: must be in [0, 1), got nan"),
        (["--step-tokens", "2k"], "argument --step-tokens: expected an integer, got '2k'"),
        (["--kv-budget-gib", "0"], "argument --kv-budget-gib: must be > 0, got 0"),
        (["--kv-budget-gib", "1", "--kv-budget-tokens", "8"],
         "argument --kv-budget-tokens: not allowed with argument --kv-budget-gib"),
    ],
)
def test_bad_values_are_one_line_usage_errors(argv, message):
    with pytest.raises(UsageError) as err:
        parser().parse_args(argv)
    assert str(err.value) == message


def test_app_args_read_the_same_fields():
    from deployments.app import AppArgs

    assert {f.name for f in fields(SchedulerConfig)} <= set(AppArgs.model_fields)
    assert AppArgs(**CHANGED).scheduler_config() == SchedulerConfig(**CHANGED)
    gib = AppArgs(kv_budget_gib=1.0).scheduler_config()  # the budget in GiB becomes rows where the target is known
    assert gib.kv_budget_tokens == SchedulerConfig().kv_budget_tokens
