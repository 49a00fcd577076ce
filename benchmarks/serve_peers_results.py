"""Results of benchmarks/serve_peers.py: what one SSE stream said (`StreamTally`, `RequestResult`), each cell's
summary, the greedy-text check, the ratios (medians over repeated cells), the Markdown tables and the plot."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

# greedy texts of every system are compared with the first of these that ran the same prompt: ours-none, else the
# in-process loop's (prompts that only the paired concurrency-1 cells ran: benchmarks/serve_peers.py --paired-c1)
REFERENCE = ("ours-none", "inproc-none", "inproc")
PEERS = ("vllm", "vllm-ngram", "vllm-draft", "hf")


# ---- streaming responses --------------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    prompt_index: int
    latency_s: float = 0.0
    ttft_s: float | None = None  # first chunk with text
    text: str = ""
    usage_tokens: int | None = None  # completion_tokens of the last usage block seen
    id_tokens: int | None = None  # token ids in the chunks, where every chunk had them (ours)
    error: str | None = None
    started_s: float | None = None  # when it was sent, in seconds from its cell's start (timed cells)


@dataclass
class StreamTally:
    """What one SSE stream said so far: OpenAI completion chunks (`choices[0].text`), `data: [DONE]` at the end."""

    text: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    usage_tokens: int | None = None
    id_tokens: int | None = 0
    done: bool = False  # "[DONE]" seen
    finish_reason: str | None = None  # transformers serve ends its stream after this chunk, without "[DONE]"
    error: str | None = None

    def feed(self, line: str, elapsed_s: float) -> None:
        if not line.startswith("data:") or self.done or self.error:
            return  # blank separators, comments (": ping"), "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = "stream_error"
            return
        choice = (chunk.get("choices") or [{}])[0]
        if text := choice.get("text") or "":
            self.text.append(text)
            if self.ttft_s is None:
                self.ttft_s = elapsed_s
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        ids = choice.get("token_ids")
        self.id_tokens = None if ids is None or self.id_tokens is None else self.id_tokens + len(ids)
        if usage := chunk.get("usage"):
            self.usage_tokens = int(usage["completion_tokens"])


def count_tokens(result: RequestResult, tokenize: Callable[[str], int]) -> int:
    """Usage if the server sent it, else the chunks' token ids, else the text re-tokenized (vLLM without
    stream_options, whose speculative chunks carry several tokens)."""
    if result.usage_tokens is not None:
        return result.usage_tokens
    return result.id_tokens if result.id_tokens is not None else tokenize(result.text)


# ---- summaries ------------------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def window_share(first: float, done: float, start: float, end: float) -> float:
    """The share of a request's decoding, from its first token to its end, inside [start, end) (its tokens taken as
    evenly spread; a request that decoded in no time: 1 if it ended inside)."""
    if done <= first:
        return float(start <= done < end)
    return max(0.0, min(done, end) - max(first, start)) / (done - first)


def summarize_cell(results: list[RequestResult], wall_s: float, tokenize: Callable[[str], int],
                   window_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """tokens_per_s: every token over the cell's wall time (its start, and its drain after the last request was
    sent). window_s (timed cells, whose requests know when they were sent): also the tokens decoded in the cell's
    first window_s seconds, each request's spread from its first token to its end (`window_tokens_per_s`): the
    drain left out, where a server that ends its requests in waves and one that does not differ."""
    ok = [r for r in results if r.error is None]
    counts = [count_tokens(r, tokenize) for r in ok]
    tokens = sum(counts)
    latency, ttft = [r.latency_s for r in ok], [r.ttft_s for r in ok if r.ttft_s is not None]
    cell = {"requests": len(results), "ok": len(ok), "errors": dict(Counter(r.error for r in results if r.error)),
            "tokens": tokens, "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2) if wall_s else 0.0,
            "latency_p50_s": percentile(latency, 50), "latency_p95_s": percentile(latency, 95),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95)}
    if window_s and ok and all(r.started_s is not None for r in ok):
        inside = sum(n * window_share(r.started_s + min(r.ttft_s if r.ttft_s is not None else r.latency_s,
                                                        r.latency_s), r.started_s + r.latency_s, 0.0, window_s)
                     for r, n in zip(ok, counts))  # fmt: skip
        cell["window_tokens_per_s"] = round(inside / window_s, 2)
    return cell


def cell_label(system: str, concurrency: int) -> str:
    return f"{system} c={concurrency}"


def greedy_check(texts: dict[str, dict[int, list[str]]],
                 reference: tuple[str, ...] = REFERENCE) -> dict[str, Any]:  # fmt: skip
    """texts: greedy cell label ("vllm c=8") -> prompt index -> texts seen. Every cell's texts against the first text
    the first reference system that ran the prompt gave for it in any of its cells: {"reference", "cells": {label:
    {"compared", "mismatched", "first": [...]}}}; the reference's own cells are checked too (batch invariance: the
    same prompt in another of its cells, or again in one). The text a reference was taken from is not compared with
    itself: with fresh prompts the reference's cells then compare nothing, and say so (0/0), instead of a check that
    cannot fail."""
    ref: dict[int, tuple[str, str]] = {}  # prompt -> (its reference text, the cell that gave it first)
    for system in reference:
        for label, by_prompt in texts.items():
            if label.rsplit(" c=", 1)[0] == system:
                for i, seen in by_prompt.items():
                    ref.setdefault(i, (seen[0], label))
    if not ref:
        return {"reference": list(reference), "error": f"no greedy texts from {' or '.join(reference)}"}
    cells = {}
    for label, by_prompt in texts.items():
        compared, wrong = 0, []
        for i, seen in sorted(by_prompt.items()):
            expected, source = ref.get(i, (None, None))
            for k, text in enumerate(seen if expected is not None else ()):
                if source == label and k == 0:
                    continue  # the reference text itself
                compared += 1
                if text != expected:
                    wrong.append({"prompt": i, "expected": expected[:80], "got": text[:80]})
        cells[label] = {"compared": compared, "mismatched": len(wrong), "first": wrong[:3]}
    return {"reference": list(reference), "cells": cells}


def rates(cells: list[dict[str, Any]], key: str = "tokens_per_s") -> dict[tuple[str, float, int], float]:
    """(system, temperature, concurrency) -> tokens/s (`key`: or another rate of the cells): the median of its cells
    (one per --repeats) that have it."""
    runs: dict[tuple[str, float, int], list[float]] = {}
    for c in cells:
        if c.get(key) is not None:
            runs.setdefault((c["system"], c["temperature"], c["concurrency"]), []).append(c[key])
    return {key: float(np.median(values)) for key, values in runs.items()}


def ratios(cells: list[dict[str, Any]], ours: tuple[str, ...] = ("ours", "ours-none"),
           key: str = "tokens_per_s") -> list[dict[str, Any]]:  # fmt: skip
    """tokens/s (`key`: or another rate) of each of ours over each peer, and of the service's choice over tree none,
    per (temperature, concurrency) both ran (medians over repeats)."""
    rate = rates(cells, key)
    out = []
    for (system, temperature, concurrency), value in sorted(rate.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if system not in ours:
            continue
        for peer in PEERS + (("ours-none",) if system == "ours" else ()):  # the service's choice over tree none
            base = rate.get((peer, temperature, concurrency))
            if base:
                out.append({"ours": system, "peer": peer, "temperature": temperature, "concurrency": concurrency,
                            "ratio": round(value / base, 3)})
    return out


def served_vs_inproc(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Served concurrency-1 tokens/s over the in-process loop's, drafting on and off (medians over repeats);
    same_prompts: every cell of both ran the same prompts (--paired-c1), not timed cells of different ones."""
    rate = rates(cells)
    out = []
    for served, loop in (("ours", "inproc"), ("ours-none", "inproc-none")):
        for temperature in sorted({t for _, t, _ in rate}):
            s, l = rate.get((served, temperature, 1)), rate.get((loop, temperature, 1))
            if s is not None and l:
                both = [c for c in cells if c["system"] in (served, loop) and c["temperature"] == temperature
                        and c["concurrency"] == 1]  # fmt: skip
                out.append({"served": served, "inproc": loop, "temperature": temperature, "served_tokens_per_s": s,
                            "inproc_tokens_per_s": l, "ratio": round(s / l, 3),
                            "same_prompts": all(c.get("paired", False) for c in both)})  # fmt: skip
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def markdown(result: dict[str, Any]) -> str:
    check = (result.get("greedy_check") or {}).get("cells", {})
    lines = ["| system | T | concurrency | requests | errors | tokens/s | in the window | latency p50 (ms) | p95 (ms) "
             "| TTFT p50 (ms) | greedy mismatches |", "|" + " --- |" * 11]
    for c in result["cells"]:
        mismatch = check.get(cell_label(c["system"], c["concurrency"])) if c["temperature"] == 0 else None
        mismatches = f"{mismatch['mismatched']}/{mismatch['compared']}" if mismatch else "-"
        lines.append(f"| {c['system']} | {c['temperature']:g} | {c['concurrency']} | {c['requests']} | "
                     f"{sum(c['errors'].values())} | {c['tokens_per_s']:.1f} | "
                     f"{'-' if c.get('window_tokens_per_s') is None else format(c['window_tokens_per_s'], '.1f')} | "
                     f"{ms(c['latency_p50_s'])} | "
                     f"{ms(c['latency_p95_s'])} | {ms(c['ttft_p50_s'])} | "
                     f"{mismatches} |")
    if result["ratios"]:
        window = {(r["ours"], r["peer"], r["temperature"], r["concurrency"]): r["ratio"]
                  for r in result.get("ratios_window") or []}  # fmt: skip
        lines += ["", "| ours | vs | T | concurrency | tokens/s ratio | in the window |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in result["ratios"]:
            inside = window.get((r["ours"], r["peer"], r["temperature"], r["concurrency"]))
            lines.append(f"| {r['ours']} | {r['peer']} | {r['temperature']:g} | {r['concurrency']} | "
                         f"{r['ratio']:.2f}x | {'-' if inside is None else f'{inside:.2f}x'} |")
    if result["served_vs_inproc"]:
        lines += ["", "| served | in-process loop | T | served tokens/s | in-process tokens/s | ratio | prompts |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['served']} (concurrency 1) | {r['inproc']} | {r['temperature']:g} | "
                  f"{r['served_tokens_per_s']:.1f} | {r['inproc_tokens_per_s']:.1f} | {r['ratio']:.2f}x | "
                  f"{'the same' if r.get('same_prompts') else 'different'} |" for r in result["served_vs_inproc"]]
    lines += ["", f"Greedy mismatches: texts unlike {REFERENCE[0]}'s for the same prompt (where it did not run the "
                  f"prompt: {' or '.join(REFERENCE[1:])}'s) / texts compared; a reference text is not compared with "
                  f"itself, so with fresh prompts the reference's own cells compare nothing (0/0)."]
    if result.get("ratios_window"):
        lines += ["In the window: the tokens decoded within the cell's duration, each request's spread from its first "
                  "token to its end, over the duration (the cell's drain left out); tokens/s: every token over the "
                  "cell's wall time, drain included."]
    if any(c.get("repeat", 0) for c in result["cells"]):
        lines += ["Ratios are of medians over each system's repeated cells (one row per cell above)."]
    down = {k: v for k, v in result["servers"].items() if v["status"] != "ok"}
    lines += [""] + [f"- {name}: unavailable ({v['reason']})" for name, v in down.items()]
    return "\n".join(lines).rstrip() + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    """tokens/s against concurrency per system, greedy and T=1 panels: the median line, each repeated cell a dot."""
    from matplotlib.figure import Figure  # the OO API renders with Agg, whatever pyplot's backend
    from matplotlib.ticker import NullLocator

    median = rates(result["cells"])
    temperatures = sorted({c["temperature"] for c in result["cells"]}) or [0.0]
    fig = Figure(figsize=(6 * len(temperatures), 4.5))
    colors = {system: f"C{i}" for i, system in enumerate(dict.fromkeys(c["system"] for c in result["cells"]))}
    for ax, temperature in zip(np.atleast_1d(fig.subplots(1, len(temperatures))), temperatures):
        for system, color in colors.items():
            points = sorted((c["concurrency"], c["tokens_per_s"]) for c in result["cells"]
                            if c["system"] == system and c["temperature"] == temperature)
            if points:
                line = sorted({(n, median[(system, temperature, n)]) for n, _ in points})
                ax.plot(*zip(*line), marker="o", color=color, label=system)
                if len(points) > len(line):  # repeats: every cell
                    ax.scatter(*zip(*points), s=10, color=color, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency", ylabel="completion tokens/s", ylim=(0, None),
               title="greedy" if temperature == 0 else f"T={temperature:g}")
        ax.set_xticks(sorted({c["concurrency"] for c in result["cells"]}))
        ax.xaxis.set_major_formatter("{x:.0f}")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
