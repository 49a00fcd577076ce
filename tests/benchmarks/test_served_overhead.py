"""benchmarks/served_overhead.py: its /proc reading and per-process accounting (the benchmark itself starts Ray and
measures speed, so it is not run here)."""

from pathlib import Path

import pytest

from benchmarks.served_overhead import activity, main, process_name, snapshot, thread_counters

# proc(5): pid (comm) state ppid ... utime (14th field) stime (15th)
STAT = "4321 (ray::IDLE (x)) S 1 4321 4321 0 -1 4194560 100 0 0 0 {utime} {stime} 0 0 20 0 3 0 77 0 0"
STATUS = "Name:\tray::IDLE\nvoluntary_ctxt_switches:\t{v}\nnonvoluntary_ctxt_switches:\t{n}\n"


def test_thread_counters_reads_cpu_ticks_and_both_kinds_of_switches():
    # the name holds a space and parentheses: fields are counted from the last ")"
    assert thread_counters(STAT.format(utime=30, stime=12), STATUS.format(v=500, n=7)) == (42, 507)


def test_process_name():
    assert process_name(b"ray::ServeReplica:specdec:engine\0") == "ray::ServeReplica:specdec:engine"
    assert process_name(b"/usr/bin/python3\0-u\0/opt/ray/log_monitor.py\0--x\0") == "python3 log_monitor.py"
    assert process_name(b"/usr/bin/python3\0-m\0benchmarks.x\0") == "python3 -m benchmarks.x"
    assert process_name(b"/opt/ray/raylet\0--log_dir=/var/log/ray\0--x=1\0") == "raylet"
    assert process_name(b"", "kworker/0:1\n") == "[kworker/0:1]"


def _fake_proc(root: Path, threads: dict[int, dict[int, tuple[int, int]]]) -> Path:
    for pid, tasks in threads.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "cmdline").write_bytes(f"ray::P{pid}\0".encode())
        (root / str(pid) / "comm").write_text(f"p{pid}\n")
        for tid, (ticks, switches) in tasks.items():
            task = root / str(pid) / "task" / str(tid)
            task.mkdir(parents=True)
            (task / "stat").write_text(STAT.format(utime=ticks, stime=0))
            (task / "status").write_text(STATUS.format(v=switches, n=0))
    (root / "self").mkdir()  # not a process directory: skipped
    return root


def test_snapshot_reads_every_thread_of_every_process(tmp_path):
    proc = _fake_proc(tmp_path, {10: {10: (5, 100), 11: (1, 40)}, 20: {20: (0, 3)}})
    assert snapshot(proc) == {(10, 10): ("ray::P10", 5, 100), (10, 11): ("ray::P10", 1, 40),
                              (20, 20): ("ray::P20", 0, 3)}  # fmt: skip


def test_activity_sums_threads_per_process_and_sorts_by_wakeups():
    before = {(10, 10): ("a", 100, 1000), (10, 11): ("a", 0, 0), (20, 20): ("b", 50, 10)}
    after = {(10, 10): ("a", 150, 1500), (10, 11): ("a", 10, 300),  # a: 800 switches, 60 ticks in 2 s
             (20, 20): ("b", 50, 4010),  # b: 4000 switches, no CPU
             (20, 21): ("b", 999, 999)}  # a thread that started meanwhile: no baseline, left out  # fmt: skip
    rows = activity(before, after, seconds=2.0, hz=100)
    assert [r["name"] for r in rows] == ["b", "a"]
    assert rows[0] == {"pid": 20, "name": "b", "wakeups_per_s": 2000.0, "cpu_pct": 0.0}
    assert rows[1] == {"pid": 10, "name": "a", "wakeups_per_s": 400.0, "cpu_pct": 30.0}
    with pytest.raises(ValueError):
        activity(before, after, seconds=0.0, hz=100)


@pytest.mark.parametrize("flags", [["--cells", "0"], ["--duration", "0"], ["--concurrency", "0"], ["--tree", "1,x"]])
def test_bad_arguments_fail_before_anything_starts(flags):
    with pytest.raises(SystemExit):
        main(flags)
