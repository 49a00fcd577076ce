"""Function-preserving growth of a GPTNeoX causal LM: a wider model that computes the same logits, untrained beyond
its source.

The grown model carries the source's hidden vector x as k copies, ``[x, x, …, x]`` (k = hidden_factor). A LayerNorm of
the copies has the copies' mean and variance, so its gamma and beta are the source's repeated k times. A weight that
writes the hidden state repeats its output rows (and bias) k times; a weight that reads it takes its input columns k
times, copy c scaled by a share s_c with Σ s_c = 1, so that its product sums back to the source's. Attention heads are
copied whole, k times (head_dim unchanged, so the rotary dims and the 1/√head_dim scale stay): GPTNeoXAttention views
the fused query_key_value output as ``[heads, 3 · head_dim]`` (each head's q, k and v rows together), so copying the
fused rows block-wise copies heads, and the output projection ``dense`` reads the k copies of the heads with shares.
The MLP's intermediate units are copied mlp_factor times the same way. Embedding rows are repeated along hidden; the
LM head reads hidden with shares.

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
from pathlib import Path

import torch

GROWTH_FILE = "growth.json"
# Files copied from the source directory as they are (those it has).
_COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt")
_WEIGHTS_FILE = "model.safetensors"

# How each 2D weight grows, by the last two parts of its name: (output copies, input copies, input scaled by shares).
# "hidden" and "mlp" name the factor; None keeps that dimension.
_MATRIX_RULES = {
    "embed_in.weight": (None, "hidden", False),
    "query_key_value.weight": ("hidden", "hidden", True),
    "dense.weight": ("hidden", "hidden", True),  # attention output: reads the heads, writes hidden
    "dense_h_to_4h.weight": ("mlp", "hidden", True),
    "dense_4h_to_h.weight": ("hidden", "mlp", True),
    "embed_out.weight": (None, "hidden", True),  # the LM head, as checkpoints name it
    "lm_head.weight": (None, "hidden", True),  # the LM head, as transformers 5 names it in memory
}
# How each 1D tensor grows: copies by factor name.
_VECTOR_RULES = {
    "query_key_value.bias": "hidden",
    "dense.bias": "hidden",
    "dense_h_to_4h.bias": "mlp",
    "dense_4h_to_h.bias": "hidden",
}
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "final_layer_norm")


def dyadic_shares(copies: int) -> list[float]:
    """`copies` powers of two that sum to 1, as even as powers of two allow: with p the largest power of two <= copies,
    2p - copies shares of 1/p and 2(copies - p) of 1/(2p)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    p = 1 << (copies.bit_length() - 1)
    return [1.0 / p] * (2 * p - copies) + [0.5 / p] * (2 * (copies - p))


def _copy_rows(w: torch.Tensor, copies: int) -> torch.Tensor:
    # w: [out, ...] -> [copies * out, ...], copy-major
    return torch.cat([w] * copies, dim=0)


def split_by_shares(w: torch.Tensor, copies: int) -> list[torch.Tensor]:
    """w as `copies` parts scaled by the dyadic shares that sum back to w exactly: the first part takes what the others
    round away (a share of a subnormal loses its low bits; the difference is a multiple of the same last unit)."""
    rest = [w * s for s in dyadic_shares(copies)[1:]]
    first = (w.double() - sum(part.double() for part in rest)).to(w.dtype) if rest else w
    return [first, *rest]


def _copy_columns(w: torch.Tensor, copies: int, shared: bool) -> torch.Tensor:
    # w: [out, in] -> [out, copies * in]: parts that sum to w where shared, else w itself `copies` times
    return torch.cat(split_by_shares(w, copies) if shared else [w] * copies, dim=1)


def grow_tensor(name: str, tensor: torch.Tensor, hidden_factor: int, mlp_factor: int) -> torch.Tensor:
    """The grown value of one GPTNeoXForCausalLM state-dict entry (same dtype)."""
    factors = {"hidden": hidden_factor, "mlp": mlp_factor, None: 1}
    parts = name.split(".")
    key = ".".join(parts[-2:])
    if parts[-2] in _LAYER_NORMS and parts[-1] in ("weight", "bias"):
        return _copy_rows(tensor, hidden_factor)
    if key in _VECTOR_RULES and tensor.dim() == 1:
        return _copy_rows(tensor, factors[_VECTOR_RULES[key]])
    if key in _MATRIX_RULES and tensor.dim() == 2:
        rows, cols, shared = _MATRIX_RULES[key]
        return _copy_rows(_copy_columns(tensor, factors[cols], shared), factors[rows])
    raise ValueError(f"no growth rule for {name!r} of shape {tuple(tensor.shape)}")


def grow_state_dict(state: dict[str, torch.Tensor], hidden_factor: int, mlp_factor: int) -> dict[str, torch.Tensor]:
    """The grown GPTNeoXForCausalLM state dict: same names, wider tensors, same function."""
    return {name: grow_tensor(name, t, hidden_factor, mlp_factor) for name, t in state.items()}


def grow_config(config: dict, hidden_factor: int, mlp_factor: int) -> dict:
    """The grown GPTNeoX config (a config.json dict): hidden and heads times hidden_factor, intermediate times
    mlp_factor; head_dim, rotary and everything else unchanged."""
    if config.get("model_type") != "gpt_neox":
        raise ValueError(f"growth knows GPTNeoX only, got model_type {config.get('model_type')!r}")
    if hidden_factor < 1 or mlp_factor < 1:
        raise ValueError(f"factors must be >= 1, got hidden {hidden_factor}, mlp {mlp_factor}")
    return {
        **config,
        "hidden_size": config["hidden_size"] * hidden_factor,
        "num_attention_heads": config["num_attention_heads"] * hidden_factor,
        "intermediate_size": config["intermediate_size"] * mlp_factor,
    }


def fingerprint(source: Path, hidden_factor: int, mlp_factor: int) -> str:
    """What a built copy is a function of: the source's weights and config, and the factors."""
    digest = hashlib.sha256(f"gpt_neox growth, hidden x{hidden_factor}, mlp x{mlp_factor}\n".encode())
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

    config = grow_config(json.loads((source / "config.json").read_text()), hidden_factor, mlp_factor)
    out.mkdir(parents=True)
    grown = {}
    with safe_open(source / _WEIGHTS_FILE, framework="pt") as f:
        names = list(f.keys())
        with tqdm(total=len(names) + 1, desc=f"building {name}", unit="tensor", dynamic_ncols=True) as bar:
            for key in names:
                grown[key] = grow_tensor(key, f.get_tensor(key), hidden_factor, mlp_factor).contiguous()
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
