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
REPEAT_PROBABILITY = 0.9                          # ... and a repeat's, copied past the sequence's end
# Tokens copied at most: more than an SSM's chain, as a copy costs no model call and a sequence that
# repeats itself is accepted far (embedded prompts, bfloat16: 4.2-4.6 tokens a step against 3.9-4.1 at 8).
LOOKUP_DEPTH = 16


class LookupDrafter:
    """One sequence's lookup drafts: the tokens verified so far and where each short run of them
    last occurred (with what followed): ``prefill``, ``draft``, ``commit``, ``release``, as
    :class:`speculate.SSMDrafter` has them, but a draft needs only the root and the node budget."""

    def __init__(self, index: int, sizer: TreeSizer, record: Acceptance, depth: int = LOOKUP_DEPTH,
                 greedy: bool = True):
        self.index, self.sizer, self.record, self.depth, self.greedy = index, sizer, record, depth, greedy
        self.tokens: list[int] = []               # the sequence before the next root
        # A run of 1..LONGEST_MATCH tokens -> the index after its latest occurrence.
        self._next: dict[tuple[int, ...], int] = {}
        # The last draft's whole copied chain, (token, nominal probability) each, and how many of
        # them it proposed (None: no draft awaits its verdict).
        self._chain: list[tuple[int, float]] = []
        self._proposed: int | None = None
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
        matching end (root included; past it, the copy repeats itself), cut where more tokens
        would not pay."""
        tree = TokenTree(root)
        self._chain, self._proposed, self.speedup = [], 0, 0.0
        context = self.tokens + [int(root)]
        for n in range(min(LONGEST_MATCH, len(context)), 0, -1):
            start = self._next.get(tuple(context[-n:]))
            if start is not None:
                break
        else:
            return tree
        # Where the latest occurrence runs into the sequence's end (a run that repeats with period
        # len(context) - start), the copy goes on from its own tokens, as LZ77's overlapping
        # copies do: a sequence that repeats itself is predicted to keep repeating, as far as the
        # depth allows, not only to the end of what it has repeated so far.
        period = len(context) - start
        chain: list[int] = []
        for i in range(min(self.depth, budget - 1)):
            chain.append(context[start + i] if i < period else chain[i - period])
        probability = [MATCH_PROBABILITY[n] if i < period else REPEAT_PROBABILITY for i in range(len(chain))]
        reach = list(itertools.accumulate(self.record(probability, 0), operator.mul))
        self.speedup = self.sizer.speedup(reach, free=True)
        self._proposed = self.sizer.best_count(reach)
        self._chain = list(zip(chain, probability))
        node = 0
        for token in chain[:self._proposed]:
            node = tree.add(node, token, Proposal(self.index, 0, None))
        return tree

    def commit(self, path_tokens: Sequence[int]) -> None:
        """The accepted path, root first, without the bonus: it joins the sequence, and the record
        learns which copied tokens were accepted: the proposed ones, and, greedy, the copied tokens
        it did not propose as far as the path shows what the LLM took there (its greedy tokens),
        so that the record goes on learning while its drafts do not pay (a step that drafts
        nothing then tells it as much as one that drafts)."""
        if self._proposed is not None and self._chain:
            matched = 0   # copied tokens the path took, from the first
            while (matched < len(self._chain) and matched + 1 < len(path_tokens)
                   and self._chain[matched][0] == path_tokens[matched + 1]):
                matched += 1
            # The first copied token the path did not take was verified, and rejected, if it was
            # proposed or, greedy, if the path shows the LLM's token in its place.
            known = max(self._proposed, len(path_tokens) - 1) if self.greedy else self._proposed
            seen = min(matched + 1, known, len(self._chain))
            if seen:
                self.record.observe([p for _, p in self._chain[:seen]], [0] * seen, [i < matched for i in range(seen)])
        self._chain, self._proposed = [], None
        self._extend(path_tokens)

    def release(self) -> None:
        self.tokens, self._next = [], {}
