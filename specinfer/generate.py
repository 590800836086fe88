"""The generation loop: incremental decoding is speculative decoding with no SSM.

Every step the LLM scores a token tree in one Runtime call and keeps a verified path plus one token
of its own (the bonus). The tree's root is the last emitted token, which no model has in its KV
cache yet; with no SSM the tree is that root alone and a step is one incremental decoding step.

    start(prompt[:-1]); root = prompt[-1]
    loop: step(root) = SSMs draft trees from root -> merge -> LLM scores the tree -> verify -> commit
          emit path[1:] + [bonus] up to a stop condition; root = bonus

A :class:`Speculator` does one sequence's steps: :class:`LocalSpeculator` in this process, or the
Triton orchestrator's, whose step is one call of the ``spec_step`` ensemble. :func:`decode` is the
one loop over either.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from .engines.runtime import ChainSampling, Runtime
from .errors import SpecInferError
from .lookup import LookupDrafter
from .sampling import SamplingParams, plain_softmax
from .speculate import DYNAMIC_DEPTH, Drafting, SSMDrafter, check_vocab, run_draft
from .tree import TokenTree, merge
from .tree_sizing import acceptance, chains, tree_sizer
from .verify import SAMPLING_RULES, verify

SPECINFER_TREE = (1, 1, 3, 1, 1, 1, 1, 1)  # SpecInfer's expansion config
DEFAULT_BUDGET = 64                      # tree nodes, root included
# Whether a sampled request's dynamic tree drafts by lookup too. A lookup draft is a point mass, which
# verification accepts with the LLM's probability of its token; on held-out code (aiohttp, the
# embedded LLM and distilled SSM 1, 14 prompts x 96 tokens, interleaved, /tmp/s34/ab_samp.py) the
# dynamic tree ran 1.26x incremental sampling with lookup against 1.33x without at T=0.7 (MSS;
# traversal 1.24x / 1.32x), 0.95x / 1.05x at T=1, 1.20x / 1.36x at T=0.3: no temperature where it paid.
LOOKUP_WHEN_SAMPLING = False


def drafts_by_lookup(tree: Sequence[int] | None, params: SamplingParams, lookup: bool = True) -> bool:
    """Whether a request drafts by lookup (lookup.py): asked for (``lookup``), on the dynamic tree
    (``tree`` None), and greedy unless :data:`LOOKUP_WHEN_SAMPLING`."""
    return lookup and tree is None and (params.greedy or LOOKUP_WHEN_SAMPLING)


@dataclass
class Stats:
    """What requests cost (one, or the sum of several given the same Stats). ``tokens_per_step`` counts every emitted token of a verification step
    (accepted speculated tokens plus the LLM's bonus token), as SpecInfer reports it."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    draft_tokens: int = 0      # speculated tree nodes sent to verification (root excluded)
    accepted_draft_tokens: int = 0
    ssm_seconds: float = 0.0
    llm_seconds: float = 0.0
    total_seconds: float = 0.0
    stop_reason: str = ""

    def add_step(self, part: "Stats") -> None:
        """Add what a step's drafting and verification counted in ``part`` (its own Stats)."""
        self.draft_tokens += part.draft_tokens
        self.accepted_draft_tokens += part.accepted_draft_tokens
        self.ssm_seconds += part.ssm_seconds
        self.llm_seconds += part.llm_seconds

    def add(self, other: "Stats") -> None:
        """Add another run's counts and times (e.g. another prompt's)."""
        self.prompt_tokens += other.prompt_tokens
        self.new_tokens += other.new_tokens
        self.tokens_per_step += other.tokens_per_step
        self.add_step(other)
        self.total_seconds += other.total_seconds

    @classmethod
    def total(cls, parts: "Iterable[Stats]") -> "Stats":
        """The sum of several runs' Stats."""
        out = cls()
        for part in parts:
            out.add(part)
        return out

    @property
    def steps(self) -> int:
        return len(self.tokens_per_step)

    @property
    def mean_tokens_per_step(self) -> float:
        return float(np.mean(self.tokens_per_step)) if self.tokens_per_step else 0.0

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.tokens_per_step).items()))

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.ssm_seconds - self.llm_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_seconds:.2f} s ({self.tokens_per_second:.1f} tokens/s), "
                f"{self.steps} steps, {self.mean_tokens_per_step:.2f} tokens/step {self.histogram}, "
                f"time: SSM {self.ssm_seconds:.2f} s, LLM {self.llm_seconds:.2f} s, "
                f"other {self.other_seconds:.2f} s; stop: {self.stop_reason}")


