"""Which target adapter serves a model: `TargetModel` for attention causal LMs, `SSMTargetModel` for Mamba, Mamba2,
Jamba and Bamba; a clear error for every other recurrent or hybrid class, read from the model's config before any
weights load."""

from __future__ import annotations

import torch

from ray_specdec.models.loading import resolve_model_path

# HF classes served by models/target/ssm.py (Jamba and Bamba: hybrids of Mamba or Mamba2 and attention layers)
SSM_ARCHITECTURES = ("MambaForCausalLM", "Mamba2ForCausalLM", "JambaForCausalLM", "BambaForCausalLM")
# Layer kinds of a config's `layer_types` that the attention adapter verifies trees through
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention")
SUPPORTED = ("Transformer causal LMs whose attention runs through sdpa (GPTNeoX, Llama, Mistral, Qwen2, ...) and "
             + ", ".join(SSM_ARCHITECTURES))


class UnsupportedTarget(ValueError):
    """The model's class cannot be a target here; the message names what can."""


def target_kind(config) -> str:
    """'ssm' or 'attention' for a model config; UnsupportedTarget for recurrent or hybrid classes served by neither."""
    architectures = list(getattr(config, "architectures", None) or [])
    if any(a in SSM_ARCHITECTURES for a in architectures) or getattr(config, "model_type", None) in (
            "mamba", "mamba2", "jamba", "bamba"):
        return "ssm"
    kinds = set(getattr(config, "layer_types", None) or [])
    recurrent = sorted(kinds - set(ATTENTION_LAYER_KINDS))
    if recurrent:
        name = architectures[0] if architectures else getattr(config, "model_type", "this model")
        raise UnsupportedTarget(f"{name} (layer kinds {recurrent}) is not supported as a target; supported: "
                                f"{SUPPORTED}")  # fmt: skip
    return "attention"


def check_tensor_parallel(config, tp_size: int) -> None:
    """UnsupportedTarget where tp_size > 1 and `config` is an SSM or hybrid target's. Tensor parallelism shards
    attention targets only: `SSMTargetModel` computes over whole weights, and DeepSpeed AutoTP's own split of these
    classes is not sound (it cuts Mamba's in_proj by columns, whose channels x_proj then sums over, and Bamba's
    attention o_proj is not among the layers it all-reduces)."""
    if tp_size > 1 and target_kind(config) == "ssm":
        architectures = list(getattr(config, "architectures", None) or [])
        name = architectures[0] if architectures else getattr(config, "model_type", "this model")
        raise UnsupportedTarget(f"tensor parallelism (tp_size {tp_size}) serves attention targets only, not "
                                f"{name}; serve it with tp_size=1")  # fmt: skip


def load_target_model(name_or_path: str, *, dtype: str | torch.dtype | None = None, device: str = "cpu"):
    """The target adapter for a hub id, local directory or embedded name: `SSMTargetModel` for Mamba, else
    `TargetModel`."""
    from transformers import AutoConfig

    path = resolve_model_path(name_or_path)
    if target_kind(AutoConfig.from_pretrained(path)) == "ssm":
        from ray_specdec.models.target.ssm import SSMTargetModel

        return SSMTargetModel.from_pretrained(path, dtype=dtype, device=device)
    from ray_specdec.models.target.model import TargetModel

    try:
        return TargetModel.from_pretrained(path, dtype=dtype, device=device)
    except ValueError as exc:  # HF's refusal of sdpa: a class with no attention (RWKV, ...) or an unusual one
        if "does not support an attention implementation" not in str(exc):
            raise
        name = str(exc).split()[0]
        raise UnsupportedTarget(f"{name} has no sdpa attention to verify trees through; supported: "
                                f"{SUPPORTED}") from None
