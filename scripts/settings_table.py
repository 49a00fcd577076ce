"""Write docs/SETTINGS.md: the app's arguments (`deployments.app.AppArgs`) and the scheduler's settings
(`ray_specdec.engine.scheduler_config.SchedulerConfig`) as Markdown tables, read from their declarations.

Each row's meaning is the field's own documentation where it is declared: a pydantic `description` or a dataclass
field's `metadata["doc"]` when it has one, else the comment on the line that declares it, else the comment lines
directly above it. Types, constraints and defaults come from the live classes, so the table cannot drift from them.

    python scripts/settings_table.py            # rewrite docs/SETTINGS.md
    python scripts/settings_table.py --check    # exit 1 when docs/SETTINGS.md is not what it would write
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "SETTINGS.md"
sys.path.insert(0, str(ROOT))


def declared_comments(cls) -> dict[str, tuple[str, list[str]]]:
    """Field name -> (comment on its line, comment lines directly above it), from the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = comments.get(node.end_lineno, "") if lines[node.end_lineno - 1].split("#")[0].strip() else ""
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        found[node.target.id] = (trailing, above)
    return found


def comment_meaning(trailing: str, above: list[str]) -> str:
    """The trailing comment; else the block above, less a heading line that opens it (a first line without closing
    punctuation followed by a line that starts a sentence, e.g. "the scheduler of each engine replica (...)")."""
    if trailing:
        return trailing
    if len(above) > 1 and above[1][:1].isupper() and above[0][-1:] not in ".:;,":
        above = above[1:]
    return " ".join(above)


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
    from deployments.app import AppArgs

    source = textwrap.dedent(inspect.getsource(AppArgs))
    annotations = {n.target.id: ast.get_source_segment(source, n.annotation)
                   for n in ast.parse(source).body[0].body
                   if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    comments = declared_comments(AppArgs)
    rows = ["| name | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in AppArgs.model_fields.items():
        default = info.default_factory() if info.default_factory is not None else info.default
        meaning = info.description or comment_meaning(*comments.get(name, ("", [])))
        rows.append(f"| `{name}` | {pydantic_type(annotations[name], info)} | {literal(default)} | "
                    f"{cell(meaning) or ' '} |")
    return rows


def scheduler_table() -> list[str]:
    from ray_specdec.engine.llm import DEFAULT_SCHEDULER
    from ray_specdec.engine.scheduler_config import SchedulerConfig, flag

    comments = declared_comments(SchedulerConfig)
    library = SchedulerConfig()
    rows = ["| name | flag | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(SchedulerConfig):
        ours, lib = getattr(DEFAULT_SCHEDULER, f.name), getattr(library, f.name)
        default = literal(ours) if ours == lib else f"{literal(ours)} (`SchedulerConfig()`: {literal(lib)})"
        meaning = f.metadata.get("doc") or comment_meaning(comments.get(f.name, ("", []))[0], [])
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        rows.append(f"| `{f.name}` | `{flag(f.name)}` | `{kind}` | {default} | {cell(meaning) or ' '} |")
    return rows


def settings_markdown() -> str:
    parts = [
        "# Settings",
        "",
        "Generated by `python scripts/settings_table.py` from the declarations of `AppArgs` (`deployments/app.py`) "
        "and `SchedulerConfig` (`ray_specdec/engine/scheduler_config.py`); edit those, not this file.",
        "",
        "## App arguments",
        "",
        "Set with `serve run deployments:app key=value ...` or under `args:` of a Serve config file "
        "(`serve_config.yaml`). Unknown names are refused.",
        "",
        *app_table(),
        "",
        "## Scheduler",
        "",
        "One `SchedulerConfig` per engine: the app builds it from the arguments of the same names above; "
        "`python -m ray_specdec generate` and `bench` take each field as a flag. The default is the one "
        "`generate`, `bench` and the app use; where the bare dataclass differs it is given after it. "
        "`--kv-budget-gib GIB|auto` gives the budget in GiB instead of rows.",
        "",
        *scheduler_table(),
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
