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

# The shipped tokenizer's chat template (docs/MODELS.md): every message as "<|role|>\n<content>\n" (roles system, user,
# assistant; content a string or OpenAI-style text parts), then "<|assistant|>\n" for the generation prompt. The
# markers are plain text the byte-level tokenizer encodes, not special tokens: the models were not trained on chat.
CHAT_TEMPLATE = r"""{%- for message in messages -%}
    {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
        {{- raise_exception('chat roles are system, user and assistant, got ' + message['role']) -}}
    {%- endif -%}
    {%- if message['content'] is string -%}
        {%- set text = message['content'] -%}
    {%- else -%}
        {%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
    {%- endif -%}
    {{- '<|' + message['role'] + '|>\n' + text + '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}"""
