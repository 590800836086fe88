"""Speculation: each small model (SSM) grows a token tree, one Runtime call per depth.

A draft starts by scoring, in one call, the tokens accepted last step that this SSM has not scored
yet (its *catch-up*) followed by the root (the last emitted token). The root's logits give its
children; each later depth is one call scoring all new frontier nodes together, their parents being
pending nodes of earlier calls. The deepest nodes are never scored: their logits would only serve a
depth we do not build, and if accepted they become next step's catch-up, so no KV is wasted.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from .engines.runtime import Runtime
from .errors import SpecInferError
from .sampling import SamplingParams, probabilities, sample
from .tree import Proposal, TokenTree
from .tree_sizing import TreeSizer


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
DYNAMIC_DEPTH = 8     # tokens an SSM drafts for it (the exported drafter's depth: one call)


def parse_tree(spec: "str | Sequence[int] | None") -> list[int] | None:
    """A tree spec: ``"dynamic"`` (or None) for the dynamic tree, returned as None; else widths
    per depth as :func:`parse_widths` reads them."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == DYNAMIC):
        return None
    if isinstance(spec, str):
        return parse_widths(spec)
    return parse_widths(",".join(map(str, spec)))


# Where the embedded SSMs measured best on their held-out prompts with fixed trees (see the README's
# benchmark). The dynamic tree sizes itself and needs no threshold.
DEFAULT_MIN_CONFIDENCE = 0.4


def default_min_confidence(tree: Sequence[int] | None) -> float:
    """The min-confidence a tree gets unless one is given: none for the dynamic tree (None)."""
    return 0.0 if tree is None else DEFAULT_MIN_CONFIDENCE


def check_vocab(llm: Runtime, ssms: Sequence[Runtime]) -> None:
    """Every SSM must share the LLM's vocabulary: a token id means the same thing to both."""
    for i, ssm in enumerate(ssms):
        if ssm.vocab_size != llm.vocab_size:
            raise SpecInferError(f"SSM {i} has vocab size {ssm.vocab_size} but the LLM has {llm.vocab_size}; "
                                 "an SSM must use the LLM's tokenizer")


def top_k(logits: np.ndarray, k: int) -> list[int]:
    """The k largest logits' tokens, best first, ties to the lower id (as argmax breaks them)."""
    k = min(k, len(logits))
    if k == 1:  # the common case (chains): argmax already takes the lowest id among ties
        return [int(np.argmax(logits))]
    part = np.argpartition(-logits, k - 1)[:k]  # O(V), not a full sort of the vocabulary
    return [int(t) for t in part[np.lexsort((part, -logits[part]))]]


def confidence(logits: np.ndarray) -> float:
    """The probability of the most likely token (softmax at temperature 1)."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


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


class SSMDrafter:
    """One SSM's sequence in its Runtime: drafts a tree per step and commits what was accepted."""

    def __init__(self, runtime: Runtime, index: int = 0, capacity: int | None = None,
                 seq_id: Hashable | None = None, min_confidence: float = 0.0, sizer: TreeSizer | None = None):
        self.runtime, self.index = runtime, index
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

    def prefill(self, tokens: Sequence[int]) -> None:
        """Put a prompt (all of it but the root, which the first draft scores) in the SSM's cache."""
        tokens = self.catch_up + [int(t) for t in tokens]
        if tokens:
            self.runtime.prefill(self.seq, tokens)
        self.catch_up = []

    def release(self) -> None:
        self.runtime.release(self.seq)

    def draft(self, root: int, widths: Sequence[int], params: SamplingParams, rng: np.random.Generator,
              budget: int) -> TokenTree:
        """Grow a tree from ``root``: depth d gives each frontier node ``widths[d-1]`` children
        (greedy: the SSM's top tokens; sampling: distinct draws from its shaped distribution).

        The first Runtime call scores ``self.catch_up + [root]``, each later depth one more call.
        The tree has at most ``budget`` nodes (root included) and never outgrows the runtime's
        capacity: it shrinks rather than fails. Proposals carry this SSM's ``index``.
        """
        if self._tree is not None:
            raise SpecInferError("draft called twice without a commit in between")
        chain = self.catch_up + [int(root)]
        tree = TokenTree(root)
        self._tree, self._slot = tree, {}
        free = self.runtime.capacity(self.seq) - self.runtime.length(self.seq)
        if len(chain) > free:
            return tree   # no room to even catch up: no speculation; commit keeps these as catch-up
        if self.sizer is not None or (params.greedy and all(w == 1 for w in widths)):
            return self._draft_chain(chain, tree, min(len(widths), budget - 1, free - len(chain) + 1))
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
                    q, tokens = None, top_k(node_logits, k)
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

    def _draft_chain(self, chain: list[int], tree: TokenTree, depth: int) -> TokenTree:
        """A chain of the SSM's top tokens in one Runtime call (:meth:`Runtime.draft_chain`), cut
        where the SSM's confidence falls below ``min_confidence`` and, with a sizer, where the
        next token would cost more than it brings. The tokens are deterministic candidates (exact
        under sampling too). Draft token i sits at pending index ``len(chain) + i``; the last one
        is not scored (an engine may score it, but we do not count on it: if accepted, it is next
        step's catch-up)."""
        self._slot[0] = len(chain) - 1
        if depth < 1:
            self.runtime.score(self.seq, chain)   # the chain's KV still goes in: commit keeps it
            return tree
        drafted, probability = self.runtime.draft_chain(self.seq, chain, depth)
        keep = next((i for i, p in enumerate(probability) if p < self.min_confidence), len(drafted))
        if self.sizer is not None:
            keep = min(keep, self.sizer.best_count(np.cumprod(probability)))
        node = 0
        for i, token in enumerate(drafted[:keep]):
            node = tree.add(node, token, Proposal(self.index, 0, None))
            if i < depth - 1:
                self._slot[node] = len(chain) + i
        return tree

    def commit(self, path_tokens: Sequence[int]) -> None:
        """Keep what verification accepted: ``path_tokens`` is the accepted path's tokens, root first,
        without the bonus. The SSM commits catch-up + root + the part of the path it scored; the rest
        becomes the next draft's catch-up. Without a draft since the last commit, all of it does."""
        path_tokens, tree = [int(t) for t in path_tokens], self._tree
        if tree is not None and (not path_tokens or path_tokens[0] != tree.tokens[0]):
            raise SpecInferError(f"accepted path {path_tokens} does not start at the draft's root {tree.tokens[0]}")
        self._tree = None
        if tree is None or 0 not in self._slot:
            # No draft this step (the caller skipped it) or no room to score one: this SSM has seen
            # none of these tokens, so they all wait as catch-up.
            self.catch_up = self.catch_up + path_tokens
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
