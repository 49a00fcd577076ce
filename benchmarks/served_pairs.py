"""Served against in-process at one request, on the same prompts, interleaved block by block in one run.

Issue 18 asks for served concurrency-1 throughput within 10% of the in-process loop. serve_peers measures it with one
block of prompts per system, minutes apart, and on the 2-core machine a block moves by 10-15% from one minute to the
next, so its ratio moved between 0.75x and 0.92x over runs that changed nothing on the served path. Here every block
of `--block` fresh prompts runs in three modes back to back, in an order that rotates from block to block, so that
drift lands on all three alike:
- `alone`: the in-process loop (this process, the app's policy) while every process of the app and of its Ray is
  stopped (SIGSTOP, which costs the loop as little as no Ray at all);
- `beside`: the same loop while the app runs, idle: what Ray's and Serve's processes cost the loop before any HTTP;
- `served`: one streaming request at a time to the engine replica's own port (direct ingress, as `serve run
  deployments:app` answers), the app started as serve_peers starts it, in a process of its own (this process is
  only its client).
served / alone is the issue's ratio; beside / alone is the platform's share of it and served / beside the request
path's, which includes this client's own CPU time on the same cores (printed; a real client runs elsewhere: the
client here is the standard library's, `LeanClient`). Greedy texts of `served` and `alone` are compared prompt by
prompt.

Run from the repository root: python -m benchmarks.served_pairs [--blocks 6] [--block 10] [--tree none]
[--json results.json]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import platform
import signal
import statistics
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

MODES = ("alone", "beside", "served")
ORDERS = tuple(itertools.permutations(MODES))  # block b runs ORDERS[b % 6]: each mode first, second and last alike
WARMUP_PROMPTS = 4


def app_processes(root: int, proc: Path = Path("/proc")) -> list[int]:
    """`root` and every process below it (Ray's GCS, raylet and workers hang under the driver that started them)."""
    children: dict[int, list[int]] = {}
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # ppid: field 4 of proc(5)
        children.setdefault(parent, []).append(int(pid_dir.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


class Frozen:
    """SIGSTOP to the app's processes for the duration of a `with`, SIGCONT after (ones that ended are skipped)."""

    def __init__(self, root: int):
        self.root = root
        self.pids: list[int] = []

    def __enter__(self) -> "Frozen":
        self.pids = app_processes(self.root)
        self._signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class LeanClient:
    """Streaming completions over one kept-alive connection, with the standard library only: the client shares the
    two cores with the app, and httpx's asyncio client took ~10 ms of CPU a request there (a real client runs
    elsewhere)."""

    def __init__(self, url: str, timeout_s: float = 120.0):
        parsed = urllib.parse.urlsplit(url)
        self.url = url
        self.connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout_s)

    def stream(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions (stream: true) -> seconds, tokens (the usage chunk's), text, ttft_s; raises on an
        error status or an error event."""
        from benchmarks.serve_peers_results import StreamTally

        tally, start = StreamTally(), time.perf_counter()
        self.connection.request("POST", "/v1/completions", json.dumps(body),
                                {"Content-Type": "application/json"})  # fmt: skip
        response = self.connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"a served request failed: HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            tally.feed(line.decode().rstrip("\r\n"), time.perf_counter() - start)
        if tally.error or not tally.done or tally.usage_tokens is None:
            raise RuntimeError(f"a served request failed: {tally.error or 'no [DONE] or usage'}")
        return {"seconds": time.perf_counter() - start, "tokens": tally.usage_tokens, "text": "".join(tally.text),
                "ttft_s": tally.ttft_s}  # fmt: skip


def summarize(block: list[dict[str, Any]]) -> dict[str, float]:
    """A mode's requests in one block -> tokens/s over the block, mean ms a request, tokens and seconds."""
    seconds, tokens = sum(r["seconds"] for r in block), sum(r["tokens"] for r in block)
    return {"tokens_per_s": tokens / seconds, "ms_per_request": 1000 * seconds / len(block), "tokens": tokens,
            "seconds": seconds}  # fmt: skip


def overall(blocks: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """Per mode, tokens/s over every block together (all its tokens over all its seconds)."""
    return {mode: sum(b[mode]["tokens"] for b in blocks) / sum(b[mode]["seconds"] for b in blocks) for mode in MODES}


def ratio_rows(blocks: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per ratio (served / alone, beside / alone, served / beside): the median over blocks and the range."""
    out = {}
    for top, bottom in (("served", "alone"), ("beside", "alone"), ("served", "beside")):
        values = [b[top]["tokens_per_s"] / b[bottom]["tokens_per_s"] for b in blocks]
        out[f"{top}/{bottom}"] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                                  "max": round(max(values), 3)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6, help="blocks of prompts, each run in all three modes")
    parser.add_argument("--block", type=int, default=10, help="prompts per block")
    parser.add_argument("--tree", default="policy", help='"policy" (the service\'s choice) or a tree config')
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=131)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.block < 1 or args.max_tokens < 1:
        parser.error("--blocks, --block and --max-tokens must be at least 1")

    from ray_specdec.config import TreeConfig

    try:
        tree = None if args.tree == "policy" else TreeConfig.parse(args.tree)
    except ValueError as exc:
        parser.error(f"--tree: {exc}")

    import torch

    from benchmarks.serve_peers import select_prompts
    from benchmarks.serve_peers_servers import TARGET
    from benchmarks.served_overhead import start_app, stop_app
    from ray_specdec.config import SamplingParams
    from ray_specdec.engine.llm import SpeculativeEngine
    from ray_specdec.factory import load_drafter, load_target
    from ray_specdec.speculation.bandit import Bandit

    prompts = select_prompts(WARMUP_PROMPTS + args.blocks * args.block, args.seed)
    # an engine per in-process mode, each seeing every prompt once as the app does: a second run of a prompt on one
    # engine would take its prefill from the prefix cache
    engines = {mode: SpeculativeEngine(load_target(str(TARGET), dtype="float32", device="cpu"),
                                       load_drafter(None, dtype="float32"), Bandit())  # the app's, as serve_peers'
               for mode in ("alone", "beside")}  # fmt: skip
    params = SamplingParams(max_new_tokens=args.max_tokens)
    fields = {} if tree is None else {"tree": args.tree}

    def in_process(mode: str, prompt: str) -> dict[str, Any]:
        start = time.perf_counter()
        gen = engines[mode].generate(prompt, params, tree)
        return {"seconds": time.perf_counter() - start, "tokens": len(gen.token_ids), "text": gen.text}

    def served_block(client: LeanClient, block: list[str]) -> list[dict[str, Any]]:
        body = {"max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}} | fields  # fmt: skip
        return [client.stream(body | {"prompt": prompt}) for prompt in block]

    with tempfile.TemporaryDirectory() as folder:
        app = start_app(Path(folder))
        try:
            client = LeanClient((Path(folder) / "url").read_text().strip())
            print(f"the app answers at {client.url}; this process runs the in-process loop and the client",
                  flush=True)  # fmt: skip
            warm = prompts[:WARMUP_PROMPTS]
            served_block(client, warm)
            for mode, prompt in itertools.product(engines, warm):
                in_process(mode, prompt)
            blocks, mismatches, compared = [], 0, 0
            for b in range(args.blocks):
                block = prompts[WARMUP_PROMPTS + b * args.block:WARMUP_PROMPTS + (b + 1) * args.block]
                runs: dict[str, list[dict[str, Any]]] = {}
                for mode in ORDERS[b % len(ORDERS)]:
                    if mode == "served":
                        cpu = time.process_time()  # this process is only the client meanwhile
                        runs[mode] = served_block(client, block)
                        client_cpu_s = time.process_time() - cpu
                    elif mode == "alone":
                        with Frozen(app.pid):
                            runs[mode] = [in_process(mode, p) for p in block]
                    else:
                        runs[mode] = [in_process(mode, p) for p in block]
                for served, alone in zip(runs["served"], runs["alone"]):
                    compared += 1
                    mismatches += served["text"] != alone["text"]
                summary = {mode: summarize(runs[mode]) for mode in MODES}
                ttfts = [r["ttft_s"] for r in runs["served"] if r["ttft_s"] is not None]
                summary["served"]["ttft_p50_ms"] = 1000 * statistics.median(ttfts) if ttfts else None
                summary["served"]["client_cpu_ms_per_request"] = 1000 * client_cpu_s / len(block)
                blocks.append(summary)
                print(f"block {b + 1}/{args.blocks} ({' '.join(ORDERS[b % len(ORDERS)])}): "
                      + ", ".join(f"{m} {summary[m]['tokens_per_s']:.1f} tok/s" for m in MODES)
                      + f"; served / alone {summary['served']['tokens_per_s'] / summary['alone']['tokens_per_s']:.3f}",
                      flush=True)  # fmt: skip
        finally:
            stop_app(Path(folder), app)
    ratios, whole = ratio_rows(blocks), overall(blocks)
    result = {
        "tree": args.tree, "blocks": args.blocks, "block": args.block, "max_tokens": args.max_tokens,
        "seed": args.seed, "ratios": ratios,
        "overall_tokens_per_s": {mode: round(v, 1) for mode, v in whole.items()},
        "blocks_detail": [{m: {k: (round(v, 2) if v is not None else None) for k, v in s.items()}
                           for m, s in b.items()} for b in blocks],  # fmt: skip
        "greedy_mismatches": mismatches, "greedy_compared": compared,
        "hardware": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch_threads": torch.get_num_threads()},
    }
    print()
    for name, r in ratios.items():
        print(f"{name:15s} median {r['median']:.3f}x (blocks {r['min']:.3f}-{r['max']:.3f})")
    print("all blocks together: " + ", ".join(f"{m} {v:.1f} tok/s" for m, v in whole.items())
          + f"; served / alone {whole['served'] / whole['alone']:.3f}")
    client = statistics.median(b["served"]["client_cpu_ms_per_request"] for b in blocks)
    print(f"the client's own CPU time (on the same cores): {client:.1f} ms a request (median over blocks)")
    print(f"greedy texts served against alone: {mismatches} of {compared} differ")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
