"""Small helpers shared by the model adapters: dtype strings, model locations (directories, embedded names, hub ids),
tokenizers, environment switches, what a model's config says of its end tokens and attention window."""

from __future__ import annotations

import argparse
import os

import torch

from ray_specdec.defaults import EMBEDDED_MODEL_NAMES, embedded_model_path


def failure(exc: BaseException) -> str:
    """An exception in one line, for a `..._why` reason: its type and the first line of its message."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}

# Files that mean "this directory ships a tokenizer" (fast, slow/BPE, sentencepiece).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """Turn "bf16" / "float32" / torch.float16 / "auto" / None into a torch dtype.

    "auto" and None pick float32 on CPU (half precision matmuls on CPU are slow, whatever the checkpoint
    holds) and bfloat16 on accelerators.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or str(dtype).lower() == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)} or 'auto'")
    return _DTYPE_NAMES[name]


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A local directory (returned as an absolute path), the name of an embedded model (defaults.py: its directory,
    a grown one built first where needed) or a hub id "org/name" (returned unchanged), in that order: a directory
    that exists wins over an embedded model's name, and an embedded name over a hub id without an org."""
    text = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(text):
        return os.path.abspath(text)
    if text in EMBEDDED_MODEL_NAMES:
        return os.fspath(embedded_model_path(text))
    if os.path.exists(text):
        raise ValueError(f"{text!r} is a file; expected a model directory or a hub id")
    parts = text.split("/")
    if len(parts) > 2 or not all(parts) or text.startswith("."):
        raise FileNotFoundError(f"model directory {text!r} does not exist and is not a hub id")
    return text


def load_tokenizer(name_or_path: str | os.PathLike):
    """AutoTokenizer for a model directory or hub id; None when a local directory has no tokenizer files."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


# The config key under which a drafter model names its prefill window (the longest windows it was trained on).
PREFILL_WINDOW_KEY = "ray_specdec_prefill_window"


def resolve_prefill_window(window: int | str | None, config) -> int | None:
    """The drafter prefill window an argument means for a model with this config (None: all tokens). 'auto': the
    config's PREFILL_WINDOW_KEY if it has one, else all; 'all' or None: all; an int >= 1: that many tokens."""
    if window == "auto":
        window = getattr(config, PREFILL_WINDOW_KEY, None)
    if window is None or window == "all":
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"prefill_window must be >= 1, 'auto', 'all' or None, got {window!r}")
    return window


def prefill_window_arg(text: str) -> int | str:
    """Command-line form of a prefill window: 'auto', 'all' or a token count >= 1."""
    text = text.strip().lower()
    if text in ("auto", "all"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected 'auto', 'all' or a token count >= 1, got {text!r}")


def eos_token_ids(model) -> frozenset[int]:
    """The token ids that end a generation: the model's generation config's, else its text config's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(decoder=True), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


def sliding_window(config) -> int | None:
    """The attention window every layer uses, or None for full attention; mixed layer kinds cannot share one mask."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window:
        return int(window)
    raise ValueError(f"layer kinds {sorted(kinds)} need per-layer masks, which the tree verifier does not build")
