import numpy as np
import pytest

from specinfer.errors import SpecInferError
from specinfer.tree import Proposal, TokenTree, merge


def chain_tree(root, *paths, ssm=0):
    """A tree holding each token path under the root; ranks count children per parent."""
    tree = TokenTree(root)
    for path in paths:
        node = 0
        for t in path:
            rank = sum(pr.ssm == ssm for c in tree.children(node) for pr in tree.proposals[c])
            existing = tree.child(node, t)
            node = existing if existing is not None else tree.add(node, t, Proposal(ssm, rank, None))
    return tree


def test_add_shares_identical_prefixes():
    tree = TokenTree(7)
    a = tree.add(0, 3, Proposal(0, 0, None))
    b = tree.add(0, 4, Proposal(0, 1, None))
    a2 = tree.add(0, 3, Proposal(1, 0, None))
    c = tree.add(a, 5)
    assert a2 == a and len(tree) == 4
    assert tree.tokens == [7, 3, 4, 5] and tree.parents == [-1, 0, 0, 1] and tree.depths == [0, 1, 1, 2]
    assert [(p.ssm, p.rank) for p in tree.proposals[a]] == [(0, 0), (1, 0)]
    assert tree.proposals[0] == [] and tree.proposals[c] == []
    assert tree.children(0) == [a, b] and tree.children(b) == []
    assert tree.path(c) == [0, a, c] and tree.path(0) == [0]
    assert tree.child(a, 5) == c and tree.child(a, 6) is None
    with pytest.raises(SpecInferError):
        tree.add(9, 1)


def test_merge_shares_prefixes_and_keeps_all_proposals():
    t0 = chain_tree(1, [10, 11], [12])
    t1 = chain_tree(1, [10, 13], [14], ssm=1)
    merged, maps = merge([t0, t1], budget=100)
    paths = {tuple(merged.tokens[n] for n in merged.path(u)[1:]) for u in range(1, len(merged))}
    assert paths == {(10,), (12,), (14,), (10, 11), (10, 13)}
    shared = merged.child(0, 10)
    assert sorted((p.ssm, p.rank) for p in merged.proposals[shared]) == [(0, 0), (1, 0)]
    for tree, m in zip([t0, t1], maps):
        assert len(m) == len(tree) and m[0] == 0
        for mu, u in m.items():   # same token path in both trees
            assert [merged.tokens[x] for x in merged.path(mu)] == [tree.tokens[x] for x in tree.path(u)]
    # Topological order: every parent comes first.
    assert all(merged.parents[n] < n for n in range(1, len(merged)))


def test_merge_rejects_different_roots():
    with pytest.raises(SpecInferError, match="roots"):
        merge([TokenTree(1), TokenTree(2)], 10)


def token_paths(tree):
    return {tuple(tree.tokens[x] for x in tree.path(n)): n for n in range(len(tree))}


@pytest.mark.parametrize("seed", range(20))
def test_merge_budget_is_never_exceeded_and_prefix_closed(seed):
    rng = np.random.default_rng(seed)
    trees = []
    for ssm in range(3):
        tree = TokenTree(0)
        for _ in range(rng.integers(1, 25)):
            parent, token = int(rng.integers(len(tree))), int(rng.integers(4))
            if tree.child(parent, token) is None:
                tree.add(parent, token, Proposal(ssm, len(tree.children(parent)), None))
        trees.append(tree)
    full, _ = merge(trees, budget=10**6)
    full_paths = token_paths(full)
    for budget in range(1, len(full) + 2):
        merged, maps = merge(trees, budget)
        assert len(merged) == min(budget, len(full))
        assert all(merged.parents[n] < n for n in range(1, len(merged)))
        for ssm, (tree, m) in enumerate(zip(trees, maps)):
            kept = set(m.values())
            assert all(tree.parents[u] in kept for u in kept if u)          # prefix-closed per tree
            for mu, u in m.items():
                assert merged.tokens[mu] == tree.tokens[u] and merged.depths[mu] == tree.depths[u]
                assert mu == 0 or m[merged.parents[mu]] == tree.parents[u]
            # Each SSM's kept proposals at a node are its ranks 0..m-1 (verification needs it).
            for u in range(len(merged)):
                ranks = sorted(p.rank for c in merged.children(u) for p in merged.proposals[c] if p.ssm == ssm)
                assert ranks == list(range(len(ranks)))
        # Breadth-first: nothing is kept deeper than the shallowest node cut off.
        missing = [full.depths[n] for path, n in full_paths.items() if path not in token_paths(merged)]
        if missing:
            assert max(merged.depths) <= min(missing)


def test_merge_drops_a_shared_draw_whose_earlier_sibling_was_cut():
    t0 = chain_tree(1, [10], [11])
    t1 = chain_tree(1, [12], [10], ssm=1)        # ssm 1 drew 12 first, then 10
    merged, maps = merge([t0, t1], budget=3)     # room for 10 and 11 only: 12 is cut
    assert sorted(merged.tokens) == [1, 10, 11]
    # 10 could be shared for free, but ssm 1's draw of it depends on its cut draw of 12.
    assert [(p.ssm, p.rank) for p in merged.proposals[merged.child(0, 10)]] == [(0, 0)]
    assert maps[1] == {0: 0}
