"""The pure parts of benchmarks/serve_peers.py: SSE parsing of each server's chunks, token counts, summaries, ratios,
the greedy text check, the table and the prompt choice. No servers, no network."""

import asyncio
import json

import httpx
import pytest

import benchmarks.serve_peers as serve_peers
from benchmarks.serve_peers import (Endpoint, closed_loop, engine_state, first_prompt, paired_prompts, parse_args,
                                    select_prompts, used)  # fmt: skip
from benchmarks.serve_peers_results import (RequestResult, StreamTally, count_tokens, greedy_check, markdown,
                                            percentile, plot, rates, ratios, served_vs_inproc,
                                            summarize_cell)  # fmt: skip


def sse(body) -> list[str]:
    return [f"data: {body if isinstance(body, str) else json.dumps(body)}", ""]


def chunk(text, finish=None, **extra):
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, **extra.pop("choice", {})}], **extra}


def feed(lines) -> StreamTally:
    tally = StreamTally()
    for t, line in enumerate(lines):
        tally.feed(line, elapsed_s=0.1 * t)
    return tally


# ours: token_ids in every chunk, usage (and a speculative block) on the last one, then [DONE]
OURS = (sse(chunk("", choice={"token_ids": []})) + sse(chunk("def", choice={"token_ids": [316]}))
        + sse(chunk(" f(x)", "length", choice={"token_ids": [269, 9, 89, 10]},
                    usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
                    speculative={"rounds": 2})) + sse("[DONE]"))  # fmt: skip
# vLLM without stream_options: text only (several tokens per chunk when it speculates), no usage, then [DONE]
VLLM = sse(chunk("def")) + sse(chunk(" f(x)")) + sse(chunk("", "length")) + sse("[DONE]")
# transformers serve: one token per chunk, usage on the finish chunk, no [DONE]
HF = sse(chunk("def")) + sse(chunk(" f(x)")) + sse(chunk("", "length", usage={"completion_tokens": 5}))


def test_ours_stream():
    tally = feed(OURS)
    assert ("".join(tally.text), tally.usage_tokens, tally.id_tokens, tally.done) == ("def f(x)", 5, 5, True)
    assert tally.ttft_s == pytest.approx(0.2)  # the first chunk with text (line 2), not the empty one


def test_vllm_stream_counts_tokens_from_text():
    tally = feed(VLLM)
    assert ("".join(tally.text), tally.usage_tokens, tally.id_tokens, tally.done) == ("def f(x)", None, None, True)
    assert tally.ttft_s == pytest.approx(0.0)
    result = RequestResult(0, text="".join(tally.text), usage_tokens=tally.usage_tokens, id_tokens=tally.id_tokens)
    assert count_tokens(result, lambda text: len(text.split())) == 2


def test_hf_stream_ends_on_finish_reason():
    tally = feed(HF + [": ping", "event: message"])
    assert ("".join(tally.text), tally.usage_tokens, tally.done, tally.finish_reason) == ("def f(x)", 5, False,
                                                                                          "length")


def test_stream_error_and_lines_after_done():
    assert feed(sse(chunk("a")) + sse({"error": {"message": "boom"}})).error == "stream_error"
    assert "".join(feed(sse("[DONE]") + sse(chunk("late"))).text) == ""
    with pytest.raises(ValueError):
        feed(["data: {not json"])


def test_percentile_and_summary():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 95) == 95.0
    results = [RequestResult(0, 1.0, 0.1, "a b", usage_tokens=4), RequestResult(1, 3.0, 0.3, "c d e"),
               RequestResult(2, 9.0, error="timeout")]  # fmt: skip
    cell = summarize_cell(results, 2.0, lambda text: len(text.split()))
    assert (cell["requests"], cell["ok"], cell["errors"], cell["tokens"], cell["tokens_per_s"]) == (
        3, 2, {"timeout": 1}, 7, 3.5)
    assert (cell["latency_p50_s"], cell["ttft_p50_s"]) == (2.0, pytest.approx(0.2))
    assert "window_tokens_per_s" not in cell  # untimed: the requests do not know when they were sent


