"""MSS is exact, proven by exact enumeration rather than by sampling.

For a tree and the LLM, :func:`enumerate_mss` follows every outcome of verification's random choices
(each candidate accepted or rejected, each bonus token) with its exact probability, computed from
the acceptance probabilities min(1, p[x] / q[x]) (p[x] for a deterministic candidate) and the bonus
law. Each outcome is a list of intervals of the uniforms that ``rng.random()`` returns, and the REAL
``verify_mss`` is run on every outcome with a scripted rng returning points of those intervals (the
middle and 1e-9 of the width inside both ends): its verdict there must be the outcome's, after
reading exactly that many uniforms. Then the enumerated law is verify_mss's own. Emitted tokens
(accepted path, then bonus) extended by LLM sampling to a fixed length must have the LLM's joint
law, to 1e-9: the first token follows p_root, the first two p_root(x1) p_x1(x2), and so on. A tree
drawn by a sampling SSM is enumerated too: every draw without replacement, with its probability.
The dynamic tree is drafted by the real SSMDrafter, LookupDrafter and TreeSizer on these models.
"""
import itertools
from collections import defaultdict
from functools import lru_cache

import numpy as np
import pytest

from specinfer import verify as verify_module
from specinfer.config import ModelConfig
from specinfer.engines import native
from specinfer.engines.runtime import Runtime
from specinfer.sampling import SamplingParams, inverse_cdf, probabilities
from specinfer.speculate import SSMDrafter
from specinfer.tree import Proposal, TokenTree, merge
from specinfer.lookup import LookupDrafter
from specinfer.tree_sizing import Acceptance, StepCost, TreeSizer, acceptance
from specinfer.verify import verify_mss

V = 5
ROOT = 0
TOL = 1e-9
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=4, top_p=0.9)]


# --- models: logits as a fixed function of the context (tokens after the root) --------------------
@lru_cache(maxsize=None)
def llm_logits(context: tuple) -> np.ndarray:
    # float32 values (held in float64): verification on the same logits as float32, the engines'
    # dtype, takes the native draws (sampling.draw), and the law must not change.
    return np.random.default_rng([7, len(context), *context]).normal(0.0, 1.5, V).astype(np.float32).astype(float)


@lru_cache(maxsize=None)
def ssm_logits(ssm: int, context: tuple) -> np.ndarray:
    """The LLM's logits plus noise: SSMs that agree with the LLM in part."""
    return llm_logits(context) + np.random.default_rng([11 + ssm, len(context), *context]).normal(0.0, 1.5, V)


def context(tree: TokenTree, node: int) -> tuple:
    return tuple(tree.tokens[n] for n in tree.path(node)[1:])


def tree_logits(tree: TokenTree) -> np.ndarray:
    return np.stack([llm_logits(context(tree, n)) for n in range(len(tree))])


def depth(tree: TokenTree) -> int:
    return max(tree.depths)


# --- trees -----------------------------------------------------------------------------------------
def build(edges) -> TokenTree:
    """A tree from (context, token, proposal) edges, parents first."""
    tree, node = TokenTree(ROOT), {(): 0}
    for ctx, token, proposal in edges:
        node[ctx + (token,)] = tree.add(node[ctx], token, proposal)
    return tree


def top_k_edges(ssm: int, widths, params, ctx=()) -> list:
    """Deterministic drafting: the SSM's top widths[d] tokens at depth d (rank = order)."""
    if not widths:
        return []
    q = probabilities(ssm_logits(ssm, ctx), params)
    top = [int(t) for t in np.argsort(-q, kind="stable")[:widths[0]] if q[t] > 0]
    edges = [(ctx, t, Proposal(ssm, r, None)) for r, t in enumerate(top)]
    return edges + [e for t in top for e in top_k_edges(ssm, widths[1:], params, ctx + (t,))]


def top_k_tree(ssm: int, widths, params) -> TokenTree:
    return build(top_k_edges(ssm, widths, params))


