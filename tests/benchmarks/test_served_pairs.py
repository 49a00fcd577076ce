"""benchmarks/served_pairs.py: which processes it stops, the block orders and the ratios (the benchmark itself starts
Ray and measures speed, so it is not run here)."""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.served_pairs import (MODES, ORDERS, Frozen, LeanClient, app_processes, main, overall, ratio_rows,
                                     summarize)

STAT = "{pid} (python3 (x)) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 3 0 77 0 0"


def _fake_proc(root: Path, parents: dict[int, int]) -> Path:
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(STAT.format(pid=pid, ppid=ppid))
    (root / "self").mkdir()  # not a process directory: skipped
    return root


def test_app_processes_are_the_root_and_everything_below_it(tmp_path):
    # 10 started Ray (GCS 11, raylet 12); the raylet's workers 13 and 14; 14 started 15. 20 and 21 are not the app's.
    proc = _fake_proc(tmp_path, {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 14: 12, 15: 14, 20: 1, 21: 20})
    assert sorted(app_processes(10, proc)) == [10, 11, 12, 13, 14, 15]
    assert sorted(app_processes(14, proc)) == [14, 15]
    assert app_processes(21, proc) == [21]


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _wait_state(pid: int, wanted: str) -> str:
    deadline = time.monotonic() + 10
    while (state := _state(pid)) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_frozen_stops_a_process_and_its_children_and_resumes_them():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(app_processes(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        family = app_processes(parent.pid)
        assert len(family) == 2
        with Frozen(parent.pid) as frozen:
            assert sorted(frozen.pids) == sorted(family)
            assert [_wait_state(pid, "T") for pid in family] == ["T", "T"]
        assert all(_wait_state(pid, "S") == "S" for pid in family)
    finally:
        for pid in app_processes(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_every_mode_takes_every_place_equally_often_over_six_blocks():
    assert len(ORDERS) == 6 and all(sorted(order) == sorted(MODES) for order in ORDERS)
    for place in range(len(MODES)):
        assert sorted(order[place] for order in ORDERS) == sorted(MODES * 2)


def test_summarize_and_ratios():
    block = [{"seconds": 0.5, "tokens": 64}, {"seconds": 1.5, "tokens": 36}]
    assert summarize(block) == {"tokens_per_s": 50.0, "ms_per_request": 1000.0, "tokens": 100, "seconds": 2.0}

    def blocks(alone, beside, served):
        return {"alone": {"tokens_per_s": alone}, "beside": {"tokens_per_s": beside},
                "served": {"tokens_per_s": served}}  # fmt: skip

    whole = overall([{m: {"tokens": 100, "seconds": 1.0} for m in MODES},
                     {"alone": {"tokens": 300, "seconds": 1.0}, "beside": {"tokens": 100, "seconds": 3.0},
                      "served": {"tokens": 50, "seconds": 1.0}}])  # fmt: skip
    assert whole == {"alone": 200.0, "beside": 50.0, "served": 75.0}
    rows = ratio_rows([blocks(200, 180, 162), blocks(100, 80, 72), blocks(300, 300, 210)])
    assert rows["served/alone"] == {"median": 0.72, "min": 0.7, "max": 0.81}
    assert rows["beside/alone"] == {"median": 0.9, "min": 0.8, "max": 1.0}
    assert rows["served/beside"] == {"median": 0.9, "min": 0.7, "max": 0.9}


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--block", "0"], ["--max-tokens", "0"],
                                  ["--tree", "nonsense"]])  # fmt: skip
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


class _SSE(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, chunked bodies

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "bad":
            self.send_response(400)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"no")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": body["prompt"]}]},
                  {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 3}}]
        payloads = [f"data: {json.dumps(e)}\r\n\r\n" for e in events] + ["data: [DONE]\r\n\r\n"]
        for payload in payloads:
            data = payload.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


def test_lean_client_streams_several_requests_over_one_connection():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = LeanClient(f"http://127.0.0.1:{server.server_address[1]}")
        for prompt in ("bc", "de"):  # the second on the kept-alive connection
            out = client.stream({"prompt": prompt, "stream": True})
            assert out["text"] == "a" + prompt and out["tokens"] == 3
            assert 0 <= out["ttft_s"] <= out["seconds"]
        with pytest.raises(RuntimeError, match="HTTP 400"):
            client.stream({"prompt": "bad"})
    finally:
        server.shutdown()