def test_the_window_rate_counts_tokens_decoded_within_the_duration():
    """Sent at 0 s (4 tokens decoded 1-3 s: all inside a 4 s window), at 2 s (6 tokens decoded 3-7 s: a quarter
    inside), at 5 s (ends at 6 s: outside); a failed request counts nothing."""
    results = [RequestResult(0, 3.0, 1.0, usage_tokens=4, started_s=0.0),
               RequestResult(1, 5.0, 1.0, usage_tokens=6, started_s=2.0),
               RequestResult(2, 1.0, 0.5, usage_tokens=8, started_s=5.0),
               RequestResult(3, 0.5, error="timeout", started_s=0.0)]  # fmt: skip
    cell = summarize_cell(results, 6.0, len, window_s=4.0)
    assert cell["tokens_per_s"] == pytest.approx(18 / 6.0)
    assert cell["window_tokens_per_s"] == pytest.approx((4 + 6 * 0.25) / 4.0, abs=0.005)  # rounded to 2 places


def cell(system, concurrency, tokens_per_s, temperature=0.0):
    return {"system": system, "temperature": temperature, "concurrency": concurrency, "tokens_per_s": tokens_per_s,
            "requests": 3, "errors": {}, "latency_p50_s": 0.5, "latency_p95_s": 0.9, "ttft_p50_s": None}


CELLS = [cell("inproc", 1, 400.0), cell("ours", 1, 200.0), cell("ours", 8, 300.0), cell("ours-none", 1, 100.0),
         cell("vllm", 1, 400.0), cell("vllm", 8, 150.0), cell("hf", 1, 50.0, temperature=1.0)]


def test_ratios_pair_same_temperature_and_concurrency():
    got = {(r["ours"], r["peer"], r["temperature"], r["concurrency"]): r["ratio"] for r in ratios(CELLS)}
    assert got == {("ours", "vllm", 0.0, 1): 0.5, ("ours", "vllm", 0.0, 8): 2.0, ("ours-none", "vllm", 0.0, 1): 0.25,
                   ("ours", "ours-none", 0.0, 1): 2.0}  # the service's choice over tree none
    assert served_vs_inproc(CELLS) == [{"served": "ours", "inproc": "inproc", "temperature": 0.0,
                                        "served_tokens_per_s": 200.0, "inproc_tokens_per_s": 400.0, "ratio": 0.5,
                                        "same_prompts": False}]  # fmt: skip
    paired = [c | {"paired": True} if c["system"] in ("ours", "inproc") and c["concurrency"] == 1 else c
              for c in CELLS]  # fmt: skip
    assert [r["same_prompts"] for r in served_vs_inproc(paired)] == [True]


def test_the_window_ratios_sit_beside_the_cells_ratios():
    cells = [c | {"window_tokens_per_s": {"ours": 330.0, "vllm": 110.0}[c["system"]]}
             for c in CELLS if c["system"] in ("ours", "vllm") and c["concurrency"] == 8]  # fmt: skip
    window = ratios(cells, key="window_tokens_per_s")
    assert window == [{"ours": "ours", "peer": "vllm", "temperature": 0.0, "concurrency": 8, "ratio": 3.0}]
    text = markdown({"cells": cells, "ratios": ratios(cells), "ratios_window": window, "served_vs_inproc": [],
                     "greedy_check": None, "servers": {}})  # fmt: skip
    assert "| ours | vllm | 0 | 8 | 2.00x | 3.00x |" in text and "| 330.0 |" in text


