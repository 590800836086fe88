"""Trees sized to the machine and to the SSMs' confidence (the dynamic tree, after EAGLE-2 / Sequoia).

A verified token is worth having only if it pays for itself: each draft node adds its chance of
being accepted to the step's expected tokens, and its share of the LLM call to the step's cost. So
every step keeps the draft nodes most likely to be accepted, as many as maximise

    expected tokens per second = (1 + sum of kept nodes' reach) / (LLM cost(1 + kept) + overhead)

where a node's *reach* is its SSM path probability (the product of the SSM's probabilities of the
tokens from the root to it: the SSMs are trained to predict the LLM's greedy token, so this
estimates the chance that verification accepts the node), the 1 is the LLM's bonus token, the LLM
cost of T tree tokens is a line fitted to a table measured on this machine (:class:`StepCost`) and
refitted to the steps decoding runs, and the overhead is what a step costs outside the LLM (SSMs,
Python), measured as decoding runs.

Exactness does not depend on any of this: the nodes are the SSM's deterministic picks (its top
tokens), so the tree is a function of the SSM alone, which greedy verification and multi-step
speculative sampling's point-mass candidates both take exactly (see ``verify.py``).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .engines.runtime import Runtime

COST_CONTEXT = 256                          # cached tokens the cost is measured over
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)     # tree tokens measured; larger trees extrapolate


def step_times(runtime: Runtime, contexts: Sequence[int], tree_sizes: Sequence[int],
               repeats: int = 20, warm_up: int = 3, seed: int = 0) -> list[dict]:
    """Median wall time of one ``score`` call of a T-node tree over a cache of C tokens.

    The tree is a balanced binary tree (node i's parent is (i - 1) // 2), a shape between a chain
    and a star; the step is discarded after timing (commit of an empty path), so the cache stays C.
    The sizes take turns, so a load that comes and goes weighs on all alike, after ``warm_up``
    untimed rounds (a cold process runs its first calls far slower).
    """
    rng = np.random.default_rng(seed)
    results = []
    for context in contexts:
        seq = runtime.start()
        samples: dict[int, list[float]] = {t: [] for t in tree_sizes}
        try:
            runtime.prefill(seq, rng.integers(0, runtime.vocab_size, context))
            for round_ in range(warm_up + repeats):
                for t in tree_sizes:
                    tokens = rng.integers(0, runtime.vocab_size, t)
                    parents = [(i - 1) // 2 if i else -1 for i in range(t)]
                    start = time.perf_counter()
                    runtime.score(seq, tokens, parents)
                    if round_ >= warm_up:
                        samples[t].append(time.perf_counter() - start)
                    runtime.commit(seq, [])
        finally:
            runtime.release(seq)
        results += [{"context": context, "tree_tokens": t,
                     "median_ms": 1e3 * float(np.median(samples[t])),
                     "p90_ms": 1e3 * float(np.percentile(samples[t], 90))} for t in tree_sizes]
    return results


@dataclass(frozen=True)
class StepCost:
    """Median seconds of one LLM verification call at each measured tree size (at one context)."""

    tree_tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def measure(cls, runtime: Runtime, context: int = COST_CONTEXT, sizes: Sequence[int] = COST_SIZES,
                repeats: int = 9, seed: int = 0) -> "StepCost":
        """Time the runtime's verification calls here and now (about half a second for the embedded
        LLM)."""
        sizes = [t for t in sizes if t < runtime.max_context]
        context = max(1, min(context, runtime.max_context - max(sizes)))
        rows = step_times(runtime, [context], sizes, repeats=repeats, seed=seed)
        return cls(tuple(sizes), tuple(r["median_ms"] / 1e3 for r in rows))

    def to_dict(self) -> dict:
        return {"tree_tokens": list(self.tree_tokens), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCost":
        return cls(tuple(int(t) for t in d["tree_tokens"]), tuple(float(s) for s in d["seconds"]))


_measured: "weakref.WeakKeyDictionary[Runtime, StepCost]" = weakref.WeakKeyDictionary()


def step_cost(runtime: Runtime) -> StepCost:
    """The runtime's cost table, measured at its first use and kept as long as the runtime lives."""
    if runtime not in _measured:
        _measured[runtime] = StepCost.measure(runtime)
    return _measured[runtime]