class Speculator(Protocol):
    """One sequence's speculation and verification, wherever the models run."""

    max_context: int

    def start(self, prefix: list[int]) -> None:
        """Put the prompt minus its last token (the first root) in every model's cache."""

    def step(self, root: int, budget: int) -> tuple[list[int], int]:
        """Draft from ``root``, verify, commit; return the accepted path's tokens (root first) and
        the LLM's bonus token. The tree has at most ``budget`` nodes."""

    def release(self) -> None:
        """Free the sequence's state in every model."""


class LocalSpeculator:
    """Speculation with the LLM and SSM Runtimes in this process."""

    def __init__(self, llm: Runtime, ssms: Sequence[Runtime] = (), tree: Sequence[int] | None = None,
                 params: SamplingParams = SamplingParams(), stats: Stats | None = None, seq_id=None,
                 rule: str = "mss", min_confidence: float = 0.0, lookup: bool = False, capacity: int | None = None,
                 max_new_tokens: int | None = None):
        """``tree``: widths per depth (SpecInfer's expansion), None for the dynamic tree, [] for
        none (incremental decoding);
        ``lookup``: the dynamic tree of a greedy request also drafts by lookup in the sequence
        (lookup.py; see :data:`LOOKUP_WHEN_SAMPLING`);
        ``capacity``: tokens the sequence may reach (default the LLM's context). An SSM with a
        shorter context drafts while the sequence fits it, then no more;
        ``max_new_tokens``: the tokens the request wants, if known (incremental steps taken
        several in one run then compute none past them)."""
        check_vocab(llm, ssms)
        if rule not in SAMPLING_RULES:
            raise SpecInferError(f"unknown sampling rule {rule!r}: expected one of {', '.join(SAMPLING_RULES)}")
        lookup = drafts_by_lookup(tree, params, lookup)
        if tree is not None and not tree:   # "none": incremental decoding, no drafter at all
            ssms = ()
        # Incremental decoding takes several steps in one LLM run where the engine can: its drafter
        # graph on the LLM itself (Runtime.decode_chain), each step's argmax (or draw) fed to the next
        # inside the run, so no Python runs between them (and no cache-cold Python: ~100 us a step
        # here, after a run has swept the caches). Same tokens, 1.06x the tokens/s on 16 of
        # aiohttp's prompts. A speculative request's step that drafts nothing takes such a run too,
        # and its sizer weighs every tree against it. Only whole runs of draft_depth: a run of
        # another depth is another session, which costs the embedded LLM ~280 ms to open and 50 MB
        # (its weights prepacked again), so the steps left at the end of a request (or of the
        # context) are taken one a run.
        # Sampled requests (softmax at a temperature, no top-k or top-p cut) chain where the LLM's
        # graph draws each token (Runtime.samples_chains): the same draws as a step a token makes,
        # 1.17-1.18x incremental sampling's tokens/s on 14 of aiohttp's prompts (a Zen 3, AVX2).
        self.can_chain = chains(llm) and (params.greedy or (plain_softmax(params) and llm.samples_chains))
        self.chained = self.can_chain and not ssms and not lookup
        self.sizer = tree_sizer(llm, ssms, lookup, self.can_chain) if tree is None and (ssms or lookup) else None
        self.tree = [1] * DYNAMIC_DEPTH if tree is None else list(tree)
        self.llm, self.params, self.rule = llm, params, rule
        self.max_context = capacity = llm.max_context if capacity is None else capacity
        self.stats = stats if stats is not None else Stats()
        self.rng = np.random.default_rng(params.seed)
        self.seq = llm.start(seq_id, capacity)
        self.drafters: list[SSMDrafter] = []
        self.lookup: LookupDrafter | None = None
        try:
            self.drafters = [SSMDrafter(rt, i, min(capacity, rt.max_context), seq_id=seq_id,
                                        min_confidence=min_confidence, sizer=self.sizer, rule=rule)
                             for i, rt in enumerate(ssms)]
            if lookup:
                self.lookup = LookupDrafter(len(ssms), self.sizer, acceptance(llm, params, "lookup", rule),
                                             greedy=params.greedy)
        except BaseException:
            self.release()
            raise
        self.last_path: list[int] = []
        self._draft_seconds = self._catch_up_seconds = 0.0
        self.wanted = max_new_tokens   # tokens still wanted (None: unknown)

    def start(self, prefix: list[int]) -> None:
        t0 = time.perf_counter()
        if prefix:
            self.llm.prefill(self.seq, prefix)
        self.stats.llm_seconds += time.perf_counter() - t0
        self.start_drafters(prefix)

    def start_drafters(self, prefix: list[int]) -> None:
        """The drafters' half of :meth:`start` (a scheduler prefills the LLM with other work)."""
        t0 = time.perf_counter()
        for d in self.drafters + ([self.lookup] if self.lookup else []):
            d.prefill(prefix)
        self.stats.ssm_seconds += time.perf_counter() - t0

    def step(self, root: int, budget: int) -> tuple[list[int], int]:
        depth = self.chain_depth(budget)
        if depth is None:
            tree = self.propose(root, budget)
            depth = self.chain_instead(tree, budget)
        if depth is not None:
            start = time.perf_counter()
            chain = self.llm.decode_chain(self.seq, [root], depth, self.chain_sampling(depth))
            return self.settle_chain(root, chain, time.perf_counter() - start)
        start = time.perf_counter()
        logits = self.llm.score(self.seq, tree.tokens, tree.parents)
        return self.settle(tree, logits, time.perf_counter() - start)

    def chain_depth(self, budget: int, share: int | None = None) -> int | None:
        """Tokens the next step takes in one LLM run of incremental decoding (the LLM's
        :meth:`~specinfer.engines.runtime.Runtime.decode_chain` from the root), or None where it
        verifies a tree (or takes one token). ``budget``: the nodes the step may take (the
        context's room included); ``share``: the tree nodes a scheduler's batch leaves it, where
        1 means no draft: then a request that drafts chains too, its drafters catching up
        on the chain at their next draft."""
        if self.chained or (self.can_chain and share is not None and share <= 1):
            depth = self.llm.draft_depth
            if depth <= min(budget, self.wanted or budget):
                return depth
        return None

    def chain_sampling(self, depth: int) -> ChainSampling | None:
        """How a chain of ``depth`` tokens draws them (None: greedy): at the request's temperature,
        with the next ``depth`` uniforms of its generator, as ``depth`` steps of one token would
        draw (``sampling.draw``: a uniform a token)."""
        return None if self.params.greedy else ChainSampling(self.params.temperature, self.rng.random(depth))

    def chain_instead(self, tree: TokenTree, budget: int) -> int | None:
        """Where the drafters drafted nothing (``tree`` the root alone), the tokens the step takes in
        one chain run instead, as incremental decoding does (:meth:`chain_depth`; None: verify the
        tree, or one token); the sizer weighs every tree against that run, and learns what the
        draft that kept nothing cost."""
        if len(tree) > 1:
            return None
        depth = self.chain_depth(budget, share=1)
        if depth is not None and self.sizer is not None and any(d.drafted for d in self.drafters):
            self.sizer.observe(self._drafting_seconds)
        return depth

    @property
    def _drafting_seconds(self) -> float:
        """What the last draft cost, as the sizer learns it: without the SSMs' prefills of a long
        catch-up (a prompt, or the tokens of steps they did not draft), which a request pays once
        whatever its trees, not each step. With them the sizer's estimate of a step's drafting was
        0.65-0.94 ms on 8 embedded prompts, without them 0.40-0.51, where a draft of SSM 1 takes
        ~0.27 ms (median) here between LLM calls."""
        return self._draft_seconds - self._catch_up_seconds

    def settle_chain(self, root: int, chain: list[int], llm_seconds: float) -> tuple[list[int], int]:
        """Keep a chain of incremental decoding the LLM drafted from ``root`` (its tokens
        pending but the last): the root and every token but the last committed, the last the next
        root. A scheduler drafts many sequences' chains in one run (scheduler.py)."""
        start = time.perf_counter()
        self.llm.commit(self.seq, range(len(chain)))
        llm_seconds += time.perf_counter() - start
        self.stats.llm_seconds += llm_seconds
        if self.sizer is not None:
            self.sizer.observe_chain(len(chain), llm_seconds)
        self.wanted = self.wanted and self.wanted - len(chain)
        path = [root] + chain[:-1]
        if self.drafters or self.lookup:   # they learn it before their next draft (proposing)
            self.last_path = self.last_path + path
        return path, chain[-1]

    # A step in two halves, so that a scheduler can verify many sequences' trees in one LLM call
    # between them (scheduler.py): the step algorithm is these two whoever calls them.
    def propose(self, root: int, budget: int) -> TokenTree:
        """Draft from ``root`` and merge the drafts into one tree of at most ``budget`` nodes (the
        drafters first learn last step's verdict)."""
        return run_draft(self.proposing(root, budget))

    def proposing(self, root: int, budget: int) -> Drafting:
        """:meth:`propose` as a draft in progress, whose SSM calls a scheduler makes together with
        other sequences' (:func:`~specinfer.speculate.run_drafts`)."""
        t0 = time.perf_counter()
        trees, lead = [], 0.0
        if self.lookup is not None:   # first, as an SSM need not run where the lookup's draft is better
            if self.last_path:
                self.lookup.commit(self.last_path)
            if budget > 1:
                trees.append(self.lookup.draft(root, budget))
                lead = self.lookup.speedup
        for d in self.drafters:
            if self.last_path:
                d.commit(self.last_path)  # the SSMs learn last step's verdict before they draft
        self._draft_seconds, self._catch_up_seconds = time.perf_counter() - t0, 0.0
        for d in self.drafters:
            trees.append((yield from d.drafting(root, self.tree, self.params, self.rng, budget, lead)))
            self._draft_seconds += d.seconds
            self._catch_up_seconds += d.catch_up_seconds
        self.last_path = []
        self.stats.ssm_seconds += self._draft_seconds
        if all(len(t) == 1 for t in trees):   # no drafter drafted (or none runs): nothing to merge
            return TokenTree(root)
        return merge(trees, budget)[0]

    def settle(self, tree: TokenTree, logits: np.ndarray, llm_seconds: float) -> tuple[list[int], int]:
        """Verify ``tree`` with the LLM's ``logits`` for it (its nodes are pending in the LLM's
        sequence) and commit the accepted path; return its tokens (root first) and the bonus token.
        If verification fails the tree is dropped, so the sequence can still step."""
        t0 = time.perf_counter()
        try:
            verdict = verify(tree, logits, self.params, self.rng, self.rule)
        except BaseException:
            self.llm.commit(self.seq, [])
            raise
        self.llm.commit(self.seq, verdict.path)
        llm_seconds += time.perf_counter() - t0
        if self.sizer is not None:   # what drafting and verification cost, as they run
            drafted = any(d.drafted for d in self.drafters)
            self.sizer.observe(self._drafting_seconds if drafted else None, tree_tokens=len(tree), llm_seconds=llm_seconds)
        self.stats.llm_seconds += llm_seconds
        self.wanted = self.wanted and self.wanted - len(verdict.path)   # the path's tokens after the root, and the bonus
        self.stats.draft_tokens += len(tree) - 1
        self.stats.accepted_draft_tokens += len(verdict.path) - 1
        self.last_path = [tree.tokens[i] for i in verdict.path]
        return self.last_path, verdict.bonus

    def release(self) -> None:
        self.llm.release(self.seq)
        for d in self.drafters + ([self.lookup] if self.lookup else []):
            d.release()


