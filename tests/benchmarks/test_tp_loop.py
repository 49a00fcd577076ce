"""benchmarks/tp_loop runs end to end on CPU (two rank actors over gloo), and what it checks holds: the ranks'
fast paths (the lean forward, sums through shared memory, compiled steps) and what they ran before (HF's forward per
request, gloo, a task per rank) give every prompt both finished the same greedy tokens. No timing is asserted."""

from __future__ import annotations

import json

from benchmarks import tp_loop


def test_both_variants_run_and_agree_on_greedy_tokens(tmp_path):
    out = tmp_path / "tp.json"
    results = tp_loop.main(["--concurrency", "2", "--duration", "1.5", "--prompts", "12", "--max-tokens", "8",
                            "--variants", "now,before", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == results
    cells = {(c["variant"], c["concurrency"]) for c in results["cells"]}
    assert cells == {(f"{v} {t}", c) for v in ("now", "before") for t in ("drafting", "none") for c in (2,)}
    assert all(c["tokens_per_s"] > 0 for c in results["cells"])
    assert sum(g["compared"] for g in results["greedy"].values()) > 0
    assert all(g["differ"] == 0 for g in results["greedy"].values()), results["greedy"]
