"""Trees sized to the machine and to the SSMs' confidence (the dynamic tree, after EAGLE-2 / Sequoia).

A verified token is worth having only if it pays for itself: each draft node adds its chance of
being accepted to the step's expected tokens, and its share of the LLM call to the step's cost. So
every step keeps the draft nodes most likely to be accepted, as many as maximise

    expected tokens per second = (1 + sum of kept nodes' reach) / (LLM cost(1 + kept) + overhead)

where a node's *reach* is the chance that verification accepts it (the product, along its path, of
the SSM's probabilities of the tokens, each as the SSM's :class:`Acceptance` record rates it: the
SSMs are trained to predict the LLM's greedy token, so their probability is a first guess, which
the record corrects by what verification did with tokens of that probability), the 1 is the
LLM's bonus token, the LLM cost of T tree tokens is a line fitted to a table measured on this
machine (:class:`StepCost`) and refitted to the steps decoding runs, and the overhead is what a
step costs outside the LLM (SSMs, Python), measured as decoding runs. Where even the best tree is expected to be slower than a step
without one (text the SSM does not know, sampling at a high temperature), the SSM drafts nothing
and tries again later.

Exactness does not depend on any of this: the nodes are the SSM's deterministic picks (its top
tokens), so the tree is a function of the SSM and of the steps already verified, fixed before this
step's verification draws anything, which greedy verification and multi-step speculative
sampling's point-mass candidates both take exactly (see ``verify.py``).
"""
from __future__ import annotations

import bisect
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .engines.runtime import ChainSampling, Runtime
from .sampling import SamplingParams
from .tree import TokenTree

COST_CONTEXT = 256                          # cached tokens the cost is measured over
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)     # tree tokens measured; larger trees extrapolate


