"""Traversal verification is exact and accepts at least as much as MSS, proven by exact enumeration.

The REAL ``verify_traversal`` is replayed on every outcome of its random choices: its coins
(``verify.accept``) and bonus draws (``verify.sample``) are replaced by a script, and each new
choice it asks for branches the enumeration into every outcome with its probability. The law of
the emitted tokens (followed by LLM sampling to a fixed length) must be the LLM's own, to 1e-9, on
the trees of ``test_verify_exact`` (deterministic, sampled, mixed, merged under budgets that bind,
the drafters' dynamic trees) and on sampled chains (where it is block verification).
"""
from collections import defaultdict

import numpy as np
import pytest

import test_verify_exact as exact
from specinfer import verify as verify_module
from specinfer.verify import verify, verify_traversal

TOL = exact.TOL
PARAMS = exact.PARAMS


class _Branch(Exception):
    def __init__(self, options):
        self.options = options


def traversal_law(tree, params, verifier=verify_traversal) -> dict:
    """{(path, bonus): probability} of the real verifier, every coin and bonus draw enumerated."""
    logits = exact.tree_logits(tree)
    law, scripts = defaultdict(float), [[]]
    real = verify_module.accept, verify_module.sample
    try:
        while scripts:
            script, state = scripts.pop(), {"read": 0, "weight": 1.0}

            def choose(options):
                if state["read"] == len(script):
                    raise _Branch(options)
                probability, value = options[script[state["read"]]]
                state["read"] += 1
                state["weight"] *= probability
                return value
            verify_module.accept = lambda rng, a: choose([(a, True), (1.0 - a, False)])
            verify_module.sample = lambda p, rng: choose([(w / p.sum(), int(t)) for t, w in enumerate(p)])
            try:
                v = verifier(tree, logits, params, None)
            except _Branch as b:
                scripts += [script + [k] for k, (w, _) in enumerate(b.options) if w > 0]
                continue
            law[(tuple(v.path), v.bonus)] += state["weight"]
    finally:
        verify_module.accept, verify_module.sample = real
    return law


def gap_and_accepted(trees, params, verifier=verify_traversal) -> tuple[float, float]:
    """The largest gap to the LLM's law of the first n tokens, and the mean accepted draft tokens."""
    n = 1 + max(exact.depth(t) for _, t in trees)
    law, accepted = defaultdict(float), 0.0
    for weight, tree in trees:
        verdicts = traversal_law(tree, params, verifier)
        accepted += weight * sum(w * (len(path) - 1) for (path, _), w in verdicts.items())
        for tokens, w in exact.emitted(tree, verdicts).items():
            law[tokens] += weight * w
    assert abs(sum(law.values()) - 1.0) < TOL
    return exact.distance(exact.extended(law, n, params), exact.llm_continuations((), n, params)), accepted


def mss_accepted(trees, params) -> float:
    return sum(weight * w * (len(path) - 1) for weight, tree in trees
               for (path, _), w in exact.verify_mss_law(tree, params)[0].items())


def sampled_chain(params):
    return [(w, exact.build(e)) for w, e in exact.sampled_edges(0, [1, 1, 1], params)]


SAMPLED = [(sampled_chain, PARAMS[0]), (sampled_chain, PARAMS[1]), (exact.sampled, PARAMS[1]),
           (exact.sampled, PARAMS[3]), (exact.mixed(0), PARAMS[1]), (exact.mixed(1), PARAMS[2])] + exact.MERGED_SAMPLED


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("make", exact.DETERMINISTIC)
def test_deterministic_trees_are_exact_and_accept_as_mss(make, params):
    trees = [(1.0, make(params))]
    gap, accepted = gap_and_accepted(trees, params)
    assert gap < TOL, gap
    assert abs(accepted - mss_accepted(trees, params)) < TOL   # point masses: nothing to gain


@pytest.mark.parametrize("make,params", SAMPLED, ids=lambda x: getattr(x, "__name__", str(x)))
def test_sampled_trees_are_exact_and_accept_at_least_as_mss(make, params):
    trees = make(params)
    gap, accepted = gap_and_accepted(trees, params)
    assert gap < TOL, gap
    assert accepted >= mss_accepted(trees, params) - TOL


@pytest.mark.parametrize("make,params", SAMPLED[:3], ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_tree_shaped_row_by_row_has_the_same_law(monkeypatch, make, params):
    """A large tree of a large vocabulary is shaped one row at a time (``SHAPE_AT_ONCE``), a small
    one in one call: the verdicts' law is the same either way."""
    trees = [t for _, t in make(params)]
    at_once = [traversal_law(t, params) for t in trees]
    monkeypatch.setattr(verify_module, "SHAPE_AT_ONCE", 0)
    for tree, law in zip(trees, at_once):
        row_by_row = traversal_law(tree, params)
        assert row_by_row.keys() == law.keys()
        assert all(abs(row_by_row[k] - law[k]) < 1e-12 for k in law)


def test_on_a_sampled_chain_traversal_accepts_more():
    """Block verification's gain: on a chain drafted by sampling, strictly more than MSS."""
    trees = sampled_chain(PARAMS[0])
    assert gap_and_accepted(trees, PARAMS[0])[1] > 1.05 * mss_accepted(trees, PARAMS[0])


def test_a_wrong_rule_is_detected(monkeypatch):
    """Negative control: without the parent's weight update after a rejection, the law is off."""
    trees = sampled_chain(PARAMS[0])
    assert gap_and_accepted(trees, PARAMS[0])[0] < TOL
    assert gap_and_accepted(trees, PARAMS[0], _without_alpha_update)[0] > 1e-3


def _without_alpha_update(tree, llm_logits, params, rng):
    """verify_traversal with alpha_u left as it was after a rejection (a plausible mistake)."""
    from specinfer.verify import Verdict, _candidates, probabilities

    def visit(u, alpha):
        p = probabilities(llm_logits[u], params)
        for child, x, q in _candidates(tree, u, llm_logits.shape[1]):
            a = min(1.0, alpha * p[x] / q[x])
            v = visit(child, a) if a > 0 else None
            if v is not None:
                return Verdict([u] + v.path, v.bonus)
            r = np.maximum(alpha * p - q, 0.0)
            if r.sum() > 0:
                p = r / r.sum()
        return Verdict([u], verify_module.sample(p, rng)) if u == 0 or verify_module.accept(rng, alpha) else None
    return visit(0, 1.0)


def test_verify_takes_the_rule_by_name():
    tree = exact.chain(PARAMS[0])
    logits = exact.tree_logits(tree)
    for rule in ("mss", "traversal", "naive"):
        assert verify(tree, logits, PARAMS[0], np.random.default_rng(0), rule).path[0] == 0
    with pytest.raises(ValueError, match="unknown sampling rule 'nope'"):
        verify(tree, logits, PARAMS[0], np.random.default_rng(0), "nope")
