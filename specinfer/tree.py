"""Token trees: what the small models (SSMs) speculate and what the LLM verifies in one pass.

Node 0 is the root: the last emitted token, not yet in any model's KV cache. Every other node is a
speculated token; its :class:`Proposal` records which SSM drew it, in which order and from which
distribution, which is what multi-step speculative sampling (``verify.py``) needs. The LLM scores
``tree.tokens`` with ``tree.parents`` (-1 for the root) in one Runtime call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import SpecInferError


@dataclass(frozen=True)
class Proposal:
    """How one SSM came to propose a node."""

    ssm: int                   # index of the SSM that drew the node
    rank: int                  # 0, 1, 2...: order in which that SSM drew its children at this parent
    q: np.ndarray | None       # that SSM's shaped distribution at the parent, float64 [V]; None: a deterministic candidate (greedy drafts, top-k)


class TokenTree:
    """A tree of tokens in topological order: a node always comes after its parent.

    ``tokens``, ``parents`` (``parents[0] == -1``), ``depths`` and ``proposals`` (a list per node,
    ``[]`` for the root) are parallel lists indexed by node.
    """

    def __init__(self, root_token: int):
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.proposals: list[list[Proposal]] = [[]]
        self._children: list[list[int]] = [[]]
        self._index: dict[tuple[int, int], int] = {}   # (parent, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, proposal: Proposal | None = None) -> int:
        """Add ``token`` under ``parent`` and return its node. A child with the same token is shared:
        the proposal is appended to it."""
        if not 0 <= parent < len(self):
            raise SpecInferError(f"parent {parent} is not a node of a tree of {len(self)} nodes")
        token = int(token)
        node = self._index.get((parent, token))
        if node is None:
            node = len(self)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.proposals.append([])
            self._children.append([])
            self._children[parent].append(node)
            self._index[(parent, token)] = node
        if proposal is not None:
            self.proposals[node].append(proposal)
        return node

    def child(self, parent: int, token: int) -> int | None:
        """The child of ``parent`` holding ``token``, or None."""
        return self._index.get((parent, int(token)))

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in insertion order."""
        return list(self._children[node])

    def path(self, node: int) -> list[int]:
        """Nodes from the root to ``node``, both included."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def merge(trees: Sequence[TokenTree], budget: int) -> tuple[TokenTree, list[dict[int, int]]]:
    """Merge the SSMs' trees into one of at most ``budget`` nodes (root included).

    Identical prefixes are shared and a shared node keeps every tree's proposals. Nodes are taken
    breadth-first (depth, then tree, then insertion order), so whatever the budget cuts, the result
    is prefix-closed. Returns the merged tree and, per input tree, ``{merged_node: that_tree_node}``.
    """
    if not trees:
        raise SpecInferError("merge needs at least one tree")
    if budget < 1:
        raise SpecInferError(f"tree budget must be >= 1 (the root), got {budget}")
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise SpecInferError(f"trees to merge have different roots: {[t.tokens[0] for t in trees]}")
    merged = TokenTree(root)
    to_merged = [{0: 0} for _ in trees]          # per tree: its node -> merged node
    # Whether a node is kept must never depend on its own token: verification takes an SSM's kept
    # draws at a parent as its first draws there, each distributed as that SSM's q. So once the
    # tree is full every later node is cut, even one that would share an existing node for free
    # (keeping it would keep a draw because of its value, which skews the output: see
    # tests/test_verify_exact.py, sampled trees merged under a budget). And a node whose earlier
    # sibling (same tree) was cut is cut too: each draw is conditioned on that SSM's earlier draws
    # at the same parent, so those must all be in the tree (see verify.py).
    cut_under: list[set[int]] = [set() for _ in trees]
    order = sorted((t.depths[n], i, n) for i, t in enumerate(trees) for n in range(1, len(t)))
    for _, i, node in order:
        tree, parent = trees[i], trees[i].parents[node]
        if parent not in to_merged[i] or parent in cut_under[i]:
            cut_under[i].add(parent)
            continue
        m_parent = to_merged[i][parent]
        if len(merged) >= budget:
            cut_under[i].add(parent)
            continue
        m = merged.add(m_parent, tree.tokens[node])
        merged.proposals[m].extend(tree.proposals[node])
        to_merged[i][node] = m
    return merged, [{m: n for n, m in d.items()} for d in to_merged]