class TreeSizer:
    """Chooses how many draft nodes a step verifies, from the cost table and the steps seen so far.

    The LLM's cost per step is a line ``a + b * tree tokens`` fitted to the measured table and then
    to the steps actually run (a running least-squares fit that forgets old steps). A line, since on
    CPU the cost grows about linearly with the tree, and a line does not turn one noisy size into a
    step that would decide every tree; refitted, since in decoding the SSMs and Python run between
    LLM calls, so a call costs more than back to back in the table, and more so per tree token."""

    PRIOR_WEIGHT = 4.0   # how many steps the measured table counts for against the observed ones
    FORGET = 0.98        # per observed step

    def __init__(self, cost: StepCost, overhead: float | None = None):
        self.cost = cost
        # Seconds of a step outside the LLM call: a guess until the first steps are observed.
        self.overhead = cost.seconds[0] / 2 if overhead is None else overhead
        t, y = np.asarray(cost.tree_tokens, dtype=float), np.asarray(cost.seconds, dtype=float)
        w = self.PRIOR_WEIGHT / len(t)
        # Weighted sums for the fit: n, sum t, sum y, sum t^2, sum t*y.
        self._sums = w * np.array([len(t), t.sum(), y.sum(), (t * t).sum(), (t * y).sum()])
        self._line = self._fit()

    def _fit(self) -> tuple[float, float]:
        n, st, sy, stt, sty = self._sums
        var = n * stt - st * st
        slope = max(0.0, (n * sty - st * sy) / var) if var > 1e-12 else 0.0
        return (sy - slope * st) / n, slope

    def llm_seconds(self, tree_tokens: np.ndarray | float) -> np.ndarray | float:
        intercept, slope = self._line
        return np.maximum(intercept + slope * np.asarray(tree_tokens, dtype=float), 1e-6)

    def observe(self, overhead_seconds: float, weight: float = 0.2, tree_tokens: int | None = None,
                llm_seconds: float | None = None) -> None:
        """One step's seconds outside the LLM call (a moving average: the machine's load changes)
        and, when given, its LLM call's tree size and seconds (verification included)."""
        self.overhead += weight * (overhead_seconds - self.overhead)
        if tree_tokens is not None and llm_seconds is not None:
            t = float(tree_tokens)
            self._sums = self.FORGET * self._sums + np.array([1.0, t, llm_seconds, t * t, t * llm_seconds])
            self._line = self._fit()

    def tokens_per_second(self, reach: Sequence[float], extra_seconds: float = 0.0) -> np.ndarray:
        """Expected tokens per second when verifying the first 0, 1, ..., n nodes of ``reach``, with
        ``extra_seconds`` more per step outside the LLM."""
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach)])
        return expected / (self.llm_seconds(1 + np.arange(len(reach) + 1)) + self.overhead + extra_seconds)

    def drafting_more_pays(self, reach: Sequence[float], more: Sequence[float], seconds: float) -> bool:
        """Whether drafting nodes of reach ``more`` (expected), at ``seconds`` more drafting, would
        raise the best expected tokens per second over the nodes of ``reach`` (each best first)."""
        longer = np.sort(np.concatenate([reach, more]))[::-1]
        return bool(self.tokens_per_second(longer, seconds).max() > self.tokens_per_second(reach).max())

    def best_count(self, reach: Sequence[float]) -> int:
        """How many of the nodes to keep, ``reach`` given best first (a parent before its children:
        a child's reach never exceeds its parent's, so a kept prefix is always a tree)."""
        if not len(reach):
            return 0
        return int(np.argmax(self.tokens_per_second(reach)))