def dynamic_tree(ssm: int, budget: int, params, max_depth: int = 3) -> TokenTree:
    """Deterministic dynamic tree: repeatedly add the node of highest SSM path probability."""
    tree, mass = TokenTree(ROOT), {0: 1.0}
    while len(tree) < budget:
        options = [(mass[n] * q[t], n, int(t)) for n in range(len(tree)) if tree.depths[n] < max_depth
                   for q in [probabilities(ssm_logits(ssm, context(tree, n)), params)]
                   for t in range(V) if q[t] > 0 and tree.child(n, t) is None]
        m, parent, token = max(options)
        node = tree.add(parent, token, Proposal(ssm, len(tree.children(parent)), None))
        mass[node] = m
    return tree


def draws_without_replacement(q: np.ndarray, k: int):
    """(probability, tokens) for every outcome of ``speculate.sample_without_replacement(q, k)``."""
    if k == 0 or not q.sum() > 0:
        yield 1.0, ()
        return
    for x in np.flatnonzero(q):
        rest = q.copy()
        rest[x] = 0.0
        for w, xs in draws_without_replacement(rest, k - 1):
            yield q[x] / q.sum() * w, (int(x),) + xs


def sampled_edges(ssm: int, widths, params, ctx=()):
    """(probability, edges) for every tree an SSM drafting by sampling can draw (SSMDrafter's way)."""
    if not widths:
        yield 1.0, []
        return
    q = probabilities(ssm_logits(ssm, ctx), params)
    for w, xs in draws_without_replacement(q, widths[0]):
        subtrees = [list(sampled_edges(ssm, widths[1:], params, ctx + (x,))) for x in xs]
        for combo in itertools.product(*subtrees):
            yield (w * np.prod([c[0] for c in combo]),
                   [(ctx, x, Proposal(ssm, r, q)) for r, x in enumerate(xs)] + [e for c in combo for e in c[1]])


# --- exact enumeration of verification -------------------------------------------------------------
# ``bug`` makes the enumeration follow a wrong rule, for the negative controls: "accept point masses"
# (a deterministic candidate accepted whenever p[x] > 0, p left as is), "keep p" (no residual after a
# rejection), "no rank conditioning" (a sampled draw's plain q).
def model_candidates(tree: TokenTree, u: int, bug: str | None = None) -> list:
    """(child, token, q or None) in (ssm, rank) order; a sampled q conditioned on the SSM's earlier
    sampled draws at u (it draws without replacement)."""
    drawn = defaultdict(list)
    out = []
    for ssm, rank, c, q in sorted((pr.ssm, pr.rank, c, pr.q) for c in tree.children(u) for pr in tree.proposals[c]):
        x = tree.tokens[c]
        if q is not None and bug != "no rank conditioning":
            q = q.copy()
            q[drawn[ssm]] = 0.0
            q /= q.sum()
            drawn[ssm].append(x)
        out.append((c, x, q))
    return out


def enumerate_mss(tree: TokenTree, logits: np.ndarray, params: SamplingParams, bug: str | None = None) -> list:
    """Every outcome of MSS's random choices as (probability, uniform intervals, path, bonus)."""
    out = []

    def visit(u, p, candidates, weight, intervals, path):
        if not candidates:   # the bonus: sample() inverts the CDF, token y for u in [c[y-1], c[y]) / c[-1]
            c = np.cumsum(p)
            for y in np.flatnonzero(p):
                out.append((weight * p[y] / c[-1], intervals + [((c[y] - p[y]) / c[-1], c[y] / c[-1])], path, int(y)))
            return
        (child, x, q), rest = candidates[0], candidates[1:]
        if q is None and bug == "accept point masses":
            a, residual = float(p[x] > 0), p
        elif q is None:
            a, residual = p[x], p.copy()
            residual[x] = 0.0
        else:
            a, residual = min(1.0, p[x] / q[x]), np.maximum(p - q, 0.0)
        if bug == "keep p":
            residual = p
        if a > 0:
            visit(child, probabilities(logits[child], params), model_candidates(tree, child, bug), weight * a,
                  intervals + [(0.0, a)], path + [child])
        if a < 1:
            # (zero residual mass: p == q up to rounding, verify.residual's case; p is then the law)
            visit(u, residual / residual.sum() if residual.sum() > 0 else p, rest, weight * (1 - a),
                  intervals + [(a, 1.0)], path)

    visit(0, probabilities(logits[0], params), model_candidates(tree, 0, bug), 1.0, [], [0])
    return out


