"""How logits become a distribution and a token: greedy, or temperature / top-k / top-p sampling.

The same shaping applies to the LLM and to every SSM, which is what lets multi-step speculative
sampling keep the (shaped) LLM distribution exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engines import native
from .errors import SpecInferError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy (argmax); then top_k / top_p are ignored."""

    temperature: float = 0.0
    top_k: int = 0          # 0: no top-k cut
    top_p: float = 1.0      # 1: no nucleus cut
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecInferError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecInferError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecInferError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The shaped distribution, float64 [..., V]. Greedy gives a one-hot at the argmax."""
    if params.greedy:
        logits = np.asarray(logits)
        out = np.zeros(logits.shape, dtype=np.float64)
        np.put_along_axis(out, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return out
    if plain_softmax(params):   # the common case in one native call where it runs
        shaped = native.softmax(np.asarray(logits), params.temperature)
        if shaped is not None:
            return shaped
    # In place on one float64 copy: at a vocabulary of 8k a pass costs a few microseconds, and a
    # sampled step shapes every tree node's logits (6% of a chain-of-4 step here, py-spy).
    z = np.array(logits, dtype=np.float64)
    z /= params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z[z < kth] = -np.inf
    z -= z.max(-1, keepdims=True)
    p = np.exp(z, out=z)
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


SAMPLE_BLOCK = 128   # tokens per block of sample()'s two-level search


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a distribution [V] (exact inverse-CDF on float64): the first token
    whose cumulative mass exceeds u times the total, u = ``rng.random()`` (:func:`inverse_cdf`)."""
    return inverse_cdf(p, rng.random())


def plain_softmax(params: SamplingParams) -> bool:
    """Whether sampled logits are shaped by softmax(logits / temperature) alone (no top-k or top-p
    cut): what the native shaping and draws compute (here and inside a graph)."""
    return not params.greedy and not params.top_k and params.top_p >= 1.0


def draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """``sample(probabilities(logits, params), rng)`` for one row of sampled logits: the same
    uniform read, the same inverse CDF (:func:`draw_at`)."""
    return draw_at(logits, params, rng.random())


def draw_at(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token of uniform ``u`` under the shaped distribution of one row of sampled logits
    (:func:`inverse_cdf` of :func:`probabilities`), drawn in one native call where it runs (float32
    logits, :func:`plain_softmax`; ``kernels/shaping.c``) without writing the float64
    distribution."""
    if plain_softmax(params) and native.can_sample(logits):
        token = native.sample_softmax(logits, params.temperature, u)
        return token if token >= 0 else inverse_cdf(probabilities(logits, params), u)   # (no mass: no draw there)
    return inverse_cdf(probabilities(logits, params), u)


def inverse_cdf(p: np.ndarray, u: float) -> int:
    """The token of uniform ``u`` under the weights ``p`` [V] (not necessarily normalized): the
    first whose cumulative weight exceeds u times the total. Searched in two levels, the blocks'
    masses then one block's tokens, as one cumulative sum over a vocabulary of 8k costs ~30 us
    (numpy's cumsum runs one add at a time) against a few for the block sums; in one native pass
    where it runs (float64 weights)."""
    token = native.sample_residual(p, None, u)
    if token is not None:
        return token
    if len(p) <= 2 * SAMPLE_BLOCK:
        return _first_above(np.cumsum(p), p, u)
    starts = np.arange(0, len(p), SAMPLE_BLOCK)
    blocks = np.cumsum(np.add.reduceat(p, starts))
    target = u * blocks[-1]
    b = int(np.searchsorted(blocks, target, side="right"))
    if b >= len(blocks):   # u * total rounded up to the total: the last block that has mass
        b = int(np.flatnonzero(np.diff(blocks, prepend=0.0) > 0)[-1])
    below = blocks[b - 1] if b else 0.0
    block = p[starts[b]:starts[b] + SAMPLE_BLOCK]
    return int(starts[b]) + _first_above(below + np.cumsum(block), block, target, absolute=True)


def _first_above(cumulative: np.ndarray, p: np.ndarray, u: float, absolute: bool = False) -> int:
    """The first index whose ``cumulative`` mass exceeds ``u`` times the last (``absolute``: ``u``
    itself); where rounding puts it past the end, the last index with mass (never one without)."""
    i = int(np.searchsorted(cumulative, u if absolute else u * cumulative[-1], side="right"))
    return i if i < len(p) else int(np.flatnonzero(p)[-1])


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The token incremental decoding emits after these logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return draw(logits, params, rng)
