"""The target's planned GEMM paths on this CPU: per row count, ms per sweep over all of its Linear weights for
every path (what the plan is chosen from; `native (f32 panels)` is the native path without the exact half-precision
panels, for comparison), then plain greedy decoding and a chain draft's verify with and without the plan,
interleaved in one run.

Run from the repository root: python -m benchmarks.cpu_gemm [--target PATH] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ray_specdec.config import TreeConfig
from ray_specdec.defaults import DEFAULT_TARGET
from ray_specdec.models.native import gemm
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.drafting import tree_for

TABLE_ROWS = (1, 2, 3, 4, 5, 8, 12, 16, 32, 64, 128, 512)
NATIVE_F32 = "native (f32 panels)"


def decode_ms(target: TargetModel, prompt: torch.Tensor, tokens: int, chain: int) -> float:
    """Median ms of one forward over 1 + chain rows (a plain decode step when chain is 0) at the prompt's context."""
    cache = target.new_cache()
    target.prefill(cache, prompt)
    tree = tree_for(TreeConfig((1,) * chain))
    draft = torch.randint(0, target.vocab_size, (chain,))
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        logits = target.verify(cache, int(prompt[-1]), tree, draft)
        times.append(time.perf_counter() - start)
        target.commit(cache, [0])
        prompt = torch.cat([prompt, logits[0].argmax()[None]])
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--tokens", type=int, default=64, help="forwards per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of (planned, unplanned)")
    args = p.parse_args()

    target = TargetModel.from_pretrained(args.target, planned_gemm=False)
    layers = gemm.linear_layers(target.model)
    weights = [(m.weight.detach(), None if m.bias is None else m.bias.detach()) for m in layers]
    paths = {name: gemm.PATHS[name] for name in gemm.available_paths()}
    if gemm.NATIVE in paths:
        f32_panels = {id(w): gemm.pack_panels(w) for w, _ in weights}
        paths[NATIVE_F32] = lambda x, w, b: gemm.linear(x, f32_panels[id(w)], b, w.shape[0])
        formats = sorted({str(gemm.exact_panel_dtype(w)).removeprefix("torch.") for w, _ in weights})
        print(f"native panels: {', '.join(formats)}")
    timings = gemm.measure(weights, paths=paths)
    paths = list(dict.fromkeys(name for name, _ in timings))
    mb = sum(w.numel() * w.element_size() for w, _ in weights) / 1e6
    print(f"ms per sweep over the target's {len(weights)} Linear weights ({mb:.0f} MB), best of 4:")
    print("| rows | " + " | ".join(paths) + " | chosen |")
    print("| --- |" + " --- |" * (len(paths) + 1))
    plan = gemm.choose({key: t for key, t in timings.items() if key[0] != NATIVE_F32})
    for m in TABLE_ROWS:
        cells = " | ".join(f"{1e3 * timings[(p_, m)]:.2f}" for p_ in paths)
        print(f"| {m} | {cells} | {plan.path_for(m)} |")
    print(f"plan: {plan.describe()}")

    prompt = torch.randint(1, target.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for planned in (True, False):
            if planned:
                gemm.install(target.model, plan)
            else:
                gemm.uninstall(target.model)
            for chain in (0, 3, 8):
                results.setdefault(("planned" if planned else "F.linear", chain), []).append(
                    decode_ms(target, prompt, args.tokens, chain))
    print("\nms per target forward at 200 tokens of context (median over rounds):")
    print("| rows | F.linear | planned | planned / F.linear |")
    print("| --- | --- | --- | --- |")
    for chain in (0, 3, 8):
        base, fast = (statistics.median(results[(k, chain)]) for k in ("F.linear", "planned"))
        print(f"| {1 + chain} | {base:.2f} | {fast:.2f} | {fast / base:.2f} |")


if __name__ == "__main__":
    main()