def check_request(prompt: Sequence[int], max_new_tokens: int, max_context: int) -> None:
    """The request errors every entry point reports the same way."""
    if not len(prompt):
        raise SpecInferError("the prompt is empty")
    if max_new_tokens < 1:
        raise SpecInferError(f"max tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) >= max_context:
        raise SpecInferError(f"the prompt has {len(prompt)} tokens; the context holds {max_context} "
                             f"(prompt plus at least one new token)")


def decode(speculator: Speculator, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
           budget: int = DEFAULT_BUDGET, stats: Stats | None = None) -> Iterator[list[int]]:
    """The loop: yield each step's new token ids until EOS (included), ``max_new_tokens`` or the
    context capacity. Releases the speculator's state however the loop ends."""
    prompt = [int(t) for t in prompt]
    stats = stats if stats is not None else Stats()  # accumulates over the requests it is given
    eos = set(int(e) for e in eos_ids)
    started = time.perf_counter()
    try:
        check_request(prompt, max_new_tokens, speculator.max_context)
        if budget < 1:
            raise SpecInferError(f"tree budget must be >= 1 node, got {budget}")
        stats.prompt_tokens += len(prompt)
        speculator.start(prompt[:-1])
        length, root, produced, stop = len(prompt) - 1, prompt[-1], 0, ""
        while not stop:
            room = speculator.max_context - length
            if room < 1:
                stats.stop_reason = "context capacity"
                return
            path, bonus = speculator.step(root, min(budget, room))
            length += len(path)
            new = path[1:] + [bonus]
            for i, token in enumerate(new):  # stop conditions may fall inside the accepted path
                if token in eos or produced + i + 1 >= max_new_tokens:
                    new = new[:i + 1]
                    stop = stats.stop_reason = "eos" if token in eos else "max tokens"
                    break
            produced += len(new)
            stats.new_tokens += len(new)
            stats.tokens_per_step.append(len(new))
            yield new
            root = bonus
    finally:
        speculator.release()
        stats.total_seconds += time.perf_counter() - started


def generate_ids(
    llm: Runtime,
    prompt: Sequence[int],
    *,
    ssms: Sequence[Runtime] = (),
    tree: Sequence[int] | None = None,
    params: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_ids: Sequence[int] = (),
    budget: int = DEFAULT_BUDGET,
    stats: Stats | None = None,
    rule: str = "mss",
    min_confidence: float = 0.0,
    lookup: bool = False,
) -> Iterator[list[int]]:
    """Speculative generation in this process: yield the new token ids of each step until EOS
    (included), ``max_new_tokens`` or the context capacity. ``tree``: widths per depth, or None
    for the dynamic tree (sized each step to this machine and the SSMs' confidence). Greedy output is token for token the
    LLM's own greedy decoding; sampled output is distributed as the LLM's own sampling (multi-step
    speculative sampling; ``rule="naive"`` samples from the LLM and follows the tree instead)."""
    stats = stats if stats is not None else Stats()
    speculator = LocalSpeculator(llm, ssms, tree, params, stats, rule=rule, min_confidence=min_confidence,
                                 lookup=lookup, max_new_tokens=max_new_tokens)
    return decode(speculator, prompt, max_new_tokens, eos_ids, budget, stats)
