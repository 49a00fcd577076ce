"""Drafter step cost against a Transformer decode step, measured side by side (interleaved, so load hits both).

A random ~2.8M-parameter Mamba (d_model 256, 4 layers, vocab 4096) through MambaDrafter's native C step (models/
native, the CPU float32 default) and its torch step (with planned matrix products), rows=1 / 4 / 16, and through
HF's own cached forward, against a random HF GPTNeoX 6 layers x 384 (vocab 4096) decoding one token with 128 tokens
in its KV cache. Also times MambaDrafter.prefill at a few prompt lengths, native and torch.
Run: python benchmarks/drafter_step.py [--threads 1] [--repeats 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPTNeoXConfig, MambaConfig, MambaForCausalLM

from ray_specdec.models.drafter.mamba import MambaDrafter

VOCAB = 4096
TARGET_CONTEXT = 128
PREFILL_LENGTHS = (512, 2048, 8192)


def build_models(device: str) -> tuple[MambaForCausalLM, torch.nn.Module]:
    torch.manual_seed(0)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, state_size=16))
    target_config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=4 * 384
    )
    target = AutoModelForCausalLM.from_config(target_config)
    return mamba.to(device).eval(), target.to(device).eval()


def drafter_step(drafter: MambaDrafter, rows: int) -> Callable[[], object]:
    state = drafter.copy_rows(drafter.prefill(torch.arange(8))[0], [0] * rows)
    tokens = torch.randint(0, VOCAB, (rows,), device=drafter.device)
    return lambda: drafter.step(state, tokens)


@torch.inference_mode()
def hf_mamba_step(model: MambaForCausalLM) -> Callable[[], object]:
    device = model.device
    cache = DynamicCache(config=model.config)
    model(torch.arange(8, device=device)[None], cache_params=cache, use_cache=True)
    token = torch.tensor([[5]], device=device)

    @torch.inference_mode()
    def step():
        return model(token, cache_params=cache, use_cache=True).logits

    return step


@torch.inference_mode()
def target_decode(model: torch.nn.Module) -> Callable[[], object]:
    device = model.device
    cache = DynamicCache(config=model.config)
    model(torch.randint(0, VOCAB, (1, TARGET_CONTEXT), device=device), past_key_values=cache, use_cache=True)
    token = torch.tensor([[5]], device=device)

    @torch.inference_mode()
    def step():
        logits = model(token, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)  # drop the new token: every call decodes at the same context length
        return logits

    return step


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(timers: dict[str, Callable[[], object]], repeats: int, device: str) -> dict[str, list[float]]:
    """ms per call for each timer; one call of each per round, so load spikes hit all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in timers}
    for round_ in range(repeats + 10):
        for name, fn in timers.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if round_ >= 10:  # warm-up rounds
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on shared CPUs)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    mamba, target = build_models(args.device)
    drafter = MambaDrafter(mamba)
    drafters = {"native": drafter} if drafter.native is not None else {}
    if args.device == "cpu":
        drafters["torch"] = MambaDrafter(mamba, fast_matmul=True, native=False)
    print(f"drafter {sum(p.numel() for p in mamba.parameters()) / 1e6:.2f}M params, "
          f"target {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params, "
          f"{args.threads} thread(s), device {args.device}, fast kernels: {drafter._use_kernels}, "
          f"native: {drafter.native is not None} ({drafter.native_why or 'built'})")
    timers = {"target decode (GPTNeoX 6x384, ctx 128)": target_decode(target)}
    for rows in (1, 4, 16):
        for name, d in (drafters or {"": drafter}).items():
            timers[f"drafter step rows={rows} {name}".rstrip()] = drafter_step(d, rows)
    timers["HF Mamba cached forward rows=1"] = hf_mamba_step(mamba)
    times = time_interleaved(timers, args.repeats, args.device)
    # p10 as well as the median: on a shared CPU a preemption adds milliseconds, which inflates short calls most.
    stats = {name: (statistics.median(ms), statistics.quantiles(ms, n=10)[0]) for name, ms in times.items()}
    target_median, target_p10 = next(iter(stats.values()))
    print(f"{'':42s} {'median ms':>10s} {'p10 ms':>8s} {'target/this (median, p10)':>26s}")
    for name, (median, p10) in stats.items():
        print(f"{name:42s} {median:10.3f} {p10:8.3f} {target_median / median:14.1f} {target_p10 / p10:10.1f}")

    for length in PREFILL_LENGTHS:
        ids = torch.randint(0, VOCAB, (length,), device=args.device)
        seconds: dict[str, list[float]] = {name: [] for name in drafters or {"": drafter}}
        for _ in range(3):  # interleaved; the first call of each also pays one-time costs
            for name, d in (drafters or {"": drafter}).items():
                sync(args.device)
                start = time.perf_counter()
                d.prefill(ids)
                sync(args.device)
                seconds[name].append(time.perf_counter() - start)
        for name, s in seconds.items():
            print(f"drafter prefill {length:5d} tokens {name:6s}: {min(s):7.3f} s (best of 3)")


if __name__ == "__main__":
    main()
