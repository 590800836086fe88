"""Speculation: each small model (SSM) grows a token tree, one Runtime call per depth (a greedy
chain: one call per chunk of the engine's drafter, :meth:`Runtime.draft_chain`).

A draft starts by scoring, in one call, the tokens accepted last step that this SSM has not scored
yet (its *catch-up*) followed by the root (the last emitted token). The root's logits give its
children; each later depth is one call scoring all new frontier nodes together, their parents being
pending nodes of earlier calls. The deepest nodes are never scored: their logits would only serve a
depth we do not build, and if accepted they become next step's catch-up, so no KV is wasted.

A draft is a generator that yields its chain drafts (:data:`Drafting`): :func:`run_drafts` runs
many sequences' drafts side by side and makes each SSM's chains for all of them in one run.
"""
from __future__ import annotations

import itertools
import math
import operator
import time
from typing import Generator, Hashable, Sequence

import numpy as np

from .engines.runtime import ChainDraft, Runtime, each_or_its_error, top_tokens
from .errors import SpecInferError
from .sampling import SamplingParams, probabilities, sample
from .tree import Proposal, TokenTree
from .tree_sizing import Acceptance, DrafterCalls, TreeSizer, acceptance, drafter_calls, warm_drafter


def parse_widths(spec: str) -> list[int]:
    """Expansion widths per depth from ``"1,1,3,1"``: depth d gives each node ``widths[d-1]`` children."""
    try:
        widths = [int(w) for w in str(spec).split(",")]
    except ValueError:
        raise SpecInferError(f"a tree is 'dynamic' or comma-separated widths like '1,1,3,1', got {spec!r}") from None
    if any(w < 1 for w in widths):
        raise SpecInferError(f"tree widths must all be >= 1, got {spec!r}")
    return widths


DYNAMIC = "dynamic"   # the tree spec of the dynamic tree (tree_sizing.py)
NONE = "none"         # the tree spec of no speculation: incremental decoding
DYNAMIC_DEPTH = 8     # the most tokens an SSM drafts for it: one call of the exported drafter
# A dynamic tree's first greedy drafter call asks for this many chain tokens more than the sizer
# has been keeping (a moving average; sampled draws are drawn as deep as they are kept): a drafter
# call costs about linearly in its tokens (each an unrolled step of the graph), so drafting 8 where
# 2 are kept would pay for 6 unread steps; a chain that would pay for more goes on in another call
# (SSMDrafter._go_on) and raises the average.
DEPTH_MARGIN = 2
# An SSM drafts only into a tree with room for two draft nodes: its call costs about what a longer
# draft costs (a batch that shares out few nodes leaves its requests the lookup's free drafts).
SSM_MIN_BUDGET = 3
# Catch-up tokens (a prompt, or the tokens of steps an SSM did not draft) that go into its cache by
# a prefill, on the pool, before it drafts; fewer are the first step of its drafter's run, which
# runs on one thread (DraftChain) and would take a prompt of 200 tokens in ~3 ms.
PREFILL_CATCH_UP = 32


