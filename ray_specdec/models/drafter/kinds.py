"""Which drafter class serves a checkpoint: `MambaDrafter` for `MambaForCausalLM`, `Mamba2Drafter` for
`Mamba2ForCausalLM`, read from the config before any weights load; a clear error for every other class."""

from __future__ import annotations

import torch

from ray_specdec.models.loading import resolve_model_path

# HF class -> the config's model_type, for checkpoints whose config names no architectures
DRAFTER_ARCHITECTURES = {"MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba2"}


class UnsupportedDrafter(ValueError):
    """The model's class cannot be a drafter here; the message names what can."""


def drafter_architecture(config) -> str:
    """'MambaForCausalLM' or 'Mamba2ForCausalLM' for a model config; UnsupportedDrafter for any other class."""
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    for name, kind in DRAFTER_ARCHITECTURES.items():
        if name in architectures or (not architectures and model_type == kind):
            return name
    name = architectures[0] if architectures else model_type or "this model"
    raise UnsupportedDrafter(f"{name} cannot be a drafter; supported: {', '.join(DRAFTER_ARCHITECTURES)}")


def load_drafter_model(name_or_path: str, *, dtype: str | torch.dtype | None = None, device: str = "cpu",
                       prefill_window: int | str | None = "auto"):
    """The drafter for a hub id, local directory or embedded name: a `MambaDrafter` or a `Mamba2Drafter`."""
    from transformers import AutoConfig

    path = resolve_model_path(name_or_path)
    if drafter_architecture(AutoConfig.from_pretrained(path)) == "Mamba2ForCausalLM":
        from ray_specdec.models.drafter.mamba2 import Mamba2Drafter

        return Mamba2Drafter.from_pretrained(path, dtype=dtype, device=device, prefill_window=prefill_window)
    from ray_specdec.models.drafter.mamba import MambaDrafter

    return MambaDrafter.from_pretrained(path, dtype=dtype, device=device, prefill_window=prefill_window)
