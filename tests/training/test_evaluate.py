"""Chain acceptance by teacher forcing: literal cases."""

from __future__ import annotations

import pytest

from ray_specdec.training.evaluate import chain_accepted_lengths


@pytest.mark.parametrize("target, draft, gamma, expected", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4, [5, 5]),     # all accepted, then bonus
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 4, [1] * 6),  # stops when < gamma left
    ([1, 2, 3, 4, 5, 6, 7, 8], [1, 0, 3, 4, 5, 6, 7, 8], 2, [2, 3, 3]),  # the bonus position is never drafted
    ([5, 5, 5, 5, 5, 5, 5], [5, 9, 5, 5, 5, 5, 5], 3, [2, 4]),
])
def test_chain_accepted_lengths(target, draft, gamma, expected):
    assert chain_accepted_lengths(target, draft, gamma) == expected
