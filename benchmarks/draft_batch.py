"""One batched draft for many requests (`drafting.draft_many`) against drafting them one by one, interleaved.

The shipped drafter; n requests over different prompts, each drafting the same tree greedily from its root state
(a draft leaves the root as it is, so rounds repeat without commits); per repeat both ways in random order, then the
median ms of a whole step's drafting each way and their ratio. Both ways give the same drafts (tests/test_draft_batch).

Run from the repository root: python -m benchmarks.draft_batch [--drafter PATH] [--requests 1,8,32]
    [--trees "1,1,1;3,2,2,1,1"] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_DRAFTER
from ray_specdec.models.drafter.kinds import load_drafter_model
from ray_specdec.speculation.drafting import DraftRequest, DrafterSession, draft_many

PROMPT_TOKENS = 64  # the prompt only sets the root state; its length does not change a draft's cost


def one_by_one(requests: list[DraftRequest]) -> None:
    for r in requests:
        r.session.draft(r.config, r.params, r.generator)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--requests", default="1,8,32", help="requests per step, comma-separated")
    parser.add_argument("--trees", default="1,1,1;3,2,2,1,1", help="tree configs, semicolon-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    drafter = load_drafter_model(args.drafter)
    print(f"torch threads: {torch.get_num_threads()}; native step: {bool(drafter.native)}; "
          f"row-invariant steps (batched): {drafter.steps_row_invariant}\n")  # fmt: skip
    print("| requests | tree | one by one (ms) | draft_many (ms) | one by one / draft_many |")
    print("| --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for n in (int(r) for r in args.requests.split(",")):
        prompts = torch.randint(0, drafter.vocab_size, (n, PROMPT_TOKENS), generator=gen)
        sessions = [DrafterSession(drafter, p.tolist(), drafter.vocab_size) for p in prompts]
        for tree in (TreeConfig.parse(t) for t in args.trees.split(";")):
            requests = [DraftRequest(s, tree, SamplingParams(), None) for s in sessions]
            ways = {"one by one": lambda: one_by_one(requests), "draft_many": lambda: draft_many(requests)}
            times = {name: [] for name in ways}
            for _ in range(args.repeats + 2):
                for name in random.sample(list(ways), len(ways)):
                    start = time.perf_counter()
                    ways[name]()
                    times[name].append(time.perf_counter() - start)
            ms = {name: 1e3 * statistics.median(t[2:]) for name, t in times.items()}
            print(f"| {n} | {tree} | {ms['one by one']:.2f} | {ms['draft_many']:.2f} | "
                  f"{ms['one by one'] / ms['draft_many']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
