"""The corpus split is a pure function of relative paths; prompts are reproducible slices of the held-out stream."""

from __future__ import annotations

import hashlib

from ray_specdec.training.corpus import (HELDOUT_PERCENT, encode_split, heldout_prompts, is_heldout, list_sources,
                                         manifest, split_sources)


def test_split_is_deterministic_disjoint_and_complete():
    paths = list_sources()
    train, heldout = split_sources(paths)
    assert split_sources(list_sources()) == (train, heldout)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == paths
    assert 0.5 * HELDOUT_PERCENT < 100 * len(heldout) / len(paths) < 2 * HELDOUT_PERCENT


def test_split_rule_matches_its_definition():
    for path in ["os.py", "json/decoder.py", "asyncio/tasks.py"]:
        value = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") % 100
        assert is_heldout(path) == (value < HELDOUT_PERCENT)


def test_excluded_directories_are_left_out():
    parts = {part for path in list_sources() for part in path.split("/")[:-1]}
    assert not parts & {"test", "tests", "site-packages", "idlelib", "lib2to3"}
    assert "os.py" in list_sources()


def test_manifest_counts_match_file_list():
    data = manifest()
    files = data["files"]
    assert data["n_files"]["heldout"] == sum(f["split"] == "heldout" for f in files)
    assert data["bytes"]["train"] == sum(f["bytes"] for f in files if f["split"] == "train")
    assert all(len(f["sha256"]) == 64 for f in files)


def test_encode_split_joins_files_with_eos(small_tokenizer):
    stream = encode_split(small_tokenizer, "heldout")
    n_heldout = len(split_sources(list_sources())[1])
    assert int((stream == small_tokenizer.eos_token_id).sum()) == n_heldout
    assert stream[-1] == small_tokenizer.eos_token_id


def test_heldout_prompts_are_reproducible_slices(small_tokenizer):
    stream = encode_split(small_tokenizer, "heldout").tolist()
    prompts = heldout_prompts(5, 10, 40, seed=3, tokenizer=small_tokenizer)
    assert prompts == heldout_prompts(5, 10, 40, seed=3, tokenizer=small_tokenizer)
    assert prompts != heldout_prompts(5, 10, 40, seed=4, tokenizer=small_tokenizer)
    for p in prompts:
        assert 10 <= len(p.token_ids) <= 40
        assert stream[p.offset:p.offset + len(p.token_ids)] == p.token_ids
        assert p.text == small_tokenizer.decode(p.token_ids)