class ScriptedRng:
    """Stands in for np.random.Generator in verify_mss: random() returns the given values in turn."""

    def __init__(self, values):
        self.values, self.calls = list(values), 0

    def random(self) -> float:
        self.calls += 1
        return self.values[self.calls - 1] if self.calls <= len(self.values) else 0.5


def probes(lo: float, hi: float) -> list[float]:
    """Points of [lo, hi): the middle and, unless the interval is too narrow to place them safely
    from rounding, points 1e-9 of its width inside either end."""
    width = hi - lo
    ends = [lo + 1e-9 * width, hi - 1e-9 * width] if width > 1e-6 else [lo + width / 2] * 2
    return [lo + width / 2, *ends]


def verify_mss_law(tree: TokenTree, params: SamplingParams, bug: str | None = None, dtype=np.float64):
    """The law of the real verify_mss's verdicts {(path, bonus): probability}, and whether on every
    outcome it agreed with the enumeration at all the probe points (same verdict, same rng reads).
    verify_mss is given the logits as ``dtype`` (float32: the native draws where they run)."""
    logits = tree_logits(tree)
    law, agrees = defaultdict(float), True
    for weight, intervals, path, bonus in enumerate_mss(tree, logits, params, bug):
        points = [probes(lo, hi) for lo, hi in intervals]
        verdicts = []
        for k in range(3):   # all middles, all lower ends, all upper ends
            rng = ScriptedRng(pt[k] for pt in points)
            v = verify_mss(tree, logits.astype(dtype), params, rng)
            verdicts.append((tuple(v.path), v.bonus))
            agrees &= rng.calls == len(intervals)
        agrees &= verdicts == [(tuple(path), bonus)] * 3
        law[verdicts[0]] += weight
    return law, agrees


def emitted(tree: TokenTree, verdict_law: dict) -> dict:
    """{emitted tokens: probability} from a verdict law."""
    out = defaultdict(float)
    for (path, bonus), w in verdict_law.items():
        out[tuple(tree.tokens[n] for n in path[1:]) + (bonus,)] += w
    return out


@lru_cache(maxsize=None)
def llm_continuations(ctx: tuple, n: int, params: SamplingParams) -> dict:
    """The LLM's law of its next n tokens after ctx: {tokens: probability}."""
    if n == 0:
        return {(): 1.0}
    p = probabilities(llm_logits(ctx), params)
    return {(int(t),) + rest: p[t] * w for t in np.flatnonzero(p)
            for rest, w in llm_continuations(ctx + (int(t),), n - 1, params).items()}


def extended(emitted_law: dict, n: int, params: SamplingParams) -> dict:
    """The law of the first n tokens when the emitted ones are followed by LLM sampling."""
    out = defaultdict(float)
    for tokens, w in emitted_law.items():
        for rest, v in llm_continuations(tokens, n - len(tokens), params).items():
            out[tokens + rest] += w * v
    return out


def distance(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys())


