"""Train one model of the default family: targets from scratch (cross-entropy), drafters by distillation.

Distillation loss: alpha * KL(teacher || student) + (1 - alpha) * cross-entropy, the teacher's next-token
distribution computed under no_grad on the same corpus windows. The LR follows a cosine over the run's progress,
max(step / max_steps, elapsed / max_minutes), so a run cut by its time budget still ends at a low LR. Checkpoints
(model, optimizer, step, elapsed time, RNG states) go to runs/<name>/ckpt.pt; `--resume` continues from there.
`fit` is the loop; `train` feeds it the corpus and a model of the family, `distill` (the train-drafter command) a
user's files and a Mamba drafter for any target.

    python -m ray_specdec.training.train --arch target-neox --max-minutes 25
    python -m ray_specdec.training.train --arch drafter-mamba --teacher ray_specdec/default_models/target-neox
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ray_specdec.models.loading import resolve_model_path
from ray_specdec.training.corpus import encode_split
from ray_specdec.training.mamba_train import fast_training_forward
from ray_specdec.training.models import build_config, build_model


@dataclass(frozen=True)
class TrainSettings:
    arch: str
    name: str
    tokenizer: str
    teacher: str | None = None
    init_from: str | None = None  # an exported model dir whose weights start the run (continue shipped weights)
    alpha: float = 0.9          # weight of the KL term when distilling
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 1_000_000
    max_minutes: float = 30.0
    ckpt_every: int = 50
    seed: int = 0


def lr_at(s: TrainSettings, step: int, progress: float) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cosine)


def sample_batch(stream: torch.Tensor, s: TrainSettings, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens. stream: [N] -> [batch, seq_len + 1]."""
    starts = torch.randint(0, len(stream) - s.seq_len - 1, (s.batch_size,), generator=gen)
    return torch.stack([stream[i:i + s.seq_len + 1] for i in starts.tolist()]).long()


