"""Coupled sampling: every sampled token is a Gumbel-max draw under noise keyed by (seed, choice, position).

The token at absolute position t of a sequence (prompt + generated, 0-based) is

    x_t = argmax_x ( log p_t(x) + G_t(x) ),   G_t(x) = -log(-log(u(seed, choice, t, x)))

where p_t is the target's processed distribution there (penalties, logit_bias, min_tokens, temperature, top-k,
top-p: exactly what target-only sampling draws from) and u is a uniform in (0, 1) made of 52 bits of Philox-4x32-10
(Salmon et al., 2011), a counter-based generator computed in integer arithmetic (torch's on any device, a native
kernel's on CPU: models/native/philox_cpu.c), so a CPU and a GPU give the same bits. G_t(x) are i.i.d. standard
Gumbel, so x_t is an exact draw from p_t; the noise of position t is independent
of the noise that chose the prefix, so a sequence is an exact draw from the target's sequence distribution. And x_t is
a deterministic function of (prefix, seed, choice): whatever the drafter, the tree, the batch or a replica change.

Speculation under this coupling is exact matching, as in greedy decoding: the target's token at a tree node is its
keyed argmax at the node's absolute position, and the greedy walk (acceptance.py `accept_greedy`) accepts a child
that equals it. The drafter proposes with the same noise on its own distribution q: the first child is its keyed
argmax, further children the next tokens by perturbed score (Gumbel-top-k of q). The first child equals the target's
token with probability at least (1 - TV(p, q)) / (1 + TV(p, q)) (Daliri, Musco and Suresh, 2024).

Positions only grow within a request, and the drafter and the verify of a round ask for the same few, so a request's
noise is kept per position (`KeyedGumbel`) until its sequence moves past it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ray_specdec.models.native import library as native

# Philox-4x32 multipliers and Weyl key increments (Random123).
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
PHILOX_ROUNDS = 10


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a (a 32-bit constant) * b (int64 tensor of 32-bit values) -> (high, low) 32-bit words of the 64-bit product.
    The product can pass int64's range: torch's integer products wrap modulo 2^64 (two's complement) on CPU and CUDA,
    which keeps all 64 bits of it (Random123's known answers in tests/speculation check that)."""
    p = b * a
    return (p >> 32) & _MASK32, p & _MASK32


