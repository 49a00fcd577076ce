"""`python -m ray_specdec train-drafter`: distil a Mamba or Mamba2 drafter from any HF causal-LM target on the user's
files.

The recipe is the default drafter's (train.fit with a teacher): on random windows of the user's text the drafter
learns the target's own next-token distributions, loss alpha * KL(target || drafter) + (1 - alpha) * cross-entropy
to the text's next token. The drafter takes the target's tokenizer and vocabulary size, so the two share token ids.

With --generate-tokens N the windows are the target's own continuations instead (sequence-level distillation): the
target continues prompts cut from the user's text, greedily and at temperature 1 in turn, until N tokens are
generated, and the drafter trains on prompt and continuation. The drafter then learns the text the target writes,
which is what it drafts against at serving time. --init-from continues an existing drafter's weights (the shipped
drafter-mamba, for a target of its tokenizer). --arch mamba2 trains a Mamba2 drafter of about the same size.

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
from ray_specdec.models.loading import resolve_model_path
from ray_specdec.training.models import DRAFTER_CONFIGS, DRAFTER_SIZES, build_model

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

    from ray_specdec.models.loading import resolve_dtype

    try:
        path = resolve_model_path(name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype("auto", device))
    except Exception as e:  # any failure to load is the user's input problem here
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise LoadError(f"cannot load target {name!r}: {type(e).__name__}: {first_line}") from None
    return tokenizer, model.to(device).eval()


@torch.no_grad()
def target_continuations(target, stream: torch.Tensor, tokens: int, prompt_len: int, new_tokens: int, eos: int | None,
                         seed: int, device: torch.device, batch_size: int = 64) -> torch.Tensor:
    """[M] the target's own text: prompts of prompt_len tokens cut at random from stream [N], each continued by the
    target for new_tokens (batches alternate greedy and temperature 1), joined by eos; until `tokens` are generated."""
    from tqdm import tqdm

    if len(stream) < prompt_len + 1:
        raise UsageError(f"--data: {len(stream)} tokens, fewer than one --prompt-tokens prompt ({prompt_len})")
    gen = torch.Generator().manual_seed(seed)
    batch_size = min(batch_size, -(-tokens // new_tokens))
    pieces, made = [], 0
    with tqdm(total=tokens, desc="target continuations", unit="tok", dynamic_ncols=True) as bar:
        while made < tokens:
            starts = torch.randint(0, len(stream) - prompt_len, (batch_size,), generator=gen)
            prompts = torch.stack([stream[s : s + prompt_len] for s in starts.tolist()]).long().to(device)
            sampled = len(pieces) % 2 == 1
            torch.manual_seed(seed + len(pieces))
            out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=sampled, temperature=1.0 if sampled else None,
                                  top_k=0 if sampled else None, top_p=1.0 if sampled else None, pad_token_id=eos)
            piece = torch.cat([out.cpu(), torch.full((batch_size, 1), eos if eos is not None else 0)], dim=1)
            pieces.append(piece.reshape(-1).to(torch.int32))
            made += batch_size * new_tokens
            bar.update(batch_size * new_tokens)
    return torch.cat(pieces)


def parse_args(argv: list[str]):
    from ray_specdec.training.train import add_settings_arguments

    p = OneLineParser(prog="python -m ray_specdec train-drafter", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="HF id or local dir of the target to distil from")
    p.add_argument("--data", required=True, nargs="+", type=Path, metavar="PATH",
                   help="text or code files, or directories (searched recursively for text and code files)")
    p.add_argument("--out", required=True, type=Path, help="directory of the drafter (and of its checkpoint)")
    p.add_argument("--arch", choices=list(DRAFTER_CONFIGS), default="mamba",
                   help="the drafter's family: Mamba (MambaForCausalLM) or Mamba2 (Mamba2ForCausalLM)")
    p.add_argument("--size", choices=list(DRAFTER_SIZES), default="2.8m",
                   help="parameters at a 4096-token vocabulary (a larger vocabulary adds vocab x hidden)")
    p.add_argument("--hidden-size", type=positive_int, help="overrides the size's hidden size")
    p.add_argument("--layers", type=positive_int, help="overrides the size's layer count")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU where there is one)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in OUT")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="start from this drafter's weights (a model directory or embedded name of this size)")
    p.add_argument("--generate-tokens", type=positive_int, default=None, metavar="N",
                   help="train on N tokens the target generates from prompts cut from --data (its own outputs)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128,
                   help="with --generate-tokens: prompt length cut from --data")
    p.add_argument("--continuation-tokens", type=positive_int, default=256,
                   help="with --generate-tokens: tokens the target writes after each prompt")
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
    text_tokens = len(stream)
    if args.generate_tokens:
        stream = target_continuations(teacher, stream, args.generate_tokens, args.prompt_tokens,
                                      args.continuation_tokens, tokenizer.eos_token_id, args.seed, device)
    if len(stream) < args.seq_len + 2:
        raise UsageError(f"--data: {len(stream)} tokens in {len(files)} file(s); a training window needs "
                         f"{args.seq_len + 2} (more text or a smaller --seq-len)")
    preset_hidden, preset_layers = DRAFTER_SIZES[args.size]
    hidden, layers = args.hidden_size or preset_hidden, args.layers or preset_layers
    vocab_size = teacher.config.get_text_config(decoder=True).vocab_size
    settings = TrainSettings(
        arch=f"{args.arch}-{hidden}x{layers}", name=args.out.name, tokenizer=args.target, teacher=args.target,
        init_from=args.init_from,  # as given (training.json keeps no path of this machine); fit resolves it
        **{k: getattr(args, k) for k in ("alpha", "seq_len", "batch_size", "lr", "warmup_steps", "max_steps",
                                         "max_minutes", "ckpt_every", "seed")})
    torch.manual_seed(settings.seed)
    model = build_model(DRAFTER_CONFIGS[args.arch](vocab_size, tokenizer.eos_token_id, hidden, layers))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"drafter: {args.arch}, {parameters / 1e6:.2f}M parameters (hidden {hidden}, {layers} layers, vocab "
          f"{vocab_size}); data: {len(files)} files, {text_tokens:,} tokens; training stream {len(stream):,} tokens; "
          f"device {device}")
    try:
        fit(model, teacher, stream, settings, run_dir, device, args.resume)
    except ValueError as e:  # a checkpoint of another size
        raise UsageError(str(e)) from None
    size = {"name": args.size if (hidden, layers) == (preset_hidden, preset_layers) else "custom",
            "hidden_size": hidden, "layers": layers}
    extra = {"target": args.target, "size": size, "device": str(device),
             "data": {"paths": [str(p) for p in args.data], "files": len(files), "tokens": text_tokens}}
    if args.generate_tokens:
        extra["generated"] = {"tokens": len(stream), "prompt_tokens": args.prompt_tokens,
                              "continuation_tokens": args.continuation_tokens}
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