def test_repeated_cells_compare_by_their_medians(tmp_path):
    cells = [cell("ours", 8, v) | {"repeat": i} for i, v in enumerate((300.0, 900.0, 330.0))]
    cells += [cell("vllm", 8, v) | {"repeat": i} for i, v in enumerate((150.0, 100.0))]
    assert rates(cells) == {("ours", 0.0, 8): 330.0, ("vllm", 0.0, 8): 125.0}
    assert ratios(cells) == [{"ours": "ours", "peer": "vllm", "temperature": 0.0, "concurrency": 8, "ratio": 2.64}]
    assert ratios(cells, key="window_tokens_per_s") == []  # no cell has that rate
    result = {"cells": cells, "ratios": ratios(cells), "served_vs_inproc": [], "greedy_check": None, "servers": {}}
    assert "medians over each system's repeated cells" in markdown(result)
    assert plot(result, tmp_path / "p.png").stat().st_size > 0
    assert parse_args(["--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_engine_state_is_kept_where_the_server_says_it(monkeypatch):
    speculation = {"drafted_share": 0.25, "cost_weights": {"fixed": 2e-3}}
    asked = []

    def get(url, **kwargs):
        asked.append(url)
        if "down" in url:
            raise httpx.ConnectError("refused")
        engine = {"steps": 7, "speculation": speculation, "running": 0}
        return httpx.Response(200, json={"replicas": {}, "engine": engine})

    monkeypatch.setattr(httpx, "get", get)
    assert engine_state(Endpoint("http://127.0.0.1:1", None)) is None and not asked  # a peer: nothing to ask
    state = engine_state(Endpoint("http://127.0.0.1:1", None, stats="/v1/stats"))
    assert state == {"steps": 7, "speculation": speculation}
    assert asked == ["http://127.0.0.1:1/v1/stats"]
    assert engine_state(Endpoint("http://down:1", None, stats="/v1/stats")) is None


def test_greedy_check_per_cell_against_ours_none():
    texts = {"ours-none c=1": {0: ["a"]}, "ours-none c=8": {0: ["a"], 1: ["b"]},
             "vllm c=1": {0: ["a"], 1: ["x"], 2: ["only vllm ran it"]}, "ours c=8": {1: ["b", "b"]}}
    cells = greedy_check(texts)["cells"]
    assert (cells["vllm c=1"]["compared"], cells["vllm c=1"]["mismatched"]) == (2, 1)
    assert cells["vllm c=1"]["first"] == [{"prompt": 1, "expected": "b", "got": "x"}]
    assert [cells[k]["mismatched"] for k in ("ours c=8", "ours-none c=1", "ours-none c=8")] == [0, 0, 0]
    # the reference's own cells: prompt 0 again at 8 is a batch-invariance check; a text is never its own check
    assert [cells[k]["compared"] for k in ("ours c=8", "ours-none c=1", "ours-none c=8")] == [2, 0, 1]
    fresh = greedy_check({"ours-none c=1": {0: ["a"]}, "ours-none c=8": {1: ["b"]}, "ours c=1": {2: ["c"]}})["cells"]
    assert [fresh[k]["compared"] for k in ("ours-none c=1", "ours-none c=8", "ours c=1")] == [0, 0, 0]
    twice = greedy_check({"ours-none c=1": {0: ["a", "a2"]}})["cells"]["ours-none c=1"]
    assert (twice["compared"], twice["mismatched"]) == (1, 1)  # the same prompt twice in one cell: checked
    assert "error" in greedy_check({"vllm c=1": {0: ["a"]}})


def test_greedy_check_falls_back_to_the_in_process_loop():
    """Prompts ours-none never ran (the paired concurrency-1 blocks of the drafting systems) are checked against the
    in-process loop's text; ours-none's text wins where both ran the prompt."""
    texts = {"ours-none c=8": {0: ["a"]}, "inproc-none c=1": {0: ["not the reference here"], 1: ["b"]},
             "inproc c=1": {2: ["c"]}, "ours c=1": {1: ["b"], 2: ["wrong"]}, "vllm c=1": {0: ["a"], 3: ["unchecked"]}}
    cells = greedy_check(texts)["cells"]
    assert (cells["ours c=1"]["compared"], cells["ours c=1"]["mismatched"]) == (2, 1)
    assert cells["ours c=1"]["first"] == [{"prompt": 2, "expected": "c", "got": "wrong"}]
    assert (cells["inproc-none c=1"]["compared"], cells["inproc-none c=1"]["mismatched"]) == (1, 1)  # not "b": its own
    assert (cells["vllm c=1"]["compared"], cells["vllm c=1"]["mismatched"]) == (1, 0)


def test_markdown_table():
    result = {"cells": CELLS, "ratios": ratios(CELLS), "served_vs_inproc": served_vs_inproc(CELLS),
              "greedy_check": greedy_check({"ours-none c=1": {0: ["a"]}, "vllm c=1": {0: ["b"]}}),
              "servers": {"vllm": {"status": "ok"}, "hf": {"status": "unavailable", "reason": "did not start"}}}
    table = markdown(result)
    assert "| vllm | 0 | 1 | 3 | 0 | 400.0 | - | 500 | 900 | - | 1/1 |" in table  # no window rate: untimed cells
    assert "| hf | 1 | 1 | 3 | 0 | 50.0 | - | 500 | 900 | - | - |" in table
    assert "| ours | vllm | 0 | 8 | 2.00x |" in table
    assert "| ours (concurrency 1) | inproc | 0 | 200.0 | 400.0 | 0.50x | different |" in table
    assert "- hf: unavailable (did not start)" in table


def test_prompts_are_deterministic_held_out_code():
    first, again, other = select_prompts(8, seed=3), select_prompts(8, seed=3), select_prompts(8, seed=4)
    assert first == again and first != other
    assert len(first) == 8 and len(set(first)) == 8 and all("<|endoftext|>" not in p for p in first)


@pytest.mark.parametrize("fresh", [False, True])
def test_cells_start_at_the_first_prompt_unless_fresh_prompts(fresh, capsys):
    """Every cell sends the same prompts in the same order (prefix caches hit across cells), or with --fresh-prompts
    each goes on where the last stopped (no prompt twice: no hits), with a warning when --prompts runs out."""
    args = parse_args(["--prompts", "100"] + (["--fresh-prompts"] if fresh else []))
    starts = []
    for sent in (40, 50, 30):
        starts.append(first_prompt(args))
        used(args, sent)
    assert starts == ([0, 40, 90] if fresh else [0, 0, 0])
    assert ("120 prompts sent, more than --prompts 100" in capsys.readouterr().out) == fresh


def test_paired_blocks_are_shared_by_twins_and_never_by_one_server():
    """--paired-c1: a served system and its in-process twin run the same prompts at concurrency 1; each tree mode,
    temperature and repeat has a block of its own at the end of the list (one server never sees a prompt twice, or its
    prefix cache would hit); other cells stay timed; and the fresh cells are warned before they reach the blocks."""
    args = parse_args(["--prompts", "100", "--paired-c1", "5", "--repeats", "2", "--temperatures", "0,1",
                       "--fresh-prompts"])  # fmt: skip
    assert args.paired_reserved == 2 * 2 * 2 * 5
    blocks = {}
    for system in ("ours", "inproc", "ours-none", "inproc-none"):
        for temperature in (0.0, 1.0):
            for repeat in (0, 1):
                blocks[system, temperature, repeat] = paired_prompts(args, system, temperature, repeat, 1)
    for (system, temperature, repeat), block in blocks.items():
        assert len(block) == 5 and min(block) >= 100 - 40 and max(block) < 100
        twin = {"ours": "inproc", "inproc": "ours", "ours-none": "inproc-none", "inproc-none": "ours-none"}[system]
        assert block == blocks[twin, temperature, repeat]
    distinct = {tuple(b) for b in blocks.values()}
    assert len(distinct) == 8 and len(set().union(*distinct)) == 40
    assert paired_prompts(args, "ours", 0.0, 0, 8) is None and paired_prompts(args, "vllm", 0.0, 0, 1) is None
    assert paired_prompts(parse_args(["--prompts", "100"]), "ours", 0.0, 0, 1) is None
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "100", "--paired-c1", "25", "--temperatures", "0,1"])  # 100 set aside


