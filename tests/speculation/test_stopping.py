"""StopChecker: stop_token_ids end generation like EOS (kept in token_ids, their text left out); min_tokens holds back
stop strings, whatever the rounds; byte-level tokenizers' text is kept incrementally, the same as decoding it whole."""

from __future__ import annotations

import copy

import pytest
import torch

from ray_specdec.config import SamplingParams
from ray_specdec.speculation.stopping import StopChecker, decodes_by_concatenation
from tests.helpers.models import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("split", [1, 2, 3])  # the round boundary falls before, at and after the stop token
def test_a_stop_token_id_ends_generation_and_its_text_stays_out(tokenizer, split):
    the, quick, fox, lazy = ids(tokenizer, "the quick fox lazy")
    checker = StopChecker(tokenizer, SamplingParams(stop_token_ids=(fox,)), frozenset({0}))
    tokens = [the, quick, fox, lazy]
    kept, text = checker.feed(tokens[:split])
    more, rest = checker.feed(tokens[split:])
    assert kept + more == [the, quick, fox] and checker.token_ids == [the, quick, fox]
    assert checker.finish_reason == "stop"
    assert text + rest == "the quick" == checker.text


@pytest.mark.parametrize("stopper", ["eos", "stop id"])
def test_eos_and_stop_ids_are_treated_alike(tokenizer, stopper):
    the, quick = ids(tokenizer, "the quick")
    stop = 0 if stopper == "eos" else quick
    checker = StopChecker(tokenizer, SamplingParams(stop_token_ids=(quick,)), frozenset({0}))
    kept, text = checker.feed([the, stop, the])
    assert (kept, text, checker.finish_reason) == ([the, stop], "the", "stop")
    assert checker.stop_ids == frozenset({0, quick})


def test_ignore_eos_keeps_stop_token_ids(tokenizer):
    the, quick = ids(tokenizer, "the quick")
    checker = StopChecker(tokenizer, SamplingParams(ignore_eos=True, stop_token_ids=(quick,)), frozenset({0}))
    assert checker.stop_ids == frozenset({quick})
    kept, _ = checker.feed([0, the, quick, the])
    assert kept == [0, the, quick] and checker.finish_reason == "stop"


def test_without_a_tokenizer_stop_ids_still_stop():
    checker = StopChecker(None, SamplingParams(stop_token_ids=(7,), max_new_tokens=4), frozenset())
    assert checker.feed([5, 6]) == ([5, 6], "") and not checker.finished
    assert checker.feed([7, 8]) == ([7], "") and checker.finish_reason == "stop"


# ---- min_tokens holds back stop strings ------------------------------------------------------------------------------

WORDS = "the quick the lazy the dog"


@pytest.mark.parametrize("rounds", [(6,), (1,) * 6, (2, 4), (3, 3), (1, 4, 1)])  # how rounds group the tokens
@pytest.mark.parametrize(
    "min_tokens, stop, kept, text, reason",
    [
        (0, ("the",), 1, "", "stop"),
        (2, ("the",), 3, "the quick ", "stop"),  # "the" completes at tokens 1 and 3: only 3 is past min_tokens
        (3, ("the",), 5, "the quick the lazy ", "stop"),  # completing at token 3 = min_tokens is not enough
        (2, ("quick the",), 3, "the ", "stop"),  # begins in the first min_tokens tokens' text, ends after it
        (4, ("quick",), 6, WORDS, "length"),  # only ever completes early: the text keeps it and goes on
        (4, ("quick", "lazy the"), 5, "the quick the ", "stop"),
        (6, ("the",), 6, WORDS, "length"),  # min_tokens = max_new_tokens: no stop string can end it
    ],
)
def test_min_tokens_holds_back_stop_strings(tokenizer, rounds, min_tokens, stop, kept, text, reason):
    tokens = ids(tokenizer, WORDS)
    checker = StopChecker(tokenizer, SamplingParams(max_new_tokens=6, min_tokens=min_tokens, stop=stop), frozenset())
    emitted, deltas, start = [], [], 0
    for size in rounds:
        if checker.finished:
            break
        new, delta = checker.feed(tokens[start : start + size])
        emitted += new
        deltas.append(delta)
        start += size
    assert (emitted, checker.token_ids) == (tokens[:kept], tokens[:kept])
    assert "".join(deltas) == checker.text == text
    assert checker.finish_reason == reason


def test_a_stop_string_held_back_leaves_the_stop_id_to_end_generation(tokenizer):
    the, quick, lazy = ids(tokenizer, "the quick lazy")
    params = SamplingParams(max_new_tokens=6, min_tokens=1, stop=("the",), stop_token_ids=(lazy,))
    checker = StopChecker(tokenizer, params, frozenset({0}))
    assert checker.feed([the, quick, lazy]) == ([the, quick, lazy], "the quick")
    assert checker.finish_reason == "stop" and checker.stopped_on_id


# ---- incremental text on byte-level tokenizers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_tokenizer():
    from ray_specdec.defaults import DEFAULT_TARGET
    from ray_specdec.models.loading import load_tokenizer

    return load_tokenizer(str(DEFAULT_TARGET))


def test_only_byte_level_decoders_without_clean_up_decode_incrementally(shipped_tokenizer, tokenizer):
    assert decodes_by_concatenation(shipped_tokenizer)
    assert not decodes_by_concatenation(tokenizer)  # word-level: tokens joined with spaces
    cleaned = copy.deepcopy(shipped_tokenizer)
    cleaned.clean_up_tokenization_spaces = True
    assert not decodes_by_concatenation(cleaned)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_is_the_whole_decode_every_round(shipped_tokenizer, seed, monkeypatch):
    """Random token ids (byte tokens that split UTF-8 characters included) in rounds of 1-5: every round's text and
    delta equal those of decoding every token (the path other tokenizers take), and the tokenizer decodes each token
    a bounded number of times, not once per later round."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, len(shipped_tokenizer), (400,), generator=g).tolist()
    ids[10:10] = shipped_tokenizer.encode("naïve 你好 🙂 ünïcode", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=1000, stop=["zzzzzz"])
    fast, whole = (StopChecker(shipped_tokenizer, params, frozenset()) for _ in range(2))
    whole._incremental = False
    costs = {"fast": 0, "whole": 0}
    real_decode = shipped_tokenizer.decode
    current = ["fast"]

    def counting(x, **kw):
        costs[current[0]] += len(x)
        return real_decode(x, **kw)
    monkeypatch.setattr(shipped_tokenizer, "decode", counting)
    start = 0
    while start < len(ids):
        size = int(torch.randint(1, 6, (1,), generator=g))
        batch = ids[start : start + size]
        start += size
        current[0] = "fast"
        got = fast.feed(batch)
        current[0] = "whole"
        assert got == whole.feed(batch) and fast.text == whole.text
    assert fast.text == real_decode(ids, skip_special_tokens=True)
    # tokens decoded over the request: each a few times (a tail that ends inside a character waits for the rest),
    # against once per later round
    assert costs["fast"] <= 4 * len(ids) and costs["whole"] > 25 * len(ids)
