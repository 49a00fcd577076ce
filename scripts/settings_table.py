"""Write docs/SETTINGS.md: the app's own arguments (`deployments.app.AppOwnArgs`), the engine's settings
(`ray_specdec.engine.config.EngineConfig`: its scheduler, speculation and serving parts) and the environment switches
(`ray_specdec.env`) as Markdown tables, read from their declarations.

Each row's meaning is the field's own documentation where it is declared (`ray_specdec.settings.field_docs`: the
comment on the line that declares it, else the comment lines directly above it). Types, bounds and defaults come from
the live classes, so the tables cannot drift from them.

    python scripts/settings_table.py            # rewrite docs/SETTINGS.md
    python scripts/settings_table.py --check    # exit 1 when docs/SETTINGS.md is not what it would write
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "SETTINGS.md"
sys.path.insert(0, str(ROOT))


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def literal(value) -> str:
    if value is None:
        return "`None`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def pydantic_type(annotation_source: str, info) -> str:
    """The declared type, `Annotated[X, ...]` shown as X, with the field's bounds (ge, gt, le, lt) after it."""
    tree = ast.parse(annotation_source, mode="eval").body

    def show(node) -> str:
        if isinstance(node, ast.BinOp):
            return f"{show(node.left)} \\| {show(node.right)}"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            if node.value.id == "Annotated":
                return show(node.slice.elts[0])
            if node.value.id == "Literal":
                items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                return " \\| ".join(f'"{ast.literal_eval(i)}"' for i in items)
        return ast.unparse(node).replace("|", "\\|")

    bounds = []
    for meta in info.metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, name, None) is not None:
                bounds.append(f"{sign} {getattr(meta, name)}")
    for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):  # bounds inside Annotated[...]
        for sub in ast.walk(tree):
            if isinstance(sub, ast.keyword) and sub.arg == name and f"{sign} {ast.unparse(sub.value)}" not in bounds:
                bounds.append(f"{sign} {ast.unparse(sub.value)}")
    return f"`{show(tree)}`" + (f" ({', '.join(bounds)})" if bounds else "")


def app_table() -> list[str]:
    from deployments.app import AppOwnArgs
    from ray_specdec.settings import field_docs

    source = textwrap.dedent(inspect.getsource(AppOwnArgs))
    annotations = {n.target.id: ast.get_source_segment(source, n.annotation)
                   for n in ast.parse(source).body[0].body
                   if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    docs = field_docs(AppOwnArgs)
    rows = ["| name | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in AppOwnArgs.model_fields.items():
        default = info.default_factory() if info.default_factory is not None else info.default
        meaning = info.description or docs.get(name, "")
        rows.append(f"| `{name}` | {pydantic_type(annotations[name], info)} | {literal(default)} | "
                    f"{cell(meaning) or ' '} |")
    return rows


def part_table(cls, flags: bool) -> list[str]:
    from ray_specdec.settings import field_bounds, field_docs, flag

    docs, defaults = field_docs(cls), cls()
    head = ["name", *(["flag"] if flags else []), "type", "default", "meaning"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for f in dataclasses.fields(cls):
        kind = (f.type if isinstance(f.type, str) else f.type.__name__).replace("|", "\\|")
        bounds = ", ".join(f"{sign} {value}" for name, value in field_bounds(f).items()
                           for key, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if key == name)
        cells = [f"`{f.name}`", *([f"`{flag(f.name)}`"] if flags else []),
                 f"`{kind}`" + (f" ({bounds})" if bounds else ""), literal(getattr(defaults, f.name)),
                 cell(docs.get(f.name, "")) or " "]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def env_table() -> list[str]:
    from ray_specdec import env

    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in env.ALL:
        default = ("on" if var.default else "off") if isinstance(var, env.Switch) else "unset"
        rows.append(f"| `{var.name}` | {default} | {cell(var.doc)} |")
    return rows


def settings_markdown() -> str:
    from ray_specdec.engine.config import PART_CLASSES

    parts = [
        "# Settings",
        "",
        "Generated by `python scripts/settings_table.py` from the declarations of `AppOwnArgs` (`deployments/app.py`), "
        "the parts of `EngineConfig` (`ray_specdec/engine/config.py`) and `ray_specdec/env.py`; edit those, not this "
        "file.",
        "",
        "One `EngineConfig` holds an engine's settings, with one default each: the library (`SpeculativeEngine`), "
        "`python -m ray_specdec generate` and `bench`, and the app use the same. The app's arguments are its own "
        "(below) plus every field of `EngineConfig`'s parts under the field's own name. Set them with `serve run "
        "deployments:app key=value ...` or under `args:` of a Serve config file (`serve_config.yaml`); unknown names "
        "are refused.",
        "",
        "## App arguments",
        "",
        *app_table(),
        "",
        "## Scheduler (`SchedulerConfig`)",
        "",
        "Each field is also a flag of `generate` and `bench`. `--kv-budget-gib GIB|auto` (the app's `kv_budget_gib`) "
        "gives the budget in GiB instead of rows; the app's budget is `kv_budget_gib` unless `kv_budget_tokens` is "
        "given.",
        "",
        *part_table(PART_CLASSES["scheduler"], flags=True),
        "",
        "## Speculation (`SpeculationConfig`)",
        "",
        "Each field is also a flag of `generate` and `bench`.",
        "",
        *part_table(PART_CLASSES["speculation"], flags=True),
        "",
        "## Serving (`ServingConfig`)",
        "",
        *part_table(PART_CLASSES["serving"], flags=False),
        "",
        "## Environment",
        "",
        "Read in `ray_specdec/env.py`. A switch is off where set to 0 / off / false / no, on where set to anything "
        "else.",
        "",
        *env_table(),
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/SETTINGS.md instead of writing it")
    args = parser.parse_args(argv)
    text = settings_markdown()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/settings_table.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
