"""Where the target's greedy tokens rank among the drafter's choices, and what each tree shape would accept from that.

For held-out prompts the target generates --new-tokens greedily (HF `generate`, eos ignored); the drafter then reads
the prompt and that continuation in one forward (teacher forcing) and each continuation token's rank among the
drafter's logits at its position is recorded (0: the drafter's top choice). Greedy acceptance keeps a node only if
every node above it is the target's own token, so along an accepted path the drafter has read exactly the target's
tokens: these ranks decide what any tree accepts. A tree (N_1, ..., N_d) accepts depth k from position t when the ranks
of tokens t+1 .. t+k are below N_1 .. N_k; its expected tokens per round (accepted + the bonus) are averaged over
every position of every prompt. No timing: the costs of the rows are benchmarks/verify_cost.py's and
benchmarks/draft_batch.py's.

Run from the repository root:
    python -m benchmarks.draft_ranks [--target target-hybrid] [--drafter drafter-mamba-hybrid] [--prompts 12]
        [--prompt-tokens 128] [--new-tokens 64] [--trees "1,1,1,1;2,1,1,1;2,2,1,1"] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from transformers import AutoModelForCausalLM

from ray_specdec.config import TreeConfig
from ray_specdec.models.loading import load_tokenizer, resolve_model_path
from ray_specdec.training.corpus import heldout_prompts

TREES = "1,1;1,1,1;1,1,1,1;1,1,1,1,1;1,1,1,1,1,1;2,1,1;2,1,1,1;2,1,1,1,1;2,2,1,1;3,1,1,1;2,2,2,1;3,2,1"


@torch.inference_mode()
def draft_ranks(target, drafter, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Per prompt: the rank of each of the target's greedy continuation tokens among the drafter's logits."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        seq = target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0]
        logits = drafter(seq[None]).logits[0, len(prompt) - 1:-1]  # row i predicts continuation token i
        chosen = seq[len(prompt):]
        out.append((logits > logits.gather(1, chosen[:, None])).sum(1).tolist())
    return out


def accepted(branching: tuple[int, ...], ranks: list[int]) -> int:
    """Draft tokens a tree of `branching` accepts where the next tokens rank `ranks` under the drafter."""
    depth = 0
    for n, rank in zip(branching, ranks):
        if rank >= n:
            break
        depth += 1
    return depth


def tokens_per_round(branching: tuple[int, ...], ranks: list[list[int]]) -> float:
    """Mean accepted draft tokens + 1 over every position of every prompt."""
    counts = [accepted(branching, r[t:]) for r in ranks for t in range(len(r))]
    return 1 + sum(counts) / len(counts)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="target-hybrid")
    p.add_argument("--drafter", default="drafter-mamba-hybrid")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--trees", default=TREES, help="';'-separated trees")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the ranks and the table here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_path, drafter_path = resolve_model_path(args.target), resolve_model_path(args.drafter)
    target = AutoModelForCausalLM.from_pretrained(target_path).eval()
    drafter = AutoModelForCausalLM.from_pretrained(drafter_path).eval()
    prompts = [h.token_ids for h in heldout_prompts(args.prompts, args.prompt_tokens, args.prompt_tokens, 1,
                                                    load_tokenizer(target_path))]  # fmt: skip
    ranks = draft_ranks(target, drafter, prompts, args.new_tokens)
    flat = [r for rs in ranks for r in rs]
    histogram = collections.Counter(min(r, 4) for r in flat)
    shares = {("4+" if k == 4 else str(k)): histogram[k] / len(flat) for k in range(5)}
    print(f"{args.target} + {args.drafter}: {len(flat)} tokens of {len(prompts)} prompts; the target's token is the "
          "drafter's choice of rank " + ", ".join(f"{k}: {v:.1%}" for k, v in shares.items()))  # fmt: skip
    rows = []
    print("| tree | nodes | tokens per round |\n|---|---|---|")
    for text in args.trees.split(";"):
        tree = TreeConfig.parse(text)
        rows.append({"tree": text, "nodes": tree.num_nodes, "tokens_per_round": tokens_per_round(tree.branching,
                                                                                                 ranks)})
        print(f"| {text} | {tree.num_nodes} | {rows[-1]['tokens_per_round']:.3f} |")
    result = {"target": args.target, "drafter": args.drafter, "rank_shares": shares, "trees": rows, "ranks": ranks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
