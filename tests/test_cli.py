"""The CLI contract: `generate --json` prints one JSON object; every scheduler setting is a flag that reaches the
engine; bad input is one line on stderr and exit code 2."""

import json
import subprocess
import sys
from dataclasses import fields

import pytest

from ray_specdec.cli import generate_parser
from ray_specdec.config import SamplingParams
from ray_specdec.engine.kv_sizing import kv_budget_rows
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.settings import flag
from ray_specdec.speculation.controller import SpeculationConfig
from ray_specdec.models.target.model import TargetModel
from tests.helpers.cli import run_cli

WORDS = "the quick brown fox jumps over the lazy dog a tree of tokens is verified in one pass".split()


def test_generate_json_contract(cli_model_dirs, capsys):
    target_dir, drafter_dir = cli_model_dirs
    code, out, err = run_cli(["generate", "--prompt", "the quick brown", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--tree", "2,1", "--max-new-tokens", "9", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "stats"}
    assert {"rounds", "mean_accepted_length", "tokens_per_s"} <= set(result["stats"])
    target = TargetModel.from_pretrained(str(target_dir))
    expected = SpeculativeEngine(target, None).generate("the quick brown", SamplingParams(max_new_tokens=9))
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text
    assert result["stats"]["rounds"] >= 1


def test_drafter_none_is_plain_decoding(cli_model_dirs, capsys):
    target_dir, _ = cli_model_dirs
    code, out, _ = run_cli(["generate", "--prompt", "a tree", "--target", str(target_dir), "--drafter", "none",
                        "--max-new-tokens", "5", "--json"], capsys)
    assert code == 0
    stats = json.loads(out)["stats"]
    assert stats["mean_accepted_length"] == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "", "--target", "T", "--drafter", "none"],
        ["generate", "--prompt", "x", "--target", "T", "--tree", "a,b"],
        ["generate", "--prompt", "x", "--target", "T", "--temperature", "-1"],
        ["generate", "--prompt", "x", "--target", "T", "--max-new-tokens", "0"],
        ["generate", "--prompt", "x", "--target", "T", "--top-p", "2"],
        ["generate", "--prompt", "x", "--target", "/nonexistent/model/dir", "--drafter", "none"],
        ["generate", "--prompt", "x", "--target", "T", "--drafter", "/nonexistent/drafter"],
        ["generate", "--prompt", "x", "--target", "T", "--device", "tpu"],
        ["generate", "--prompt", "x", "--target", "T", "--dtype", "float7"],
        ["generate", "--prompt", "x", "--target", "T", "--max-running", "0"],
        ["generate", "--prompt", "x", "--target", "T", "--step-tokens", "many"],
        ["generate", "--prompt", "x", "--target", "T", "--lookup", "99"],
        ["generate", "--prompt", "x", "--target", "T", "--min-path-prob", "1.5"],
        ["generate", "--prompt", "x", "--target", "T", "--kv-budget-gib", "-1"],
        ["generate", "--prompt", "x", "--target", "T", "--kv-budget-gib", "1", "--kv-budget-tokens", "64"],
        ["generate", "--bogus"],
        ["frobnicate"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, cli_model_dirs, capsys):
    argv = [str(cli_model_dirs[0]) if a == "T" else a for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_every_scheduler_setting_is_a_generate_flag():
    text = generate_parser().format_help()
    for f in fields(SchedulerConfig) + fields(SpeculationConfig):
        assert flag(f.name) in text
    assert "--no-prefix-cache" in text and "--kv-budget-gib" in text


def test_scheduler_flags_reach_the_engine(cli_model_dirs, built_engines, capsys):
    target_dir, drafter_dir = cli_model_dirs
    code, out, err = run_cli(["generate", "--prompt", "the quick brown", "--target", str(target_dir), "--drafter",
                          str(drafter_dir), "--tree", "2,1", "--max-new-tokens", "9", "--json", "--max-running", "8",
                          "--max-waiting", "2", "--step-tokens", "768", "--prefill-chunk", "4", "--kv-budget-tokens",
                          "4096", "--min-path-prob", "0.05", "--lookup", "3", "--plain-lookup", "2", "--no-kv-grow"],
                         capsys)  # fmt: skip
    assert code == 0, err
    assert built_engines[0].config == EngineConfig().with_fields(
        kv_budget_tokens=4096, max_running=8, max_waiting=2, step_tokens=768, prefill_chunk=4, min_path_prob=0.05,
        lookup=3, plain_lookup=2, kv_grow=False)  # fmt: skip
    target = TargetModel.from_pretrained(str(target_dir))
    expected = SpeculativeEngine(target, None).generate("the quick brown", SamplingParams(max_new_tokens=9))
    assert json.loads(out)["token_ids"] == expected.token_ids  # greedy: the settings change the speed, not the text


def test_kv_budget_in_gib_becomes_rows_of_the_targets_cache(cli_model_dirs, built_engines, capsys):
    target_dir, _ = cli_model_dirs
    code, _, err = run_cli(["generate", "--prompt", "a tree", "--target", str(target_dir), "--drafter", "none",
                        "--max-new-tokens", "3", "--kv-budget-gib", "0.001"], capsys)
    assert code == 0, err
    config = built_engines[0].config.scheduler
    assert config.kv_budget_tokens == kv_budget_rows(0.001, built_engines[0].target.kv_bytes_per_token)
    assert built_engines[0].config == EngineConfig().with_fields(kv_budget_tokens=config.kv_budget_tokens)


def test_module_entry_point_exit_code(cli_model_dirs):
    proc = subprocess.run([sys.executable, "-m", "ray_specdec", "generate", "--prompt", "x", "--target",
                           "/nonexistent", "--drafter", "none"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: cannot load target")
    assert len(proc.stderr.strip().splitlines()) == 1
