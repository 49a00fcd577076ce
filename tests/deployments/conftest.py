"""The deployment tests' models: the agreeing bigram pair (tests/helpers/bigram.py) saved once per session, and the
in-process engine over them (the reference for serving outputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_specdec.config import TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from tests.helpers.bigram import save_bigram_pair


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir with tokenizer, drafter dir), saved once per test session."""
    return save_bigram_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def engine(model_dirs) -> SpeculativeEngine:
    """The in-process engine over the saved models (the reference for serving outputs)."""
    target_dir, drafter_dir = model_dirs
    target = TargetModel.from_pretrained(str(target_dir))
    return SpeculativeEngine(target, MambaDrafter.from_pretrained(str(drafter_dir)), TreeConfig((3, 2, 2, 1, 1)))
