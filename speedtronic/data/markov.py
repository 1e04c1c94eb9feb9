"""A learnable synthetic source: windows sampled from a fixed sparse random Markov chain.

``data.synthetic: markov`` (the default). The chain is a function of ``data.seed`` and the
vocabulary only, so every DiLoCo node and every held-out set sees the same chain:

* each token has ``SUCCESSORS`` distinct successors other than itself; one of them follows a
  random cyclic permutation of the vocabulary (so the chain is irreducible), the others are
  random;
* the successor probabilities are drawn from a Dirichlet(``CONCENTRATION``) (skewed) and
  quantised to multiples of ``1 / RESOLUTION``; generation then needs one table lookup per
  token: ``next = table[token * RESOLUTION + uniform_int(RESOLUTION)]``.

Each window starts from the chain's stationary distribution, so every target position has the
same statistics and the best possible mean cross-entropy is the chain's **entropy rate**
``floor = sum_s pi(s) * H(P(. | s))`` in nats (computed from the quantised table, so it is
exact for the generator). A model that has learnt the transitions reaches ``floor``; one that
has learnt nothing scores ``ln(vocab_size)``.

Samples are indexed: sample ``i`` of domain ``d`` under ``sample_seed`` is drawn from a
generator seeded with ``SeedSequence(sample_seed, spawn_key=(d, i))``. Training samples use
``TRAIN_DOMAIN`` and the (node) stream seed; held-out samples use ``HELDOUT_DOMAIN`` and
``data.seed``. The chain itself uses ``CHAIN_DOMAIN``. Distinct spawn keys give independent
streams, so no training sample is ever a held-out sample's stream.
"""

from __future__ import annotations

import math
from array import array

import numpy as np
import torch

from speedtronic.data.datasets import SyntheticTokenDataset

__all__ = [
    "CHAIN_DOMAIN",
    "HELDOUT_DOMAIN",
    "TRAIN_DOMAIN",
    "MarkovChain",
    "MarkovTokenDataset",
    "seed_generator",
]

CHAIN_DOMAIN = 0
TRAIN_DOMAIN = 1
HELDOUT_DOMAIN = 2

SUCCESSORS = 4
RESOLUTION = 64
CONCENTRATION = 0.5


def seed_generator(seed: int, *key: int) -> np.random.Generator:
    """A NumPy generator for ``(seed, key...)``: ``SeedSequence`` mixing, never ``seed + i``."""
    entropy = int(seed) % 2**64  # negative seeds map to distinct non-negative values
    sequence = np.random.SeedSequence(entropy, spawn_key=tuple(int(k) for k in key))
    return np.random.Generator(np.random.PCG64(sequence))


def _successors(rng: np.random.Generator, vocab: int, k: int) -> np.ndarray:
    """(V, k) distinct successors per token, never the token itself (no sticky states); column 0
    is a random cycle through all tokens."""
    order = rng.permutation(vocab)
    cycle = np.empty(vocab, dtype=np.int64)
    cycle[order] = np.roll(order, -1)
    table = np.empty((vocab, k), dtype=np.int64)
    table[:, 0] = cycle
    if k == 1:
        return table
    table[:, 1:] = rng.integers(vocab, size=(vocab, k - 1))
    own = np.arange(vocab)[:, None]
    while True:  # redraw rows that picked a successor twice or themselves (rare unless V is tiny)
        ordered = np.sort(table, axis=1)
        clash = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1) | (table == own).any(axis=1)
        if not clash.any():
            return table
        table[clash, 1:] = rng.integers(vocab, size=(int(clash.sum()), k - 1))


def _quantise(probs: np.ndarray, resolution: int) -> np.ndarray:
    """Integer slot counts per row: at least 1 each, summing to ``resolution``."""
    counts: np.ndarray = np.maximum(np.floor(probs * resolution).astype(np.int64), 1)
    rows = np.arange(counts.shape[0])
    largest = counts.argmax(axis=1)
    counts[rows, largest] += resolution - counts.sum(axis=1)
    return counts


