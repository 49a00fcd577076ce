"""benchmarks/batched_loop runs end to end on CPU, and what it checks holds: every finished request's greedy tokens,
batched with others (drafting or not), equal the same prompt decoded alone. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import batched_loop


def test_batched_cells_give_each_prompt_its_own_greedy_tokens(tmp_path):
    out = tmp_path / "loop.json"
    results = batched_loop.main(["--device", "cpu", "--concurrency", "1,3", "--duration", "1.5", "--prompts", "12",
                                 "--variants", "batched drafting,batched none,torch-layers none,per-request none",
                                 "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == results
    cells = {(c["variant"], c["concurrency"]) for c in results["cells"]}
    variants = ("batched drafting", "batched none", "torch-layers none", "per-request none")
    assert cells == {(v, c) for v in variants for c in (1, 3)}
    assert all(c["tokens_per_s"] > 0 for c in results["cells"])
    checked = results["greedy_vs_reference"]
    assert set(checked) == {"batched drafting", "batched none", "torch-layers none"}
    assert all(v["compared"] > 0 and v["differ"] == 0 for v in checked.values()), checked


def test_a_synthetic_target_runs_the_undrafted_variants_only():
    results = batched_loop.main(["--device", "cpu", "--concurrency", "2", "--duration", "0.5", "--prompts", "8",
                                 "--synthetic-llama", "128,1"])  # fmt: skip
    assert results["target"] == "128,1"
    assert {c["variant"] for c in results["cells"]} == {"batched none", "per-request none"}


def test_each_concurrency_starts_at_a_share_of_its_own(monkeypatch):
    """No cell replays the prompts of an earlier cell of its engine (its prefix cache would serve their prefill): the
    cells at each concurrency start at their own share, the same in every variant (their greedy tokens are compared
    prompt by prompt), and a cell that sends more than its share reports how many."""
    starts, real = [], batched_loop.run_cell

    def spy(engine, prompts, concurrency, tree, duration, device, profile_steps=0, **kwargs):
        starts.append((concurrency, kwargs.get("start", 0), len(prompts)))
        return real(engine, prompts, concurrency, tree, duration, device, profile_steps, **kwargs)

    monkeypatch.setattr(batched_loop, "run_cell", spy)
    results = batched_loop.main(["--device", "cpu", "--concurrency", "1,2", "--duration", "1.0", "--prompts", "40",
                                 "--variants", "batched none,per-request none"])  # fmt: skip
    assert starts == [(1, 0, 40), (2, 20, 40)] * 2
    for cell in results["cells"]:
        assert cell["sent"] > 0 and cell["repeated_prompts"] == max(cell["sent"] - 20, 0)


def test_the_speculation_check_sets_the_cells_ratio_beside_the_controllers_drafted_share():
    from benchmarks.batched_loop import speculation_check

    cells = [{"variant": "batched drafting", "concurrency": 1, "tokens_per_s": 92.0,
              "speculation": {"drafted_share": 0.5, "cell_drafted_share": 0.9}},  # the cell's own share
             {"variant": "batched drafting", "concurrency": 8, "tokens_per_s": 80.0,
              "speculation": {"drafted_share": None}},
             {"variant": "batched drafting", "concurrency": 32, "tokens_per_s": 50.0,
              "speculation": {"drafted_share": 0.0}},  # no none cell at 32: no line
             {"variant": "batched none", "concurrency": 1, "tokens_per_s": 100.0, "speculation": None},
             {"variant": "batched none", "concurrency": 8, "tokens_per_s": 100.0, "speculation": None}]  # fmt: skip
    assert speculation_check(cells) == [
        "c=1: the controller's choice / none 0.92x in the cells; it drafted 90% of its rounds",
        "c=8: the controller's choice / none 0.80x in the cells; it drafted no rounds yet",
    ]


def test_a_cell_can_end_with_its_python_profile(monkeypatch, capsys):
    """--python-profile VARIANT@C: after that cell, steps under cProfile; the functions' table is in its numbers."""
    from benchmarks import batched_loop

    monkeypatch.setattr(batched_loop, "select_prompts", lambda n, seed: [f"def f{i}(x):\n    return x + {i}\n"
                                                                         for i in range(n)])
    results = batched_loop.main(["--device", "cpu", "--duration", "0.2", "--concurrency", "1", "--prompts", "8",
                                 "--variants", "batched none", "--python-profile", "batched none@1"])
    (cell,) = results["cells"]
    assert "steps under cProfile" in cell["profile"] and "engine/scheduler.py" in cell["profile"]
    assert "engine/scheduler.py" in capsys.readouterr().out  # the table is printed too


def test_sampled_cells_send_seeded_sampled_requests_and_compare_no_tokens(monkeypatch):
    from ray_specdec.engine.scheduler import Scheduler

    sent, real_add = [], Scheduler.add
    monkeypatch.setattr(Scheduler, "add", lambda self, rid, ids, params, tree=None: (
        sent.append(params), real_add(self, rid, ids, params, tree))[1])
    results = batched_loop.main(["--device", "cpu", "--concurrency", "2", "--duration", "0.5", "--prompts", "8",
                                 "--variants", "batched none,per-request none", "--temperature", "1"])  # fmt: skip
    assert results["temperature"] == 1.0 and "greedy_vs_reference" not in results  # sampled tokens differ by design
    sampled = [p for p in sent if p.temperature > 0]  # the warm-up is greedy
    assert sampled and all(p.temperature == 1.0 and p.seed is not None for p in sampled)
    with pytest.raises(SystemExit):
        batched_loop.main(["--temperature", "-1"])


def test_fixed_trees_and_couplings_are_variants_of_their_own(monkeypatch):
    """--trees adds a `batched <tree>` variant per tree, --coupling runs each variant per sampling_coupling (seeded
    sampled requests: coupled under `auto`); every cell reports its rounds' mean accepted length."""
    from ray_specdec.engine.scheduler import Scheduler

    coupled, real_add = [], Scheduler.add

    def spy(self, rid, ids, params, tree=None):
        real_add(self, rid, ids, params, tree)
        r = next((r for r in self.waiting if r.request_id == rid), None) or self.running[rid]
        coupled.append((self.speculation.sampling_coupling, tree, r.noise is not None))

    monkeypatch.setattr(Scheduler, "add", spy)
    results = batched_loop.main(["--device", "cpu", "--concurrency", "1", "--duration", "0.3", "--prompts", "4",
                                 "--variants", "batched none", "--trees", "1,1;2,1", "--coupling", "rejection,coupled",
                                 "--temperature", "1"])  # fmt: skip
    labels = [c["variant"] for c in results["cells"]]
    assert labels == ["batched none rejection", "batched none coupled", "batched 1,1 rejection", "batched 1,1 coupled",
                      "batched 2,1 rejection", "batched 2,1 coupled"]
    assert all(c["accepted_length"] >= 1 for c in results["cells"] if c["finished"])
    seen = {(mode, str(tree), noise) for mode, tree, noise in coupled}
    assert {("coupled", "2,1", True), ("rejection", "2,1", False)} <= seen and ("rejection", "2,1", True) not in seen
