"""benchmarks/peer_history.py: every recorded serve_peers run's ratios, recomputed from its cells. No servers."""

import json

import pytest

from benchmarks import peer_history
from benchmarks.peer_history import GOALS, RUNS, history, load_cells, markdown, plot, summarize


def cell(system, temperature, concurrency, tokens_per_s, paired=False):
    return {"system": system, "temperature": temperature, "concurrency": concurrency, "tokens_per_s": tokens_per_s,
            "paired": paired}


def write_run(root, name, cells):
    (root / name).mkdir()
    (root / name / "serve_peers.json").write_text(json.dumps({"cells": cells}))


def test_a_rerun_replaces_the_same_cells_and_keeps_the_others(tmp_path):
    write_run(tmp_path, "run", [cell("ours", 0.0, 1, 100.0, True), cell("inproc", 0.0, 1, 400.0, True),
                                cell("vllm", 0.0, 1, 50.0), cell("ours", 0.0, 8, 300.0), cell("vllm", 0.0, 8, 200.0)])
    write_run(tmp_path, "rerun", [cell("ours", 0.0, 1, 360.0, True), cell("inproc", 0.0, 1, 380.0, True)])
    cells = load_cells(("run", "rerun"), tmp_path)
    assert sorted((c["system"], c["concurrency"], c["tokens_per_s"]) for c in cells) == [
        ("inproc", 1, 380.0), ("ours", 1, 360.0), ("ours", 8, 300.0), ("vllm", 1, 50.0), ("vllm", 8, 200.0)]
    out = summarize(cells)
    assert out["vllm@1"] == pytest.approx(7.2)  # the rerun's 360 over the run's vLLM 50
    assert out["vllm@8"] == pytest.approx(1.5)
    assert out["served/inproc@1"] == pytest.approx(360 / 380, abs=1e-3)
    assert out["vllm@32"] is None and out["vllm-draft@1"] is None and out["served/inproc@1 none"] is None


def test_repeated_cells_count_by_their_median():
    cells = [cell("ours", 1.0, 32, v) for v in (90.0, 100.0, 400.0)] + [cell("vllm", 1.0, 32, v) for v in (50, 200)]
    assert summarize(cells)["vllm@32 T=1"] == pytest.approx(100 / 125, abs=1e-3)


def test_the_table_marks_met_goals_and_the_plot_is_written(tmp_path):
    rows = [{"run": 1, "date": "d", "change": "c", **{key: None for key, _ in peer_history.COLUMNS}},
            {"run": 2, "date": "d", "change": "c", **{key: None for key, _ in peer_history.COLUMNS}}]
    rows[0].update({"vllm@1": GOALS["vllm@1"], "served/inproc@1": 0.899})
    rows[1].update({"vllm@1": 0.5, "vllm@8": 1.2})
    text = markdown(rows)
    first, second = text.splitlines()[2:4]
    assert f"**{GOALS['vllm@1']:.2f}x**" in first and "0.90x" in first and "**0.90x**" not in first
    assert "| 0.50x |" in second and "**1.20x**" in second
    png = plot(rows, tmp_path / "history.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_recorded_run_is_in_docs_and_has_greedy_ratios():
    rows = history()
    assert [row["run"] for row in rows] == [run for run, *_ in RUNS]
    for row in rows:
        assert row["vllm@1"] is not None and row["vllm@8"] is not None and row["vllm@32"] is not None, row["run"]