def step_times(runtime: Runtime, contexts: Sequence[int], tree_sizes: Sequence[int],
               repeats: int = 20, warm_up: int = 3, seed: int = 0, sequences: Sequence[int] = (1,)) -> list[dict]:
    """Median wall time of one verification call: T-node trees of ``n`` sequences (one
    :meth:`Runtime.score_batch` call; for n > 1 also ``one_by_one_ms``, n ``score`` calls), each
    sequence over a cache of C tokens.

    The tree is a balanced binary tree (node i's parent is (i - 1) // 2), a shape between a chain
    and a star; the step is discarded after timing (commit of an empty path), so the cache stays C.
    The sizes take turns, so a load that comes and goes weighs on all alike, after ``warm_up``
    untimed rounds (a cold process runs its first calls far slower).
    """
    rng = np.random.default_rng(seed)
    results = []
    for n in sequences:
        for context in contexts:
            seqs = [runtime.start() for _ in range(n)]
            batched: dict[int, list[float]] = {t: [] for t in tree_sizes}
            single: dict[int, list[float]] = {t: [] for t in tree_sizes}
            try:
                for seq in seqs:
                    runtime.prefill(seq, rng.integers(0, runtime.vocab_size, context))
                for round_ in range(warm_up + repeats):
                    for t in tree_sizes:
                        parents = [(i - 1) // 2 if i else -1 for i in range(t)]
                        calls = [(seq, rng.integers(0, runtime.vocab_size, t), parents) for seq in seqs]
                        for together in ([True, False] if n > 1 else [True]):
                            start = time.perf_counter()
                            if together:
                                runtime.score_batch(calls)
                            else:
                                for call in calls:
                                    runtime.score(*call)
                            if round_ >= warm_up:
                                (batched if together else single)[t].append(time.perf_counter() - start)
                            for seq in seqs:
                                runtime.commit(seq, [])
            finally:
                for seq in seqs:
                    runtime.release(seq)
            for t in tree_sizes:
                row = {"sequences": n, "context": context, "tree_tokens": t,
                       "median_ms": 1e3 * float(np.median(batched[t])),
                       "p90_ms": 1e3 * float(np.percentile(batched[t], 90))}
                if n > 1:
                    row["one_by_one_ms"] = 1e3 * float(np.median(single[t]))
                results.append(row)
    return results


def warm_shapes(runtime: Runtime, tree_sizes: Sequence[int] = (), chain_depths: Sequence[int] = (),
                sampled: bool = False, batch_sizes: Sequence[int] = (1,), decoding: bool = False) -> None:
    """One untimed run of every tree size and chain depth given, for each batch size given (that
    many sequences in one :meth:`~Runtime.score_batch` or :meth:`~Runtime.draft_chains` call), on
    sequences of one token made and released here: an engine may plan or open something at a
    shape's first run (ONNX Runtime: the embedded LLM's first tree of a size took 0.4-0.7 ms more
    than its later ones; an SSM's first chain of a depth opens that depth's drafter session, 5-7 ms;
    a batch size its own session, ~0.1 s), which the sizer would otherwise learn as what a step
    costs, or a burst of requests wait for. ``sampled``: the chains with draw noise; ``decoding``:
    incremental decoding's chains (:meth:`~Runtime.decode_chains`; ``sampled``, drawing each
    token), not drafts."""
    seqs = [runtime.start() for _ in range(max(batch_sizes, default=0))]
    try:
        for seq in seqs:
            runtime.prefill(seq, [0])
        for n in batch_sizes:
            for t in tree_sizes:
                runtime.score_batch([(seq, [0] * t, [i - 1 for i in range(t)]) for seq in seqs[:n]])
                for seq in seqs[:n]:
                    runtime.commit(seq, [])
            for depth in chain_depths:
                if decoding:
                    drawn = ChainSampling(1.0, np.full(depth, 0.5)) if sampled else None
                    runtime.decode_chains([(seq, [0], depth, drawn) for seq in seqs[:n]])
                else:
                    noise = np.zeros((depth, runtime.draft_candidates), np.float32) if sampled else None
                    runtime.draft_chains([(seq, [0], depth, noise) for seq in seqs[:n]])
                for seq in seqs[:n]:
                    runtime.commit(seq, [])
    finally:
        for seq in seqs:
            runtime.release(seq)


_warmed: "weakref.WeakKeyDictionary[Runtime, set[bool]]" = weakref.WeakKeyDictionary()


def warm_drafter(runtime: Runtime, sampled: bool = False) -> None:
    """An SSM's chains of every depth run once (:func:`warm_shapes`), before its first draft for
    a dynamic tree, whose chunks take any depth up to :attr:`~Runtime.draft_depth`: without it
    the sizer took the first draft of each depth (7 of a request's first 40 steps here) for what
    drafting costs."""
    done = _warmed.setdefault(runtime, set())
    if sampled not in done:
        done.add(sampled)
        warm_shapes(runtime, chain_depths=range(1, runtime.draft_depth + 1), sampled=sampled)


def chain_seconds(runtime: Runtime, context: int, repeats: int = 9, warm_up: int = 2, seed: int = 0) -> float:
    """Median wall time of one run of the runtime's drafter graph on itself: greedy incremental
    decoding of :attr:`~Runtime.draft_depth` tokens in one call (:meth:`Runtime.decode_chain`), over
    a cache of ``context`` tokens (discarded after each run)."""
    rng = np.random.default_rng(seed)
    seq = runtime.start()
    times = []
    try:
        runtime.prefill(seq, rng.integers(0, runtime.vocab_size, context))
        for round_ in range(warm_up + repeats):
            start = time.perf_counter()
            runtime.decode_chain(seq, [int(rng.integers(0, runtime.vocab_size))], runtime.draft_depth)
            if round_ >= warm_up:
                times.append(time.perf_counter() - start)
            runtime.commit(seq, [])
    finally:
        runtime.release(seq)
    return float(np.median(times))


def chains(runtime: Runtime) -> bool:
    """Whether greedy incremental decoding on this runtime takes several tokens a run (its drafter
    graph on the LLM itself; not with a draft vocabulary, whose drafter sees part of the LLM's)."""
    return runtime.draft_depth > 1 and runtime.draft_vocab is None


@dataclass(frozen=True)
class StepCost:
    """Median seconds of one LLM verification call at each measured tree size (at one context),
    and, where the LLM decodes several tokens a run (:func:`chains`), of one such run of
    ``chain_tokens`` tokens (0: none)."""

    tree_tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    chain_tokens: int = 0
    chain_seconds: float = 0.0

    @classmethod
    def measure(cls, runtime: Runtime, context: int = COST_CONTEXT, sizes: Sequence[int] = COST_SIZES,
                repeats: int = 9, seed: int = 0) -> "StepCost":
        """Time the runtime's verification calls (and chain runs) here and now (about half a
        second for the embedded LLM)."""
        sizes = [t for t in sizes if t < runtime.max_context]
        depth = runtime.draft_depth if chains(runtime) else 0
        context = max(1, min(context, runtime.max_context - max(sizes + [depth])))
        warm_shapes(runtime, range(1, max(sizes) + 1))   # the sizes between, which decoding meets too
        rows = step_times(runtime, [context], sizes, repeats=repeats, seed=seed)
        chain = chain_seconds(runtime, context, repeats, seed=seed) if depth else 0.0
        return cls(tuple(sizes), tuple(r["median_ms"] / 1e3 for r in rows), depth, chain)

    def to_dict(self) -> dict:
        return {"tree_tokens": list(self.tree_tokens), "seconds": list(self.seconds),
                "chain_tokens": self.chain_tokens, "chain_seconds": self.chain_seconds}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCost":
        return cls(tuple(int(t) for t in d["tree_tokens"]), tuple(float(s) for s in d["seconds"]),
                   int(d.get("chain_tokens", 0)), float(d.get("chain_seconds", 0.0)))


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
    LLM calls, so a call costs more than back to back in the table, and more so per tree token.

    A step that drafts nothing is one LLM token or, where the speculator takes greedy incremental
    decoding several tokens a run (``chained``; ``LocalSpeculator.step``), such a run, which the
    cost table times too and the chains run refine: a tree must beat that to be worth drafting."""

    PRIOR_WEIGHT = 4.0   # how many steps the measured table counts for against the observed ones
    FORGET = 0.98        # per observed step

    def __init__(self, cost: StepCost, overhead: float | None = None, chained: bool = False):
        self.cost = cost
        # A chain run's tokens and seconds per token (a moving average), where steps take them.
        self.chain_tokens = cost.chain_tokens if chained and cost.chain_seconds > 0 else 0
        self._chain_token_seconds = cost.chain_seconds / cost.chain_tokens if self.chain_tokens else 0.0
        # Seconds of a step outside the LLM call: a guess until the first steps are observed.
        self.overhead = cost.seconds[0] / 2 if overhead is None else overhead
        t, y = np.asarray(cost.tree_tokens, dtype=float), np.asarray(cost.seconds, dtype=float)
        w = self.PRIOR_WEIGHT / len(t)
        # Weighted sums for the fit: n, sum t, sum y, sum t^2, sum t*y. Plain floats: every step
        # updates them, and five numpy operations on five numbers cost more than the arithmetic.
        self._sums = [float(w * s) for s in (len(t), t.sum(), y.sum(), (t * t).sum(), (t * y).sum())]
        self._line: tuple[float, float] | None = self._fit()   # (intercept, slope); None: refit when asked

    def _fit(self) -> tuple[float, float]:
        n, st, sy, stt, sty = self._sums
        var = n * stt - st * st
        slope = max(0.0, (n * sty - st * sy) / var) if var > 1e-12 else 0.0
        return (sy - slope * st) / n, slope

    def _fitted(self) -> tuple[float, float]:
        """The line, refitted first if steps were observed since it was last asked for."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def llm_seconds(self, tree_tokens: float) -> float:
        """Seconds of an LLM call verifying ``tree_tokens`` tokens, by the fitted line."""
        intercept, slope = self._fitted()
        return max(intercept + slope * tree_tokens, 1e-6)

    def observe(self, overhead_seconds: float | None, weight: float = 0.2, tree_tokens: int | None = None,
                llm_seconds: float | None = None) -> None:
        """One step's seconds outside the LLM call (a moving average: the machine's load changes;
        None for a step no SSM drafted, which says nothing of drafting's cost) and, when given, its
        LLM call's tree size and seconds (verification included)."""
        if overhead_seconds is not None:
            # At most twice the estimate: a one-off (a session's first run, a hiccup of the machine)
            # must not make drafting look dear for long, while a real rise still comes through.
            self.overhead += weight * (min(overhead_seconds, 2 * self.overhead) - self.overhead)
        if tree_tokens is not None and llm_seconds is not None:
            t, y = float(tree_tokens), float(llm_seconds)
            self._sums = [self.FORGET * s + x for s, x in zip(self._sums, (1.0, t, y, t * t, t * y))]
            self._line = None   # refitted when next asked: most steps that draft nothing never ask

    def observe_chain(self, tokens: int, seconds: float, weight: float = 0.2) -> None:
        """A chain run of incremental decoding took ``seconds`` for ``tokens`` tokens. At most
        twice the estimate, as :meth:`observe` takes a step's overhead: a sampled request's first
        chain run opened its session (140-180 ms for 8 tokens, 20x a later run), which made chains
        look 5x dearer than they are, so the sizer drafted nearly every step (60 steps of 2.1
        tokens, 321 tokens/s where incremental sampling made ~1000) and ran too few chains to learn
        better for the rest of the request."""
        if self.chain_tokens and tokens > 0:
            token_seconds = min(seconds / tokens, 2 * self._chain_token_seconds)   # > 0 with chain_tokens
            self._chain_token_seconds += weight * (token_seconds - self._chain_token_seconds)

    def idle_rate(self) -> float:
        """Tokens per second of a step that drafts nothing: one LLM token, or a chain run."""
        one = 1.0 / self.llm_seconds(1)
        return max(one, 1.0 / self._chain_token_seconds) if self.chain_tokens else one

    def tokens_per_second(self, reach: Sequence[float], extra_seconds: "float | Sequence[float]" = 0.0) -> list[float]:
        """Expected tokens per second when verifying the first 0, 1, ..., n nodes of ``reach``, with
        ``extra_seconds`` more per step outside the LLM (one value, or one per count of nodes: a
        drafter whose cost follows how deep it drafts). Keeping no node is a step that drafts
        nothing: where steps take chains, a chain run, if that is faster than one token."""
        # Every drafted step runs this two or three times on a dozen or more nodes: plain floats and
        # the line inline (a numpy call on a few numbers costs ~1 us, and so did a method call a
        # count: 10.2 us a call of 16 nodes with one, 5.4 without, the same choices).
        intercept, slope = self._fitted()
        per_count = not isinstance(extra_seconds, (int, float))
        overhead, total, rates = self.overhead, 1.0, []
        for count in range(len(reach) + 1):
            if count:
                total += reach[count - 1]
            other = overhead + (extra_seconds[count] if per_count else extra_seconds)
            if other < 0.0:
                other = 0.0
            llm = intercept + slope * (count + 1)
            rates.append(total / ((llm if llm > 1e-6 else 1e-6) + other))
            if not count and self.chain_tokens:
                tokens = self.chain_tokens
                rates[0] = max(rates[0], tokens / (tokens * self._chain_token_seconds + other))
        return rates

    def drafting_more_pays(self, reach: Sequence[float], more: Sequence[float], seconds: float) -> bool:
        """Whether drafting nodes of reach ``more`` (expected), at ``seconds`` more drafting, would
        raise the best expected tokens per second over the nodes of ``reach`` (each best first)."""
        longer = sorted([*reach, *more], reverse=True)
        return max(self.tokens_per_second(longer, seconds)) > max(self.tokens_per_second(reach))

    def speedup(self, reach: Sequence[float], free: bool = False, extra_seconds: "float | Sequence[float]" = 0.0) -> float:
        """The best expected tokens per second over the nodes of ``reach`` (best first), drafting
        included (``free``: nodes drafted at no cost, no overhead; ``extra_seconds`` as in
        :meth:`tokens_per_second`), against a step that drafts nothing (:meth:`idle_rate`)."""
        return self.best(reach, -self.overhead if free else extra_seconds)[1]

    def best(self, reach: Sequence[float], extra_seconds: "float | Sequence[float]" = 0.0) -> tuple[int, float]:
        """:meth:`best_count` and :meth:`speedup` of the same nodes, from one evaluation."""
        rates = self.tokens_per_second(reach, extra_seconds)
        count = max(range(len(rates)), key=rates.__getitem__)   # the first of equals, as argmax
        return count, rates[count] / self.idle_rate()

    def best_count(self, reach: Sequence[float], extra_seconds: "float | Sequence[float]" = 0.0) -> int:
        """How many of the nodes to keep, ``reach`` given best first (a parent before its children:
        a child's reach never exceeds its parent's, so a kept prefix is always a tree)."""
        return self.best(reach, extra_seconds)[0]


_sizers: "weakref.WeakKeyDictionary[Runtime, dict[tuple, TreeSizer]]" = weakref.WeakKeyDictionary()


def tree_sizer(llm: Runtime, ssms: Sequence[Runtime] = (), lookup: bool = False, chained: bool = False) -> TreeSizer:
    """The sizer of the LLM's requests that draft with ``ssms`` (and by ``lookup``; ``chained`` as
    :class:`TreeSizer` has it): one, shared by them and kept as long as the LLM lives, so that what
    a step costs is learnt over requests, not anew by each from the first guesses (a request of
    ~100 tokens takes 20-30 steps: measured on aiohttp's code, a step's drafting was expected to
    cost 0.26-0.33 ms while it cost 0.84-0.94)."""
    # Weak references, not ids: an SSM's id may be a later SSM's once it is gone, and a reference
    # to a dead SSM equals no other (its entry stays, a few bytes, until the LLM goes).
    key = (tuple(weakref.ref(ssm) for ssm in ssms), lookup, chained)
    by_drafters = _sizers.setdefault(llm, {})
    if key not in by_drafters:
        by_drafters[key] = TreeSizer(step_cost(llm), chained=chained)
    return by_drafters[key]


class Acceptance:
    """What an SSM's probabilities turn out to be worth: how often verification accepts its
    candidates, by the probability the SSM gave them, and whether its drafts pay at all.

    The SSM's probability of its top token is its own guess of the chance that the LLM agrees. On
    text unlike its training data that guess is too high, and under sampling more so (a point-mass
    candidate is accepted with the LLM's probability of it). So a candidate's probability is scaled
    by accepted / expected, both counted per probability band over the steps seen (old steps
    forgotten), starting from the SSM's own word. And where even the best tree is expected to be
    slower than a step without one, the SSM stops drafting, and tries again after a wait that
    doubles each time drafting still does not pay."""

    EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
    PRIOR = 2.0          # accepted tokens' worth of the SSM's own word, per band
    FORGET = 0.99        # per verified step
    RETRY = (2, 64)      # steps without a draft before the next try: first, most
    # Most steps between tries of a sampled drafter. A try after a wait costs the SSM's catch-up of
    # every token since its last draft (~130 tokens, ~1 ms here) and a tree that draws, accepted
    # ~0.6 of the time, seldom repay; where sampled drafts do not pay (on this CPU every sampled
    # chain ran 0.8-0.94x incremental sampling), tries every 64 steps cost ~4% of decoding
    # (aiohttp's source, T = 0.7: 0.88x / 0.89x incremental sampling against 0.93x / 0.93x with
    # 512, alternated; greedy unchanged within the noise, 1.15x against 1.13x). Where drafts pay
    # the wait never grows.
    SAMPLED_MOST_WAIT = 512
    GAIN_WEIGHT = 0.3    # of a new step in the moving average of the expected speedup

    def __init__(self, most_wait: int = RETRY[1]):
        """``most_wait``: the most steps between tries while drafts do not pay."""
        bands = len(self.EDGES) + 1
        # Per rank (0: chain token, 1: runner-up) and probability band. Every step runs this on a
        # few candidates, so plain floats, not numpy (a call on a few numbers costs ~1 us), and
        # forgetting is one multiplication a step: each step's counts go in times ``_weight``, which
        # grows by 1 / FORGET a step, and a count is read as the stored sum over ``_weight``.
        self._accepted, self._expected, self._seen = ([[0.0] * bands for _ in range(2)] for _ in range(3))
        self._weight = 1.0
        self.gain: float | None = None                # expected speedup of drafting (moving average)
        self._waited, self._wait, self._most_wait = 0, self.RETRY[0], most_wait

    def __call__(self, probability: Sequence[float], rank: int) -> list[float]:
        """The chance that verification accepts a candidate of this rank and SSM probability, once
        its parent is accepted."""
        accepted, expected, prior = self._accepted[rank], self._expected[rank], self.PRIOR * self._weight
        out = []
        for p in probability:
            band = bisect.bisect_right(self.EDGES, p)
            out.append(min(p * ((accepted[band] + prior) / (expected[band] + prior)), 1.0))
        return out

    def observe(self, probability: Sequence[float], rank: Sequence[int], accepted: Sequence[bool]) -> None:
        """One verified step: the SSM probability and rank of each candidate whose parent was
        accepted, and whether it was."""
        self._weight /= self.FORGET
        if self._weight > 1e100:   # rescaled now and then, long before a float overflows
            for record in (self._accepted, self._expected, self._seen):
                for row in record:
                    row[:] = [x / self._weight for x in row]
            self._weight = 1.0
        w = self._weight
        for p, r, a in zip(probability, rank, accepted):
            band = bisect.bisect_right(self.EDGES, p)
            self._accepted[r][band] += w * bool(a)
            self._expected[r][band] += w * p
            self._seen[r][band] += w

    def rate(self, rank: int) -> float:
        """The chance that verification accepts a candidate of this rank once its parent is,
        whatever its probability: accepted / seen over the steps seen (old ones forgotten), the
        SSM's own word (its mean probability of them; an even chance before any) as the prior."""
        seen = sum(self._seen[rank])
        own = sum(self._expected[rank]) / seen if seen else 0.5
        return (sum(self._accepted[rank]) + self.PRIOR * own * self._weight) / (seen + self.PRIOR * self._weight)

    def learn(self, tree: TokenTree, proposed: Sequence[tuple[int, int, float]], path_tokens: Sequence[int]) -> None:
        """One verified step of a drafter's tree: ``proposed`` its candidates as (tree node, rank,
        probability), ``path_tokens`` the accepted path's tokens, root first."""
        accepted, node = {0}, 0
        for token in path_tokens[1:]:
            node = tree.child(node, int(token))
            if node is None:
                break
            accepted.add(node)
        reached = [(n, rank, p) for n, rank, p in proposed if tree.parents[n] in accepted]
        if reached:
            nodes, ranks, probability = zip(*reached)
            self.observe(probability, ranks, [n in accepted for n in nodes])

    def expect(self, speedup: float) -> None:
        """A draft's expected speedup over not drafting (:meth:`TreeSizer.speedup`)."""
        self.gain = speedup if self.gain is None else self.gain + self.GAIN_WEIGHT * (speedup - self.gain)
        if self.gain >= 1.0:
            self._wait = self.RETRY[0]

    def drafting_pays(self, lead: float = 0.0) -> bool:
        """Whether to draft this step: yes while drafts are expected to pay, else now and then to
        see whether they do again (the wait doubles each time they still do not); not while
        ``lead``, the speedup the step's free drafts already give, is higher."""
        if self.gain is not None and self.gain < lead:
            return False
        if self.gain is None or self.gain >= 1.0:
            return True
        self._waited += 1
        if self._waited < self._wait:
            return False
        self._waited, self._wait = 0, min(2 * self._wait, self._most_wait)
        return True


_acceptance: "weakref.WeakKeyDictionary[object, dict[tuple, Acceptance]]" = weakref.WeakKeyDictionary()


def acceptance(owner: object, params: SamplingParams, drafter: str = "ssm", rule: str = "mss") -> Acceptance:
    """A drafter's acceptance record under this sampling (greedy and each temperature / top-k /
    top-p accept differently) and, sampled, this verification rule (naive sampling accepts about
    half what traversal does), kept as long as its owner lives and shared by its sequences: an
    SSM's (``drafter="ssm"``, ``owner`` the SSM's Runtime) or the lookup drafter's (``"lookup"``,
    ``owner`` the LLM's Runtime, or the served lookup model). A sampled record waits longer between
    tries while drafts do not pay (:attr:`Acceptance.SAMPLED_MOST_WAIT`)."""
    by_params = _acceptance.setdefault(owner, {})
    key = (drafter,) + ((0.0,) if params.greedy else (params.temperature, params.top_k, params.top_p, rule))
    if key not in by_params:
        by_params[key] = Acceptance(Acceptance.RETRY[1] if params.greedy else Acceptance.SAMPLED_MOST_WAIT)
    return by_params[key]


class DrafterCalls:
    """What an SSM's drafter calls cost, by the tokens a call drafts, and how many chain tokens
    the sizer keeps of its drafts (moving averages): shared by every sequence that drafts with the
    SSM (:func:`drafter_calls`), as a request's first drafts would otherwise start from nothing:
    its first sampled chain drawn as if each token drafted deeper cost nothing, its first greedy
    chunk 8 deep whatever the sizer had been keeping."""

    WEIGHT = 0.2   # of a new call in the moving averages

    def __init__(self, depth: int):
        self.seconds: dict[int, float] = {}   # a call's seconds by its tokens
        self.kept = float(depth)              # chain tokens the sizer keeps

    def observe_call(self, tokens: int, seconds: float) -> None:
        self.seconds[tokens] = self.seconds.get(tokens, seconds) * (1 - self.WEIGHT) + self.WEIGHT * seconds

    def observe_kept(self, tokens: int) -> None:
        self.kept += self.WEIGHT * (tokens - self.kept)

    def token_seconds(self) -> float:
        """What one more drafted token costs: its share of a call, at the call size nearest the
        chain tokens kept (a call of t tokens costs about t + 1 tokens' worth: 1, 4 and 8 sampled
        tokens 112, 244 and 430 us, alone, on one machine here). 0 before any call."""
        if not self.seconds:
            return 0.0
        size = min(self.seconds, key=lambda t: abs(t - self.kept))
        return self.seconds[size] / (size + 1)


_drafter_calls: "weakref.WeakKeyDictionary[Runtime, dict[bool, DrafterCalls]]" = weakref.WeakKeyDictionary()


def drafter_calls(runtime: Runtime, sampled: bool, depth: int) -> DrafterCalls:
    """The SSM's :class:`DrafterCalls` of greedy or ``sampled`` drafts (their drafters are different
    graphs), kept as long as the SSM's Runtime lives; ``depth``: the chain tokens expected kept
    before any draft."""
    by_kind = _drafter_calls.setdefault(runtime, {})
    if sampled not in by_kind:
        by_kind[sampled] = DrafterCalls(depth)
    return by_kind[sampled]