def parse_tree(spec: "str | Sequence[int] | None") -> list[int] | None:
    """A tree spec: ``"dynamic"`` (or None) for the dynamic tree, returned as None; ``"none"`` for
    no speculation (incremental decoding), returned as []; else widths per depth as
    :func:`parse_widths` reads them."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == DYNAMIC):
        return None
    if isinstance(spec, str) and spec.strip().lower() == NONE:
        return []
    if isinstance(spec, str):
        return parse_widths(spec)
    return parse_widths(",".join(map(str, spec)))


# Where the embedded SSMs measured best on their held-out prompts with fixed trees, greedy (see
# docs/benchmarks.md). The dynamic tree sizes itself and needs no threshold. Nor do sampled drafts:
# a draw is accepted with sum min(p, q), not with its SSM's top probability, and a calibrated
# (distilled) SSM's top probability is low where its draws are still accepted (held-out code,
# temperature 0.7, a chain of 3: cut at 0.4, 1.77 tokens a step; uncut, 2.49).
DEFAULT_MIN_CONFIDENCE = 0.4


def default_min_confidence(tree: Sequence[int] | None, params: SamplingParams = SamplingParams()) -> float:
    """The min-confidence a tree gets unless one is given: none for the dynamic tree (None) and
    under sampling."""
    return DEFAULT_MIN_CONFIDENCE if tree is not None and params.greedy else 0.0


def check_vocab(llm: Runtime, ssms: Sequence[Runtime]) -> None:
    """Every SSM must share the LLM's vocabulary: a token id means the same thing to both."""
    for i, ssm in enumerate(ssms):
        if ssm.vocab_size != llm.vocab_size:
            raise SpecInferError(f"SSM {i} has vocab size {ssm.vocab_size} but the LLM has {llm.vocab_size}; "
                                 "an SSM must use the LLM's tokenizer")


