"""Quality of the shipped models: held-out perplexity per model and greedy chain acceptance per target/drafter pair.

Acceptance is computed by teacher forcing, which gives the same number as running the chain: the target generates
greedily; a drafter that agreed with every target token so far sees exactly the target's context, so its greedy
draft at each position is its argmax under teacher forcing. A round drafts up to gamma tokens from a boundary,
accepts the matching prefix and adds the bonus token (accepted length = accepted + 1).

    python -m ray_specdec.training.evaluate --doc docs/MODELS.md
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from ray_specdec.defaults import DEFAULT_MODEL_NAMES, DEFAULT_MODELS_DIR
from ray_specdec.training.corpus import encode_split, heldout_prompts

PAIRS = (("target-neox", "drafter-mamba"), ("target-neox", "drafter-neox-small"), ("target-llama", "drafter-mamba"),
         ("target-hybrid", "drafter-mamba"))
RESULTS_START, RESULTS_END = "<!-- results:start -->", "<!-- results:end -->"


def chain_accepted_lengths(target_tokens: Sequence[int], draft_tokens: Sequence[int], gamma: int) -> list[int]:
    """Accepted length of each full round. target_tokens[i]: the target's greedy token at step i; draft_tokens[i]:
    the drafter's greedy token at step i given the target's tokens before it."""
    lengths, pos = [], 0
    while pos + gamma < len(target_tokens):
        accepted = 0
        while accepted < gamma and draft_tokens[pos + accepted] == target_tokens[pos + accepted]:
            accepted += 1
        lengths.append(accepted + 1)
        pos += accepted + 1
    return lengths


def load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def heldout_perplexity(model, stream: torch.Tensor, windows: int, seq_len: int) -> float:
    """exp(mean next-token loss) over the first `windows` non-overlapping windows of the held-out stream [N]."""
    batch = stream[: windows * (seq_len + 1)].view(windows, seq_len + 1).long()
    losses = [F.cross_entropy(model(input_ids=row[None, :-1]).logits[0].float(), row[1:]) for row in batch]
    return float(torch.exp(torch.stack(losses).mean()))


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [n, P] (equal lengths, no padding) -> the target's greedy tokens [n, new_tokens]."""
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)
    return out[:, prompts.shape[1]:]


@torch.no_grad()
def drafter_greedy(drafter, prompts: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """The drafter's argmax at each continuation position under teacher forcing: [n, T]."""
    ids = torch.cat([prompts, continuation], dim=1)
    logits = drafter(input_ids=ids[:, :-1]).logits                    # [n, P + T - 1, V]
    return logits[:, prompts.shape[1] - 1:].argmax(-1)


def evaluate(models_dir: Path = DEFAULT_MODELS_DIR, gamma: int = 4, n_prompts: int = 16, prompt_len: int = 128,
             new_tokens: int = 64, ppl_windows: int = 16, seq_len: int = 256) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "target-neox")
    stream = torch.from_numpy(encode_split(tokenizer, "heldout").astype("int64"))
    present = [n for n in DEFAULT_MODEL_NAMES if (models_dir / n / "config.json").exists()]
    models = {name: load(models_dir / name) for name in present}
    ppl = {name: round(heldout_perplexity(m, stream, ppl_windows, seq_len), 3) for name, m in models.items()}
    prompts = torch.tensor([p.token_ids for p in heldout_prompts(n_prompts, prompt_len, prompt_len, 0, tokenizer)])
    targets = {p[0] for p in PAIRS} & set(present)
    continuations = {t: greedy_continuations(models[t], prompts, new_tokens) for t in targets}
    acceptance = {}
    for target, drafter in PAIRS:
        if target not in models or drafter not in models:
            continue
        drafts = drafter_greedy(models[drafter], prompts, continuations[target])
        lengths = [x for t, d in zip(continuations[target].tolist(), drafts.tolist())
                   for x in chain_accepted_lengths(t, d, gamma)]
        acceptance[f"{target} + {drafter}"] = round(sum(lengths) / len(lengths), 3)
    training = {name: json.loads((models_dir / name / "training.json").read_text()) for name in present}
    return {"heldout_perplexity": ppl, "mean_accepted_length": acceptance, "training": training,
            "setup": {"gamma": gamma, "prompts": n_prompts, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
                      "ppl_windows": ppl_windows, "ppl_seq_len": seq_len}}


def results_markdown(results: dict) -> str:
    s = results["setup"]
    lines = [RESULTS_START, "",
             "| model | parameters | rounds | steps | tokens seen | minutes | loss | teacher (KL weight) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, t in results["training"].items():
        teacher = Path(t["settings"]["teacher"]).name if t["settings"]["teacher"] else "-"
        alpha = f" ({t['settings']['alpha']})" if t["settings"]["teacher"] else ""
        rounds = 1 + len(t.get("previous_rounds", []))  # runs continued with --init-from: totals over all rounds
        steps, tokens = t.get("total_steps", t["steps"]), t.get("total_tokens", t["tokens"])
        lines.append(f"| {name} | {t['parameters'] / 1e6:.2f}M | {rounds} | {steps} | {tokens:,} | "
                     f"{t.get('total_minutes', t['minutes'])} | {t.get('final_loss', '-')} | {teacher}{alpha} |")
    lines += ["", f"Held-out perplexity ({s['ppl_windows']} windows x {s['ppl_seq_len']} tokens of the held-out "
                  "split):", "",
             "| model | perplexity |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in results["heldout_perplexity"].items()]
    lines += ["", f"Greedy chain drafting, gamma={s['gamma']}, {s['prompts']} held-out prompts of "
              f"{s['prompt_tokens']} tokens, {s['new_tokens']} target tokens each (accepted length = accepted + 1):",
              "", "| target + drafter | mean accepted length |", "|---|---|"]
    lines += [f"| {pair} | {value} |" for pair, value in results["mean_accepted_length"].items()]
    return "\n".join(lines + ["", RESULTS_END])


def write_results(doc: Path, results: dict) -> None:
    """Replaces the results block of `doc` (or appends one)."""
    text = doc.read_text() if doc.exists() else ""
    block = results_markdown(results)
    pattern = re.compile(re.escape(RESULTS_START) + ".*?" + re.escape(RESULTS_END), re.S)
    doc.write_text(pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--doc", type=Path, default=Path("docs/MODELS.md"))
    parser.add_argument("--json", type=Path, default=Path("runs/eval.json"))
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = evaluate(args.models_dir, gamma=args.gamma)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    write_results(args.doc, results)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
