"""Long-context QA traffic: prompts of about 1k/2k/4k/8k tokens built from local Python source, with known answers.

Each item is a window of source files (by default the running interpreter's standard library) followed by a question
whose answer is in the window, e.g. "Q: In the file `json/decoder.py` above, what is the default value of the
parameter `strict` of `JSONDecoder.__init__`?\\nA:". Facts come from `ast`, so the expected answer (the exact source
text of a default value, a returned expression or a module-level constant) is stored with the item.

Reproducible: item i of bucket b depends only on (seed, b, i), the source files and the token counter. The prompt is
as long as fits the bucket: prompt_tokens <= bucket, short of it by less than a few source lines.
Records (JSONL): {"id", "bucket", "prompt_tokens", "prompt", "question", "answer", "source_files"}.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

DEFAULT_BUCKETS = (1024, 2048, 4096, 8192)
# Tests, vendored packages and data-like modules make poor or huge documents.
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__", "idlelib", "turtledemo", "pydoc_data"})
_MAX_LINE_CHARS = 200  # a window grows line by line: long lines would make the token budget coarse
_MAX_ANSWER_CHARS = 60
_TRIVIAL_ANSWERS = frozenset({"None", "True", "False"})  # too common to show that the answer was found
_CHARS_PER_TOKEN_MAX = 8  # generous: gather this many characters per budget token before trimming

TokenCounter = Callable[[str], int]


def token_counter(tokenizer: Any) -> TokenCounter:
    """A token counter from an HF tokenizer (or a `tokenizers.Tokenizer`), or a callable text -> count as is."""
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"expected a tokenizer with .encode or a callable counting tokens, got {type(tokenizer).__name__}")


@dataclass(frozen=True)
class Fact:
    question: str  # without the file reference, e.g. "what does `f` return?"
    answer: str  # exact source text, one line
    first_line: int  # 0-based lines of the file that hold the fact (def line through the answer)
    last_line: int


@dataclass(frozen=True)
class SourceFile:
    root: str
    path: str  # relative to the root, posix style
    lines: tuple[str, ...]

    @property
    def facts(self) -> tuple[Fact, ...]:
        return _facts(self.root, self.path)


def _segment(lines: Sequence[str], node: ast.expr) -> str | None:
    """Source text of a one-line node (ast column offsets count utf-8 bytes); None if multi-line, long or trivial."""
    if node.end_lineno != node.lineno:
        return None
    text = lines[node.lineno - 1].encode()[node.col_offset : node.end_col_offset].decode()
    return text if 0 < len(text) <= _MAX_ANSWER_CHARS and text not in _TRIVIAL_ANSWERS else None


def _returns(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Return]:
    """Return statements of `func` itself, not of functions, lambdas or classes nested in it."""
    found, stack = [], list(func.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return found


def _function_facts(
    lines: Sequence[str], func: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str
) -> Iterator[Fact]:
    args = func.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(arg, d) for arg, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    for arg, default in pairs:
        answer = _segment(lines, default)
        if answer is not None:
            question = f"what is the default value of the parameter `{arg.arg}` of `{qualname}`?"
            yield Fact(question, answer, func.lineno - 1, default.end_lineno - 1)
    returns = _returns(func)
    if len(returns) == 1 and returns[0].value is not None:
        answer = _segment(lines, returns[0].value)
        if answer is not None:
            yield Fact(f"what expression does `{qualname}` return?", answer, func.lineno - 1, returns[0].end_lineno - 1)


def _constant_facts(lines: Sequence[str], module: ast.Module) -> Iterator[Fact]:
    assigned: dict[str, int] = {}
    for stmt in module.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for target in targets:
            for name in ast.walk(target) if target is not None else ():
                if isinstance(name, ast.Name):
                    assigned[name.id] = assigned.get(name.id, 0) + 1
    for stmt in module.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, answer = stmt.targets[0].id, _segment(lines, stmt.value)
            if answer is not None and assigned[name] == 1:
                question = f"what value is assigned to the module-level name `{name}`?"
                yield Fact(question, answer, stmt.lineno - 1, stmt.end_lineno - 1)


def extract_facts(source: str) -> list[Fact]:
    """Questions with unambiguous answers: functions, methods and module names defined exactly once in the file."""
    module = ast.parse(source)
    functions: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    stack: list[tuple[str, ast.AST]] = [("", module)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    functions.append((qualname, child))
                stack.append((qualname + ".", child))
    names = [q for q, _ in functions]
    lines = source.splitlines()
    facts = list(_constant_facts(lines, module))
    for qualname, func in functions:
        if names.count(qualname) == 1:
            facts.extend(_function_facts(lines, func, qualname))
    return sorted(facts, key=lambda f: (f.first_line, f.question))


@lru_cache(maxsize=4096)
def _read_source(root: str, rel: str) -> SourceFile | None:
    """A usable document (utf-8, no long lines); None otherwise."""
    try:
        lines = tuple((Path(root) / rel).read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError):
        return None
    if not lines or max(map(len, lines)) > _MAX_LINE_CHARS:
        return None
    return SourceFile(root, rel, lines)


@lru_cache(maxsize=4096)
def _facts(root: str, rel: str) -> tuple[Fact, ...]:
    try:
        return tuple(extract_facts((Path(root) / rel).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ()


def list_sources(root: str | os.PathLike) -> list[str]:
    """Relative paths of the .py files under `root`, sorted (the order seeds index into)."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        rel = Path(directory).relative_to(root)
        found += [(rel / name).as_posix() for name in names if name.endswith(".py")]
    return sorted(found)