def _stationary(succ: np.ndarray, probs: np.ndarray, *, tol: float = 1e-13) -> np.ndarray:
    """Stationary distribution by power iteration on the lazy chain ``(I + P) / 2``.

    The lazy chain has the same stationary distribution and is aperiodic, so the iteration
    converges for any irreducible chain (ours is: it contains a cycle through every token).
    """
    vocab = succ.shape[0]
    pi = np.full(vocab, 1.0 / vocab)
    flat = succ.ravel()
    for _ in range(200_000):
        moved = np.bincount(flat, weights=(pi[:, None] * probs).ravel(), minlength=vocab)
        nxt = 0.5 * pi + 0.5 * moved
        nxt /= nxt.sum()
        if np.abs(nxt - pi).sum() < tol:
            return nxt
        pi = nxt
    return pi  # pragma: no cover - converges long before for any vocabulary we build


class MarkovChain:
    """The fixed chain of ``(vocab_size, seed)``; see the module docstring.

    Attributes: ``vocab_size``; ``successors`` (V, k) int64; ``probs`` (V, k) float64 (the
    quantised transition probabilities); ``stationary`` (V,) float64; ``floor`` (the entropy
    rate in nats per token: the lowest mean cross-entropy any model can reach).
    """

    def __init__(self, vocab_size: int, seed: int) -> None:
        vocab = int(vocab_size)
        if vocab <= 0:
            raise ValueError("vocab_size must be positive")
        self.vocab_size = vocab
        self.seed = int(seed)
        rng = seed_generator(self.seed, CHAIN_DOMAIN)
        k = min(SUCCESSORS, max(vocab - 1, 1))
        self.successors = _successors(rng, vocab, k)
        counts = _quantise(rng.dirichlet(np.full(k, CONCENTRATION), size=vocab), RESOLUTION)
        self.probs = counts / RESOLUTION
        self.stationary = _stationary(self.successors, self.probs)
        row_entropy = -(self.probs * np.log(self.probs)).sum(axis=1)
        self.floor = float((self.stationary * row_entropy).sum())
        self._cdf = np.cumsum(self.stationary)
        # Slot table: table[s * RESOLUTION + q] is the successor of s for slot q.
        self._table = array("q")
        self._table.frombytes(np.repeat(self.successors.ravel(), counts.ravel()).tobytes())

    @property
    def uniform_loss(self) -> float:
        """``ln(vocab_size)``: the mean cross-entropy of a model that predicts uniformly."""
        return math.log(self.vocab_size)

    def sample(self, rng: np.random.Generator, length: int) -> list[int]:
        """``length`` tokens: a stationary start, then ``length - 1`` transitions."""
        start = int(np.searchsorted(self._cdf, rng.random() * self._cdf[-1], side="right"))
        token = min(start, self.vocab_size - 1)
        table = self._table
        out = [token]
        append = out.append
        for slot in rng.integers(RESOLUTION, size=int(length) - 1).tolist():
            token = table[token * RESOLUTION + slot]
            append(token)
        return out


class MarkovTokenDataset(SyntheticTokenDataset):
    """``num_samples`` windows of ``block_size + 1`` tokens from ``MarkovChain(vocab, seed)``.

    Sample ``i`` depends only on ``(sample_seed, domain, i)`` (``sample_seed`` defaults to
    ``seed``), so it is identical across runs, workers and access orders. ``floor`` is the
    chain's entropy rate in nats.
    """

    def __init__(
        self,
        num_samples: int = 10_000,
        block_size: int = 128,
        vocab_size: int = 512,
        seed: int = 1234,
        *,
        sample_seed: int | None = None,
        domain: int = TRAIN_DOMAIN,
        chain: MarkovChain | None = None,
    ) -> None:
        super().__init__(num_samples, block_size, vocab_size, seed)
        self.sample_seed = self.seed if sample_seed is None else int(sample_seed)
        self.domain = int(domain)
        if chain is not None and (chain.vocab_size, chain.seed) != (self.vocab_size, self.seed):
            raise ValueError("chain does not match vocab_size/seed")
        self.chain = chain if chain is not None else MarkovChain(self.vocab_size, self.seed)

    @property
    def floor(self) -> float:
        """The chain's entropy rate (nats per token): the loss floor."""
        return self.chain.floor

    def window(self, index: int) -> torch.Tensor:
        """The ``block_size + 1`` tokens of sample ``index``, drawn from the chain."""
        rng = seed_generator(self.sample_seed, self.domain, index)
        return torch.tensor(self.chain.sample(rng, self.block_size + 1), dtype=torch.long)
