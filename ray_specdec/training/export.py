"""Export a training checkpoint to a self-contained HF model directory (fp16 safetensors + tokenizer).

    python -m ray_specdec.training.export --run runs/target-neox --out ray_specdec/default_models/target-neox
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ray_specdec.defaults import CHAT_TEMPLATE
from ray_specdec.models.loading import PREFILL_WINDOW_KEY, resolve_model_path
from ray_specdec.training.models import build_model

EXPORT_DTYPE = torch.float16


def _final_loss(run_dir: Path) -> float | None:
    """Last batch loss of the run (from summary.json written at its end), None for a run still going."""
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()).get("final_loss") if summary.exists() else None


def _prior_training(init_from: str | None) -> dict | None:
    """training.json of the model a run was started from (a directory or an embedded name such as drafter-mamba),
    None where there is none (no --init-from, a model trained elsewhere, a directory since removed)."""
    if not init_from:
        return None
    try:
        path = Path(resolve_model_path(init_from)) / "training.json"
    except (FileNotFoundError, ValueError):  # a directory since removed, or not a model directory
        return None
    return json.loads(path.read_text()) if path.exists() else None


def _history(init_from: str | None, info: dict) -> dict:
    """Earlier rounds of a run started with --init-from, and totals over all rounds (read before out_dir is written,
    which may be the same directory)."""
    prior = _prior_training(init_from)
    if prior is None:
        return {}
    rounds = prior.pop("previous_rounds", []) + [{k: v for k, v in prior.items() if not k.startswith("total_")}]
    return {"previous_rounds": rounds,
            "total_steps": sum(r["steps"] for r in rounds) + info["steps"],
            "total_tokens": sum(r["tokens"] for r in rounds) + info["tokens"],
            "total_minutes": round(sum(r["minutes"] for r in rounds) + info["minutes"], 1)}


def _longest_window(settings: dict) -> int:
    """The longest training window (seq_len) of this run and the runs it continued."""
    longest = settings["seq_len"]
    prior = _prior_training(settings.get("init_from"))
    if prior is not None:
        for round_ in prior.get("previous_rounds", []) + [prior]:
            longest = max(longest, round_.get("settings", {}).get("seq_len", 0))
    return longest


def export(run_dir: Path, out_dir: Path, tokenizer_dir: Path | str) -> dict:
    """A default-family model directory (write_model_dir); the tokenizer gets the shipped chat template if it has
    none (a fresh tokenizer run has none)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = tokenizer.chat_template or CHAT_TEMPLATE
    return write_model_dir(run_dir, out_dir, tokenizer)


def write_model_dir(run_dir: Path, out_dir: Path, tokenizer, extra_info: dict | None = None) -> dict:
    """Writes model.safetensors (fp16), config.json, generation_config.json, the tokenizer's files and training.json
    (the run's steps, tokens, minutes, parameters, final loss, settings, then extra_info); returns training.json's
    content."""
    ckpt = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    config_dict = dict(ckpt["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = build_model(config)
    model.load_state_dict(ckpt["model"])
    model = model.to(EXPORT_DTYPE)
    model.config.dtype = EXPORT_DTYPE
    if config.model_type in ("mamba", "mamba2"):  # a drafter names its training windows as its prefill window
        setattr(model.config, PREFILL_WINDOW_KEY, _longest_window(ckpt["settings"]))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info = {"steps": ckpt["step"], "tokens": ckpt["tokens"], "minutes": round(ckpt["elapsed_s"] / 60, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "final_loss": _final_loss(run_dir),
            "settings": ckpt["settings"]}
    info.update(_history(ckpt["settings"].get("init_from"), info))
    info.update(extra_info or {})
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="run directory holding ckpt.pt")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", default="runs/tokenizer")
    args = parser.parse_args()
    info = export(args.run, args.out, args.tokenizer)
    print(f"{args.out}: step {info['steps']}, {info['parameters'] / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
