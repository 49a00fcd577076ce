"""The deployment tests' models: the agreeing bigram pair (tests/helpers/bigram.py) saved once per session, and the
in-process engine over them (the reference for serving outputs); the pair again with a long context, and its greedy
tokens, for the tests that kill a replica under long streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_specdec.config import TreeConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.mamba import MambaDrafter
from ray_specdec.models.target.model import TargetModel
from tests.helpers.bigram import LONG_CONTEXT, LONG_TOKENS, greedy_reference, save_bigram_pair


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


@pytest.fixture(scope="session")
def long_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir, drafter dir) of the pair with its target's context widened to LONG_CONTEXT."""
    return save_bigram_pair(tmp_path_factory.mktemp("long"), max_positions=LONG_CONTEXT)


@pytest.fixture(scope="session")
def long_reference(long_model_dirs) -> dict[str, list[int]]:
    """The long-context target's greedy LONG_TOKENS ids of each of PROMPTS (target alone)."""
    target, drafter = long_model_dirs
    engine = SpeculativeEngine(TargetModel.from_pretrained(str(target)), MambaDrafter.from_pretrained(str(drafter)))
    return greedy_reference(engine, LONG_TOKENS)
