"""The training corpus: the running interpreter's standard library sources, split reproducibly.

A file goes to the held-out split when a hash of its path relative to the stdlib root says so, so the split is the
same on every machine with the same Python version and does not depend on file order. `write_manifest` records
exactly which files (sha256, size) were used. Token streams are files joined with the end-of-text token.

    python -m ray_specdec.training.corpus --manifest docs/corpus_manifest.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Directories left out: tests (huge, repetitive fixtures), vendored or generated code, data tables.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo", "pydoc_data",
    "encodings", "ensurepip", "__pycache__", "__phello__",
})
HELDOUT_PERCENT = 5  # share of files (by path hash) kept out of training


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib .py files used as corpus."""
    return list(_list_sources(root or stdlib_root()))


@functools.lru_cache(maxsize=4)
def _list_sources(root: Path) -> tuple[str, ...]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so excluded trees (site-packages is most of the disk) are never walked.
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        rel_dir = Path(dirpath).relative_to(root)
        paths += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    return tuple(sorted(paths))


def is_heldout(rel_path: str) -> bool:
    """Stable split: the first 8 bytes of sha256(relative path) modulo 100."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def split_sources(paths: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout), each keeping the input order."""
    return [p for p in paths if not is_heldout(p)], [p for p in paths if is_heldout(p)]


def read_source(rel_path: str, root: Path | None = None) -> str:
    # Some stdlib files carry stray non-UTF-8 bytes in comments: keep them visible rather than fail.
    return ((root or stdlib_root()) / rel_path).read_bytes().decode("utf-8", errors="replace")


def read_split(split: str, root: Path | None = None) -> list[str]:
    """Texts of the train or heldout files, in sorted path order."""
    train, heldout = split_sources(list_sources(root))
    return [read_source(p, root) for p in {"train": train, "heldout": heldout}[split]]


def manifest(root: Path | None = None) -> dict:
    """Exactly what the corpus is: python version, split rule and every file with its split, size and sha256."""
    root = root or stdlib_root()
    files = []
    for rel in list_sources(root):
        data = (root / rel).read_bytes()
        files.append({"path": rel, "split": "heldout" if is_heldout(rel) else "train", "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()})
    return {
        "python_version": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "excluded_dirs": sorted(EXCLUDED_DIRS) + ["config-*"],
        "split_rule": f"heldout iff int(sha256(relative_path)[:8 bytes], big-endian) % 100 < {HELDOUT_PERCENT}",
        "n_files": {s: sum(f["split"] == s for f in files) for s in ("train", "heldout")},
        "bytes": {s: sum(f["bytes"] for f in files if f["split"] == s) for s in ("train", "heldout")},
        "files": files,
    }


def write_manifest(path: Path, root: Path | None = None) -> dict:
    data = manifest(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def encode_texts(tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: every text followed by the end-of-text token (where the tokenizer has one).

    uint16 while every id fits (the default family's 4096 tokens), int32 for larger vocabularies.
    """
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.extend(eos)
    return np.asarray(ids, dtype=np.uint16 if len(tokenizer) <= 2**16 else np.int32)


def encode_split(tokenizer, split: str, root: Path | None = None) -> np.ndarray:
    """The token stream of every file of the split (encode_texts)."""
    return encode_texts(tokenizer, read_split(split, root))


@dataclass(frozen=True)
class HeldoutPrompt:
    token_ids: list[int]
    text: str
    offset: int  # position in the held-out token stream


def heldout_prompts(n: int, min_tokens: int, max_tokens: int, seed: int = 0, tokenizer=None) -> list[HeldoutPrompt]:
    """`n` prompts cut from the held-out token stream at random offsets, lengths uniform in [min, max] tokens.

    The tokenizer defaults to the shipped target's. Prompts may cross file boundaries (long-context prompts of
    8k tokens need that); the same seed gives the same prompts.
    """
    if tokenizer is None:
        from transformers import AutoTokenizer

        from ray_specdec.defaults import DEFAULT_TARGET
        tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    stream = encode_split(tokenizer, "heldout")
    if max_tokens >= len(stream) or min_tokens > max_tokens or min_tokens < 1:
        raise ValueError(f"bad prompt lengths [{min_tokens}, {max_tokens}] for {len(stream)} held-out tokens")
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_tokens, max_tokens)
        offset = rng.randrange(0, len(stream) - length)
        ids = stream[offset:offset + length].tolist()
        prompts.append(HeldoutPrompt(token_ids=ids, text=tokenizer.decode(ids), offset=offset))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=Path("docs/corpus_manifest.json"))
    args = parser.parse_args()
    data = write_manifest(args.manifest)
    print(f"python {data['python_version']}: files {data['n_files']}, bytes {data['bytes']} -> {args.manifest}")


if __name__ == "__main__":
    main()
