"""Locations of the default model family shipped inside the package (trained by `ray_specdec.training`).

Paths are resolved relative to the installed package, so they work from a checkout and from a wheel alike.
Every directory holds an HF model (`from_pretrained`) and the shared tokenizer (`AutoTokenizer`).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODELS_DIR = Path(__file__).resolve().parent / "default_models"

# Names of the shipped model directories (see docs/MODELS.md for how each was trained).
TARGET_NEOX = "target-neox"
TARGET_LLAMA = "target-llama"
DRAFTER_MAMBA = "drafter-mamba"
DRAFTER_NEOX_SMALL = "drafter-neox-small"
DEFAULT_MODEL_NAMES = (TARGET_NEOX, TARGET_LLAMA, DRAFTER_MAMBA, DRAFTER_NEOX_SMALL)


def default_model_path(name: str) -> Path:
    """Absolute path of the shipped model directory `name` (one of DEFAULT_MODEL_NAMES)."""
    if name not in DEFAULT_MODEL_NAMES:
        raise ValueError(f"unknown default model {name!r}; expected one of {DEFAULT_MODEL_NAMES}")
    return DEFAULT_MODELS_DIR / name


DEFAULT_TARGET = default_model_path(TARGET_NEOX)
DEFAULT_DRAFTER = default_model_path(DRAFTER_MAMBA)
DEFAULT_TARGET_LLAMA = default_model_path(TARGET_LLAMA)
DEFAULT_TF_DRAFTER = default_model_path(DRAFTER_NEOX_SMALL)
