"""How a bench of several rounds reads, in process (``specinfer bench``) and served (``specinfer
client bench``) alike: the contenders take turns within a round, as this machine's speed drifts
within minutes, so a contender's median round stands for it and a ratio of two contenders is the
median of their ratios within each round (their runs seconds apart), not the ratio of their median
rounds, which may come from different rounds."""
from __future__ import annotations

import statistics
from typing import Callable, Sequence, TypeVar

Run = TypeVar("Run")


def median_round(runs: Sequence[Run], tokens_per_s: Callable[[Run], float]) -> Run:
    """The run of median tokens/s (the upper middle one of an even count)."""
    return sorted(runs, key=tokens_per_s)[len(runs) // 2]


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float | None:
    """The median over rounds of ``a[i] / b[i]`` (tokens/s of two contenders in round i); None
    where a round of ``b`` made nothing."""
    if len(a) != len(b) or not a:
        raise ValueError(f"rounds to pair: {len(a)} and {len(b)}")
    if not all(b):
        return None
    return statistics.median(x / y for x, y in zip(a, b))