class QAGenerator:
    def __init__(
        self,
        count_tokens: TokenCounter,
        source_dir: str | os.PathLike | None = None,
        seed: int = 0,
        include: Callable[[str], bool] | None = None,
    ):
        """include: keep only the files (relative posix paths) it accepts, e.g. `training.corpus.is_heldout` for
        documents the default models never trained on."""
        self.count_tokens = count_tokens
        self.root = str(source_dir if source_dir is not None else sysconfig.get_paths()["stdlib"])
        self.files = [f for f in list_sources(self.root) if include is None or include(f)]
        if len(self.files) < 2:
            raise ValueError(f"need at least two .py files under {self.root}, found {len(self.files)}")
        self.seed = seed

    def _random_file(self, rng: random.Random, exclude: set[str] = frozenset()) -> SourceFile:
        for _ in range(10 * len(self.files)):
            rel = rng.choice(self.files)
            doc = _read_source(self.root, rel) if rel not in exclude else None
            if doc is not None:
                return doc
        raise ValueError(f"not enough usable source files under {self.root}")

    def item(self, bucket: int, index: int) -> dict[str, Any]:
        rng = random.Random(f"{self.seed}:{bucket}:{index}")  # str seeds are hashed deterministically
        for _ in range(100):
            doc = self._random_file(rng)
            if not doc.facts:
                continue
            fact = rng.choice(doc.facts)
            built = self._build(rng, bucket, doc, fact)
            if built is not None:
                prompt, n_tokens, files = built
                question = f"In the file `{doc.path}` above, {fact.question}"
                item_id = f"qa-s{self.seed}-{bucket}-{index:05d}"
                return {"id": item_id, "bucket": bucket, "prompt_tokens": n_tokens, "prompt": prompt,
                        "question": question, "answer": fact.answer, "source_files": files}  # fmt: skip
        raise ValueError(f"could not build a {bucket}-token item from {self.root}")

    def _build(self, rng: random.Random, budget: int, doc: SourceFile, fact: Fact):
        """(prompt, tokens, files) of the longest window around the fact that fits; None if the fact alone does not."""
        question = f"\n\nQ: In the file `{doc.path}` above, {fact.question}\nA:"
        fillers: list[SourceFile] = []
        want_chars = _CHARS_PER_TOKEN_MAX * budget
        while True:
            pos = rng.randint(0, len(fillers))
            files = [*fillers[:pos], doc, *fillers[pos:]]
            offset = sum(len(f.lines) for f in fillers[:pos])
            lines = [(f.path, line) for f in files for line in f.lines]
            window = _Window(lines, offset + fact.first_line, offset + fact.last_line, rng.random())

            def fits(n: int) -> bool:
                return self.count_tokens(window.render(n) + question) <= budget

            if not fits(window.span):
                return None
            if not fits(len(lines)):
                n = _largest(window.span, len(lines), fits)
                text = window.render(n) + question
                return text, self.count_tokens(text), window.files(n)
            used = {f.path for f in files}
            while sum(len("\n".join(f.lines)) for f in fillers) < want_chars:
                fillers.append(self._random_file(rng, exclude=used))
                used.add(fillers[-1].path)
            want_chars *= 2


