"""Drafting by lookup: where the sequence's last tokens occurred before, propose what followed them
then (prompt lookup decoding; vLLM's n-gram proposer). No model runs, so a draft costs a few
microseconds: on code, which repeats its names and patterns, and on text that repeats itself, it
proposes long runs the LLM accepts, beside or instead of the SSMs' chains.

It drafts for the dynamic tree: its chain's candidates are rated by its own :class:`Acceptance`
record (a candidate's nominal probability is set by how long the match is, and the record learns
what each length is worth) and the sizer keeps as many as pay. The candidates are deterministic (a
function of the tokens already verified), so greedy verification and multi-step speculative
sampling take them exactly, as point masses, like the SSMs' top tokens.
"""
from __future__ import annotations

import itertools
import operator
from typing import Sequence

from .tree import Proposal, TokenTree
from .tree_sizing import Acceptance, TreeSizer

LONGEST_MATCH = 3                                 # tokens of the sequence's end looked up, at most
MATCH_PROBABILITY = {1: 0.3, 2: 0.5, 3: 0.7}      # a copied token's nominal probability by match length


class LookupDrafter:
    """One sequence's lookup drafts: the tokens verified so far and where each short run of them
    last occurred (with what followed): ``prefill``, ``draft``, ``commit``, ``release``, as
    :class:`speculate.SSMDrafter` has them, but a draft needs only the root and the node budget."""

    def __init__(self, index: int, sizer: TreeSizer, record: Acceptance, depth: int):
        self.index, self.sizer, self.record, self.depth = index, sizer, record, depth
        self.tokens: list[int] = []               # the sequence before the next root
        # A run of 1..LONGEST_MATCH tokens -> the index after its latest occurrence.
        self._next: dict[tuple[int, ...], int] = {}
        self._tree: TokenTree | None = None
        self._proposed: list[tuple[int, int, float]] = []   # (tree node, rank, nominal probability)
        self.speedup = 0.0   # the last draft's expected speedup (TreeSizer.speedup, drafted free)

    def _extend(self, tokens: Sequence[int]) -> None:
        # A run is indexed once the token after it is known, so a lookup never finds the run it
        # is looking up (the sequence's end) with nothing after it.
        for token in tokens:
            end = len(self.tokens)
            for n in range(1, min(LONGEST_MATCH, end) + 1):
                self._next[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def prefill(self, tokens: Sequence[int]) -> None:
        self._extend(tokens)

    def draft(self, root: int, budget: int) -> TokenTree:
        """A chain copied from after the latest earlier occurrence of the sequence's longest
        matching end (root included), cut where more tokens would not pay."""
        tree = self._tree = TokenTree(root)
        self._proposed, self.speedup = [], 0.0
        context = self.tokens + [int(root)]
        for n in range(min(LONGEST_MATCH, len(context)), 0, -1):
            start = self._next.get(tuple(context[-n:]))
            if start is not None:
                break
        else:
            return tree
        chain = context[start:start + min(self.depth, budget - 1)]
        probability = MATCH_PROBABILITY[n]
        reach = list(itertools.accumulate(self.record([probability] * len(chain), 0), operator.mul))
        self.speedup = self.sizer.speedup(reach, free=True)
        node = 0
        for token in chain[:self.sizer.best_count(reach)]:
            node = tree.add(node, token, Proposal(self.index, 0, None))
            self._proposed.append((node, 0, probability))
        return tree

    def commit(self, path_tokens: Sequence[int]) -> None:
        """The accepted path, root first, without the bonus: it joins the sequence, and the record
        learns which copied tokens were accepted."""
        if self._tree is not None and self._proposed:
            self.record.learn(self._tree, self._proposed, path_tokens)
        self._tree, self._proposed = None, []
        self._extend(path_tokens)

    def release(self) -> None:
        self.tokens, self._next = [], {}
