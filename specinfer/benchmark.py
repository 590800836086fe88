"""Measurements people look at: step time of a Runtime by context length and tree size."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .engines.runtime import Runtime


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def step_times(runtime: Runtime, contexts: Sequence[int], tree_sizes: Sequence[int],
               repeats: int = 20, seed: int = 0) -> list[dict]:
    """Median wall time of one ``score`` call of a T-node tree over a cache of C tokens.

    The tree is a balanced binary tree (node i's parent is (i - 1) // 2), a shape between a chain
    and a star; the step is discarded after timing (commit of an empty path), so the cache stays C.
    """
    rng = np.random.default_rng(seed)
    results = []
    for context in contexts:
        seq = runtime.start()
        try:
            runtime.prefill(seq, rng.integers(0, runtime.vocab_size, context))
            for t in tree_sizes:
                tokens = rng.integers(0, runtime.vocab_size, t)
                parents = [(i - 1) // 2 if i else -1 for i in range(t)]
                runtime.score(seq, tokens, parents)  # warm-up: shapes, allocator
                runtime.commit(seq, [])
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    runtime.score(seq, tokens, parents)
                    samples.append(time.perf_counter() - start)
                    runtime.commit(seq, [])
                results.append({"context": context, "tree_tokens": t,
                                "median_ms": 1e3 * float(np.median(samples)),
                                "p90_ms": 1e3 * float(np.percentile(samples, 90))})
        finally:
            runtime.release(seq)
    return results
