"""benchmarks/served_ab.py: its argument parsing, run order, summary and the orchestration of its runs (each run
starts Ray and the app in a process of its own and measures speed: here that process is replaced by a fake)."""

import argparse
import json
import subprocess

import pytest

from benchmarks import served_ab
from benchmarks.served_ab import cell_name, main, parse_cells, parse_pairs, run_order, summarize


def test_parse_pairs():
    assert parse_pairs("") == {}
    assert parse_pairs("hubs=deployments, RAY_x=a=b ,") == {"hubs": "deployments", "RAY_x": "a=b"}
    for bad in ("hubs", "=1", "a=1,b"):
        with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
            parse_pairs(bad)


def test_parse_cells():
    assert parse_cells("1:policy; 8:none;32:3,2,1;") == [(1, None), (8, "none"), (32, "3,2,1")]
    for bad in ("0:none", "x:none", "8", "8:"):
        with pytest.raises(argparse.ArgumentTypeError, match="concurrency"):
            parse_cells(bad)
    assert cell_name(8, None) == "c=8 policy" and cell_name(1, "none") == "c=1 none"


def test_runs_alternate_so_each_side_goes_first_as_often():
    assert run_order(1) == ["A", "B"]
    assert run_order(3) == ["A", "B", "B", "A", "A", "B"]
    order = run_order(4)
    assert order.count("A") == order.count("B") == 4 and [order[i] for i in range(0, 8, 2)] == ["A", "B", "A", "B"]


def test_summary_is_medians_and_their_ratio():
    runs = [{"side": s, "cells": {"c=1 policy": v}} for s, v in
            [("A", 100.0), ("B", 130.0), ("B", 110.0), ("A", 90.0), ("A", 300.0), ("B", 120.0)]]
    row = summarize(runs)["c=1 policy"]
    assert (row["A"], row["B"]) == (100.0, 120.0) and row["B/A"] == pytest.approx(1.2)


def test_main_runs_each_side_with_its_own_args_and_environment(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run(command, env, capture_output, text, timeout):
        spec = json.loads(command[command.index("--one") + 1])
        calls.append((spec, env))
        value = 200.0 if spec["app_args"] else 100.0  # A (with app args) twice B's speed
        out = "ray noise\n" + json.dumps({"c=1 policy": value, "c=8 none": value * 3})
        return subprocess.CompletedProcess(command, 0, stdout=out, stderr="")

    monkeypatch.setattr(served_ab.subprocess, "run", fake_run)
    out = tmp_path / "ab.json"
    assert main(["--a-args", "hubs=deployments", "--a-env", "RAY_enable_worker_prestart=1", "--pairs", "2",
                 "--cells", "1:policy;8:none", "--json", str(out)]) == 0  # fmt: skip
    sides = ["A" if spec["app_args"] else "B" for spec, _ in calls]
    assert sides == ["A", "B", "B", "A"]
    assert len({spec["seed"] for spec, _ in calls}) == 4  # fresh prompts every run
    for spec, env in calls:
        a = spec["app_args"] == {"hubs": "deployments"}
        assert (env.get("RAY_enable_worker_prestart") == "1") == a == (spec["env"].get("RAY_enable_worker_prestart")
                                                                        == "1")  # fmt: skip
        assert env["OMP_NUM_THREADS"] == "1"  # benchmarks/serve_load.py's Ray environment under both
    record = json.loads(out.read_text())
    assert record["summary"]["c=8 none"] == {"A": 600.0, "B": 300.0, "B/A": 0.5} and len(record["runs"]) == 4
    assert "c=8 none" in capsys.readouterr().out


def test_a_failed_run_stops_the_benchmark_with_its_output(monkeypatch, capsys):
    def fake_run(command, env, capture_output, text, timeout):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="Traceback\nRuntimeError: c=1 policy: 503")

    monkeypatch.setattr(served_ab.subprocess, "run", fake_run)
    assert main(["--pairs", "1"]) == 1
    assert "run 1 (A) failed, exit 1" in capsys.readouterr().err


def test_bad_arguments_are_one_line_errors(capsys):
    for argv in (["--pairs", "0"], ["--a-args", "hubs"], ["--cells", "0:none"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "error:" in capsys.readouterr().err
