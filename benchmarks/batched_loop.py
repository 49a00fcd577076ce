"""The in-process scheduler under a closed load: one batched target forward per step against one forward per request.

Each cell keeps `c` requests in the scheduler (a finished request is replaced by the next prompt at once) for
`--duration` seconds after a warm-up, greedy, 64 new tokens, on held-out code windows of 32-512 tokens (the prompts
of benchmarks/serve_peers.py). The cells at each concurrency start at their own share of the prompts, so no cell
sends a prompt an earlier cell of its engine sent: the prefix cache would serve its prefill. A cell that runs
past its share says so. Four variants of the same engine, side by side in one run:

- `batched`: the lean forward (models/target/lean_forward.py) carries the verify rows of every request in one
  forward per step, each weight read once for all of them; attention runs per request over its own cache;
- `per-request`: `lean=False`, the model's own forward once per request per step (what the GPU path ran before the
  lean forward took CUDA);

- `prefills-apart` (`none` only; asked for by name): batched verify rows, but each prefill chunk in a forward of its
  own, as on CPU (where that keeps a chunk's K/V independent of the batch); on CUDA one forward takes both;
- `torch-layers` (asked for by name): `batched` with the verify rows' decoder layers as torch ops instead of one
  native call per forward (models/native/decoder.py);
- `own-caches` (asked for by name): batched products, but every request's K/V in a cache of its own and its
  attention one call per request per layer (`kv_pool=False`); `batched` pools the caches where the target does
  (models/target/kv_pool.py: CUDA), so its verify rows attend in one call per layer;
- `eager` (asked for by name): `batched` without the target's CUDA graphs (`cuda_graphs=False`;
  models/target/step_graphs.py graphs the work around each attention on CUDA, and a forward over pooled caches
  with its attention in one graph);
- `pieces` (asked for by name): the graphs around each attention only, the attention eager between them (no fused
  forward: kernels/pooled_attention.py unused);

each with the app's policy (the bandit's default arms priced by the speculation controller, the lookup
branch) and with `tree none`. Every variant runs the same prompts in the same order, so their greedy tokens can be
compared prompt by prompt: `per-request none` computes each request alone, the target's own greedy decoding, and the
others are checked against it (on CPU the batch-invariant path makes them identical; on CUDA in float32 they may
part at near-ties, since cuBLAS picks its kernel by the row count; the count is printed).

`--synthetic-llama HIDDEN,LAYERS` swaps the shipped 13.8M-parameter target for a Llama of that size with random weights
(the shipped tokenizer's vocabulary, heads of 128): a forward of the shipped target on a GPU costs its kernel launches,
not its weights, while a real target's batch-1 forward reads every weight for one request. Its drafts would be
rejected, so only the `none` variants run.

`--trees "1,1,1;2,2,1,1"` adds a `batched <tree>` variant per fixed tree; `--coupling rejection,coupled` runs every
variant once per `sampling_coupling` (speculation/coupled.py; seeded requests are coupled under the default `auto`),
labelled with it. Each cell reports the mean accepted length of the rounds of its finished requests.

An SSM or hybrid `--target` (Mamba, Mamba2, Jamba, Bamba: models/target/ssm.py, e.g. target-hybrid) runs the `batched`
variants only (its greedy tokens compared against `batched none`'s): its forward always carries every request's
rows, and the switches of the other variants are the attention target's.

Run from the repository root: python -m benchmarks.batched_loop [--device cuda] [--dtype float32]
[--target target-neox-large] [--concurrency 1,8,32] [--duration 10] [--synthetic-llama 2048,16] [--temperature 1]
[--trees "1,1,1;3,2,1"] [--coupling rejection,coupled] [--json results.json]
(`--temperature` above 0: sampled requests, each seeded; their tokens are not compared.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import platform
import pstats
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from benchmarks.serve_peers import select_prompts
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.engine.config import EngineConfig
from ray_specdec.models.loading import resolve_model_path
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.factory import resolve_device
from ray_specdec.models.drafter.kinds import load_drafter_model
from ray_specdec.models.target.kinds import target_kind
from ray_specdec.models.target.model import TargetModel
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.speculation.bandit import Bandit

VARIANTS = (("batched", True, None), ("batched", True, "none"), ("pieces", True, None), ("pieces", True, "none"),
            ("eager", True, None), ("eager", True, "none"),
            ("own-caches", True, None), ("own-caches", True, "none"), ("prefills-apart", True, "none"),
            ("torch-layers", True, None), ("torch-layers", True, "none"),
            ("per-request", False, None), ("per-request", False, "none"))  # fmt: skip
OPT_IN = ("prefills-apart", "own-caches", "eager", "pieces", "torch-layers")  # variants that run only when named
REFERENCE = "per-request none"
WARM_UP = 4  # prompts each engine decodes before its cells, apart from theirs
MAX_NEW_TOKENS = 64


def synthetic_llama(spec: str, dtype: str, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """A random-weight Llama of `HIDDEN,LAYERS` with the shipped target's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ray_specdec.models.loading import load_tokenizer, resolve_dtype

    hidden, layers = (int(x) for x in spec.split(","))
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 128, 1), num_key_value_heads=max(hidden // 512, 1),
                         intermediate_size=256 * round(hidden * 8 / 3 / 256), max_position_embeddings=4096,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(resolve_dtype(dtype, device)).eval()
    return model, tokenizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cell(engine: SpeculativeEngine, prompts: list[list[int]], concurrency: int, tree: TreeConfig | None,
             duration: float, device: torch.device, profile_steps: int = 0, max_new_tokens: int = MAX_NEW_TOKENS,
             start: int = 0, temperature: float = 0.0,
             python_steps: int = 0) -> tuple[dict[str, Any], dict[int, list[int]]]:  # fmt: skip
    """Closed loop for `duration` s, requests from prompt `start` on -> the cell's numbers and each finished request's
    tokens by prompt index (profile_steps: then that many steps under torch's profiler, its table in the numbers).
    `engine`: anything with a `scheduler` (benchmarks/tp_loop.py hands its scheduler over rank actors);
    temperature > 0: sampled requests, each with its own seed; python_steps: then that many steps under cProfile, the
    Python functions that take the host's time (on a GPU the host's work is most of a small model's step)."""
    scheduler = engine.scheduler
    order, running, tokens = itertools.count(start), {}, {}

    def add() -> None:
        index = next(order)
        key = f"p{index}"
        running[key] = (index % len(prompts), [])
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=index if temperature > 0 else None)  # fmt: skip
        scheduler.add(key, prompts[index % len(prompts)], params, tree)

    def rounds() -> tuple[int, int]:  # the controller's drafted and undrafted rounds so far (since the engine began)
        summary = scheduler.controller.summary()
        return summary["drafted_rounds"], summary["undrafted_rounds"]

    for _ in range(concurrency):
        add()
    rounds_before = rounds()
    steps, produced, t0 = 0, 0, time.perf_counter()
    accepted: list[int] = []  # accepted length of every round of the finished requests
    while time.perf_counter() - t0 < duration:
        for out in scheduler.step():
            index, ids = running[out.request_id]
            ids += out.chunk.token_ids
            produced += len(out.chunk.token_ids)
            if out.chunk.finish_reason is not None:
                accepted += out.chunk.stats.accepted_lengths
                tokens.setdefault(index, ids)
                del running[out.request_id]
                add()
        steps += 1
    sync(device)
    elapsed = time.perf_counter() - t0
    cell_drafted, cell_undrafted = (after - before for after, before in zip(rounds(), rounds_before))
    profile = None

    def more_steps(n: int) -> None:  # the same closed load, untimed, for a profiler
        for _ in range(n):
            for out in scheduler.step():
                if out.chunk.finish_reason is not None:
                    del running[out.request_id]
                    add()
        sync(device)

    if profile_steps:  # where the time of a step goes, after the timed loop (the same load)
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            more_steps(profile_steps)
        profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    if python_steps:
        profiler = cProfile.Profile()
        t = time.perf_counter()
        with profiler:
            more_steps(python_steps)
        text = io.StringIO()
        text.write(f"{python_steps} steps under cProfile: {(time.perf_counter() - t) / python_steps * 1e3:.2f} ms a "
                   f"step (the profiler's own cost included)\n")
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(28)
        profile = (profile or "") + text.getvalue()
    for key in running:
        scheduler.abort(key)
    while scheduler.has_work:  # let aborted requests leave before the next cell
        scheduler.step()
    speculation = scheduler.controller.summary()
    # the controller's counts run over the engine's life (warm-up and earlier cells too): the timed loop's own share
    cell_rounds = cell_drafted + cell_undrafted
    speculation["cell_drafted_share"] = cell_drafted / cell_rounds if cell_rounds else None
    return {"tokens_per_s": produced / elapsed, "steps_per_s": steps / elapsed, "finished": len(tokens),
            "accepted_length": sum(accepted) / max(len(accepted), 1),
            "sent": next(order) - start, "seconds": elapsed, "speculation": speculation,
            "profile": profile}, tokens  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when there is one)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    p.add_argument("--prompts", type=int, default=2400,
                   help="distinct prompts; each concurrency's cells start at their own share of them (4 more warm up)")
    p.add_argument("--variants", default=",".join(f"{name} {tree or 'drafting'}" for name, _, tree in VARIANTS
                                                  if name not in OPT_IN),
                   help="comma-separated of: batched drafting, batched none, pieces drafting, pieces none, "
                        "eager drafting, eager none, own-caches drafting, own-caches none, "
                        "prefills-apart none, per-request drafting, per-request none")
    p.add_argument("--synthetic-llama", default=None, metavar="HIDDEN,LAYERS",
                   help="a random-weight Llama of this size as the target (the none variants only)")
    p.add_argument("--profile", default="", metavar="VARIANT@C",
                   help="after that cell (e.g. 'batched none@32'), 20 steps under torch's profiler: its table")
    p.add_argument("--python-profile", default="", metavar="VARIANT@C",
                   help="after that cell, 200 steps under cProfile: the Python functions taking the host's time")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled requests")
    p.add_argument("--trees", default="", metavar="T1;T2",
                   help="fixed trees, each one more variant 'batched <tree>' (e.g. '1,1,1;2,2,1,1')")
    p.add_argument("--coupling", default="auto", metavar="C1,C2",
                   help="sampling_coupling values to run every variant with (auto, coupled, rejection)")
    p.add_argument("--target", default="target-neox", help="embedded model name or HF directory of the target")
    p.add_argument("--drafter", default="drafter-mamba", help="embedded model name or HF directory of the drafter")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    device = torch.device(resolve_device(args.device))
    chosen = {v.strip() for v in args.variants.split(",")}
    if args.synthetic_llama:
        chosen = {v for v in chosen if v.endswith(" none")}
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    drafter = load_drafter_model(str(resolve_model_path(args.drafter)), dtype=args.dtype, device=str(device))
    texts = select_prompts(args.prompts + WARM_UP, seed=18)
    share = args.prompts // len(concurrencies)  # prompts per concurrency
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                               else platform.processor() or platform.machine(), "dtype": args.dtype,
                               "duration_s": args.duration, "temperature": args.temperature,
                               "target": args.synthetic_llama or args.target, "drafter": args.drafter,
                               "cells": []}  # fmt: skip
    outputs: dict[str, dict[int, list[int]]] = {}
    trees = [t.strip() for t in args.trees.split(";") if t.strip()]
    chosen |= {f"batched {t}" for t in trees}
    couplings = [c.strip() for c in args.coupling.split(",")]
    variants = [*VARIANTS, *(("batched", True, t) for t in trees)]
    ssm = not args.synthetic_llama and target_kind(AutoConfig.from_pretrained(resolve_model_path(args.target))) == "ssm"
    for (name, lean, tree_text), coupling in itertools.product(variants, couplings):
        label = f"{name} {tree_text or 'drafting'}" + ("" if coupling == "auto" else f" {coupling}")
        if label.removesuffix(f" {coupling}") not in chosen:
            continue
        switches = dict(lean=lean, kv_pool=False if name == "own-caches" else None,
                        cuda_graphs=False if name == "eager" else None)  # fmt: skip
        if ssm and name != "batched":
            print(f"{label}: skipped (an SSM target runs the batched variants only)", flush=True)
            continue
        if ssm:
            target = SSMTargetModel.from_pretrained(str(resolve_model_path(args.target)), dtype=args.dtype,
                                                    device=str(device))
        elif args.synthetic_llama:
            model, tokenizer = synthetic_llama(args.synthetic_llama, args.dtype, device)
            target = TargetModel(model, tokenizer, **switches)
        else:
            target = TargetModel.from_pretrained(str(resolve_model_path(args.target)), dtype=args.dtype,
                                                 device=str(device), **switches)  # fmt: skip
        if name == "prefills-apart":
            target.one_forward = False
        if name == "torch-layers" and target._lean is not None:
            target._lean.native_decoder = None
        if name == "pieces" and target._lean is not None and target._lean.graphs is not None:
            target._lean.graphs.fused = False
        config = EngineConfig().with_fields(sampling_coupling=coupling)
        engine = SpeculativeEngine(target, drafter, Bandit(), config=config)
        encoded = [engine.encode(t) for t in texts]
        prompts, warm_up = encoded[:args.prompts], encoded[args.prompts:]
        tree = TreeConfig.parse(tree_text) if tree_text else None
        engine.generate_many(warm_up, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), tree)
        for i, c in enumerate(concurrencies):
            profiled = 20 if args.profile == f"{label}@{c}" else 0
            python_steps = 200 if args.python_profile == f"{label}@{c}" else 0
            cell, tokens = run_cell(engine, prompts, c, tree, args.duration, device, profiled, start=i * share,
                                    temperature=args.temperature, python_steps=python_steps)
            cell.update(variant=label, concurrency=c, repeated_prompts=max(cell["sent"] - share, 0))
            if cell["repeated_prompts"]:
                print(f"warning: {label} c={c} sent {cell['sent']} prompts, {cell['repeated_prompts']} past its share "
                      f"of {share}: prefix cache hits may inflate it (raise --prompts)", flush=True)
            results["cells"].append(cell)
            for index, ids in tokens.items():
                outputs.setdefault(label, {}).setdefault(index, ids)
            print(f"{label:24s} c={c:<3d} {cell['tokens_per_s']:8.1f} tok/s  {cell['steps_per_s']:7.1f} steps/s  "
                  f"accepted length {cell['accepted_length']:.2f}  {cell['finished']} finished", flush=True)
            if cell["profile"]:
                print(cell["profile"], flush=True)
    reference_label = "batched none" if ssm else REFERENCE  # an SSM target's plain decoding
    reference = outputs.get(reference_label, {})
    for label, by_prompt in outputs.items() if args.temperature == 0 else ():  # sampled tokens differ by design
        if label == reference_label:
            continue
        shared = [i for i in by_prompt if i in reference]
        differ = sum(by_prompt[i] != reference[i] for i in shared)
        results.setdefault("greedy_vs_reference", {})[label] = {"compared": len(shared), "differ": differ}
        print(f"greedy tokens, {label} vs {reference_label}: {differ} of {len(shared)} prompts differ")
    table = {(c["variant"], c["concurrency"]): c["tokens_per_s"] for c in results["cells"]}
    print(f"\n| variant | {' | '.join(f'c={c}' for c in concurrencies)} |")
    print(f"|---|{'---|' * len(concurrencies)}")
    for label in dict.fromkeys(c["variant"] for c in results["cells"]):
        row = [f"{table[label, c]:.1f}" if (label, c) in table else "-" for c in concurrencies]
        print(f"| {label} | {' | '.join(row)} |")
    for c in concurrencies:
        a, b = table.get(("batched drafting", c)), table.get(("per-request drafting", c))
        n, m = table.get(("batched none", c)), table.get(("per-request none", c))
        if a and b:
            print(f"c={c}: batched / per-request, drafting {a / b:.2f}x" + (f", none {n / m:.2f}x" if n and m else ""))
    for line in speculation_check(results["cells"]):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def speculation_check(cells: list[dict[str, Any]]) -> list[str]:
    """Per concurrency with both `batched drafting` and `batched none` cells: the service's choice against tree none
    in the closed loop, beside the share of rounds the speculation controller drafted in the drafting cell's timed loop
    (`cell_drafted_share`; the controller's own share counts every earlier cell too) (a choice slower than none while
    it drafts most rounds misprices drafting; one that drafts no round should match none)."""
    lines = []
    for drafted in (c for c in cells if c["variant"] == "batched drafting" and c.get("speculation")):
        none = next((c for c in cells if c["variant"] == "batched none" and c["concurrency"] == drafted["concurrency"]),
                    None)  # fmt: skip
        if none is None or not none["tokens_per_s"]:
            continue
        speculation = drafted["speculation"]
        share = speculation.get("cell_drafted_share", speculation["drafted_share"])
        drafted_text = "no rounds yet" if share is None else f"{share:.0%} of its rounds"
        ratio = drafted["tokens_per_s"] / none["tokens_per_s"]
        lines.append(f"c={drafted['concurrency']}: the controller's choice / none {ratio:.2f}x in the cells; it "
                     f"drafted {drafted_text}")
    return lines


if __name__ == "__main__":
    main()