def test_paired_cells_send_their_prompts_untimed(monkeypatch, capsys):
    """A paired cell sends exactly its prompts, whatever the duration, and leaves the fresh prompts' count alone; a
    timed cell goes on where the last stopped."""
    sent = []

    async def fake_stream(client, url, body, index, timeout_s):
        sent.append(index)
        await asyncio.sleep(0)
        return RequestResult(index, 0.01, text=body["prompt"])

    monkeypatch.setattr(serve_peers, "stream_one", fake_stream)
    args = parse_args(["--prompts", "20", "--paired-c1", "3", "--temperatures", "0", "--fresh-prompts",
                       "--duration", "0.05"])  # fmt: skip
    prompts = [f"p{i}" for i in range(20)]
    endpoint = Endpoint("http://127.0.0.1:1", None)
    results, _ = asyncio.run(closed_loop(endpoint, prompts, {}, 1, 0.0, args, indices=[17, 18, 19]))
    assert sent == [17, 18, 19] and [r.text for r in results] == ["p17", "p18", "p19"] and args.prompts_sent == 0
    sent.clear()
    asyncio.run(closed_loop(endpoint, prompts, {}, 2, 0.0, args, max_requests=5))
    assert sorted(sent) == [0, 1, 2, 3, 4] and args.prompts_sent == 5
    used(args, 10)  # 15 sent: past the 14 not set aside
    assert "6 of them set aside for --paired-c1" in capsys.readouterr().out
