"""The embedded model family: the models shipped inside the package (trained by `ray_specdec.training`) and the ones
grown from them on first use (models/target/growth.py), their names and directories, and `python -m ray_specdec models`.

Shipped paths are resolved relative to the installed package, so they work from a checkout and from a wheel alike. A
grown model is built into the cache directory (RAY_SPECDEC_CACHE_DIR/models, default ~/.cache/ray_specdec/models) the
first time its name is resolved, and rebuilt where its source or factors changed. Every directory holds an HF model
(`from_pretrained`) and the shared tokenizer (`AutoTokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from ray_specdec import env

DEFAULT_MODELS_DIR = Path(__file__).resolve().parent / "default_models"

# Names of the shipped model directories (see docs/MODELS.md for how each was trained).
TARGET_NEOX = "target-neox"
TARGET_LLAMA = "target-llama"
DRAFTER_MAMBA = "drafter-mamba"
DRAFTER_NEOX_SMALL = "drafter-neox-small"
TARGET_HYBRID = "target-hybrid"  # target-llama made a Mamba2-attention hybrid (BambaForCausalLM), distilled from it
TARGET_MAMBA2 = "target-mamba2"  # a pure Mamba2 target (Mamba2ForCausalLM), distilled from target-neox
DRAFTER_MAMBA2 = "drafter-mamba2"  # a Mamba2 drafter of drafter-mamba's size, distilled from target-neox
DRAFTER_MAMBA_HYBRID = "drafter-mamba-hybrid"  # drafter-mamba distilled further against target-hybrid
DEFAULT_MODEL_NAMES = (TARGET_NEOX, TARGET_LLAMA, DRAFTER_MAMBA, DRAFTER_NEOX_SMALL, TARGET_HYBRID, TARGET_MAMBA2,
                       DRAFTER_MAMBA2, DRAFTER_MAMBA_HYBRID)

# Models grown from a shipped one with its function unchanged: name -> (source, hidden factor, MLP factor). 3 is the
# smallest hidden factor that takes target-neox (13.8M parameters) past 100M (105.1M), out of the CPU's caches.
# target-hybrid (13.7M) grows 2x to 48.3M: its step reads float32 weights (193 MB; target-neox-large's native path
# reads 210 MB of float16 panels), so one decode step costs about as much as target-neox-large's (docs/MODELS.md).
TARGET_NEOX_LARGE = "target-neox-large"
TARGET_HYBRID_LARGE = "target-hybrid-large"
GROWN_MODELS = {TARGET_NEOX_LARGE: (TARGET_NEOX, 3, 3), TARGET_HYBRID_LARGE: (TARGET_HYBRID, 2, 2)}
EMBEDDED_MODEL_NAMES = (*DEFAULT_MODEL_NAMES, *GROWN_MODELS)
# The drafter an embedded target gets where none is named: the one distilled against it (or against the model it was
# grown from); drafter-mamba for every other target.
PAIRED_DRAFTERS = {TARGET_HYBRID: DRAFTER_MAMBA_HYBRID, TARGET_HYBRID_LARGE: DRAFTER_MAMBA_HYBRID}


def default_model_path(name: str) -> Path:
    """Absolute path of the shipped model directory `name` (one of DEFAULT_MODEL_NAMES)."""
    if name not in DEFAULT_MODEL_NAMES:
        raise ValueError(f"unknown default model {name!r}; expected one of {DEFAULT_MODEL_NAMES}")
    return DEFAULT_MODELS_DIR / name


def models_cache_dir() -> Path:
    """Where grown models are built: RAY_SPECDEC_CACHE_DIR/models, or ~/.cache/ray_specdec/models (also where that
    variable is empty, which keeps no GEMM plans but cannot keep no models)."""
    root = (env.CACHE_DIR.value() or "").strip()
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "ray_specdec") / "models"


def embedded_model_path(name: str, build: bool = True) -> Path:
    """The directory of embedded model `name` (one of EMBEDDED_MODEL_NAMES): a shipped one's in the package, a grown
    one's in the cache, built first where it is missing or stale unless `build` is False."""
    if name in DEFAULT_MODEL_NAMES:
        return default_model_path(name)
    if name not in GROWN_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; expected one of {EMBEDDED_MODEL_NAMES}")
    out = models_cache_dir() / name
    if build:
        from ray_specdec.models.target.growth import ensure_grown

        source, hidden_factor, mlp_factor = GROWN_MODELS[name]
        ensure_grown(name, default_model_path(source), out, hidden_factor, mlp_factor)
    return out


def is_built(name: str) -> bool:
    """Whether embedded model `name` can be loaded from its directory as it is (a grown one: built and current)."""
    if name in GROWN_MODELS:
        from ray_specdec.models.target.growth import is_current

        source, hidden_factor, mlp_factor = GROWN_MODELS[name]
        return is_current(embedded_model_path(name, build=False), default_model_path(source), hidden_factor,
                          mlp_factor)
    return (embedded_model_path(name) / "config.json").exists()


DEFAULT_TARGET = default_model_path(TARGET_NEOX)
DEFAULT_DRAFTER = default_model_path(DRAFTER_MAMBA)
DEFAULT_TARGET_LLAMA = default_model_path(TARGET_LLAMA)
DEFAULT_TF_DRAFTER = default_model_path(DRAFTER_NEOX_SMALL)


def default_drafter_for(target: str | None) -> Path:
    """The shipped drafter for a target as named (an embedded name or its directory; None: the default target): the
    one paired with it (PAIRED_DRAFTERS), else drafter-mamba."""
    for name, drafter in PAIRED_DRAFTERS.items():
        if target is not None and (str(target) == name or _is_embedded_dir(str(target), name)):
            return default_model_path(drafter)
    return DEFAULT_DRAFTER


def _is_embedded_dir(target: str, name: str) -> bool:
    """Whether directory `target` is the embedded model `name`'s (shipped, or grown into the cache)."""
    try:
        return Path(target).resolve() == embedded_model_path(name, build=False).resolve()
    except (OSError, ValueError):
        return False


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
