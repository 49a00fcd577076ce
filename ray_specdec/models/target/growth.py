"""Function-preserving growth of a causal LM: a wider model that computes the same logits, untrained beyond its source.
GPTNeoX, Bamba (Llama-style attention and Mamba2 layers) and Mamba2 (`ARCHITECTURES`, one rule table each).

The grown model carries the source's hidden vector x as k copies, ``[x, x, …, x]`` (k = hidden_factor). A LayerNorm or
RMSNorm of the copies has the copies' mean and variance (mean of squares), so its weights (and bias) are the source's
repeated k times. A weight that writes the hidden state repeats its output rows (and bias) k times; a weight that
reads it takes its input columns k times, copy c scaled by a share s_c with Σ s_c = 1, so that its product sums back
to the source's. Embedding rows are repeated along hidden; the LM head reads hidden with shares (a tied head is untied:
it reads with shares what the embedding writes as copies). An MLP's intermediate units (gated: gate and up rows
together) are copied mlp_factor times the same way, its down projection reading the copies with shares.

Heads of every kind are copied whole, k times, copy-major (copy c of head h is head c·H + h), their per-head sizes
unchanged:
- attention (head_dim, so the rotary dims and the 1/√head_dim scale stay): GPTNeoX's fused query_key_value views its
  output as ``[heads, 3 · head_dim]`` (each head's q, k and v rows together), so copying its rows block-wise copies
  heads; Bamba's q, k and v projections copy their heads separately, K/V heads k times as query heads are, so query
  copy c·H + h maps to K/V head (c·H + h) // (H / H_kv) = c·H_kv + h // (H / H_kv): the copy of its source K/V head.
  The output projection reads the k copies of the heads with shares.
- Mamba2 mixers (d_head, d_state and the conv width stay; heads and groups times k, so d_inner = expand · hidden
  stays true): in_proj's output is the segments z, x, B, C, dt, and the conv's channels x, B, C; each segment is
  copied k times in place, so head c·H + h reads group c·G + h // (H / G), the copy of its source group, and A, D and
  dt_bias repeat per head. The gated RMSNorm normalizes per group of d_inner / G channels, the same groups copied.
  out_proj reads the k copies of d_inner with shares. A request's SSM state is k times the source's.

Shares are powers of two (`dyadic_shares`: 1/2, 1/4, 1/4 for three copies), not 1/k: a weight times a power of two is
exact in any binary float format short of the subnormal range (there the first copy takes what the others round
away), so a float16 checkpoint grows into float16 weights whose copies sum back to the source weight bit for bit, where
1/3 would round every one of them.

`build_grown` writes the grown model as an HF directory (weights in the source's dtype, the source's tokenizer and
generation config, and growth.json saying what it was grown from); `ensure_grown` keeps one built copy in a cache
directory, rebuilt when its fingerprint (source weights, source config, factors) no longer matches.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

GROWTH_FILE = "growth.json"
# Files copied from the source directory as they are (those it has).
_COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "chat_template.jinja")
_WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Rule:
    """How one tensor grows. rows: the factor its dim 0 is copied by ("hidden", "mlp" or None to keep it), whole or
    per segment of the architecture's row layout `segments`; cols: the factor of its dim 1, each copy scaled by the
    dyadic shares where `shared`."""

    rows: str | None
    cols: str | None = None
    shared: bool = False
    segments: str | None = None
    dims: int = 2


def _reads(rows: str | None, cols: str = "hidden", segments: str | None = None) -> Rule:
    """A weight that reads `cols` copies with shares and writes `rows` copies."""
    return Rule(rows, cols, shared=True, segments=segments)


def _copies(factor: str, segments: str | None = None, dims: int = 1) -> Rule:
    """A tensor whose dim 0 is copied (a bias, a norm's weight, a per-head parameter, the conv's channels)."""
    return Rule(factor, segments=segments, dims=dims)


def _mamba2_segments(d_inner: int, groups: int, state: int, heads: int) -> dict[str, list[int]]:
    """A Mamba2 mixer's row layouts: in_proj writes z, x, B, C, dt; the conv runs over x, B, C."""
    return {"in_proj": [d_inner, d_inner, groups * state, groups * state, heads],
            "conv": [d_inner, groups * state, groups * state]}


