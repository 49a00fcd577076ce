"""Loading a target / drafter pair (factory.load_engine, the CLI's and the benchmark's path): the tokenizer check runs
before any weights load, a mismatched pair fails in one line naming the ids, and the vocabulary padding real pairs have
(a Pythia target's 50,304 embeddings against mamba-130m-hf's 50,280, one tokenizer) keeps working."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from ray_specdec.cli import main
from ray_specdec.factory import LoadError, load_engine
from tests.helpers.models import tiny_gpt_neox, tiny_tokenizer

PYTHIA_VOCAB, MAMBA_VOCAB = 50304, 50280  # embedding rows of EleutherAI/pythia-1.4b and state-spaces/mamba-130m-hf


def swap_ids(tokenizer_json: dict, a: str, b: str) -> dict:
    vocab = tokenizer_json["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return tokenizer_json


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    """A tiny GPTNeoX target and Mamba drafter with Pythia's and mamba-130m-hf's vocabulary sizes, one small
    tokenizer (19 tokens: every id from 19 on is padding), and a second drafter whose tokenizer swaps two words."""
    root = tmp_path_factory.mktemp("padded")
    tok = tiny_tokenizer()
    tiny_gpt_neox(vocab=PYTHIA_VOCAB, hidden=16, layers=1, heads=2).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = MambaForCausalLM(MambaConfig(vocab_size=MAMBA_VOCAB, hidden_size=16, num_hidden_layers=1,
                                               state_size=4))  # fmt: skip
    for name in ("drafter", "mismatched"):
        drafter.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    path = root / "mismatched" / "tokenizer.json"
    path.write_text(json.dumps(swap_ids(json.loads(path.read_text()), "quick", "lazy")))
    return root / "target", root / "drafter", root / "mismatched"


def generate(capsys, target, drafter) -> tuple[int, dict | None, str]:
    code = main(["generate", "--prompt", "the quick brown", "--target", str(target), "--drafter", str(drafter),
                 "--tree", "2,1", "--max-new-tokens", "6", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_padded_vocabularies_load_and_generate_the_targets_tokens(padded_pair, capsys):
    target, drafter, _ = padded_pair
    code, speculative, err = generate(capsys, target, drafter)
    assert code == 0, err
    _, plain, _ = generate(capsys, target, "none")
    assert speculative["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 6


def test_mismatched_pair_is_refused_before_loading_weights(padded_pair, monkeypatch):
    target, _, mismatched = padded_pair
    import ray_specdec.factory as factory

    monkeypatch.setattr(factory, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(LoadError) as info:
        load_engine(str(target), str(mismatched), device="cpu")
    message = str(info.value)
    assert message.startswith("the drafter's tokenizer does not match the target's: 2 of 19 shared token ids differ:")
    assert "target 'quick', drafter 'lazy'" in message and "target 'lazy', drafter 'quick'" in message
    assert "\n" not in message


def test_mismatched_pair_fails_the_cli_in_one_line(padded_pair, capsys):
    target, _, mismatched = padded_pair
    code, _, err = generate(capsys, target, mismatched)
    assert code == 2
    assert err.startswith("error: the drafter's tokenizer does not match the target's") and err.count("\n") == 1
