"""Every shipped default model directory loads standalone, with a tokenizer that matches its vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ray_specdec.defaults import DEFAULT_MODEL_NAMES, DEFAULT_MODELS_DIR, default_model_path

MAX_TOTAL_BYTES = 128 * 2**20  # 121.4 MiB shipped: three targets, four drafters


@pytest.mark.parametrize("name", DEFAULT_MODEL_NAMES)
def test_default_model_loads_with_its_tokenizer(name):
    path = default_model_path(name)
    if not (path / "config.json").exists():
        pytest.skip(f"{name} not exported yet")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size == 4096
    assert tokenizer.eos_token_id == model.config.eos_token_id == 0
    if name.startswith("target"):
        assert model.config.max_position_embeddings >= 8192
    ids = tokenizer("import os\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_default_models_fit_the_size_budget():
    total = sum(f.stat().st_size for f in DEFAULT_MODELS_DIR.rglob("*") if f.is_file())
    assert total <= MAX_TOTAL_BYTES


def test_default_paths_are_inside_the_package():
    assert DEFAULT_MODELS_DIR.name == "default_models" and DEFAULT_MODELS_DIR.parent.name == "ray_specdec"
    with pytest.raises(ValueError):
        default_model_path("nope")
