"""benchmarks/kv_grow.py: its arguments, its percentiles, and a short run of both settings on the shipped models."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import kv_grow


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--repeats", "0"], ["--duration", "0"],
                                  ["--max-tokens", "0"], ["--kv-budget-gib", "-1"]])  # fmt: skip
def test_bad_arguments_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kv_grow.main(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_percentiles():
    assert math.isnan(kv_grow.percentile([], 50))
    assert kv_grow.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert kv_grow.percentile([float(i) for i in range(101)], 95) == 95.0


def test_a_short_run_alternates_the_settings_and_compares_their_tokens(tmp_path):
    out = tmp_path / "kv.json"
    results = kv_grow.main(["--concurrency", "2", "--duration", "1", "--repeats", "2", "--prompts", "40",
                            "--max-tokens", "6", "--json", str(out)])  # fmt: skip
    assert [(c["kv_grow"], c["repeat"]) for c in results["cells"]] == [(True, 0), (False, 0), (False, 1), (True, 1)]
    assert all(c["finished"] > 0 and c["tokens_per_s"] > 0 for c in results["cells"])
    assert results["compared"] > 0 and results["differ"] == 0
    assert json.loads(out.read_text())["max_tokens"] == 6
