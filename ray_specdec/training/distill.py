"""`python -m ray_specdec train-drafter`: distil a Mamba drafter from any HF causal-LM target on the user's files.

The recipe is the default drafter's (train.fit with a teacher): on random windows of the user's text the drafter
learns the target's own next-token distributions, loss alpha * KL(target || drafter) + (1 - alpha) * cross-entropy
to the text's next token. The drafter takes the target's tokenizer and vocabulary size, so the two share token ids.

OUT after a run is a model directory for `--drafter` (config.json naming the training window as the drafter's
prefill window, fp16 model.safetensors, generation_config.json, the target's tokenizer files, training.json) plus
OUT/checkpoint/ (ckpt.pt and summary.json: the training state, needed only to continue). An OUT that holds a
checkpoint is continued with --resume and refused without it; --max-steps and --max-minutes count the whole run,
resumed parts included, so a continued run raises one of them.

    python -m ray_specdec train-drafter --target Qwen/Qwen2.5-0.5B --data notes/ src/ --size 2.8m --out my-drafter
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from ray_specdec.cli import OneLineParser, UsageError, positive_int
from ray_specdec.factory import LoadError, resolve_device
from ray_specdec.training.models import DRAFTER_SIZES, build_model, mamba_drafter_config

# Files taken from a --data directory; a file named on the command line is taken whatever its name.
TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".tex", ".html", ".xml", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".ini", ".csv",
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".kt", ".scala", ".js", ".ts",
    ".tsx", ".jsx", ".rb", ".php", ".swift", ".sh", ".sql", ".lua", ".r", ".jl", ".hs", ".ml", ".css",
})
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})  # and every directory whose name starts with "."
CHECKPOINT_DIR = "checkpoint"


def data_files(paths: list[Path]) -> list[Path]:
    """Files named as they are; directories walked recursively (TEXT_SUFFIXES files, hidden and SKIPPED_DIRS
    left out), each directory's files in sorted order."""
    files = []
    for path in paths:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIPPED_DIRS)
                files += [Path(dirpath, f) for f in sorted(filenames) if Path(f).suffix.lower() in TEXT_SUFFIXES]
        else:
            raise UsageError(f"--data {path}: no such file or directory")
    return files


def read_texts(files: list[Path]) -> list[str]:
    """The files' texts (stray non-UTF-8 bytes replaced), files holding only whitespace left out."""
    texts = (f.read_bytes().decode("utf-8", errors="replace") for f in files)
    return [t for t in texts if t.strip()]


def load_target(name: str, device: torch.device):
    """(tokenizer, model in eval mode) of the target, the model in the device's default dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_specdec.models.loading import resolve_dtype, resolve_model_path

    try:
        path = resolve_model_path(name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype("auto", device))
    except Exception as e:  # any failure to load is the user's input problem here
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise LoadError(f"cannot load target {name!r}: {type(e).__name__}: {first_line}") from None
    return tokenizer, model.to(device).eval()


def parse_args(argv: list[str]):
    from ray_specdec.training.train import add_settings_arguments

    p = OneLineParser(prog="python -m ray_specdec train-drafter", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF id or local dir of the target to distil from")
    p.add_argument("--data", required=True, nargs="+", type=Path, metavar="PATH",
                   help="text or code files, or directories (searched recursively for text and code files)")
    p.add_argument("--out", required=True, type=Path, help="directory of the drafter (and of its checkpoint)")
    p.add_argument("--size", choices=list(DRAFTER_SIZES), default="2.8m",
                   help="parameters at a 4096-token vocabulary (a larger vocabulary adds vocab x hidden)")
    p.add_argument("--hidden-size", type=positive_int, help="overrides the size's hidden size")
    p.add_argument("--layers", type=positive_int, help="overrides the size's layer count")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU where there is one)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in OUT")
    add_settings_arguments(p, ("seq_len", "batch_size", "lr", "alpha", "warmup_steps", "max_steps", "max_minutes",
                               "ckpt_every", "seed"))
    return p.parse_args(argv)


def train_drafter(args) -> dict:
    """Trains (or continues) the drafter and writes OUT; returns OUT/training.json's content."""
    from ray_specdec.training.corpus import encode_texts
    from ray_specdec.training.export import write_model_dir
    from ray_specdec.training.train import TrainSettings, fit

    files = data_files(args.data)
    if not files:
        raise UsageError(f"--data {' '.join(map(str, args.data))}: no text files")
    run_dir = args.out / CHECKPOINT_DIR
    if (run_dir / "ckpt.pt").exists() and not args.resume:
        raise UsageError(f"{args.out} holds a checkpoint: pass --resume to continue it, or choose another --out")
    device = torch.device(resolve_device(args.device))
    texts = read_texts(files)
    if not texts:
        raise UsageError(f"--data: no text in {len(files)} file(s)")
    tokenizer, teacher = load_target(args.target, device)
    stream = torch.from_numpy(encode_texts(tokenizer, texts).astype(np.int32))   # [N]
    if len(stream) < args.seq_len + 2:
        raise UsageError(f"--data: {len(stream)} tokens in {len(files)} file(s); a training window needs "
                         f"{args.seq_len + 2} (more text or a smaller --seq-len)")
    preset_hidden, preset_layers = DRAFTER_SIZES[args.size]
    hidden, layers = args.hidden_size or preset_hidden, args.layers or preset_layers
    vocab_size = teacher.config.get_text_config(decoder=True).vocab_size
    settings = TrainSettings(
        arch=f"mamba-{hidden}x{layers}", name=args.out.name, tokenizer=args.target, teacher=args.target,
        **{k: getattr(args, k) for k in ("alpha", "seq_len", "batch_size", "lr", "warmup_steps", "max_steps",
                                         "max_minutes", "ckpt_every", "seed")})
    torch.manual_seed(settings.seed)
    model = build_model(mamba_drafter_config(vocab_size, tokenizer.eos_token_id, hidden, layers))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"drafter: {parameters / 1e6:.2f}M parameters (hidden {hidden}, {layers} layers, vocab {vocab_size}); "
          f"data: {len(files)} files, {len(stream):,} tokens; device {device}")
    try:
        fit(model, teacher, stream, settings, run_dir, device, args.resume)
    except ValueError as e:  # a checkpoint of another size
        raise UsageError(str(e)) from None
    size = {"name": args.size if (hidden, layers) == (preset_hidden, preset_layers) else "custom",
            "hidden_size": hidden, "layers": layers}
    extra = {"target": args.target, "size": size, "device": str(device),
             "data": {"paths": [str(p) for p in args.data], "files": len(files), "tokens": len(stream)}}
    return write_model_dir(run_dir, args.out, tokenizer, extra)


def main(argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        args = parse_args(argv)
        info = train_drafter(args)
    except (UsageError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: step {info['steps']}, {info['tokens']:,} tokens, {info['minutes']} minutes, "
          f"final loss {info['final_loss']}")
    return 0