def check_exact(trees, params: SamplingParams, bug: str | None = None, dtype=np.float64) -> tuple[float, bool]:
    """For a random tree given as [(probability, tree)]: the largest gap between the law of the first
    n tokens under MSS (then LLM sampling) and the LLM's own, n = deepest tree + 1; and whether the
    real verify_mss (given the logits as ``dtype``) agreed with the enumeration everywhere."""
    n = 1 + max(depth(t) for _, t in trees)
    law, agrees = defaultdict(float), True
    for weight, tree in trees:
        verdicts, ok = verify_mss_law(tree, params, bug, dtype)
        agrees &= ok
        for tokens, w in emitted(tree, verdicts).items():
            law[tokens] += weight * w
    assert abs(sum(law.values()) - 1.0) < TOL
    return distance(extended(law, n, params), llm_continuations((), n, params)), agrees


# --- deterministic trees ---------------------------------------------------------------------------
def chain(params):
    return top_k_tree(0, [1, 1, 1], params)


def specinfer_like(params):
    return top_k_tree(0, [2, 2], params)


def wide_then_narrow(params):
    return top_k_tree(0, [3, 1, 1], params)


def dynamic(params):
    return dynamic_tree(0, 7, params)


def two_ssms_merged(params):
    """Two deterministic SSMs merged: shared nodes carry two point-mass proposals."""
    return merge([top_k_tree(0, [2, 1], params), top_k_tree(1, [2, 2], params)], budget=100)[0]


class ContextRuntime(Runtime):
    """A Runtime whose logits are these models' (a function of the tokens after the root on the
    node's path): it lets the real SSMDrafter draft on them. Its "KV cache" holds token ids."""

    def __init__(self, logits_of):
        super().__init__(ModelConfig("llama", V, 8, 8, 1, 1, 1, 8, 1e-6, 1e4, None, 64, False, False, True,
                                     None, (), None), max_context=64)
        self.logits_of = logits_of

    def _allocate(self, capacity):
        return np.zeros(capacity, dtype=np.int64)

    def _forward(self, seq, tokens, positions, visible):
        start = seq.length + seq.pending
        seq.kv[start:start + len(tokens)] = tokens
        tree = seq.kv[seq.length:start + len(tokens)]
        prefix = list(seq.kv[:seq.length])
        out = []
        for i in range(len(tokens)):
            row = visible[len(visible) - len(tokens) + i]
            path = prefix + [int(t) for t in tree[row]]   # ancestors in slot order, the node last
            out.append(self.logits_of(tuple(path[1:])))
        return np.stack(out).astype(np.float32)

    def _move(self, seq, src, dst):
        seq.kv[dst] = seq.kv[src]


# Verification cost that makes the sized trees neither empty nor full on these models.
SIZING_COST = StepCost((1, 4), (1.0, 1.6))


def sized_tree(params, ssms=(0, 1), rated=False):
    """The dynamic tree as SSMDrafter and TreeSizer really make it: each SSM's top-token chain (up
    to depth 3) with each depth's runner-up beside it, the likeliest nodes kept while another
    would pay for itself, merged. ``rated``: after the SSM's acceptance record has seen its chain
    tokens accepted half as often as it said and its runner-ups always."""
    trees = []
    for ssm in ssms:
        runtime = ContextRuntime(lambda ctx, ssm=ssm: ssm_logits(ssm, ctx))
        if rated:
            p = np.linspace(0.02, 0.99, 50)
            for _ in range(100):
                acceptance(runtime, params).observe(np.concatenate([p, p]), [0] * 50 + [1] * 50,
                                                    np.concatenate([np.arange(50) % 2 == 0, np.ones(50, bool)]))
        drafter = SSMDrafter(runtime, ssm, sizer=TreeSizer(SIZING_COST, overhead=0.5), draw_dynamic=False)
        trees.append(drafter.draft(ROOT, [1, 1, 1], params, np.random.default_rng(0), budget=10))
        drafter.release()
    assert any(pr.rank == 1 for t in trees for ps in t.proposals for pr in ps)   # a runner-up was kept
    if not rated:
        assert any(0 < max(t.depths) < 3 for t in trees)   # the cost model did cut a chain
    return merge(trees, budget=100)[0]


