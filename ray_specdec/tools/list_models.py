"""`python -m ray_specdec models`: the embedded models (the names --target / --drafter / target= take), with their
architecture, parameters, how each is made and where it lives; grown ones are built on the way unless --no-build."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ray_specdec.cli import OneLineParser
from ray_specdec.defaults import EMBEDDED_MODEL_NAMES, GROWN_MODELS, embedded_model_path, is_built


def parameter_count(directory: Path) -> int:
    """Parameters in a model directory's model.safetensors, read from its header (no weights loaded)."""
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())


def model_rows(build: bool) -> list[dict]:
    """One row per embedded model: name, architecture, parameters (None where not built), how it is made, built,
    directory; grown models are built first where `build`."""
    rows = []
    for name in EMBEDDED_MODEL_NAMES:
        directory = embedded_model_path(name, build=build)
        built = is_built(name)
        config = json.loads((directory / "config.json").read_text()) if built else {}
        rows.append({
            "name": name,
            "architecture": (config.get("architectures") or ["-"])[0] if built else "-",
            "parameters": parameter_count(directory) if built else None,
            "made": f"grown from {GROWN_MODELS[name][0]}" if name in GROWN_MODELS else "shipped",
            "built": built,
            "directory": os.fspath(directory),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """Rows of `model_rows` as an aligned text table."""
    header = ("name", "architecture", "parameters", "made", "built", "directory")
    cells = [header] + [
        (r["name"], r["architecture"], f"{r['parameters'] / 1e6:.1f}M" if r["parameters"] else "-", r["made"],
         "yes" if r["built"] else "no", r["directory"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in cells)


def main(argv: list[str] | None = None) -> int:
    """`python -m ray_specdec models`: list the embedded models, building any grown one not built yet."""
    p = OneLineParser(prog="python -m ray_specdec models",
                      description="List the embedded models (names that --target / --drafter / target= take).")
    p.add_argument("--no-build", action="store_true", help="only list: build no grown model")
    p.add_argument("--json", action="store_true", help="print one JSON object per model, one a line")
    args = p.parse_args(argv)
    rows = model_rows(build=not args.no_build)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_table(rows))
    return 0
