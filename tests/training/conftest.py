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


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # Tiny models on a shared 2-core machine: thread hand-offs cost more than the arithmetic.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
