"""The KV budget against the device (ray_specdec/kv_sizing.py): GiB and "auto" as rows, a budget the device cannot
hold refused at start with one line naming what fits (CLI, load_engine, the app's arguments, the engine replica), and
tensor-parallel shares checked per device on GPUs."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from pydantic import ValidationError

from deployments.app import AppArgs
from ray_specdec.engine import kv_sizing
from ray_specdec.engine.kv_sizing import AUTO_SHARE, GIB, device_room, fitted_kv_budget, kv_budget_rows
from ray_specdec.engine.config import EngineConfig, add_engine_arguments
from ray_specdec.engine.scheduler_config import SchedulerConfig
from ray_specdec.factory import LoadError, load_engine
from tests.helpers.cli import run_cli


def test_gib_and_auto_become_rows_and_rows_pass_through():
    assert fitted_kv_budget(4096, None, 1024, room=None) == 4096  # unchecked where the room is unknown
    assert fitted_kv_budget(4096, 1.0, 1024, room=None) == GIB // 1024
    assert fitted_kv_budget(4096, "auto", 1000, room=10_000_000) == math.floor(AUTO_SHARE * 10_000_000 / 1000)
    # four GPUs, each with its own room, each holding a quarter of every row
    assert fitted_kv_budget(1, "auto", 1000, room=10_000_000, shards=4) == math.floor(AUTO_SHARE * 40_000_000 / 1000)
    assert fitted_kv_budget(4096, None, 1024, room=4096 * 1024) == 4096  # exactly fits


def test_a_budget_the_device_cannot_hold_is_one_line_naming_what_fits():
    with pytest.raises(ValueError) as e:
        fitted_kv_budget(1, 2.0, 1024, room=GIB)
    message = str(e.value)
    assert "\n" not in message and "does not fit" in message and "1.00 GiB free" in message
    assert f"kv_budget_gib {AUTO_SHARE:.2f} or less" in message
    with pytest.raises(ValueError, match="does not fit"):
        fitted_kv_budget(GIB // 1024 + 1, None, 1024, room=GIB)  # the rows, too
    with pytest.raises(ValueError, match="per device at tp_size 2"):
        fitted_kv_budget(1, 3.0, 1024, room=GIB, shards=2)  # 1.5 GiB a device
    assert fitted_kv_budget(1, 2.0, 1024, room=GIB, shards=2) == kv_budget_rows(2.0, 1024)  # 1 GiB a device fits


@pytest.mark.parametrize("bad", ["lots", 0, -1.0, float("nan"), float("inf")])
def test_a_budget_that_is_not_a_size_is_refused(bad):
    with pytest.raises(ValueError, match="kv_budget_gib must be"):
        fitted_kv_budget(1, bad, 1024, room=None)


def test_auto_needs_a_device_that_reports_its_memory():
    with pytest.raises(ValueError, match="cannot be read"):
        fitted_kv_budget(1, "auto", 1024, room=None)


def test_the_devices_room(monkeypatch):
    room = device_room("cpu")
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    if kv_sizing.cgroup_room() is not None:  # a container's limit
        available = min(available, kv_sizing.cgroup_room())
    assert room is not None and 0.5 * available < room < 2 * available  # what Linux says, read moments apart
    assert device_room("meta") is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * GIB, 80 * GIB))
    assert device_room("cuda:0") == 7 * GIB  # free, not total


def test_load_engine_sizes_auto_from_the_room_and_refuses_what_does_not_fit(cli_model_dirs, monkeypatch):
    target_dir, _ = cli_model_dirs
    monkeypatch.setattr(kv_sizing, "device_room", lambda device: 3 * GIB)
    engine = load_engine(str(target_dir), "none", kv_budget_gib="auto")
    per_token = engine.target.kv_bytes_per_token
    assert engine.scheduler.config.kv_budget_tokens == math.floor(AUTO_SHARE * 3 * GIB / per_token)
    with pytest.raises(LoadError, match="does not fit"):
        load_engine(str(target_dir), "none", kv_budget_gib=4.0)


def test_the_cli_takes_auto_and_refuses_too_much_in_one_line(cli_model_dirs, built_engines, capsys, monkeypatch):
    target_dir, _ = cli_model_dirs
    monkeypatch.setattr(kv_sizing, "device_room", lambda device: GIB)
    argv = ["generate", "--prompt", "a tree", "--target", str(target_dir), "--drafter", "none", "--max-new-tokens", "3"]
    code, _, err = run_cli(argv + ["--kv-budget-gib", "auto"], capsys)
    assert code == 0, err
    assert built_engines[-1].scheduler.config.kv_budget_tokens == math.floor(
        AUTO_SHARE * GIB / built_engines[-1].target.kv_bytes_per_token)
    code, out, err = run_cli(argv + ["--kv-budget-gib", "2"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "does not fit" in err
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-budget-gib", "plenty"])
    assert "'auto'" in capsys.readouterr().err


def test_the_apps_argument_takes_auto_and_refuses_what_is_not_a_size():
    assert AppArgs(kv_budget_gib="auto").kv_budget_gib == "auto"
    assert AppArgs(kv_budget_gib=1.5).kv_budget_gib == 1.5
    for bad in ("plenty", 0, float("inf")):
        with pytest.raises(ValidationError, match="kv_budget_gib"):
            AppArgs(kv_budget_gib=bad)


def cgroup_tree(tmp_path, self_cgroup: str, files: dict[str, str]):
    """A fake /sys/fs/cgroup (files by path under it) and /proc/self/cgroup."""
    for name, text in files.items():
        (tmp_path / "cg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cg" / name).write_text(text)
    (tmp_path / "self").write_text(self_cgroup)
    return str(tmp_path / "cg"), str(tmp_path / "self")


def test_a_containers_cgroup_v2_limit_bounds_the_room(tmp_path):
    root, me = cgroup_tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/ctr/memory.max": f"{8 * GIB}\n", "kubepods/pod1/ctr/memory.current": f"{3 * GIB}\n",
        "kubepods/pod1/ctr/memory.stat": f"anon 100\ninactive_file {GIB}\nactive_file 5\n"})
    assert kv_sizing.cgroup_room(root, me) == 6 * GIB  # 8 - 3, the inactive page cache counted free


def test_a_cgroup_seen_as_the_root_and_v1(tmp_path):
    # a container's namespace shows its own cgroup at the root, whatever /proc/self/cgroup names
    root, me = cgroup_tree(tmp_path, "0::/elsewhere\n", {"memory.max": f"{4 * GIB}", "memory.current": f"{GIB}"})
    assert kv_sizing.cgroup_room(root, me) == 3 * GIB
    root, me = cgroup_tree(tmp_path / "v1", "4:memory:/docker/abc\n3:cpu:/docker/abc\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{2 * GIB}", "memory/docker/abc/memory.usage_in_bytes": f"{GIB}",
        "memory/docker/abc/memory.stat": "total_inactive_file 1024\n"})
    assert kv_sizing.cgroup_room(root, me) == GIB + 1024


@pytest.mark.parametrize("limit", ["max", str(9223372036854771712)])
def test_no_cgroup_limit_leaves_the_room_to_meminfo(tmp_path, limit, monkeypatch):
    root, me = cgroup_tree(tmp_path, "0::/\n", {"memory.max": limit, "memory.current": "5"})
    assert kv_sizing.cgroup_room(root, me) is None
    assert kv_sizing.cgroup_room(str(tmp_path / "missing"), me) is None
    monkeypatch.setattr(kv_sizing, "cgroup_room", lambda: GIB)
    assert device_room("cpu") == min(GIB, kv_sizing._mem_available())  # the tighter of the two


def test_the_default_budget_shrinks_to_the_device_and_a_chosen_one_does_not(cli_model_dirs, monkeypatch, caplog):
    """A 7B model's KV at the default 131,072 rows is ~64 GiB: `generate` on a smaller machine should run, not fail
    on a budget nobody chose. A budget someone chose still fails where it does not fit."""
    target_dir, _ = cli_model_dirs
    monkeypatch.setattr(kv_sizing, "device_room", lambda device: 1 << 20)  # 1 MiB free
    engine = load_engine(str(target_dir), "none")
    per_token = engine.target.kv_bytes_per_token
    assert SchedulerConfig().kv_budget_tokens * per_token > 1 << 20  # the default does not fit
    assert engine.scheduler.config.kv_budget_tokens == math.floor(AUTO_SHARE * (1 << 20) / per_token)
    assert "the default KV budget" in caplog.text
    with pytest.raises(LoadError, match="does not fit"):
        load_engine(str(target_dir), "none", config=EngineConfig(scheduler=SchedulerConfig(kv_budget_tokens=100_000)))
    with pytest.raises(ValueError, match="does not fit"):
        fitted_kv_budget(1, 1.0, 1024, room=1 << 20, given=False)  # GiB are always chosen
