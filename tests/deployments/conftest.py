"""The deployment tests' models: the agreeing bigram pair (tests/helpers/bigram.py) saved once per session, and the
in-process engine over them (the reference for serving outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_specdec.config import TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from tests.helpers.bigram import VOCAB, bigram_pair, word_tokenizer


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir with tokenizer, drafter dir), saved once per test session."""
    root = tmp_path_factory.mktemp("models")
    target, drafter = bigram_pair()
    tokenizer = word_tokenizer()
    assert len(tokenizer) == VOCAB
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    # as the shipped models' config says: decode greedily unless a request sets a temperature (the app's default)
    (root / "target" / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 0}))
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="session")
def engine(model_dirs) -> SpeculativeEngine:
    """The in-process engine over the saved models (the reference for serving outputs)."""
    target_dir, drafter_dir = model_dirs
    target = TargetModel.from_pretrained(str(target_dir))
    return SpeculativeEngine(target, MambaDrafter.from_pretrained(str(drafter_dir)), TreeConfig((3, 2, 2, 1, 1)))