def sized_tree_rated(params):
    """Rated by a record that favours runner-ups: each still goes in only beside its sibling, the
    chain token, which verification must meet first (a runner-up alone would be refused)."""
    return sized_tree(params, rated=True)


def test_sized_tree_keeps_the_likeliest_nodes_that_pay():
    """The drafter's dynamic tree: the SSM's greedy chain and each depth's runner-up, ranked by
    the SSM's path probability, the first TreeSizer.best_count of them kept."""
    tree = sized_tree(PARAMS[0], ssms=(0,))
    candidates, ctx, above = [], (), 1.0
    for depth in range(1, 4):
        q = probabilities(ssm_logits(0, ctx), SamplingParams(temperature=1.0))
        first, second = np.argsort(-q, kind="stable")[:2]
        candidates += [(above * q[first], ctx + (first,)), (above * q[second], ctx + (second,))]
        above, ctx = above * q[first], ctx + (int(first),)
    candidates.sort(key=lambda c: -c[0])
    keep = TreeSizer(SIZING_COST, overhead=0.5).best_count([r for r, _ in candidates])
    drafted = {tuple(int(t) for t in context(tree, u)) for u in range(1, len(tree))}
    assert drafted == {tuple(int(t) for t in path) for _, path in candidates[:keep]}
    assert 0 < keep < len(candidates)
    assert max(tree.depths) >= 2     # ContextRuntime drafts a token a call: the drafter went on


def lookup_and_ssm_merged(params):
    """A lookup chain copied from the sequence ("1 2 root" occurred before, followed by 3 1 2),
    sized by the real LookupDrafter, merged with an SSM's sized tree: two proposers' point masses."""
    lookup = LookupDrafter(2, TreeSizer(SIZING_COST, overhead=0.5), Acceptance(), depth=3)
    lookup.prefill([1, 2, ROOT, 3, 1, 2])
    tree = lookup.draft(ROOT, budget=10)
    assert tree.tokens[1:] == [3, 1, 2]
    return merge([tree, sized_tree(params, ssms=(0,))], budget=100)[0]


DETERMINISTIC = [chain, specinfer_like, wide_then_narrow, dynamic, two_ssms_merged, sized_tree, sized_tree_rated,
                 lookup_and_ssm_merged]


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("make", DETERMINISTIC)
def test_deterministic_trees_are_exact(make, params):
    tree = make(params)
    assert len(tree) > 2
    gap, agrees = check_exact([(1.0, tree)], params)
    assert agrees and gap < TOL, gap


@pytest.mark.parametrize("params", PARAMS[:2], ids=str)
@pytest.mark.parametrize("make", DETERMINISTIC)
def test_deterministic_mss_is_naive_sampling(make, params):
    """With only point-mass candidates, the verdict (path and bonus) has the law of naive sampling:
    draw from p at each node, go down while the draw is a child."""
    tree = make(params)
    naive = defaultdict(float)

    def visit(u, path, w):
        p = probabilities(llm_logits(context(tree, u)), params)
        for y in np.flatnonzero(p):
            child = tree.child(u, y)
            if child is None:
                naive[(tuple(path), int(y))] += w * p[y]
            else:
                visit(child, path + [child], w * p[y])

    visit(0, [0], 1.0)
    law, agrees = verify_mss_law(tree, params)
    assert agrees and distance(law, naive) < TOL


# --- sampled and mixed trees (the tree itself is random: enumerated) -------------------------------
def sampled(params):
    return [(w, build(e)) for w, e in sampled_edges(0, [2, 1], params)]


def mixed(det_ssm):
    """One SSM deterministic (index det_ssm), the other sampling, merged: nodes mix point masses and
    sampled draws, in both orders of trial."""
    def trees(params):
        det = top_k_edges(det_ssm, [2, 1], params)
        return [(w, merge([build(det), build(e)], budget=100)[0])
                for w, e in sampled_edges(1 - det_ssm, [2, 1], params)]
    trees.__name__ = f"mixed_deterministic_ssm{det_ssm}"
    return trees


