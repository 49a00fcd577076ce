"""The load test client against a small fake completion server on 127.0.0.1 (ephemeral port, in a thread).

The fake server reads directives from the prompt: "sleep=S" (seconds before the first token), "status=C" (answer with
HTTP status C), "mal=A" (reported mean accepted length), "rounds=R", "garbage" (a non-JSON body). Its /v1/stats
reports replica counts as the app's does: "target" 1, "drafter" 2 while more than one request is in flight, else 1.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ray_specdec.tools.loadtest import (SOAK_COPIES, SOAK_TEMPERATURE, SOAK_TOP_P, LoadTestConfig, check_loopback, main,
                                        percentiles, request_body, run_loadtest)

TOKEN_DELAY_S = 0.002


def _directives(prompt: str) -> dict[str, str]:
    return dict(part.split("=", 1) if "=" in part else (part, "") for part in prompt.split())


def _speculative(d: dict[str, str]) -> dict:
    return {"rounds": int(d.get("rounds", 4)), "mean_accepted_length": float(d.get("mal", 2.0))}


TEMPERATURES_SEEN: list[float] = []
BODIES_SEEN: list[dict] = []
STATS_READS: list[int] = []


def fake_app() -> Starlette:
    in_flight = [0]

    async def completions(request: Request):
        body = await request.json()
        TEMPERATURES_SEEN.append(body.get("temperature"))
        BODIES_SEEN.append(body)
        d, n = _directives(body["prompt"]), body["max_tokens"]
        if "status" in d:
            return JSONResponse({"error": "busy"}, status_code=int(d["status"]))
        if "garbage" in d:
            return PlainTextResponse("not json")
        in_flight[0] += 1
        try:
            await asyncio.sleep(float(d.get("sleep", 0)))
        finally:
            in_flight[0] -= 1
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if not body.get("stream"):
            choice = {"index": 0, "text": "x" * n, "finish_reason": "length", "token_ids": list(range(n))}
            return JSONResponse({"choices": [choice], "usage": usage, "speculative": _speculative(d)})

        async def events():
            for i in range(n):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x', 'token_ids': [i]}]})}\n\n"
                await asyncio.sleep(TOKEN_DELAY_S)
            final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
            yield f"data: {json.dumps(final | {'speculative': _speculative(d)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def stats(request: Request):
        STATS_READS.append(1)  # the engine's memory grows by 1 MiB a read
        engine = {"replica": "r1", "rss_bytes": (100 + len(STATS_READS)) * 2**20}
        return JSONResponse({"replicas": {"drafter": 2 if in_flight[0] > 1 else 1, "target": 1}, "engine": engine})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/stats", stats)])


@pytest.fixture(scope="module")
def server_url():
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def run(config: LoadTestConfig, reader=None) -> dict:
    return asyncio.run(run_loadtest(config, reader))


def test_percentiles_are_linear_interpolation():
    stats = percentiles([float(v) for v in range(1, 101)])
    assert stats == {"mean": 50.5, "p50": 50.5, "p95": pytest.approx(95.05), "p99": pytest.approx(99.01), "max": 100.0}
    assert percentiles([]) is None


@pytest.mark.parametrize("url", ["http://localhost:8000/", "http://127.0.0.1:1", "http://127.9.8.7", "http://[::1]:80"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url", ["http://example.com:8000", "http://10.1.2.3:8000", "http://[2001:db8::1]:80", "http://0.0.0.0:8000",
            "ftp://127.0.0.1", "http://127.0.0.1.example.com"]  # fmt: skip
)
def test_non_loopback_urls_are_refused_with_exit_2(url, capsys, tmp_path):
    assert main(["--url", url, "--duration", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loadtest: error:") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_counts_latency_percentiles_and_accepted_length(server_url):
    # 18 fast requests, 2 slow ones: p50 is the fast latency, p99 the slow one.
    prompts = ("sleep=0.05 mal=2.0 rounds=1",) * 9 + ("sleep=0.4 mal=4.0 rounds=3",)
    config = LoadTestConfig(server_url, concurrency=4, duration_s=30, max_requests=20, prompts=prompts, max_tokens=5)
    report = run(config)
    assert report["requests"] == {"total": 20, "ok": 20, "errors": 0}
    assert report["completion_tokens"] == 100
    lat = report["latency_s"]
    assert 0.05 <= lat["p50"] < 0.2
    assert 0.4 <= lat["p99"] <= lat["max"] < 0.6
    assert lat["p95"] > lat["p50"]
    assert report["mean_accepted_length"] == pytest.approx((18 * 2.0 * 1 + 2 * 4.0 * 3) / (18 + 6))
    assert report["ttft_s"] is None  # not streaming
    assert report["throughput"]["tokens_per_s"] == pytest.approx(100 / report["wall_s"])
    assert sum(b["requests"] for b in report["timeline"]) == 20


def test_temperature_is_sent_with_every_request(server_url):
    TEMPERATURES_SEEN.clear()
    report = run(LoadTestConfig(server_url, max_requests=3, prompts=("a",), max_tokens=2, temperature=0.7))
    assert TEMPERATURES_SEEN == [0.7] * 3 and report["config"]["temperature"] == 0.7
    TEMPERATURES_SEEN.clear()
    run(LoadTestConfig(server_url, max_requests=1, prompts=("a",), max_tokens=2))
    assert TEMPERATURES_SEEN == [0.0]  # greedy unless asked


def test_streaming_measures_time_to_first_token(server_url):
    config = LoadTestConfig(server_url, 2, 30, 6, ("sleep=0.1 mal=3.5",), max_tokens=20, stream=True)
    report = run(config)
    assert report["requests"]["ok"] == 6 and report["completion_tokens"] == 120
    assert 0.1 <= report["ttft_s"]["p50"] < 0.25
    for r in report["requests_log"]:
        assert r["latency_s"] >= r["ttft_s"] + 19 * TOKEN_DELAY_S
    assert report["mean_accepted_length"] == pytest.approx(3.5)


def test_errors_are_counted_by_kind(server_url):
    prompts = ("sleep=0.01", "status=503", "garbage", "status=503", "sleep=3")
    config = LoadTestConfig(server_url, 5, 30, 10, prompts, max_tokens=2, timeout_s=0.5)
    start = time.monotonic()
    report = run(config)
    assert time.monotonic() - start < 3  # the slow requests were cut at the timeout
    assert report["requests"] == {"total": 10, "ok": 2, "errors": 8}
    assert report["errors"] == {"http_503": 4, "bad_response": 2, "timeout": 2}


def test_connection_refused_is_an_error_kind():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = run(LoadTestConfig(f"http://127.0.0.1:{port}", 2, 30, 4, timeout_s=5))
    assert report["errors"] == {"connect": 4} and report["latency_s"] is None


def test_duration_bounds_the_run_and_replicas_are_sampled(server_url):
    config = LoadTestConfig(server_url, 3, 1.5, prompts=("sleep=0.05",), max_tokens=2, sample_interval_s=0.25)
    report = run(config)
    starts = [r["start_s"] for r in report["requests_log"]]
    assert max(starts) < 1.5 and report["wall_s"] < 2.5
    assert 15 <= report["requests"]["total"] <= 3 * 1.5 / 0.05
    samples = report["replicas"]
    assert len(samples) >= 4 and all(s["replicas"]["target"] == 1 for s in samples)
    assert max(s["replicas"]["drafter"] for s in samples) == 2  # 3 requests in flight


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_injected_replica_reader_is_sampled_and_its_failures_skipped(server_url, kind):
    calls = []

    def read():
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("serve controller busy")
        return {"drafter": len(calls)}

    async def aread():
        return read()

    config = LoadTestConfig(server_url, 1, duration_s=1.0, prompts=("sleep=0.05",), max_tokens=1, sample_interval_s=0.1)
    report = run(config, read if kind == "sync" else aread)
    counts = [s["replicas"]["drafter"] for s in report["replicas"]]
    assert len(calls) >= 5 and counts == list(range(1, len(calls) + 1, 2))[: len(counts)]
    assert np.all(np.diff([s["t"] for s in report["replicas"]]) > 0)


def test_cli_writes_json_and_plots(server_url, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": f"sleep=0.02 mal={i}"}) for i in (2, 3)) + "\n")
    out = tmp_path / "out"
    argv = ["--url", server_url, "--concurrency", "2", "--duration", "10", "--requests", "8", "--stream",
            "--prompts", str(prompts), "--max-tokens", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "loadtest.json").read_text())
    assert report["requests"]["ok"] == 8 and report["config"]["stream"] is True
    assert report["mean_accepted_length"] == pytest.approx(2.5)
    for name in ("latency.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "8/8 ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [(["--concurrency", "0"], "concurrency"), (["--prompts", "/nonexistent.jsonl"], "cannot read prompts"),
     (["--duration", "x"], "invalid float"), (["--temperature", "-1"], "temperature must be in [0, 2]")],  # fmt: skip
)
def test_cli_rejects_bad_input(argv, message, capsys):
    assert main(["--url", "http://127.0.0.1:1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_soak_mixes_greedy_and_sampled_requests_of_three_lengths_and_never_repeats_a_prompt(server_url):
    config = LoadTestConfig(server_url, prompts=("a b",), mix=True)
    bodies = [request_body(config, i) for i in range(12)]
    assert [b["temperature"] for b in bodies] == [0.0, SOAK_TEMPERATURE] * 6
    assert all(b["top_p"] == SOAK_TOP_P for b in bodies[1::2]) and all("top_p" not in b for b in bodies[::2])
    words = [len(b["prompt"].split()) - 1 for b in bodies]  # behind the request's number
    assert words == [2 * c for c in SOAK_COPIES for _ in range(2)] * 2
    assert len({b["prompt"] for b in bodies}) == len(bodies)


def test_cli_soak_samples_the_engines_memory_and_writes_csv_and_plot(server_url, tmp_path, capsys):
    out = tmp_path / "soak"
    BODIES_SEEN.clear()
    argv = ["--url", server_url, "--soak", "--duration", "1.2", "--memory-interval", "0.25", "--prompts",
            str(_prompts(tmp_path)), "--max-tokens", "3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "loadtest.json").read_text())
    assert report["config"]["concurrency"] == 8 and report["config"]["stream"] and report["errors"] == {}
    assert {b["temperature"] for b in BODIES_SEEN} == {0.0, SOAK_TEMPERATURE}
    samples = report["memory_samples"]
    assert len(samples) >= 4 and np.all(np.diff([m["rss_bytes"] for m in samples]) > 0)
    memory, mib = report["memory"], [m["rss_bytes"] / 2**20 for m in samples]
    assert (memory["first_mib"], memory["last_mib"], memory["max_mib"]) == (mib[0], mib[-1], mib[-1])
    assert memory["growth_first_half_mib"] + memory["growth_second_half_mib"] == mib[-1] - mib[0]
    assert memory["growth_first_half_mib"] > 0 and memory["growth_second_half_mib"] > 0
    rows = (out / "soak.csv").read_text().splitlines()
    assert rows[0] == "t_s,replica,rss_mib,requests_ok,errors,tokens_per_s" and len(rows) == len(samples) + 1
    assert sum(int(r.split(",")[3]) for r in rows[1:]) == report["requests"]["ok"]  # every request in one interval
    data = (out / "soak.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "engine memory" in capsys.readouterr().out


def _prompts(tmp_path):
    path = tmp_path / "soak_prompts.jsonl"
    path.write_text(json.dumps({"prompt": "sleep=0.02"}) + "\n")
    return path


def _max_overlap(requests: list[dict]) -> int:
    """The most of these requests in flight at once."""
    events = sorted([(r["start_s"], 1) for r in requests] + [(r["start_s"] + r["latency_s"], -1) for r in requests])
    return int(max(np.cumsum([e for _, e in events]), default=0))


def test_ramp_runs_its_phases_in_order_and_reports_each(server_url, tmp_path, capsys):
    out = tmp_path / "ramp"
    argv = ["--url", server_url, "--ramp", "1,4,2", "--phase-seconds", "0.5", "--sample-interval", "0.1",
            "--max-tokens", "3", "--prompts", str(_prompts(tmp_path)), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "loadtest.json").read_text())
    phases, log = report["phases"], report["requests_log"]
    assert [p["clients"] for p in phases] == [1, 4, 2] and report["config"]["concurrency"] == 4
    for p in phases:
        mine = [r for r in log if r["phase"] == p["phase"]]
        assert all(p["start_s"] <= r["start_s"] < p["end_s"] for r in mine)  # started within the phase
        assert {r["client"] for r in mine} == set(range(p["clients"])) and _max_overlap(mine) == p["clients"]
        assert p["end_s"] - p["start_s"] == pytest.approx(0.5, abs=0.1)
        assert p["requests"] == len(mine) and p["ok"] == len(mine) and p["errors"] == 0
        assert p["tokens_per_s"] == pytest.approx(3 * len(mine) / (p["end_s"] - p["start_s"]))
        assert 0.02 <= p["latency_s"]["p50"] <= p["latency_s"]["p95"] < 0.5
        window = [s["replicas"] for s in report["replicas"]
                  if (p["phase"] == 0 or p["start_s"] <= s["t"]) and (p["phase"] == 2 or s["t"] < p["end_s"])]
        assert p["replicas"]["target"] == {"min": 1, "max": 1}
        assert p["replicas"]["drafter"] == {"min": min(w["drafter"] for w in window),
                                            "max": max(w["drafter"] for w in window)}  # fmt: skip
    assert phases[1]["replicas"]["drafter"]["max"] == 2  # 4 requests in flight
    assert sum(p["requests"] for p in phases) == report["requests"]["total"] == len(log)
    assert sum(p["completion_tokens"] for p in phases) == report["completion_tokens"]
    printed = capsys.readouterr().out
    table = (out / "ramp.md").read_text()
    assert table.splitlines()[0] == ("| phase | clients | requests | errors | tokens/s | p50 latency (ms) | "
                                     "p95 latency (ms) | drafter replicas | target replicas |")  # fmt: skip
    assert len(table.splitlines()) == 5 and table.strip() in printed
    assert table.splitlines()[3].startswith(f"| 1 | 4 | {phases[1]['requests']} | 0 |")
    data = (out / "ramp.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_ramp_counts_errors_and_replica_samples_per_phase():
    calls = []

    def read():  # a deployment whose count rises by one a sample
        calls.append(1)
        return {"drafter": len(calls)}

    with socket.socket() as s:  # nobody listens: every request fails to connect
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LoadTestConfig(f"http://127.0.0.1:{port}", ramp=(2, 1), phase_s=0.4, sample_interval_s=0.05)
    report = run(config, read)
    phases = report["phases"]
    assert report["requests"]["ok"] == 0 and report["errors"] == {"connect": report["requests"]["total"]}
    assert [p["errors"] for p in phases] == [p["requests"] for p in phases] and all(p["errors"] for p in phases)
    assert [p["errors_by_kind"] for p in phases] == [{"connect": p["errors"]} for p in phases]
    assert sum(p["errors"] for p in phases) == report["requests"]["errors"]
    assert phases[0]["latency_s"] is None and phases[0]["tokens_per_s"] == 0
    first, second = phases[0]["replicas"]["drafter"], phases[1]["replicas"]["drafter"]
    assert first["min"] == 1 and second["min"] == first["max"] + 1 and second["max"] == len(report["replicas"])
    assert first["max"] >= 5 and second["max"] - second["min"] >= 5


@pytest.mark.parametrize(
    "argv, message",
    [(["--ramp", ""], "--ramp must be client counts"), (["--ramp", "1,x"], "--ramp must be client counts"),
     (["--ramp", "1,0,2"], "in [1, 1024]"), (["--ramp", "-1"], "in [1, 1024]"), (["--ramp", "2000"], "in [1, 1024]"),
     (["--ramp", "2", "--concurrency", "3"], "drop --concurrency"), (["--ramp", "2", "--soak"], "drop --soak"),
     (["--ramp", "2", "--duration", "9"], "drop --duration"), (["--phase-seconds", "5"], "--phase-seconds needs"),
     (["--ramp", "1,2", "--phase-seconds", "0"], "phase seconds must be > 0")],  # fmt: skip
)
def test_cli_rejects_bad_ramps(argv, message, capsys, tmp_path):
    assert main(["--url", "http://127.0.0.1:1", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loadtest: error:") and message in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())