@dataclass(frozen=True)
class Architecture:
    """The growth of one HF model_type: config fields times a factor, tensors by the longest name suffix in `tensors`,
    row layouts (segment sizes) read from the source config."""

    config_factors: dict[str, str]
    tensors: dict[str, Rule]
    embedding: str  # the state-dict name a tied LM head shares
    segments: Callable[[dict], dict[str, list[int]]] = field(default=lambda config: {})


_MAMBA2_MIXER = {
    "in_proj.weight": _reads("hidden", segments="in_proj"),
    "in_proj.bias": _copies("hidden", segments="in_proj"),
    "conv1d.weight": _copies("hidden", segments="conv", dims=3),  # [channels, 1, d_conv]
    "conv1d.bias": _copies("hidden", segments="conv"),
    "dt_bias": _copies("hidden"),
    "A_log": _copies("hidden"),
    "D": _copies("hidden"),
    "norm.weight": _copies("hidden"),  # the gated RMSNorm over d_inner (and a Mamba2 block's RMSNorm over hidden)
    "out_proj.weight": _reads("hidden"),
    "out_proj.bias": _copies("hidden"),
}

ARCHITECTURES = {
    "gpt_neox": Architecture(
        config_factors={"hidden_size": "hidden", "num_attention_heads": "hidden", "intermediate_size": "mlp"},
        tensors={
            "embed_in.weight": Rule(None, "hidden"),
            "query_key_value.weight": _reads("hidden"),
            "query_key_value.bias": _copies("hidden"),
            "dense.weight": _reads("hidden"),  # attention output: reads the heads, writes hidden
            "dense.bias": _copies("hidden"),
            "dense_h_to_4h.weight": _reads("mlp"),
            "dense_h_to_4h.bias": _copies("mlp"),
            "dense_4h_to_h.weight": _reads("hidden", "mlp"),
            "dense_4h_to_h.bias": _copies("hidden"),
            **{f"{norm}.{p}": _copies("hidden") for norm in ("input_layernorm", "post_attention_layernorm",
                                                            "final_layer_norm") for p in ("weight", "bias")},
            "embed_out.weight": _reads(None),  # the LM head, as checkpoints name it
            "lm_head.weight": _reads(None),  # the LM head, as transformers 5 names it in memory
        },
        embedding="gpt_neox.embed_in.weight",
    ),
    "bamba": Architecture(
        config_factors={"hidden_size": "hidden", "num_attention_heads": "hidden", "num_key_value_heads": "hidden",
                        "mamba_n_heads": "hidden", "mamba_n_groups": "hidden", "intermediate_size": "mlp"},
        tensors={
            "embed_tokens.weight": Rule(None, "hidden"),
            **{f"{proj}.weight": _reads("hidden") for proj in ("q_proj", "k_proj", "v_proj", "o_proj")},
            **{f"{proj}.bias": _copies("hidden") for proj in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "gate_proj.weight": _reads("mlp"),
            "gate_proj.bias": _copies("mlp"),
            "up_proj.weight": _reads("mlp"),
            "up_proj.bias": _copies("mlp"),
            "down_proj.weight": _reads("hidden", "mlp"),
            "down_proj.bias": _copies("hidden"),
            **{f"{norm}.weight": _copies("hidden") for norm in ("input_layernorm", "pre_ff_layernorm",
                                                                "final_layernorm")},
            **_MAMBA2_MIXER,
            "lm_head.weight": _reads(None),
        },
        embedding="model.embed_tokens.weight",
        segments=lambda c: _mamba2_segments(int(c["mamba_expand"] * c["hidden_size"]), c["mamba_n_groups"],
                                            c["mamba_d_state"], c["mamba_n_heads"]),
    ),
    "mamba2": Architecture(
        config_factors={"hidden_size": "hidden", "num_heads": "hidden", "n_groups": "hidden"},
        tensors={
            "embeddings.weight": Rule(None, "hidden"),
            **_MAMBA2_MIXER,
            "norm_f.weight": _copies("hidden"),
            "lm_head.weight": _reads(None),
        },
        embedding="backbone.embeddings.weight",
        segments=lambda c: _mamba2_segments(int(c["expand"] * c["hidden_size"]), c["n_groups"], c["state_size"],
                                            c["num_heads"]),
    ),
}
_NEOX_CONFIG = {"model_type": "gpt_neox"}


def architecture(config: dict) -> Architecture:
    """The growth rules of a config.json dict's model_type."""
    arch = ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise ValueError(f"growth knows model types {', '.join(ARCHITECTURES)}; got {config.get('model_type')!r}")
    return arch


def dyadic_shares(copies: int) -> list[float]:
    """`copies` powers of two that sum to 1, as even as powers of two allow: with p the largest power of two <= copies,
    2p - copies shares of 1/p and 2(copies - p) of 1/(2p)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    p = 1 << (copies.bit_length() - 1)
    return [1.0 / p] * (2 * p - copies) + [0.5 / p] * (2 * (copies - p))


def _copy_rows(w: torch.Tensor, copies: int, segments: list[int] | None = None) -> torch.Tensor:
    # w: [out, ...] -> [copies * out, ...], copy-major within each segment of dim 0 (the whole of it by default)
    if segments is None:
        return torch.cat([w] * copies, dim=0)
    if sum(segments) != w.shape[0]:
        raise ValueError(f"row segments {segments} do not add up to {w.shape[0]} rows")
    return torch.cat([part for part in w.split(segments) for _ in range(copies)], dim=0)


def split_by_shares(w: torch.Tensor, copies: int) -> list[torch.Tensor]:
    """w as `copies` parts scaled by the dyadic shares that sum back to w exactly: the first part takes what the others
    round away (a share of a subnormal loses its low bits; the difference is a multiple of the same last unit)."""
    rest = [w * s for s in dyadic_shares(copies)[1:]]
    first = (w.double() - sum(part.double() for part in rest)).to(w.dtype) if rest else w
    return [first, *rest]


def _copy_columns(w: torch.Tensor, copies: int, shared: bool) -> torch.Tensor:
    # w: [out, in] -> [out, copies * in]: parts that sum to w where shared, else w itself `copies` times
    return torch.cat(split_by_shares(w, copies) if shared else [w] * copies, dim=1)


def _rule(arch: Architecture, name: str) -> Rule | None:
    # the rule of the longest dotted suffix of `name` that has one
    parts = name.split(".")
    for start in range(len(parts)):
        rule = arch.tensors.get(".".join(parts[start:]))
        if rule is not None:
            return rule
    return None


def grow_tensor(name: str, tensor: torch.Tensor, hidden_factor: int, mlp_factor: int,
                config: dict | None = None) -> torch.Tensor:
    """The grown value (same dtype) of one state-dict entry of the model `config` (its config.json dict; default a
    GPTNeoXForCausalLM)."""
    config = config or _NEOX_CONFIG
    arch = architecture(config)
    rule = _rule(arch, name)
    if rule is None or tensor.dim() != rule.dims:
        raise ValueError(f"no growth rule for {name!r} of shape {tuple(tensor.shape)}")
    factors = {"hidden": hidden_factor, "mlp": mlp_factor, None: 1}
    segments = arch.segments(config)[rule.segments] if rule.segments else None
    grown = _copy_columns(tensor, factors[rule.cols], rule.shared) if rule.cols else tensor
    return _copy_rows(grown, factors[rule.rows], segments)


def _with_lm_head(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    # a tied model's head is its embedding; a file may leave it out
    if not config.get("tie_word_embeddings") or "lm_head.weight" in state:
        return state
    return {**state, "lm_head.weight": state[architecture(config).embedding]}


def grow_state_dict(state: dict[str, torch.Tensor], hidden_factor: int, mlp_factor: int,
                    config: dict | None = None) -> dict[str, torch.Tensor]:
    """The grown state dict of the model `config` (default a GPTNeoXForCausalLM): same names, wider tensors, same
    function; a tied LM head becomes its own weight."""
    state = _with_lm_head(state, config or _NEOX_CONFIG)
    return {name: grow_tensor(name, t, hidden_factor, mlp_factor, config) for name, t in state.items()}


def grow_config(config: dict, hidden_factor: int, mlp_factor: int) -> dict:
    """The grown config (a config.json dict): hidden size and every head and group count times hidden_factor, the MLP's
    intermediate size times mlp_factor; per-head sizes, rotary and everything else unchanged; embeddings untied."""
    arch = architecture(config)
    if hidden_factor < 1 or mlp_factor < 1:
        raise ValueError(f"factors must be >= 1, got hidden {hidden_factor}, mlp {mlp_factor}")
    factors = {"hidden": hidden_factor, "mlp": mlp_factor}
    grown = {key: config[key] * factors[factor] for key, factor in arch.config_factors.items()
             if config.get(key) is not None}  # a Bamba's absent K/V head count follows the query heads
    if config.get("tie_word_embeddings"):
        grown["tie_word_embeddings"] = False
    return {**config, **grown}


def fingerprint(source: Path, hidden_factor: int, mlp_factor: int) -> str:
    """What a built copy is a function of: the source's weights and config, and the factors."""
    model_type = json.loads((source / "config.json").read_text()).get("model_type")
    digest = hashlib.sha256(f"{model_type} growth, hidden x{hidden_factor}, mlp x{mlp_factor}\n".encode())
    for file in ("config.json", _WEIGHTS_FILE):
        with open(source / file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_growth(directory: Path) -> dict | None:
    """A built directory's growth.json, or None where it has none (not built, or not completely)."""
    try:
        return json.loads((directory / GROWTH_FILE).read_text())
    except (OSError, ValueError):
        return None


def build_grown(name: str, source: Path, out: Path, hidden_factor: int, mlp_factor: int) -> None:
    """Write the model grown from the HF directory `source` into the new directory `out`, with a progress bar."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    source_config = json.loads((source / "config.json").read_text())
    config = grow_config(source_config, hidden_factor, mlp_factor)
    out.mkdir(parents=True)
    grown = {}
    with safe_open(source / _WEIGHTS_FILE, framework="pt") as f:
        # grown name -> the file's tensor it grows from (a tied head, left out of the file, from the embedding)
        names = {key: key for key in f.keys()}
        if source_config.get("tie_word_embeddings") and "lm_head.weight" not in names:
            names["lm_head.weight"] = architecture(source_config).embedding
        with tqdm(total=len(names) + 1, desc=f"building {name}", unit="tensor", dynamic_ncols=True) as bar:
            for key, source_key in names.items():
                grown[key] = grow_tensor(key, f.get_tensor(source_key), hidden_factor, mlp_factor,
                                         source_config).contiguous()
                bar.update()
            bar.set_postfix_str("writing")
            save_file(grown, out / _WEIGHTS_FILE, metadata={"format": "pt"})
            bar.update()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in _COPIED_FILES:
        if (source / file).exists():
            shutil.copyfile(source / file, out / file)
    training = source / "training.json"
    record = {
        "name": name,
        "grown_from": source.name,
        "hidden_factor": hidden_factor,
        "mlp_factor": mlp_factor,
        "hidden_shares": dyadic_shares(hidden_factor),
        "mlp_shares": dyadic_shares(mlp_factor),
        "trained": f"no: the function of {source.name}, whose training record follows",
        "source_training": json.loads(training.read_text()) if training.exists() else None,
        "parameters": sum(math.prod(t.shape) for t in grown.values()),
        "fingerprint": fingerprint(source, hidden_factor, mlp_factor),
    }
    (out / GROWTH_FILE).write_text(json.dumps(record, indent=1) + "\n")  # written last: its presence means complete


def is_current(out: Path, source: Path, hidden_factor: int, mlp_factor: int) -> bool:
    """Whether `out` holds a complete build of this source at these factors."""
    record = read_growth(out)
    return record is not None and record.get("fingerprint") == fingerprint(source, hidden_factor, mlp_factor)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (created): processes of one machine build one copy at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_grown(name: str, source: Path, out: Path, hidden_factor: int, mlp_factor: int) -> Path:
    """`out`, built first where it is missing or stale: into a temporary directory beside it, then renamed into place,
    so a reader sees a complete build or none."""
    if is_current(out, source, hidden_factor, mlp_factor):
        return out
    with _locked(out.parent / f".{out.name}.lock"):
        if is_current(out, source, hidden_factor, mlp_factor):  # another process built it while we waited
            return out
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            build_grown(name, source, staging / out.name, hidden_factor, mlp_factor)
            if out.exists():
                os.rename(out, staging / "stale")
            os.rename(staging / out.name, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out
