"""Running the CLI in process: its exit code and what it printed."""

from __future__ import annotations

from ray_specdec.cli import main


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err
