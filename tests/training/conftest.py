"""Shared fixtures: a small tokenizer trained on a few stdlib files (seconds, not the full corpus)."""

from __future__ import annotations

import pytest

from ray_specdec.training.corpus import list_sources, read_source
from ray_specdec.training.tokenizer import train_bpe, wrap


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory):
    texts = [read_source(p) for p in list_sources()[:20]]
    path = tmp_path_factory.mktemp("tokenizer")
    wrap(train_bpe(texts, vocab_size=512)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(small_tokenizer_dir)

