"""The Serve app over real HTTP on SSM and hybrid targets: tiny float64 Mamba, Mamba2, Jamba and Bamba targets saved as
directories (with a 128-word tokenizer and a tiny Mamba drafter), one app per class in one Serve instance ("mamba" at
/, the others at /<class>), each an engine replica of half a CPU. Greedy requests sent to all four at once, under
fixed trees and the bandit's, give HF `generate`'s tokens and text; a seeded sampled request gives the same tokens
with and without a tree (coupled sampling) and runs to max_tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deployments import AppArgs
from tests.helpers.inputs import random_prompt
from tests.helpers.models import SSM_TARGETS, tiny_mamba, tiny_tokenizer
from tests.helpers.reference import greedy_margin
from tests.helpers.serve import post, serve_app

VOCAB = 128
MAX_TOKENS = 16
EOS = 0  # the tiny targets' and the tokenizer's
# (prompt length, seed, tree): fixed trees verify through the SSM layers whatever the bandit picks; None: the bandit's
REQUESTS = ((3, 3, "3,2,1"), (11, 11, "2,2,1,1"), (40, 40, None))
MAIN = "mamba"  # served at /, the other classes at /<class>


def word_tokenizer():
    """The tiny word-level tokenizer over one word per id of the models' vocabulary (ids 0 and 1: <eos>, <unk>)."""
    tokenizer = tiny_tokenizer([" ".join(f"w{i}" for i in range(VOCAB - 2))])
    assert len(tokenizer) == VOCAB
    return tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL per class, the class's HF model): the four apps in one Serve instance."""
    root = tmp_path_factory.mktemp("ssm_models")
    tiny_mamba().model.save_pretrained(root / "drafter")
    models, args = {}, {}
    for kind, build in sorted(SSM_TARGETS.items()):
        models[kind] = build(eos=EOS)
        models[kind].save_pretrained(root / kind)
        word_tokenizer().save_pretrained(root / kind)
        args[kind] = AppArgs(target=str(root / kind), drafter=str(root / "drafter"), dtype="float64",
                             num_cpus_per_rank=0.5)  # fmt: skip
    more = {kind: a for kind, a in args.items() if kind != MAIN}
    with serve_app(args[MAIN], more=more) as base:
        yield {kind: base if kind == MAIN else f"{base}/{kind}" for kind in models}, models


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """HF generate's greedy tokens (stopping at EOS, as the server does), checked to hold no near-tie."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out[0, len(prompt):].tolist()
    assert greedy_margin(model, prompt, tokens) > 1e-4, "pick another seed: a near tie"
    return tokens


def completion(url: str, body: dict) -> dict:
    response = post(url, body)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_at_once_is_hf_generate_per_class(served):
    urls, models = served
    tokenizer = word_tokenizer()
    jobs = [(kind, n, seed, tree) for kind in sorted(urls) for n, seed, tree in REQUESTS]
    bodies = []
    for kind, n, seed, tree in jobs:
        body = {"prompt": random_prompt(n, seed=seed, vocab=VOCAB), "max_tokens": MAX_TOKENS, "temperature": 0}
        if n == 11:  # one request per class as text
            body["prompt"] = tokenizer.decode(body["prompt"])
        bodies.append(body | ({"tree": tree} if tree else {}))
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job, body: completion(urls[job[0]], body), jobs, bodies))
    for (kind, n, seed, tree), answer in zip(jobs, answers):
        expected = hf_greedy(models[kind], random_prompt(n, seed=seed, vocab=VOCAB))
        choice, spec = answer["choices"][0], answer["speculative"]
        assert choice["token_ids"] == [t for t in expected if t != EOS], (kind, n)
        assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True), (kind, n)
        assert choice["finish_reason"] == ("stop" if EOS in expected else "length")
        if tree is not None:  # the client's tree drafted: greedy acceptance is exact whatever it accepts
            assert {t.split("+")[0] for t in spec["trees"]} - {"none"} <= {tree, *_prefixes(tree)}, spec
            assert spec["mean_accepted_length"] >= 1 and spec["rounds"] >= 1


def _prefixes(tree: str) -> set[str]:
    """A tree's shallower shapes (a round near max_tokens drafts fewer levels)."""
    levels = tree.split(",")
    return {",".join(levels[:k]) for k in range(1, len(levels))}


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_seeded_sampling_is_the_same_with_and_without_a_tree(served, kind):
    urls, _ = served
    body = {"prompt": random_prompt(9, seed=5, vocab=VOCAB), "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 7, "logit_bias": {str(EOS): -100}}  # fmt: skip
    drafted = completion(urls[kind], body | {"tree": "3,2,1"})["choices"][0]
    plain = completion(urls[kind], body | {"tree": "none"})["choices"][0]
    assert len(drafted["token_ids"]) == MAX_TOKENS and drafted["finish_reason"] == "length"
    assert drafted["token_ids"] == plain["token_ids"]
