"""Served throughput in the steady state: our app and vLLM-CPU under the same closed load, counted only after a warm-up.

`benchmarks/serve_peers.py` times whole cells: the clients start together and the cell waits for the last request
after its duration, so a cell's tokens/s includes the start (every request prefilling at once) and the drain. This
one counts the tokens decoded in a window after `--warmup` seconds of load (each request's tokens spread evenly from
its first token to its end), over the same prompts for every system, so that the steady state and the cells' start
and drain can be told apart. The tokens of the requests that end inside the window are also reported
(`ended_tokens_per_s`): that count moves in steps of whole waves where a server ends its requests together.

Systems: `ours` (the app's own choice of drafting) and `ours-none` (every request `"tree": "none"`), or with
`--pair seeded` `ours-seeded` (every request seeded: coupled sampling, against ours' rejection sampling), from one
server, alternating; `vllm` (vLLM-CPU plain, `../shared/peers/vllm_cpu.sh`), twice as often. No server sees a prompt
twice (its prefix cache would hit): each window takes prompts of its own, and vLLM's windows take those of ours and
of ours-none in turn, so each of ours is compared with vLLM over the same prompts. Tokens are counted as serve_peers
counts them (usage, the chunks' token ids, else the text re-tokenized).

With `--same-prompts` (ours only) the two systems of a block take the same prompts, in an order that alternates from
block to block, from an app started without its prefix cache: a block's prompts then cannot tilt the ratio (a
block's mean prompt length moves its prefill share by several percent).

Run: python -m benchmarks.serve_steady [--servers ours,vllm] [--concurrency 32] [--blocks 2] [--pair none|seeded]
[--same-prompts] [--temperature T] [--target NAME] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from benchmarks.serve_peers import request_body, select_prompts, stream_one
from benchmarks.serve_peers_results import RequestResult, count_tokens, window_share
from benchmarks.serve_peers_servers import REPO, TARGET, Endpoint, ours_server, vllm_server

# server -> its systems, in the order of their prompt slots (a window of block k, slot j takes prompt block 2k + j),
# and the request fields of each
SLOTS = {"ours": ("ours", "ours-none"), "vllm": ("vllm", "vllm")}
FIELDS = {"ours": {}, "ours-none": {"tree": "none"}, "ours-seeded": {}, "vllm": {}}
SEEDED = ("ours-seeded",)  # systems whose every request carries a seed of its own (coupled sampling, `auto`)


async def steady_window(send: Callable[[int], Awaitable[tuple[int, float | None]]], concurrency: int,
                        warmup_s: float, duration_s: float) -> dict[str, Any]:  # fmt: skip
    """`concurrency` clients, each sending its next request (send(i): i = 0, 1, ... in order; -> its tokens and time
    to first token) when the last ends, until warmup_s + duration_s have passed. Counted in the window after
    warmup_s: each request's tokens in the share of its decoding (first token to end) that falls inside the window
    (`tokens_per_s`), and the requests that end inside it (`requests`, `ended_tokens_per_s`: every token of those).
    The first is the steady rate; the second moves in steps of whole waves where requests finish together (a server
    that starts 32 requests at once ends them at once: 96 or 128 requests, nothing between). -> both, p50 time to
    first token, requests sent."""
    t0 = time.perf_counter()
    start, end = t0 + warmup_s, t0 + warmup_s + duration_s
    sent, counted, ended_tokens, share, ttfts = 0, 0, 0, 0.0, []

    async def client() -> None:
        nonlocal sent, counted, ended_tokens, share
        while time.perf_counter() < end:
            index, sent = sent, sent + 1
            began = time.perf_counter()
            n, ttft = await send(index)
            done = time.perf_counter()
            first = min(began + ttft, done) if ttft is not None else done
            share += n * window_share(first, done, start, end)
            if start <= done < end:
                counted, ended_tokens = counted + 1, ended_tokens + n
                if ttft is not None:
                    ttfts.append(ttft)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"tokens_per_s": share / duration_s, "ended_tokens_per_s": ended_tokens / duration_s, "requests": counted,
            "sent": sent, "ttft_p50_s": statistics.median(ttfts) if ttfts else None}  # fmt: skip


def run_block(endpoint: Endpoint, prompts: list[str], fields: dict[str, Any], args: argparse.Namespace,
              tokenize: Callable[[str], int], seed_base: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One window of closed load on `prompts`; seed_base: request i carries the seed seed_base + i."""
    async def go() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=args.concurrency + 1, max_keepalive_connections=args.concurrency + 1)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout), trust_env=False) as client:

            async def send(index: int) -> tuple[int, float | None]:
                extra = {"seed": seed_base + index} if seed_base is not None else {}
                body = request_body(endpoint, prompts[index % len(prompts)], args.max_tokens, args.temperature,
                                    fields | extra)  # fmt: skip
                result: RequestResult = await stream_one(client, endpoint.url, body, index, args.timeout)
                if result.error:
                    raise RuntimeError(f"request {index} failed: {result.error}")
                return count_tokens(result, tokenize), result.ttft_s

            return await steady_window(send, args.concurrency, args.warmup, args.duration)

    return asyncio.run(go())


