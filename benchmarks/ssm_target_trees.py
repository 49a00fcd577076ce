"""An SSM or hybrid target in process, one request at a time, greedy: plain decoding against fixed drafting trees.

For each held-out prompt (--prompt-tokens tokens of the corpus's held-out split, seed 1) every variant generates
--new-tokens tokens (eos ignored) in turn, --repeats times, and the fastest of its repeats counts: the variants of one
prompt run back to back, so a machine whose load changes over the run slows them alike. A variant's tokens/s is its
tokens over its summed times (prefill included, the same prompt for every variant); its accepted length is the mean
over its rounds (tokens per target forward). Prompt lookup is off unless --lookup (drafts then come from the drafter
only). Every variant's tokens are checked against plain decoding's.

With --bandit, one more variant: the engine's bandit over the fixed trees and no drafting (its arms priced by the
speculation controller, as the app runs it), warmed up on --bandit-warmup other held-out prompts first and learning on
through the measured ones. Last, the target's memory per request at --memory-contexts tokens: SSM state (conv and SSM
states of every Mamba layer, fixed) plus a hybrid's attention K/V (per token); the STree paper's table in shape.

Run from the repository root:
    python -m benchmarks.ssm_target_trees [--target target-hybrid] [--drafter drafter-mamba]
        [--trees "1,1,1;2,2,1,1"] [--prompts 8] [--prompt-tokens 128] [--new-tokens 64] [--repeats 2] [--threads 2]
        [--bandit] [--bandit-warmup 4] [--memory-contexts 1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ray_specdec.config import NO_TREE, SamplingParams, TreeConfig
from ray_specdec.engine.config import EngineConfig
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.models.drafter.kinds import load_drafter_model
from ray_specdec.models.loading import resolve_model_path
from ray_specdec.models.target.kinds import load_target_model
from ray_specdec.speculation.bandit import Bandit, BanditConfig
from ray_specdec.tools.bench import bandit_pulls
from ray_specdec.training.corpus import heldout_prompts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="target-hybrid")
    p.add_argument("--drafter", default="drafter-mamba")
    p.add_argument("--trees", default="1,1,1;1,1,1,1;2,1,1;2,2,1,1;3,2,1", help="fixed trees, ';'-separated")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lookup", action="store_true", help="keep the engine's prompt lookup drafts")
    p.add_argument("--bandit", action="store_true", help="add the bandit over the trees and no drafting")
    p.add_argument("--bandit-warmup", type=int, default=4, help="held-out prompts the bandit learns on first")
    p.add_argument("--memory-contexts", default="1024,2048,4096,8192", help="contexts of the memory table")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target_model(args.target)
    drafter = load_drafter_model(str(resolve_model_path(args.drafter)))
    warmup = args.bandit_warmup if args.bandit else 0
    held_out = [h.token_ids for h in heldout_prompts(args.prompts + 1 + warmup, args.prompt_tokens,
                                                     args.prompt_tokens, 1, target.tokenizer)]  # fmt: skip
    prompts, bandit_prompts = held_out[: args.prompts + 1], held_out[args.prompts + 1 :]
    config = EngineConfig() if args.lookup else EngineConfig().with_fields(lookup=0, plain_lookup=0)
    trees = [()] + [tuple(int(x) for x in t.split(",")) for t in args.trees.split(";") if t.strip()]
    names = [",".join(map(str, t)) or "none" for t in trees]
    engines = [SpeculativeEngine(target, drafter if t else None, TreeConfig(t), config=config) for t in trees]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for engine in engines:  # warm-up on a prompt of its own
        engine.generate(prompts[-1], params)
    if args.bandit:
        bandit = Bandit(BanditConfig(arms=tuple(TreeConfig(t) for t in trees[1:]) + (NO_TREE,)), seed=0)
        engines.append(SpeculativeEngine(target, drafter, bandit, config=config))
        names.append("bandit")
        trees.append(None)
        for prompt in bandit_prompts:
            engines[-1].generate(prompt, params)
    seconds, tokens, rounds, outputs = ([0.0] * len(trees), [0] * len(trees), [[] for _ in trees],
                                        [[] for _ in trees])  # fmt: skip
    for prompt in prompts[:-1]:
        for v, engine in enumerate(engines):
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                result = engine.generate(prompt, params)
                best = min(best, time.perf_counter() - t0)
            seconds[v] += best
            tokens[v] += len(result.token_ids)
            rounds[v] += result.stats.accepted_lengths
            outputs[v].append(result.token_ids)
    rows = []
    for v, name in enumerate(names):
        rows.append({"tree": name, "tokens_per_s": round(tokens[v] / seconds[v], 1),
                     "accepted_length": round(sum(rounds[v]) / max(len(rounds[v]), 1), 3),
                     "over_plain": round(seconds[0] / tokens[0] * tokens[v] / seconds[v], 3),
                     "greedy_as_plain": outputs[v] == outputs[0]})
    chains = [r for r, t in zip(rows, trees) if t and max(t) == 1]
    branched = [r for r, t in zip(rows, trees) if t and max(t) > 1]
    fixed = [r for r, t in zip(rows, trees) if t is not None]
    print(f"{args.target} + {args.drafter}, {args.prompts} prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads, lookup {'on' if args.lookup else 'off'}")
    print("| tree | tokens/s | accepted length | over plain | greedy as plain |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['tokens_per_s']} | {r['accepted_length']} | {r['over_plain']}x | "
              f"{r['greedy_as_plain']} |")
    summary = {"rows": rows}
    if chains and branched:
        chain = max(chains, key=lambda r: r["tokens_per_s"])
        tree = max(branched, key=lambda r: r["tokens_per_s"])
        summary["best_tree_over_best_chain"] = round(tree["tokens_per_s"] / chain["tokens_per_s"], 3)
        print(f"best tree {tree['tree']} over best chain {chain['tree']}: {summary['best_tree_over_best_chain']}x")
    if args.bandit:
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        summary["bandit_over_best_fixed"] = round(rows[-1]["tokens_per_s"] / best["tokens_per_s"], 3)
        summary["bandit_pulls"] = {str(arm): n for arm, n in zip(bandit.config.arms, bandit_pulls(bandit))}
        print(f"bandit over the best fixed setting {best['tree']}: {summary['bandit_over_best_fixed']}x; pulls "
              f"{summary['bandit_pulls']}")
    summary["memory"] = memory_table(target, [int(c) for c in args.memory_contexts.split(",")])
    print("| context | SSM state | attention K/V | per request |\n|---|---|---|---|")
    for m in summary["memory"]:
        print(f"| {m['context']} | {m['state_bytes'] / 2**10:.0f} KiB | {m['kv_bytes'] / 2**10:.0f} KiB | "
              f"{m['total_bytes'] / 2**10:.0f} KiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), **summary}, f, indent=1)
    return summary


def memory_table(target, contexts: list[int]) -> list[dict]:
    """Per request at each context: the target's SSM state (fixed) and its attention K/V (a hybrid's; none for a
    pure SSM), as the KV budget counts them."""
    state, kv = target.state_bytes, target.attention_bytes_per_token
    return [{"context": c, "state_bytes": state, "kv_bytes": kv * c, "total_bytes": state + kv * c} for c in contexts]


if __name__ == "__main__":
    main()