@pytest.mark.parametrize("params", PARAMS[1:], ids=str)   # top-k / top-p keep the enumeration small
@pytest.mark.parametrize("make", [sampled, mixed(0), mixed(1)])
def test_sampled_and_mixed_trees_are_exact(make, params):
    trees = make(params)
    assert abs(sum(w for w, _ in trees) - 1.0) < TOL
    if make is not sampled:   # some node holds both a point mass and a sampled draw
        assert any(len({pr.q is None for pr in ps}) == 2 for _, t in trees for ps in t.proposals)
    gap, agrees = check_exact(trees, params)
    assert agrees and gap < TOL, gap


def sampled_merged(widths, ssms, budget):
    """Several SSMs drafting by sampling, merged under a node budget: every combination of their
    draws, with its probability. A budget that binds must not keep a draw for its value (a draw
    that happens to equal a token already in the tree would cost no node)."""
    def trees(params):
        out = []
        for combo in itertools.product(*(list(sampled_edges(s, widths, params)) for s in ssms)):
            out.append((float(np.prod([w for w, _ in combo])), merge([build(e) for _, e in combo], budget)[0]))
        return out
    trees.__name__ = f"ssms{len(ssms)}_widths{''.join(map(str, widths))}_budget{budget}"
    return trees


MERGED_SAMPLED = [  # (make, params): budgets that bind and that do not, 1-3 SSMs, chains and widths
    (sampled_merged([1], (0, 1), 2), PARAMS[0]), (sampled_merged([1], (0, 1), 2), PARAMS[2]),
    (sampled_merged([1], (0, 1, 2), 2), PARAMS[1]), (sampled_merged([1], (0, 1, 2), 3), PARAMS[0]),
    (sampled_merged([2], (0, 1), 3), PARAMS[1]), (sampled_merged([2], (0, 1), 100), PARAMS[1]),
    (sampled_merged([2], (0, 1, 2), 4), PARAMS[1]), (sampled_merged([1, 1], (0, 1), 3), PARAMS[3]),
    (sampled_merged([1, 1], (0, 1, 2), 4), PARAMS[1]), (sampled_merged([2, 1], (0,), 3), PARAMS[1]),
]


@pytest.mark.parametrize("make,params", MERGED_SAMPLED, ids=lambda x: getattr(x, "__name__", str(x)))
def test_sampled_trees_merged_under_a_budget_are_exact(make, params):
    trees = make(params)
    assert abs(sum(w for w, _ in trees) - 1.0) < TOL
    gap, agrees = check_exact(trees, params)
    assert agrees and gap < TOL, gap


# --- the dynamic tree under sampling: chains drawn from the SSM, cut by the sizer ---------------------
class _MoreDraws(Exception):
    """The drafter asked for a draw past the scripted ones."""