class _Window:
    """Windows of n consecutive lines that contain lines [first, last], the fact at relative position `where`."""

    def __init__(self, lines: list[tuple[str, str]], first: int, last: int, where: float):
        self.lines, self.first, self.span, self.where = lines, first, last - first + 1, where

    def bounds(self, n: int) -> tuple[int, int]:
        start = self.first - round(self.where * (n - self.span))
        start = min(max(start, 0), len(self.lines) - n)
        return start, start + n

    def render(self, n: int) -> str:
        start, end = self.bounds(n)
        out, current = [], None
        for path, line in self.lines[start:end]:
            if path != current:
                out.append(f"### File: {path}")
                current = path
            out.append(line)
        return "\n".join(out)

    def files(self, n: int) -> list[str]:
        start, end = self.bounds(n)
        return list(dict.fromkeys(path for path, _ in self.lines[start:end]))


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """Largest n in [lo, hi] with fits(n), given fits(lo) and monotone fits."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def generate(
    count_tokens: TokenCounter,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    per_bucket: int = 10,
    seed: int = 0,
    source_dir: str | os.PathLike | None = None,
    progress: bool = False,
    include: Callable[[str], bool] | None = None,
) -> Iterator[dict[str, Any]]:
    from tqdm import tqdm

    gen = QAGenerator(count_tokens, source_dir, seed, include)
    keys = [(bucket, i) for bucket in buckets for i in range(per_bucket)]
    for bucket, i in tqdm(keys, desc="qa-traffic", unit="prompt", disable=not progress):
        yield gen.item(bucket, i)


def write_jsonl(items: Iterator[dict[str, Any]], path: str | os.PathLike) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
            n += 1
    return n


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _UsageError(message)


def _default_tokenizer() -> Any:
    try:
        from ray_specdec.defaults import DEFAULT_TARGET
    except ImportError:
        raise _UsageError("no default model in this install; pass --tokenizer PATH") from None
    return _load_tokenizer(DEFAULT_TARGET)


def _load_tokenizer(path: str | os.PathLike) -> Any:
    from ray_specdec.models.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise _UsageError(f"cannot load a tokenizer from {path}: {exc}".splitlines()[0]) from None
    if tokenizer is None:
        raise _UsageError(f"no tokenizer files in {path}; pass --tokenizer PATH")
    return tokenizer


def _parse_buckets(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise _UsageError(f"--buckets must be comma-separated token counts, got {text!r}") from None
    if not buckets or min(buckets) < 64:
        raise _UsageError(f"--buckets must be token counts >= 64, got {text!r}")
    return buckets


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="ray_specdec qa-traffic", description="Write long-context QA prompts as JSONL.")
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--per-bucket", type=int, default=10, help="prompts per bucket")
    parser.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)), help="token budgets, e.g. 1024,2048")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="model or tokenizer directory (default: the embedded default model's)")
    parser.add_argument("--source-dir", help="directory of .py files to draw documents from (default: the stdlib)")
    try:
        args = parser.parse_args(argv)
        buckets = _parse_buckets(args.buckets)
        if args.per_bucket < 1:
            raise _UsageError(f"--per-bucket must be >= 1, got {args.per_bucket}")
        if args.source_dir is not None and not Path(args.source_dir).is_dir():
            raise _UsageError(f"--source-dir {args.source_dir} is not a directory")
        tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else _default_tokenizer()
        items = generate(token_counter(tokenizer), buckets, args.per_bucket, args.seed, args.source_dir, True)
        n = write_jsonl(items, args.out)
    except _UsageError as exc:
        print(f"qa-traffic: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"qa-traffic: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} prompts to {args.out}")
    return 0