def batch_loss(model, teacher, batch: torch.Tensor, alpha: float) -> torch.Tensor:
    """Cross-entropy, or the distillation mix when a teacher is given. batch: [b, L + 1]."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits.float()                   # [b, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    if teacher is None:
        return ce
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1).flatten(0, 1), teacher_logp.flatten(0, 1),
                  log_target=True, reduction="batchmean")
    return alpha * kl + (1 - alpha) * ce


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "state_size")


def architecture_mismatch(ours: dict, theirs: dict) -> dict:
    """Config keys that fix weight shapes and differ between two config dicts: key -> (ours, theirs)."""
    return {k: (ours.get(k), theirs.get(k)) for k in SHAPE_KEYS if ours.get(k) != theirs.get(k)}


def save_checkpoint(path: Path, model, optimizer, step: int, elapsed_s: float, tokens: int,
                    s: TrainSettings, gen: torch.Generator) -> None:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "elapsed_s": elapsed_s, "tokens": tokens, "settings": asdict(s), "config": model.config.to_dict(),
             "torch_rng": torch.get_rng_state(), "data_rng": gen.get_state()}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a run killed while saving keeps the previous checkpoint


def restore_checkpoint(path: Path, model, optimizer, gen: torch.Generator) -> tuple[int, float, int]:
    """Loads what `save_checkpoint` wrote into model, optimizer and RNGs; returns (step, elapsed_s, tokens)."""
    ckpt = torch.load(path, map_location=next(model.parameters()).device, weights_only=False)
    mismatch = architecture_mismatch(model.config.to_dict(), ckpt["config"])
    if mismatch:
        raise ValueError(f"checkpoint {path}: architecture differs from the run's: {mismatch}")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["torch_rng"])
    gen.set_state(ckpt["data_rng"])
    return ckpt["step"], ckpt["elapsed_s"], ckpt["tokens"]


def load_initial_weights(model, model_dir: Path) -> None:
    """Start from an exported model's weights (same architecture; fp16 on disk, the run's dtype in memory)."""
    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mismatch = architecture_mismatch(model.config.to_dict(), source.config.to_dict())
    if mismatch:
        raise ValueError(f"--init-from {model_dir}: architecture differs from the run's: {mismatch}")
    model.load_state_dict(source.state_dict())


def make_optimizer(model, s: TrainSettings) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def fit(model, teacher, stream: torch.Tensor, s: TrainSettings, run_dir: Path, device: torch.device,
        resume: bool) -> dict:
    """The training loop shared by every model: runs until max_steps or max_minutes (both counted over the whole run,
    resumed parts included), checkpoints to run_dir/ckpt.pt and writes run_dir/summary.json, which it returns.

    model: freshly built (its weights replaced by the checkpoint when resuming, else by s.init_from if given);
    teacher: None for plain cross-entropy; stream: [N] token ids of the training text.
    """
    ckpt_path, summary_path = run_dir / "ckpt.pt", run_dir / "summary.json"
    gen = torch.Generator().manual_seed(s.seed)
    model = model.to(device)
    optimizer = make_optimizer(model, s)
    step, elapsed, tokens, last_loss = 0, 0.0, 0, None
    if resume and ckpt_path.exists():
        step, elapsed, tokens = restore_checkpoint(ckpt_path, model, optimizer, gen)
        if summary_path.exists():  # the loss to report should this part take no step
            last_loss = json.loads(summary_path.read_text()).get("final_loss")
    elif s.init_from:
        load_initial_weights(model, Path(resolve_model_path(s.init_from)))  # a directory or an embedded name
    run_dir.mkdir(parents=True, exist_ok=True)
    fast = (fast_training_forward(model) if model.config.model_type in ("mamba", "mamba2", "bamba")
            else contextlib.nullcontext())
    model.train()
    bar = tqdm(initial=step, total=None, desc=s.name, dynamic_ncols=True, mininterval=5)
    start = time.time() - elapsed
    with fast:
        while step < s.max_steps and (time.time() - start) < s.max_minutes * 60:
            progress = max(step / s.max_steps, (time.time() - start) / (s.max_minutes * 60))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(s, step, progress)
            batch = sample_batch(stream, s, gen).to(device)
            t0 = time.time()
            loss = batch_loss(model, teacher, batch, s.alpha)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            optimizer.step()
            step += 1
            tokens += batch.numel() - batch.shape[0]
            last_loss = loss.item()
            bar.update(1)
            rate = (batch.numel() - batch.shape[0]) / (time.time() - t0)
            bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rate:.0f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            if step % s.ckpt_every == 0:
                save_checkpoint(ckpt_path, model, optimizer, step, time.time() - start, tokens, s, gen)
    bar.close()
    elapsed = time.time() - start
    save_checkpoint(ckpt_path, model, optimizer, step, elapsed, tokens, s, gen)
    summary = {"name": s.name, "arch": s.arch, "steps": step, "tokens": tokens, "minutes": round(elapsed / 60, 1),
               "final_loss": None if last_loss is None else round(last_loss, 4), "device": str(device),
               "threads": torch.get_num_threads(), "settings": asdict(s)}
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def train(s: TrainSettings, run_dir: Path, device: torch.device, resume: bool) -> dict:
    """One model of the default family on the corpus train split (fit)."""
    tokenizer = AutoTokenizer.from_pretrained(s.tokenizer)
    stream = torch.from_numpy(encode_split(tokenizer, "train").astype(np.int32))
    torch.manual_seed(s.seed)
    model = build_model(build_config(s.arch, len(tokenizer), tokenizer.eos_token_id))
    teacher = None
    if s.teacher:
        teacher = AutoModelForCausalLM.from_pretrained(s.teacher, dtype=torch.float32).to(device).eval()
    return fit(model, teacher, stream, s, run_dir, device, resume)


def add_settings_arguments(parser: argparse.ArgumentParser, fields: tuple[str, ...]) -> None:
    """--flag for each named TrainSettings field, typed and defaulted by the dataclass."""
    for field in fields:
        default = TrainSettings.__dataclass_fields__[field].default
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--name", help="run name (default: the arch)")
    parser.add_argument("--tokenizer", default="runs/tokenizer")
    parser.add_argument("--teacher", help="model dir to distill from")
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--init-from", help="exported model dir to start from (e.g. a shipped default model)")
    add_settings_arguments(parser, ("alpha", "seq_len", "batch_size", "lr", "warmup_steps", "max_steps", "max_minutes",
                                    "ckpt_every", "seed"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fields = {k: getattr(args, k) for k in TrainSettings.__dataclass_fields__ if hasattr(args, k)}
    settings = TrainSettings(**{**fields, "name": args.name or args.arch})
    summary = train(settings, args.runs / settings.name, resolve_device(args.device), args.resume)
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}))


if __name__ == "__main__":
    main()
