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


def compare_trees(llm: Runtime, ssms: Sequence[Runtime], trees: dict[str, Sequence[int]],
                  prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                  eos_ids: Sequence[int] = (), progress: bool = True) -> list[dict]:
    """Incremental decoding and speculative decoding with each tree shape, greedy, on the same prompts
    in one run; every speculative output must equal the incremental one token for token."""
    from tqdm import tqdm

    from .generate import Stats, generate_ids

    runs = {"incremental": ([], [1])} | {f"tree {name}": (ssms, shape) for name, shape in trees.items()}
    reference: list[list[int]] = []
    rows = []
    for name, (drafts, shape) in runs.items():
        stats = Stats()
        for i, prompt in enumerate(tqdm(prompts, desc=name, disable=not progress, leave=False)):
            out = [t for step in generate_ids(llm, prompt, ssms=drafts, tree=shape, max_new_tokens=max_new_tokens,
                                              eos_ids=eos_ids, stats=stats) for t in step]
            if name == "incremental":
                reference.append(out)
            elif out != reference[i]:
                raise AssertionError(f"{name}: output differs from incremental decoding on prompt {i}")
        rows.append({"contender": name, "tree": ",".join(map(str, shape)) if drafts else "-",
                     "tokens_per_s": stats.tokens_per_second, "tokens_per_step": stats.mean_tokens_per_step,
                     "ssm_s": stats.ssm_seconds, "llm_s": stats.llm_seconds, "other_s": stats.other_seconds,
                     "histogram": stats.histogram})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base else 0.0
    return rows