def sized_sampled_chains(params, monkeypatch, min_confidence=0.0, draft_vocab=None):
    """Every chain the real SSMDrafter (sizer, draw_dynamic) can draw and keep, with its probability:
    its draws are scripted (each a token of the drafter's own candidates, weighted by the law the
    proposal says it was drawn from, ``draft_distribution``) and enumerated depth first; what it
    keeps is the real drafter's and sizer's doing. ``draft_vocab``: the SSM's (its draws among
    those tokens only)."""
    import itertools
    from types import SimpleNamespace

    import specinfer.engines.runtime as runtime_module
    import specinfer.speculate as speculate_module
    from specinfer.speculate import draft_distribution, draft_temperature

    real_draw, out = runtime_module.chain_draw, []
    # Whether the sizer drafts another chunk weighs the draft's measured seconds: a clock that ticks
    # per reading makes that the same in every replay of a script (under load, real timings differed
    # between replays and the enumeration lost its way).
    clock = itertools.count(0.0, 1e-4)
    monkeypatch.setattr(speculate_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))

    def run(script: list[int]) -> None:
        state = {"at": 0, "weight": 1.0, "options": None}

        def scripted_draw(logits, noise):
            _, candidates, top = real_draw(logits, noise)
            q = draft_distribution(candidates, top, draft_temperature(params), V)
            if state["at"] == len(script):
                state["options"] = [(int(x), q[x]) for x in np.flatnonzero(q)]
                raise _MoreDraws
            x = script[state["at"]]
            state["at"] += 1
            state["weight"] *= q[x]
            return x, candidates, top

        monkeypatch.setattr(runtime_module, "chain_draw", scripted_draw)
        runtime = ContextRuntime(lambda ctx: ssm_logits(0, ctx))
        runtime.draft_vocab = draft_vocab
        # Draws seen accepted: the rate pays for the whole chain, so a cut has room to act.
        acceptance(runtime, params).observe([0.5] * 20, [0] * 20, [True] * 20)
        drafter = SSMDrafter(runtime, 0, sizer=TreeSizer(SIZING_COST, overhead=0.5), min_confidence=min_confidence,
                             draw_dynamic=True)
        try:
            tree = drafter.draft(ROOT, [1, 1, 1], params, np.random.default_rng(0), budget=10)
        except _MoreDraws:
            for x, _ in state["options"]:
                run(script + [x])
            return
        finally:
            monkeypatch.setattr(runtime_module, "chain_draw", real_draw)
        assert state["at"] == len(script)
        out.append((state["weight"], tree))

    run([])
    return out


@pytest.mark.parametrize("min_confidence", [0.0, 0.35])
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_sampled_chains_of_the_dynamic_tree_are_exact(params, min_confidence, monkeypatch):
    """The sizer (and the confidence cut) keeps a drawn token only by the draws before it, so
    every kept token is a fair draw from the q its proposal carries, and MSS keeps the LLM's law
    (to 1e-9)."""
    trees = sized_sampled_chains(params, monkeypatch, min_confidence)
    assert abs(sum(w for w, _ in trees) - 1.0) < TOL
    assert all(pr.q is not None for _, t in trees for ps in t.proposals[1:] for pr in ps)   # drawn, not top tokens
    depths = {depth(t) for _, t in trees}
    # Without a confidence cut the depth is chosen before drawing (one for every draw, from the
    # acceptance rate); a cut follows the draws before it.
    assert len(depths) == 1 if min_confidence == 0 else len(depths) > 1
    gap, agrees = check_exact(trees, params)
    assert agrees and gap < TOL, gap


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_sampled_chains_from_a_draft_vocabulary_are_exact(params, monkeypatch):
    """An SSM with a draft vocabulary (draft_vocab.py) draws only its tokens, from the candidates'
    law renormalized within it, which its proposals carry: MSS keeps the LLM's law (to 1e-9),
    although the LLM's likeliest tokens may lie outside it."""
    vocab = np.array([0, 2, 3])
    trees = sized_sampled_chains(params, monkeypatch, draft_vocab=vocab)
    drawn = {t for _, tree in trees for t in tree.tokens[1:]}
    assert drawn and drawn <= set(vocab.tolist())
    assert all(set(np.flatnonzero(pr.q)) <= set(vocab.tolist()) for _, t in trees for ps in t.proposals[1:] for pr in ps)
    gap, agrees = check_exact(trees, params)
    assert agrees and gap < TOL, gap


