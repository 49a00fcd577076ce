"""Continuing exported weights (--init-from) and the training history that export writes."""

from __future__ import annotations

import json

import pytest
import torch

from ray_specdec.training.export import _history, _longest_window
from ray_specdec.training.train import load_initial_weights
from tests.helpers.models import tiny_gpt_neox


def test_init_from_loads_an_exported_model(tmp_path):
    source = tiny_gpt_neox(torch.float16, seed=1)
    source.save_pretrained(tmp_path / "exported")
    fresh = tiny_gpt_neox(torch.float32, seed=2)
    assert not torch.equal(fresh.gpt_neox.embed_in.weight, source.gpt_neox.embed_in.weight.float())
    load_initial_weights(fresh, tmp_path / "exported")
    for name, value in source.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value.float()), name
    assert fresh.dtype == torch.float32  # the run keeps its own dtype


def test_init_from_refuses_another_architecture(tmp_path):
    tiny_gpt_neox(torch.float32, vocab=64).save_pretrained(tmp_path / "exported")
    with pytest.raises(ValueError, match="architecture differs.*vocab_size"):
        load_initial_weights(tiny_gpt_neox(torch.float32, vocab=128), tmp_path / "exported")


def test_export_history_sums_all_rounds(tmp_path):
    first = {"steps": 10, "tokens": 100, "minutes": 1.5, "final_loss": 2.0, "settings": {"name": "r1"}}
    second = {**first, "steps": 20, "tokens": 200, "minutes": 2.0, "settings": {"name": "r2"},
              "previous_rounds": [first], "total_steps": 30, "total_tokens": 300, "total_minutes": 3.5}
    (tmp_path / "training.json").write_text(json.dumps(second))
    history = _history(str(tmp_path), {"steps": 5, "tokens": 50, "minutes": 0.5})
    assert [r["settings"]["name"] for r in history["previous_rounds"]] == ["r1", "r2"]
    assert "total_steps" not in history["previous_rounds"][1]
    assert (history["total_steps"], history["total_tokens"], history["total_minutes"]) == (35, 350, 4.0)
    assert _history(None, {}) == {} and _history(str(tmp_path / "missing"), {}) == {}


def test_longest_window_covers_every_round(tmp_path):
    prior = {"settings": {"seq_len": 512}, "previous_rounds": [{"settings": {"seq_len": 1024}}]}
    (tmp_path / "training.json").write_text(json.dumps(prior))
    assert _longest_window({"seq_len": 256, "init_from": str(tmp_path)}) == 1024
    assert _longest_window({"seq_len": 256}) == 256
