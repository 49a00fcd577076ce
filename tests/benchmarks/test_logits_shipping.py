"""benchmarks/logits_shipping runs end to end (a rank-0 actor on a local Ray) and checks what it times: rows shipped
as arrays reach the caller as the same float32 values as rows pickled as tensors. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import logits_shipping


def test_every_way_runs_and_arrays_arrive_intact(tmp_path):
    out = tmp_path / "shipping.json"
    results = logits_shipping.main(["--repeats", "1", "--settings", "256:3,4096:40", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert rows == results["results"]
    assert {(r["dtype"], r["vocab"], r["rows"]) for r in rows} == {
        (d, v, n) for d in ("float32", "bfloat16") for v, n in ((256, 3), (4096, 40))}
    assert all(r["same"] and min(r["argmax_ms"], r["tensor_ms"], r["array_ms"]) > 0 for r in rows)


@pytest.mark.parametrize("bad", ["4096", "4096:0", "a:3"])
def test_bad_settings_are_refused_in_one_line(bad, capsys):
    with pytest.raises(SystemExit):
        logits_shipping.main(["--settings", bad])
    assert "V:rows" in capsys.readouterr().err