def confidence(logits: np.ndarray) -> float:
    """The probability of the most likely token (softmax at temperature 1)."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


# A sampled draft is drawn at this multiple of the LLM's temperature. The embedded SSMs are trained
# on the LLM's greedy tokens (boost_tune.py), so they are sharper than the LLM and do better drawn
# flatter: on held-out code (aiohttp, the LLM's samples, temperature 0.7) the LLM accepts a draw
# from SSM 1's top 16 with 0.623 (sum min(p, q)) at 1.5x against 0.586 at 1x. An SSM distilled on
# the LLM's distributions (training/distill.py) is calibrated and does best at 1x (0.704 against 0.659).
DRAFT_TEMPERATURE_SCALE = 1.5


def draft_temperature(params: SamplingParams) -> float:
    """The temperature a sampled draft is drawn at, for sampling with ``params``."""
    return DRAFT_TEMPERATURE_SCALE * params.temperature


def draft_distribution(candidates: np.ndarray, logits: np.ndarray, temperature: float, vocab_size: int) -> np.ndarray:
    """The law of a sampled draft's token (:meth:`Runtime.draft_chain` with noise): softmax of the
    candidates' logits at ``temperature``, nothing elsewhere; float64 [V]. (The engine draws by
    Gumbel-max in float32: its law is this one up to float32 rounding, about 1e-7.)"""
    q = np.zeros(vocab_size)
    q[np.asarray(candidates)] = probabilities(logits, SamplingParams(temperature=temperature))
    return q


def sample_without_replacement(p: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """Up to k distinct tokens: draw one from p, zero it, renormalize, draw again; stop if no mass is left."""
    p = np.array(p, dtype=np.float64)
    out = []
    for _ in range(k):
        if not p.sum() > 0:
            break
        token = sample(p, rng)   # sample() scales by the total mass: renormalizing is implicit
        out.append(token)
        p[token] = 0.0
    return out


# A draft in progress: a generator that yields each drafter call it needs, as (runtime, (seq_id,
# tokens, depth, noise)), is sent back (the ChainDraft, the call's seconds), and returns its tree.
Drafting = Generator[tuple[Runtime, tuple], tuple[ChainDraft, float], TokenTree]


def run_drafts(draftings: Sequence[Generator]) -> list:
    """Run drafts side by side: every round, the drafter calls they wait on go to each runtime in
    one :meth:`Runtime.draft_chains` call (many sequences' drafts in one model run), each draft
    charged its share of the run's time. Returns what each returned, or the exception that ended it
    (the others go on)."""
    results: list = [None] * len(draftings)
    waiting: dict[int, tuple[Runtime, tuple]] = {}

    def resume(i: int, sent) -> None:
        try:
            if isinstance(sent, BaseException):
                waiting[i] = draftings[i].throw(sent)
            else:
                waiting[i] = draftings[i].send(sent)
        except StopIteration as done:
            results[i] = done.value
        except Exception as e:  # noqa: BLE001 - this draft fails, the others go on
            results[i] = e

    for i in range(len(draftings)):
        resume(i, None)
    while waiting:
        by_runtime: dict[int, list[int]] = {}
        for i, (runtime, _) in waiting.items():
            by_runtime.setdefault(id(runtime), []).append(i)
        now, waiting = waiting, {}
        for members in by_runtime.values():
            runtime, calls = now[members[0]][0], [now[i][1] for i in members]
            started = time.perf_counter()
            parts = each_or_its_error(runtime.draft_chains, calls)   # a failing call fails its draft alone
            share = (time.perf_counter() - started) / len(members)
            for i, part in zip(members, parts):
                resume(i, part if isinstance(part, BaseException) else (part, share))
    return results


def run_draft(drafting: Generator):
    """One draft alone (:func:`run_drafts` of one): what it returns; raises what ended it."""
    (result,) = run_drafts([drafting])
    if isinstance(result, BaseException):
        raise result
    return result


class SSMDrafter:
    """One SSM's sequence in its Runtime: drafts a tree per step and commits what was accepted."""

    def __init__(self, runtime: Runtime, index: int = 0, capacity: int | None = None,
                 seq_id: Hashable | None = None, min_confidence: float = 0.0, sizer: TreeSizer | None = None,
                 draw_dynamic: bool = True, rule: str = "mss"):
        self.runtime, self.index = runtime, index
        self.rule = rule   # the verification rule of sampled steps: its own acceptance record
        # Under sampling the dynamic tree's chain is the SSM's draws (accepted with sum min(p, q)),
        # or without draw_dynamic its top tokens (point masses to verification, accepted with
        # p(top)); both exact. Draws by default: with the distilled sampling SSM, on held-out code
        # at temperature 0.7, they made 1.11-1.19x incremental sampling against 0.91x for its top
        # tokens; with the boost-tuned SSM 1 the two were even (0.77-1.10x against 0.83-1.09x).
        # A fixed chain is always drawn.
        self.draw_dynamic = draw_dynamic
        # A node whose top token has less probability than this under the SSM gets no children:
        # the tree stops growing where the SSM is unsure, which saves SSM calls and verified
        # tokens. Any tree keeps the output exact: its shape depends on the SSM alone.
        self.min_confidence = min_confidence
        # With a sizer the draft is the dynamic tree: a chain of the SSM's top tokens, cut where
        # more tokens would no longer pay for their verification (tree_sizing.py).
        self.sizer = sizer
        self.seq = runtime.start(seq_id, capacity)
        self.catch_up: list[int] = []            # accepted tokens this SSM has not scored yet
        self._tree: TokenTree | None = None      # the draft awaiting commit
        self._slot: dict[int, int] = {}          # scored tree node -> its pending index in the runtime
        self.seconds = 0.0                        # what the last draft cost (see drafting)
        self.catch_up_seconds = 0.0               # of which its prefill of a long catch-up
        self._calls: DrafterCalls | None = None     # with a sizer: what this SSM's drafter calls cost
        # With a sizer: the SSM's acceptance record, and the draft's candidates as
        # (tree node, rank, SSM probability), for the record to learn from at commit.
        self._acceptance: Acceptance | None = None
        self._proposed: list[tuple[int, int, float]] = []
        self._reached: tuple[int, int, list[float]] | None = None   # _reach's last answer

    def prefill(self, tokens: Sequence[int]) -> None:
        """Take a prompt (all of it but the root, which the first draft scores). It waits as
        catch-up until this SSM first drafts (a prefill then, :data:`PREFILL_CATCH_UP`): a request
        that never drafts (in a large batch, or where drafts do not pay) never runs the SSM, and
        its first token does not wait for it. A prompt longer than the SSM's capacity gets no drafts."""
        self.catch_up += [int(t) for t in tokens]

    def release(self) -> None:
        self.runtime.release(self.seq)

    def draft(self, root: int, widths: Sequence[int], params: SamplingParams, rng: np.random.Generator,
              budget: int, lead: float = 0.0) -> TokenTree:
        """:meth:`drafting` run alone: this SSM's tree from ``root``."""
        return run_draft(self.drafting(root, widths, params, rng, budget, lead))

    def drafting(self, root: int, widths: Sequence[int], params: SamplingParams, rng: np.random.Generator,
                 budget: int, lead: float = 0.0) -> Drafting:
        """Grow a tree from ``root``, as a :data:`Drafting` (its chain drafts are yielded to
        :func:`run_drafts`, which makes many sequences' together): depth d gives each frontier node
        ``widths[d-1]`` children (greedy: the SSM's top tokens; sampling: distinct draws from its
        shaped distribution).

        The first Runtime call scores ``self.catch_up + [root]``, each later depth one more call.
        The tree has at most ``budget`` nodes (root included) and never outgrows the runtime's
        capacity: it shrinks rather than fails; under ``SSM_MIN_BUDGET`` it is the root alone, with
        no call. Proposals carry this SSM's ``index``. ``lead``
        (dynamic tree): the expected speedup of the step's drafts that cost no model call; the
        SSM drafts only if its own drafts have been expected to do better. :attr:`seconds` is then
        what the draft cost: its own time and its share of the drafter runs it was in;
        :attr:`catch_up_seconds` the part of it that took a long catch-up in by a prefill.
        """
        if self.sizer is not None:   # before the clock starts: a one-off, not what drafts cost
            sampled = not params.greedy and self.draw_dynamic
            warm_drafter(self.runtime, sampled=sampled)
            self._calls = drafter_calls(self.runtime, sampled, DYNAMIC_DEPTH)
        started, self.seconds, self.catch_up_seconds = time.perf_counter(), 0.0, 0.0
        tree = yield from self._drafting(root, widths, params, rng, budget, lead)
        self.seconds += time.perf_counter() - started
        return tree

    def _drafting(self, root: int, widths: Sequence[int], params: SamplingParams, rng: np.random.Generator,
                  budget: int, lead: float) -> Drafting:
        if self._tree is not None:
            raise SpecInferError("draft called twice without a commit in between")
        tree = TokenTree(root)
        self._tree, self._slot, self._proposed = tree, {}, []
        if budget < SSM_MIN_BUDGET:
            return tree   # no draft worth the call: no call now, the tokens wait as catch-up
        # The cheap verdicts first: where drafts do not pay, most steps end here (a sampled step
        # that drafts nothing cost ~15 us more than incremental sampling's, ~5% of its step).
        if self.sizer is not None:
            self._acceptance = acceptance(self.runtime, params, rule=self.rule)
            if not self._acceptance.drafting_pays(lead):
                return tree   # drafts do not pay here: no call now, the tokens wait as catch-up
        free = self.runtime.capacity(self.seq) - self.runtime.length(self.seq)
        if len(self.catch_up) + 1 > free:
            return tree   # no room to even catch up: no speculation; commit keeps these as catch-up
        chain = self.catch_up + [int(root)]
        if len(self.catch_up) >= PREFILL_CATCH_UP:   # a prompt, or a long wait: in by a prefill first
            start = time.perf_counter()
            self.runtime.prefill(self.seq, self.catch_up)
            self.catch_up_seconds = time.perf_counter() - start
            free -= len(self.catch_up)
            chain, self.catch_up = [int(root)], []
        if self.sizer is not None or all(w == 1 for w in widths):   # a chain: in the runtime's fewest calls
            # Greedy: the SSM's top tokens (deterministic candidates; the dynamic tree rates them by
            # their probability). Sampling: a fixed chain's tokens are drawn, the dynamic tree's
            # with draw_dynamic.
            drawn = not params.greedy and (self.sizer is None or self.draw_dynamic)
            sampled = (rng, draft_temperature(params)) if drawn else None
            return (yield from self._draft_chain(chain, tree, min(len(widths), budget - 1, free - len(chain) + 1),
                                                 budget, sampled))
        logits = self.runtime.score(self.seq, chain)
        pending = len(chain)
        self._slot[0] = pending - 1
        frontier = [(0, logits[-1])]
        for depth, width in enumerate(widths, start=1):
            new: list[int] = []
            for node, node_logits in frontier:
                k = min(width, budget - len(tree))
                if k <= 0:
                    break
                if self.min_confidence and confidence(node_logits) < self.min_confidence:
                    continue
                if params.greedy:
                    q, tokens = None, top_tokens(node_logits, k)
                else:
                    q = probabilities(node_logits, params)
                    tokens = sample_without_replacement(q, k, rng)
                new += [tree.add(node, t, Proposal(self.index, rank, q)) for rank, t in enumerate(tokens)]
            # Score this depth only if another depth will expand it, and only what fits the cache.
            new = new[:free - pending]
            if depth == len(widths) or len(tree) >= budget or not new:
                break
            logits = self.runtime.score(self.seq, [tree.tokens[n] for n in new],
                                        [self._slot[tree.parents[n]] for n in new])
            for i, n in enumerate(new):
                self._slot[n] = pending + i
            pending += len(new)
            frontier = list(zip(new, logits))
        return tree

    def _draft_chain(self, chain: list[int], tree: TokenTree, depth: int, budget: int,
                     sampled: tuple[np.random.Generator, float] | None = None) -> Drafting:
        """A chain of up to ``depth`` tokens, drafted in chunks of at most the runtime's
        :attr:`Runtime.draft_depth` (with a sizer, the first chunk ``DEPTH_MARGIN`` more than the
        chain tokens the sizer has been keeping) and cut where the SSM's confidence falls below
        ``min_confidence``. Greedy (``sampled`` None): the SSM's top tokens, deterministic
        candidates (exact under sampling too), and with a sizer each depth's runner-up may join as
        a leaf beside the chain token. ``sampled`` = (rng, temperature): each token drawn from the
        SSM's likeliest tokens at that temperature (:func:`draft_distribution`), its proposal
        carrying that distribution. With a sizer the nodes kept are the likeliest to be accepted,
        as many as pay for their verification, and drafting goes on while another chunk is
        expected to pay for itself; sampled, the chain is drawn as deep as its draws' acceptance
        rate pays for (:meth:`_drawn_depth`), all of it kept. Draft token i sits at pending index
        ``len(chain) + i``; the last one is not scored (an engine may score it, but we do not count
        on it: if accepted, it is next step's catch-up), nor are runner-ups."""
        self._slot[0], self._reached = len(chain) - 1, None
        if depth < 1:
            self.runtime.score(self.seq, chain)   # the chain's KV still goes in: commit keeps it
            return tree
        draft = ChainDraft([], [], [], [], [], [])
        inputs, keep, q = chain, 0, []
        if self.sizer is not None and sampled is not None:
            depth = self._drawn_depth(depth)   # the whole chain's, chosen before drawing
        size = min(self.runtime.draft_depth, depth)
        if self.sizer is not None and sampled is None:
            size = min(size, int(np.ceil(self._calls.kept)) + DEPTH_MARGIN)
        while True:
            size = min(size, depth - len(draft.tokens))
            noise = None
            if sampled is not None:
                rng, temperature = sampled
                noise = (temperature * rng.gumbel(size=(size, self.runtime.draft_candidates))).astype(np.float32)
            suspended = time.perf_counter()
            part, seconds = yield self.runtime, (self.seq, inputs, size, noise)
            self.seconds -= time.perf_counter() - suspended - seconds   # others' drafts are not this one's
            if sampled is not None:
                # Each token's proposal: the distribution it was drawn from; its likeliest token's
                # probability there is the SSM's confidence at the token's parent.
                for candidates, logits in zip(part.candidates, part.candidate_logits):
                    q.append(draft_distribution(candidates, logits, temperature, self.runtime.vocab_size))
                    part.probability.append(float(q[-1][candidates].max()))
            if self.sizer is not None:
                self._calls.observe_call(size, seconds)
            for mine, theirs in zip(draft, part):
                mine += theirs
            confident = next((i for i, p in enumerate(draft.probability) if p < self.min_confidence), None)
            keep = len(draft.tokens) if confident is None else confident
            if confident is not None or len(draft.tokens) >= depth or not self._go_on(draft, part, budget):
                break
            inputs = draft.tokens[-1:]   # the next chunk continues the chain from its last token
        chain_node = [0] * (keep + 1)    # chain token i's tree node at chain_node[i + 1]; the root at 0
        candidates = sorted(self._candidates(draft, keep, budget))
        if self.sizer is not None:
            self._calls.observe_kept(sum(rank == 0 for _, rank in candidates))
        for i, rank in candidates:
            node = tree.add(chain_node[i], draft.tokens[i] if rank == 0 else draft.runner_up[i],
                            Proposal(self.index, rank, q[i] if q else None))
            if self.sizer is not None:
                self._proposed.append((node, rank, (draft.probability if rank == 0 else draft.runner_up_probability)[i]))
            if rank == 0:
                chain_node[i + 1] = node
                if i < len(draft.tokens) - 1:
                    self._slot[node] = len(chain) + i
        return tree

    def _go_on(self, draft: ChainDraft, chunk: ChainDraft, budget: int) -> bool:
        """Whether to draft another chunk: without a sizer, until the depth asked; with one, if the
        chunk's tokens, expected as likely as the last chunk's on average, would pay for drafting
        and verifying them (sampled draws: until the depth chosen before drawing them)."""
        if self.sizer is None or draft.candidates:
            return True
        reach = self._reach(draft, len(draft.tokens))
        if len(reach) + 1 >= budget:
            return False
        likely = math.exp(sum(math.log(max(p, 1e-9)) for p in chunk.probability) / len(chunk.probability))
        last = reach[len(draft.tokens) - 1]
        more = [last * likely ** depth for depth in range(1, len(chunk.tokens) + 1)]
        return self.sizer.drafting_more_pays(sorted(reach, reverse=True), more, self._calls.seconds[len(chunk.tokens)])

    def _drawn_depth(self, most: int) -> int:
        """How many tokens a sampled chain draws under a sizer, all of them verified.

        A draw is accepted with sum min(p, q), which its parent's confidence foretells only
        roughly (on held-out code at temperature 0.7, draws at confidence 0.1-0.2 were accepted
        0.37 of the time, at 0.9-0.95 0.86), and verification must take every draw kept whatever
        its value, so a cut could only follow the draws before it, and drawing past the cut wastes
        the drafter's tokens (a chain drawn 6 deep and cut to about 3 ran 0.84x a fixed chain of 4
        here). So the depth follows the draws' measured acceptance rate and what a step costs at
        each depth (the sizer's LLM line, the drafter's seconds per token), fixed before drawing."""
        rate, token_seconds, usual = self._acceptance.rate(0), self._calls.token_seconds(), self._calls.kept
        reach = [rate ** depth for depth in range(1, most + 1)]
        drafting = [token_seconds * (depth - usual) for depth in range(most + 1)]
        count, speedup = self.sizer.best(reach, drafting)
        self._acceptance.expect(speedup)
        return max(1, count)

    def _reach(self, draft: ChainDraft, keep: int) -> list[float]:
        """The chance that verification accepts each node of a chain of top tokens, by the SSM's
        probabilities as the acceptance record rates them: the first ``keep`` chain tokens, then
        their runner-ups (chain token i and runner-up i are both children of chain token i - 1).
        Sampled chains are not rated node by node (:meth:`_drawn_depth`). Kept for the draft's
        last length and ``keep``, as :meth:`_go_on` and then :meth:`_candidates` ask the same."""
        if self._reached is not None and self._reached[:2] == (len(draft.tokens), keep):
            return self._reached[2]
        first = self._acceptance(draft.probability[:keep], 0)
        reach = list(itertools.accumulate(first, operator.mul))
        above = [1.0] + reach[:-1]
        # A runner-up is never rated above its sibling, which verification must meet first (rank 0).
        second = self._acceptance(draft.runner_up_probability[:keep], 1)
        self._reached = (len(draft.tokens), keep, reach + [a * min(s, f) for a, s, f in zip(above, second, first)])
        return self._reached[2]

    def _candidates(self, draft: ChainDraft, keep: int, budget: int) -> list[tuple[int, int]]:
        """The draft nodes to verify, as (depth index, rank): the chain's first ``keep`` tokens
        (rank 0) or, with a sizer, the likeliest of them and of their runner-ups (rank 1).

        A sampled chain keeps every draw: a draw must never be kept for its own value
        (verification takes it for a fair draw from its q), and its depth was chosen before
        drawing (:meth:`_drawn_depth`)."""
        if self.sizer is None or draft.candidates:   # sampled: as deep as _drawn_depth chose
            return [(i, 0) for i in range(min(keep, budget - 1))]
        reach = self._reach(draft, keep)
        # Likeliest first; a child is never likelier than its parent, and at equal reach the sort
        # keeps the parent (lower depth, rank 0) first, so every kept prefix is a tree.
        candidates = sorted([(-r, i % keep, i // keep) for i, r in enumerate(reach)])
        ranked = [-c[0] for c in candidates]
        # The step's overhead was measured drafting about as deep as the sizer has been keeping:
        # keeping more chain tokens (or fewer) soon drafts that much deeper (or shallower), each
        # drafted token costing about its share of a call (DrafterCalls.token_seconds).
        token_seconds, usual = self._calls.token_seconds(), self._calls.kept
        chain_tokens = itertools.accumulate((rank == 0 for _, _, rank in candidates), initial=0)
        drafting = [token_seconds * (tokens - usual) for tokens in chain_tokens]
        count, speedup = self.sizer.best(ranked, drafting)
        self._acceptance.expect(speedup)
        kept = candidates[:min(budget - 1, count)]
        return [(i, rank) for _, i, rank in kept]

    @property
    def drafted(self) -> bool:
        """Whether the draft awaiting commit called the SSM (else it is the root alone, at no cost)."""
        return self._tree is not None and 0 in self._slot

    def commit(self, path_tokens: Sequence[int]) -> None:
        """Keep what verification accepted: ``path_tokens`` is the accepted path's tokens, root first,
        without the bonus. The SSM commits catch-up + root + the part of the path it scored; the rest
        becomes the next draft's catch-up. Without a draft since the last commit, all of it does."""
        path_tokens, tree = [int(t) for t in path_tokens], self._tree
        if tree is not None and (not path_tokens or path_tokens[0] != tree.tokens[0]):
            raise SpecInferError(f"accepted path {path_tokens} does not start at the draft's root {tree.tokens[0]}")
        self._tree = None
        if tree is not None and self._proposed:
            self._acceptance.learn(tree, self._proposed, path_tokens)
        self._proposed = []
        if tree is None or 0 not in self._slot:
            # No draft this step (the caller skipped it) or no room to score one: this SSM has seen
            # none of these tokens, so they all wait as catch-up.
            self.catch_up += path_tokens   # in place: a prompt waits here too, hundreds of tokens
            return
        keep = list(range(len(self.catch_up) + 1))   # catch-up + root: the first call's nodes
        node, matched = 0, 0
        for token in path_tokens[1:]:
            node = tree.child(node, token)
            if node is None or node not in self._slot:
                break
            keep.append(self._slot[node])
            matched += 1
        self.runtime.commit(self.seq, keep)
        self.catch_up = path_tokens[1 + matched:]