def test_a_chain_cut_by_its_own_draws_value_is_caught(monkeypatch):
    """Negative control: cut where a draw is unlikely under its own q (kept or cut for its value,
    not by the draws before it), a sampled chain is off the LLM's law."""
    import specinfer.speculate as speculate_module
    from specinfer.speculate import draft_distribution, draft_temperature

    params = PARAMS[0]

    def cut_by_own_value(self, draft, keep, budget):
        own = [draft_distribution(c, l, draft_temperature(params), V)[x]
               for c, l, x in zip(draft.candidates[:keep], draft.candidate_logits[:keep], draft.tokens[:keep])]
        kept = next((i for i, q in enumerate(own) if q < 0.3), keep)
        return [(i, 0) for i in range(kept)]
    monkeypatch.setattr(speculate_module.SSMDrafter, "_candidates", cut_by_own_value)
    gap, agrees = check_exact(sized_sampled_chains(params, monkeypatch), params)
    assert agrees and gap > 1e-3, gap


# --- negative controls: the harness does fail wrong rules ------------------------------------------
# A wrong rule put into verify_mss disagrees with the right enumeration, and vice versa; with the
# wrong rule in both, they agree at every probe (the enumeration is verify_mss's law) and that law
# is off the LLM's by more than 1e-3.
def one(make):
    return lambda params: [(1.0, make(params))]


WRONG_RULES = {   # bug: ({name in verify.py: its wrong version}, random tree, params)
    # A deterministic candidate accepted whenever p[x] > 0: its proposal has no mass, p stays as is.
    "accept point masses": ({"point_mass": lambda token, size: np.zeros(size)}, one(specinfer_like), PARAMS[0]),
    # No residual after a rejection, neither before the next candidate nor for the bonus.
    "keep p": ({"residual": lambda p, q: p, "residual_draw": lambda p, q, u: inverse_cdf(p, u)},
               one(specinfer_like), PARAMS[0]),
    "no rank conditioning": ({"conditional_q": lambda q, drawn: q},
                             lambda params: [(w, build(e)) for w, e in sampled_edges(0, [3], params)], PARAMS[0]),
}


@pytest.mark.parametrize("bug", WRONG_RULES)
def test_wrong_rules_are_detected(bug, monkeypatch):
    wrong, make, params = WRONG_RULES[bug]
    trees = make(params)
    assert not check_exact(trees, params, bug)[1]   # the wrong rule enumerated vs the right verify_mss
    for name, version in wrong.items():
        monkeypatch.setattr(verify_module, name, version)
    assert not check_exact(trees, params)[1]        # the right rule enumerated vs a wrong verify_mss
    gap, agrees = check_exact(trees, params, bug)   # both wrong: they agree, and the law is off
    assert agrees and gap > 1e-3, gap


@pytest.mark.parametrize("make", [one(chain), one(specinfer_like), sampled, sampled_merged([1], (0, 1, 2), 3)],
                         ids=lambda m: getattr(m, "__name__", "tree"))
def test_native_draws_are_exact(make, monkeypatch):
    """On float32 logits with no top-k or top-p cut, the bonus is drawn natively, from the LLM's
    logits at a leaf (sample_softmax) or from the residual after the last rejection
    (sample_residual), with the same uniform: the law stays the LLM's (to 1e-9)."""
    if native.library() is None:
        pytest.skip("the native kernels do not run here")
    calls = defaultdict(int)
    for name in ("sample_softmax", "sample_residual"):
        def counted(*args, real=getattr(native, name), name=name):
            calls[name] += 1
            return real(*args)
        monkeypatch.setattr(native, name, counted)
    params = PARAMS[0]
    gap, agrees = check_exact(make(params), params, dtype=np.float32)
    assert agrees and gap < TOL, gap
    assert calls["sample_softmax"] and calls["sample_residual"], dict(calls)


# --- other properties ------------------------------------------------------------------------------
def test_deterministic_candidates_need_every_earlier_rank():
    tree = TokenTree(ROOT)
    tree.add(0, 3, Proposal(0, 0, None))
    tree.add(0, 4, Proposal(0, 2, None))   # rank 2 without rank 1
    with pytest.raises(ValueError, match="ranks"):
        verify_mss(tree, np.zeros((3, V)), PARAMS[0], np.random.default_rng(0))
