"""EngineConfig as flags: one flag per field of its scheduler and speculation parts, typed and defaulted from the
dataclasses, checked by their own validation; the app's AppArgs reads every field the same way."""

from __future__ import annotations

from dataclasses import fields

import pytest

from ray_specdec.cli import OneLineParser, UsageError
from ray_specdec.engine.config import (PART_CLASSES, PARTS, EngineConfig, add_engine_arguments,
                                       engine_config_from_args)
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.settings import field_docs, flag
from ray_specdec.speculation.controller import SpeculationConfig

# a value other than the default for every flag's field
CHANGED = {"kv_budget_tokens": 4096, "max_running": 8, "max_waiting": 3, "step_tokens": 768, "prefill_chunk": 128,
           "prefix_cache": False, "kv_grow": False, "min_path_prob": 0.05, "lookup": 4, "plain_lookup": 3,
           "cost_forget": 0.9, "cost_prior_steps": 8.0, "cost_warmup_steps": 4, "prior_accept_per_depth": 0.5,
           "prior_rounds": 1.0, "prior_round_sd": 2.0, "explore": False, "lookup_rows_weight": 0.1,
           "prefill_rate_weight": 0.3, "sampling_coupling": "rejection", "prior_from_rounds": 2.0, "finish_window": 7,
           "decide_every": 3, "lookup_forget": 0.99, "lookup_request_prior": 2.0}
ARGV = ["--kv-budget-tokens", "4096", "--max-running", "8", "--max-waiting", "3", "--step-tokens", "768",
        "--prefill-chunk", "128", "--no-prefix-cache", "--no-kv-grow", "--min-path-prob", "0.05", "--lookup", "4",
        "--plain-lookup", "3", "--cost-forget", "0.9", "--cost-prior-steps", "8", "--cost-warmup-steps", "4",
        "--prior-accept-per-depth", "0.5", "--prior-rounds", "1", "--prior-round-sd", "2", "--no-explore",
        "--lookup-rows-weight", "0.1", "--prefill-rate-weight", "0.3", "--sampling-coupling", "rejection",
        "--prior-from-rounds", "2", "--finish-window", "7", "--decide-every", "3",
        "--lookup-forget", "0.99", "--lookup-request-prior", "2"]


def parser(defaults: EngineConfig = EngineConfig()) -> OneLineParser:
    p = OneLineParser()
    add_engine_arguments(p, defaults)
    return p


def test_field_names_are_unique_across_the_parts():
    names = [f.name for part in PARTS for f in fields(PART_CLASSES[part])]
    assert len(names) == len(set(names))


def test_every_field_is_a_flag_with_its_default_and_comment():
    docs = field_docs(SchedulerConfig) | field_docs(SpeculationConfig)
    assert docs["max_running"] == "requests decoding or prefilling at once"
    assert docs["prior_rounds"].startswith("Pseudo-rounds the prior counts as")  # the comment above the field
    defaults = EngineConfig().with_fields(max_running=5, lookup=2)
    actions = {a.dest: a for a in parser(defaults)._actions}
    for f in fields(SchedulerConfig) + fields(SpeculationConfig):
        action = actions[f.name]
        assert flag(f.name) in action.option_strings
        assert action.default == getattr(defaults.scheduler, f.name, getattr(defaults.speculation, f.name, None))
        assert action.help.startswith(docs[f.name].replace("%", "%%"))
    assert actions["prefix_cache"].option_strings == ["--prefix-cache", "--no-prefix-cache"]
    assert engine_config_from_args(parser(defaults).parse_args([]), defaults) == defaults


def test_flags_parse_to_the_config():
    flagged = {f.name for f in fields(SchedulerConfig) + fields(SpeculationConfig)}
    assert set(CHANGED) == flagged  # a new field needs a case here
    args = parser().parse_args(ARGV)
    assert engine_config_from_args(args) == EngineConfig().with_fields(**CHANGED)
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
        (["--cost-forget", "0"], "argument --cost-forget: must be in (0, 1], got 0.0"),
        (["--step-tokens", "2k"], "argument --step-tokens: expected an integer, got '2k'"),
        (["--kv-budget-gib", "0"], "argument --kv-budget-gib: must be > 0, got 0"),
        (["--sampling-coupling", "keyed"],
         "argument --sampling-coupling: invalid choice: 'keyed' (choose from 'auto', 'coupled', 'rejection')"),
        (["--kv-budget-gib", "1", "--kv-budget-tokens", "8"],
         "argument --kv-budget-tokens: not allowed with argument --kv-budget-gib"),
    ],
)
def test_bad_values_are_one_line_usage_errors(argv, message):
    with pytest.raises(UsageError) as err:
        parser().parse_args(argv)
    assert str(err.value) == message


def test_with_fields_sets_fields_by_their_own_names():
    config = EngineConfig().with_fields(max_running=3, lookup=0, retry_s=1.0)
    assert (config.scheduler.max_running, config.speculation.lookup, config.serving.retry_s) == (3, 0, 1.0)
    with pytest.raises(TypeError, match="no field bogus"):
        EngineConfig().with_fields(bogus=1)


def test_app_args_read_the_same_fields():
    from deployments.app import AppArgs

    every = {f.name for part in PARTS for f in fields(PART_CLASSES[part])}
    assert every <= set(AppArgs.model_fields)
    assert AppArgs(**CHANGED).engine_config() == EngineConfig().with_fields(**CHANGED)
    gib = AppArgs(kv_budget_gib=1.0).engine_config()  # the budget in GiB becomes rows where the target is known
    assert gib.scheduler.kv_budget_tokens == SchedulerConfig().kv_budget_tokens
    assert AppArgs().engine_config() == EngineConfig()  # one set of defaults: the app's are the library's