def ratios(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over blocks of each system's tokens/s (vLLM's per prompt slot), and ours / vLLM over the same
    prompts."""
    def median(rows):
        return statistics.median(r["tokens_per_s"] for r in rows) if rows else None

    medians = {name: median([b for b in blocks if b["system"] == name]) for name in FIELDS if name != "vllm"}
    vllm = [median([b for b in blocks if b["system"] == "vllm" and b["slot"] == slot]) for slot in (0, 1)]
    over = {name: medians[name] / vllm[slot] for name in medians if (slot := _slot(name)) is not None
            and medians[name] is not None and vllm[slot]}  # fmt: skip
    # ours' second system over ours, block by block (the two alternate within a block), and the median of those
    ours = {b["block"]: b["tokens_per_s"] for b in blocks if b["system"] == "ours"}
    pairs = {b["system"]: [] for b in blocks if b["slot"] == 1 and b["system"] != "vllm"}
    for b in blocks:
        if b["system"] in pairs and ours.get(b["block"]):
            pairs[b["system"]].append(b["tokens_per_s"] / ours[b["block"]])
    return {"median_tokens_per_s": {**{k: v for k, v in medians.items() if v is not None}, "vllm": vllm},
            "over_vllm": over,
            "over_ours": {name: {"blocks": r, "median": statistics.median(r)} for name, r in pairs.items() if r}}


def _slot(name: str) -> int | None:
    return 0 if name == "ours" else 1 if name.startswith("ours-") else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="ours,vllm", help="comma-separated, of ours (ours and ours-none), vllm")
    parser.add_argument("--target", default=TARGET, help="embedded model name or directory, for every system")
    parser.add_argument("--pair", default="none", choices=("none", "seeded"),
                        help="ours' second system: every request 'tree': 'none' (none), or every request seeded "
                             "(seeded: coupled sampling against ours' rejection sampling; needs --temperature > 0)")
    parser.add_argument("--same-prompts", action="store_true",
                        help="ours' two systems take the same prompts in each block, in alternating order, from an "
                             "app without its prefix cache (which would serve the second's prefills); ours only")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of the window")
    parser.add_argument("--blocks", type=int, default=2, help="windows per system")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--vllm-script", type=Path, default=REPO.parent / "shared" / "peers" / "vllm_cpu.sh")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := set(args.servers) - {"ours", "vllm"}:
        parser.error(f"unknown servers {sorted(unknown)}; choose from ours,vllm")
    if not 1 <= args.concurrency <= 256 or args.blocks < 1 or not (args.warmup >= 0 and args.duration > 0):
        parser.error("concurrency must be in [1, 256], blocks >= 1, warmup >= 0 and duration > 0")
    if not 0.0 <= args.temperature <= 2.0:
        parser.error(f"temperature must be in [0, 2], got {args.temperature}")
    if args.same_prompts and args.servers != ["ours"]:
        parser.error("--same-prompts compares ours' two systems: give --servers ours")
    if args.pair == "seeded" and args.temperature == 0:
        parser.error("--pair seeded compares sampling modes: give --temperature > 0")
    from ray_specdec.models.loading import resolve_model_path

    args.ours_ingress = "direct"
    args.target_dir = Path(resolve_model_path(args.target))  # vLLM's and the tokenizer's (a grown model built here)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target_dir)
    tokenize = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    # the prompts of block k (every system's): enough for every request a window of this load can send
    per_block = max(64, int(args.concurrency * (args.warmup + args.duration) * 2))
    prompts = select_prompts(per_block * 2 * args.blocks, args.seed)
    blocks: list[dict[str, Any]] = []
    slots = SLOTS | {"ours": ("ours", f"ours-{args.pair}")}
    for server in args.servers:
        start = ours_server if server == "ours" else (lambda a: vllm_server(a, "plain"))
        app_args = {"prefix_cache": False} if args.same_prompts else {}
        with start(args, **app_args) as endpoint:
            for k in range(args.blocks):
                order = list(enumerate(slots[server]))  # a server's systems alternate, as serve_peers' do
                if args.same_prompts and k % 2:  # and with the same prompts, each goes first in every other block
                    order.reverse()
                for slot, name in order:
                    first = 2 * k + (0 if args.same_prompts else slot)
                    block = prompts[first * per_block:(first + 1) * per_block]
                    seed_base = 1_000_000 * (k + 1) if name in SEEDED else None
                    row = {"system": name, "block": k, "slot": slot,
                           **run_block(endpoint, block, FIELDS[name], args, tokenize, seed_base)}  # fmt: skip
                    ttft = "-" if row["ttft_p50_s"] is None else f"{row['ttft_p50_s'] * 1e3:.0f} ms"
                    print(f"{name} c={args.concurrency} block {k} (prompts {2 * k + slot}): "
                          f"{row['tokens_per_s']:.1f} tok/s (the {row['requests']} requests that ended in the window: "
                          f"{row['ended_tokens_per_s']:.1f}), TTFT p50 {ttft}", flush=True)  # fmt: skip
                    blocks.append(row)
    summary = ratios(blocks)
    for name, ratio in summary["over_vllm"].items():
        print(f"{name} / vllm over the same prompts (medians of blocks): {ratio:.2f}x", flush=True)
    for name, pair in summary["over_ours"].items():
        print(f"{name} / ours, block by block: {', '.join(f'{r:.2f}x' for r in pair['blocks'])} "
              f"(median {pair['median']:.2f}x)", flush=True)  # fmt: skip
    machine_paths = ("vllm_script", "json", "target_dir")
    out = {"config": {k: v for k, v in vars(args).items() if k not in machine_paths},
           "blocks": blocks, **summary}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