def philox4x32(
    counter: Sequence[torch.Tensor], key: tuple, rounds: int = PHILOX_ROUNDS
) -> list[torch.Tensor]:
    """Philox-4x32-`rounds` of the counters `counter` (4 int64 tensors of one shape, each word in [0, 2^32)) under
    the 2-word `key` (ints, or int64 tensors that broadcast against the counters) -> 4 int64 tensors of 32-bit
    words. Random123's known answers hold (tests/speculation)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def keyed_uniforms(seed: int, choice: int, positions: Sequence[int], vocab: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """-> [len(positions), vocab] float64 uniforms in (0, 1): u(seed, choice, position, token) (`keyed_rows`)."""
    return keyed_rows([(seed, choice, p) for p in positions], vocab, device)


def keyed_rows(keys: Sequence[tuple[int, int, int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """keys: (seed, choice, position) per row -> [rows, vocab] float64 uniforms in (0, 1), all rows in one pass.
    Token x takes 52 bits of words (0, 1) or (2, 3) of Philox's output for the counter (x // 2, position, choice low,
    choice high) under the key (seed low, seed high): its value depends on nothing else (not on vocab, nor on the
    other rows)."""
    if any(not (0 <= s < 2**63 and 0 <= c < 2**63 and 0 <= p <= _MASK32) for s, c, p in keys):
        raise ValueError("seeds and choices must be in [0, 2^63), positions in [0, 2^32)")
    table = torch.tensor(list(keys), dtype=torch.int64).reshape(-1, 3)
    if torch.device(device).type == "cpu" and (lib := native.load()) is not None:  # the same bits, one native pass
        out = torch.empty(table.shape[0], vocab, dtype=torch.float64)
        lib.keyed_uniforms(table.data_ptr(), table.shape[0], vocab, out.data_ptr())
        return out
    return torch_keyed_rows(table, vocab, device)


def torch_keyed_rows(table: torch.Tensor, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`keyed_rows` in torch integer arithmetic (any device; native/philox_cpu.c makes the same bits on CPU), of
    `table` [rows, 3] int64 (seed, choice, position)."""
    pairs = (vocab + 1) // 2
    seed, choice, pos = table.to(device).T[:, :, None]
    shape = (pos.shape[0], pairs)
    c0 = torch.arange(pairs, dtype=torch.int64, device=device).expand(shape)
    counter = [c0, pos.expand(shape), (choice & _MASK32).expand(shape), (choice >> 32).expand(shape)]
    w0, w1, w2, w3 = philox4x32(counter, (seed & _MASK32, seed >> 32))
    # 52 bits per uniform, 26 of each word: (m + 0.5) / 2^52 is exact in float64, never 0 nor 1
    bits = torch.stack([((w0 >> 6) << 26) | (w1 >> 6), ((w2 >> 6) << 26) | (w3 >> 6)], dim=-1)  # [rows, pairs, 2]
    u = (bits.to(torch.float64) + 0.5) * 2.0**-52
    return u.reshape(shape[0], 2 * pairs)[:, :vocab]


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) -> standard Gumbel noise, -log(-log u)."""
    return -torch.log(-torch.log(u))


class KeyedGumbel:
    """One request's keyed noise: the Gumbel noise of (seed, choice) at each position, kept per position until
    `forget_before` says it will not be asked again (a round's verify: positions only grow within a request)."""

    def __init__(self, seed: int, choice: int = 0):
        self.seed, self.choice = seed, choice
        self._noise: dict[int, torch.Tensor] = {}  # position -> [V] float64, on the device last asked for

    def at(self, positions: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """-> [len(positions), vocab] float64 Gumbel noise (positions may repeat)."""
        prefetch([(self, positions)], vocab, device)
        return torch.stack([self._noise[p][:vocab] for p in positions])

    def missing(self, positions: Sequence[int], vocab: int, device: torch.device) -> list[int]:
        return sorted({p for p in positions
                       if p not in self._noise or self._noise[p].numel() < vocab or self._noise[p].device != device})

    def forget_before(self, position: int) -> None:
        """Positions before `position` will not be asked for again: their noise goes."""
        for p in [p for p in self._noise if p < position]:
            del self._noise[p]


def prefetch(wants: Sequence[tuple[KeyedGumbel, Sequence[int]]], vocab: int,
             device: torch.device | str = "cpu") -> None:
    """The noise of several requests' positions, made in one pass for all those not kept yet (a step's rounds: one
    Philox pass instead of one per request)."""
    device = torch.device(device)
    todo = [(noise, p) for noise, positions in wants for p in noise.missing(positions, vocab, device)]
    if not todo:
        return
    fresh = keyed_rows([(noise.seed, noise.choice, p) for noise, p in todo], vocab, device)
    fresh.log_().neg_().log_().neg_()  # gumbel(), in place: the same bits without two more [rows, V] buffers
    for (noise, p), row in zip(todo, fresh):
        noise._noise[p] = row


def perturbed_scores(
    probs: torch.Tensor,  # [rows, V] processed distribution
    noise: torch.Tensor,  # [rows, V] float64 Gumbel noise of each row's position
) -> torch.Tensor:
    """-> [rows, V] float64 log p + G: tokens without mass score -inf and are never chosen."""
    return torch.log(probs.to(noise.device, torch.float64)) + noise


def keyed_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [rows, V], noise [rows, V] -> [rows] tokens: each row's Gumbel-max draw (an exact sample of its row)."""
    return perturbed_scores(probs, noise).argmax(dim=-1).to(probs.device)


def keyed_top_k(probs: torch.Tensor, noise: torch.Tensor, k: int) -> torch.Tensor:
    """probs [rows, V], noise [rows, V] -> [rows, k]: the k best tokens by perturbed score, best first (the first is
    `keyed_argmax`; together a draw without replacement, Gumbel-top-k)."""
    return torch.topk(perturbed_scores(probs, noise), k, dim=-1).indices.to(probs.device)
