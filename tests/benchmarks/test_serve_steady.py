"""The pure parts of benchmarks/serve_steady.py: the counted window of a closed loop and the arguments. No servers."""

import asyncio
import statistics
import time

import pytest

from benchmarks.serve_steady import parse_args, ratios, steady_window, window_share


def test_only_requests_that_end_inside_the_window_count():
    """Each request takes 0.1 s and gives index + 1 tokens: with 2 clients, 0.25 s of warm-up and a 0.5 s window,
    the requests that end at 0.3 to 0.7 s count (ten), those that end at 0.1, 0.2 (warm-up) and 0.8 s (drain) do
    not. No request ends within 50 ms of either edge, so scheduling delays do not move one across."""
    ended: list[tuple[int, float]] = []
    start = time.perf_counter()

    async def send(index: int) -> tuple[int, float]:
        await asyncio.sleep(0.1)
        ended.append((index, time.perf_counter() - start))
        return index + 1, 0.01 * (index + 1)

    out = asyncio.run(steady_window(send, concurrency=2, warmup_s=0.25, duration_s=0.5))
    counted = [i for i, t in ended if 0.25 <= t < 0.75]
    assert out["requests"] == len(counted) == 10
    assert out["ended_tokens_per_s"] == pytest.approx(sum(i + 1 for i in counted) / 0.5)
    # every request's tokens in the window's share of it: the ten inside in full, the edges' in part
    assert sum(i + 1 for i in counted) / 0.5 <= out["tokens_per_s"] < sum(i + 1 for i, _ in ended) / 0.5
    assert out["ttft_p50_s"] == pytest.approx(statistics.median(0.01 * (i + 1) for i in counted))
    assert out["sent"] == len(ended) == 16  # the warm-up's 4 and the drain's 2 were sent, not counted


def test_a_requests_tokens_count_by_the_share_of_its_decoding_in_the_window():
    assert window_share(1.0, 3.0, 0.0, 10.0) == 1.0  # inside
    assert window_share(1.0, 3.0, 2.0, 10.0) == 0.5  # began decoding before the window
    assert window_share(1.0, 5.0, 0.0, 2.0) == 0.25  # ends after it
    assert window_share(1.0, 3.0, 4.0, 10.0) == 0.0 and window_share(5.0, 6.0, 0.0, 4.0) == 0.0  # outside
    assert window_share(2.0, 2.0, 0.0, 4.0) == 1.0 and window_share(4.0, 4.0, 0.0, 4.0) == 0.0  # no decoding time
    # waves: 32 requests that decode together for 5 s, back to back; a 15 s window from 2 s on counts 3 waves' worth
    # of tokens, not the 3 or 4 whole waves that end inside it
    waves = [(1.0 + 5 * k, 6.0 + 5 * k) for k in range(5)]
    assert sum(32 * 64 * window_share(a, b, 2.0, 17.0) for a, b in waves) == pytest.approx(3 * 32 * 64)


def test_arguments_are_checked():
    args = parse_args(["--servers", "ours", "--concurrency", "8", "--blocks", "3"])
    assert args.servers == ["ours"] and args.concurrency == 8 and args.blocks == 3 and args.temperature == 0.0
    assert parse_args(["--temperature", "1"]).temperature == 1.0
    for bad in (["--servers", "hf"], ["--concurrency", "0"], ["--blocks", "0"], ["--duration", "0"],
                ["--temperature", "-1"], ["--pair", "seeded"], ["--pair", "rows", "--temperature", "1"], ["--same-prompts"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert parse_args(["--pair", "seeded", "--temperature", "1"]).pair == "seeded"
    assert parse_args(["--servers", "ours", "--same-prompts"]).same_prompts  # ours only: vLLM's cache would hit


def test_ours_is_compared_with_vllm_over_the_same_prompts():
    rows = [("ours", 0, 0, 800.0), ("ours-none", 0, 1, 700.0), ("ours", 1, 0, 900.0), ("ours-none", 1, 1, 600.0),
            ("vllm", 0, 0, 1000.0), ("vllm", 0, 1, 500.0), ("vllm", 1, 0, 700.0), ("vllm", 1, 1, 700.0)]
    out = ratios([{"system": s, "block": k, "slot": j, "tokens_per_s": t} for s, k, j, t in rows])
    assert out["median_tokens_per_s"] == {"ours": 850.0, "ours-none": 650.0, "vllm": [850.0, 600.0]}
    assert out["over_vllm"] == {"ours": pytest.approx(1.0), "ours-none": pytest.approx(650 / 600)}
    # ours' second system block by block: 700 / 800 and 600 / 900
    assert out["over_ours"]["ours-none"]["blocks"] == pytest.approx([700 / 800, 600 / 900])
    assert out["over_ours"]["ours-none"]["median"] == pytest.approx((700 / 800 + 600 / 900) / 2)
    only_ours = ratios([{"system": "ours", "block": 0, "slot": 0, "tokens_per_s": 800.0}])
    assert only_ours["over_vllm"] == {} and only_ours["median_tokens_per_s"]["ours"] == 800.0
    assert only_ours["over_ours"] == {}
    seeded = ratios([{"system": "ours", "block": 0, "slot": 0, "tokens_per_s": 500.0},
                     {"system": "ours-seeded", "block": 0, "slot": 1, "tokens_per_s": 450.0}])
    assert seeded["over_ours"]["ours-seeded"]["median"] == pytest.approx(0.9)
