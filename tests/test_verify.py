import numpy as np
import pytest
from scipy.stats import chisquare

from specinfer import verify as verify_module
from specinfer.sampling import SamplingParams, sample
from specinfer.speculate import sample_without_replacement
from specinfer.tree import Proposal, TokenTree, merge
from specinfer.verify import verify, verify_greedy, verify_mss, verify_naive

V = 6
GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)


def one_hot_logits(*argmaxes):
    logits = np.zeros((len(argmaxes), V), dtype=np.float32)
    logits[np.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


# --- greedy ----------------------------------------------------------------------------------------
def greedy_tree():
    """root 0 -> 1 -> 2 -> 3, and root -> 4 -> 5."""
    tree = TokenTree(0)
    a = tree.add(0, 1)
    b = tree.add(a, 2)
    tree.add(b, 3)
    c = tree.add(0, 4)
    tree.add(c, 5)
    return tree   # nodes: 0 root, 1 tok1, 2 tok2, 3 tok3, 4 tok4, 5 tok5


@pytest.mark.parametrize("argmaxes, path, bonus", [
    ([1, 2, 3, 0, 0, 0], [0, 1, 2, 3], 0),   # accept all of the long branch; bonus at its leaf
    ([3, 2, 3, 0, 0, 0], [0], 3),            # accept none
    ([1, 5, 3, 0, 0, 0], [0, 1], 5),         # accept part
    ([4, 2, 3, 0, 5, 1], [0, 4, 5], 1),      # the other branch
])
def test_verify_greedy(argmaxes, path, bonus):
    tree = greedy_tree()
    logits = one_hot_logits(*argmaxes)
    assert verify_greedy(tree, logits) == verify_module.Verdict(path, bonus)
    assert verify(tree, logits, GREEDY, np.random.default_rng(0)) == verify_module.Verdict(path, bonus)


# --- multi-step speculative sampling: a statistical test ------------------------------------------
def distributions(seed, alpha, floor):
    rng = np.random.default_rng(seed)
    d = rng.dirichlet(np.full(V, alpha), size=1 + V + V * V) + floor
    return d / d.sum(-1, keepdims=True)


# The LLM's law at the root, after token a, after tokens (a, b); and two SSMs' (sharper: their
# draws repeat tokens, which is what makes rank conditioning matter).
P = distributions(1, alpha=2.0, floor=0.05)
Q = [distributions(2, alpha=0.5, floor=0.0), distributions(3, alpha=0.5, floor=0.0)]


def row(tokens):
    """Row of a distribution table for the token path after the root (length 0, 1 or 2)."""
    return 0 if not tokens else 1 + tokens[0] if len(tokens) == 1 else 1 + V + V * tokens[0] + tokens[1]


def law(table, tokens):
    return table[row(tokens)]


def draw_tree(ssm, widths, rng):
    """A tree drawn the way SSMDrafter drafts: distinct children per node, from the SSM's q."""
    tree, frontier = TokenTree(0), [(0, ())]
    for width in widths:
        new = []
        for node, tokens in frontier:
            q = law(Q[ssm], tokens)
            for rank, t in enumerate(sample_without_replacement(q, width, rng)):
                new.append((tree.add(node, t, Proposal(ssm, rank, q)), tokens + (t,)))
        frontier = new
    return tree


LOG_P = np.log(P)


def llm_logits(tree):
    rows = [0] * len(tree)
    for n in range(1, len(tree)):   # parents come first
        parent = tree.parents[n]
        rows[n] = 1 + tree.tokens[n] if parent == 0 else 1 + V + V * (rows[parent] - 1) + tree.tokens[n]
    return LOG_P[rows]


def one_ssm(rng):
    return draw_tree(0, [3, 2], rng)


def two_ssms(rng):
    return merge([draw_tree(0, [2, 1], rng), draw_tree(1, [2, 2], rng)], budget=100)[0]


def two_ssms_cut(rng):
    """Merged under a budget that cuts draws (and shared draws whose earlier siblings were cut)."""
    return merge([draw_tree(0, [2, 1], rng), draw_tree(1, [2, 2], rng)], budget=4)[0]


def first_two_tokens_pvalues(build, verifier, trials=20000, seed=0):
    """p-values of chi-square tests of the first emitted token and of the first two against the LLM."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(trials):
        tree = build(rng)
        verdict = verifier(tree, llm_logits(tree), SAMPLE, rng)
        out = [tree.tokens[n] for n in verdict.path[1:]] + [verdict.bonus]
        if len(out) == 1:   # one token this step: the next step's first token has the LLM's law
            out.append(sample(law(P, out), rng))
        counts[out[0], out[1]] += 1
    joint = np.stack([P[0][a] * law(P, [a]) for a in range(V)])
    first = chisquare(counts.sum(1), trials * P[0]).pvalue
    both = chisquare(counts.ravel(), trials * joint.ravel()).pvalue
    return first, both


# Significance: a correct rule passes when both p-values exceed 1e-3 (with a fixed seed the outcome
# is reproducible); a wrong rule must give a p-value below 1e-6, i.e. be detected beyond doubt.
@pytest.mark.parametrize("build", [one_ssm, two_ssms, two_ssms_cut])
def test_mss_keeps_the_llm_distribution(build):
    first, both = first_two_tokens_pvalues(build, verify_mss)
    assert first > 1e-3 and both > 1e-3, (first, both)


def test_two_ssms_do_share_proposals():
    rng = np.random.default_rng(0)
    shared = [any(len({p.ssm for p in ps}) == 2 for ps in tree.proposals) for tree in (two_ssms(rng) for _ in range(200))]
    assert np.mean(shared) > 0.3


def test_naive_keeps_the_llm_distribution():
    first, both = first_two_tokens_pvalues(one_ssm, verify_naive, trials=5000)
    assert first > 1e-3 and both > 1e-3, (first, both)


def test_wrong_residual_is_detected(monkeypatch):
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p)
    assert min(first_two_tokens_pvalues(one_ssm, verify_mss)) < 1e-6


@pytest.mark.parametrize("build", [one_ssm, two_ssms])
def test_ignoring_rank_conditioning_is_detected(build, monkeypatch):
    monkeypatch.setattr(verify_module, "conditional_q", lambda q, drawn: q)
    assert min(first_two_tokens_pvalues(build, verify_mss)) < 1e-6


# --- other properties -------------------------------------------------------------------------------
def test_mss_accepts_everything_when_the_ssm_is_the_llm():
    rng = np.random.default_rng(0)
    for _ in range(100):
        tree, node = TokenTree(0), 0
        for _ in range(4):
            q = law(P, [tree.tokens[x] for x in tree.path(node)[1:]][:2])
            node = tree.add(node, sample(q, rng), Proposal(0, 0, q))
        logits = np.log(np.stack([law(P, [tree.tokens[x] for x in tree.path(n)[1:]][:2]) for n in range(len(tree))]))
        assert verify_mss(tree, logits, SAMPLE, rng).path == list(range(5))


def test_mss_needs_every_earlier_rank():
    tree = TokenTree(0)
    tree.add(0, 3, Proposal(0, 1, P[0]))   # rank 1 without rank 0
    with pytest.raises(ValueError, match="ranks"):
        verify_mss(tree, np.zeros((2, V)), SAMPLE, np.random.default_rng(0))
