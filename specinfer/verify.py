"""Verification: which path of a speculated token tree the LLM accepts, and the token it adds.

The LLM scores the whole tree in one pass; ``llm_logits[u]`` is its distribution for u's children.

Greedy: follow the LLM's argmax down the tree while a child holds it; the argmax at the last node
is the bonus token. The output is exactly incremental greedy decoding.

Sampling: multi-step speculative sampling (MSS, SpecInfer Algorithm 2). At node u with LLM
distribution p, the candidates are u's (child, proposal) pairs in (ssm, rank) order. A candidate x
drawn by SSM j from q is accepted with probability min(1, p[x] / q[x]); on rejection
p <- normalize(max(0, p - q)) and the next candidate is tried; with none left, the bonus is drawn
from p. A proposal without q is a deterministic candidate (an SSM's top tokens, a dynamic tree's
picks): its proposal is the point mass on x, so it is accepted with probability p[x] and a rejection
leaves p with x zeroed, renormalized. Why the emitted tokens follow the LLM's distribution exactly:

* One step of rejection sampling (x ~ q, accept w.p. min(1, p/q), else draw from the residual
  normalize(max(0, p - q))) yields a token distributed as p. Conditioned on a rejection, the
  residual is then the exact law of the token, so the next candidate faces the same situation with
  p replaced by the residual; by induction over the candidates, the token that leaves u (an
  accepted child or the bonus) is distributed as the LLM's p at u. Moving to the accepted child and
  repeating, by induction over depth, gives the LLM's joint law of the emitted tokens.
* The induction needs each candidate to be a fresh draw from the q we use, given everything seen
  so far. SSM drafts draw k children at a parent WITHOUT replacement, so its draw of rank r has the
  law of q with the SSM's ranks 0..r-1 tokens removed, renormalized (:func:`conditional_q`). Using
  the plain q there biases the output (a test checks that). Removing those tokens costs nothing:
  they were rejected, and a rejected token x had p[x] < q[x], so its residual mass is already zero.
* Hence the trial order within one SSM must be its draw order: with draws without replacement,
  trying them in a uniformly random order would not be exact. Different SSMs draw independently, so
  their order does not matter. A token proposed by two SSMs is one node carrying both proposals,
  each tried in turn with its own q (if the first rejects it, p has no mass there any more and the
  second rejects it too).
* Every SSM's proposals at a node must be its ranks 0..m-1 (``tree.merge`` cuts accordingly): a
  missing earlier draw would leave a later draw's law unknown.
* A deterministic candidate is a "draw" from the point mass on its token, exactly so, whatever was
  seen before: each one is a rejection-sampling step with proposal δ_x, so the induction holds with
  no rank conditioning, in any order and mixed with other SSMs' sampled draws (a sampled draw is
  conditioned on its SSM's earlier sampled draws only). With only deterministic candidates, MSS is
  naive sampling: the token leaving u has law p and is accepted exactly when it is a child.

Traversal verification (:func:`verify_traversal`, after Weng et al., NeurIPS 2025) decides whole
paths rather than tokens, bottom-up. Each node v carries a weight alpha_v, the chance to accept the
path to v: alpha_root = 1 and, for a candidate x with proposal q at parent u,
alpha_v = min(1, alpha_u p_u[x] / q[x]). Depth first, a node's candidates in the same (ssm, rank)
order as MSS, a subtree is tried before its parent may end the path: a node whose candidates are
all rejected (or a leaf) ends the path with probability alpha_v, the bonus drawn from its current
p. When a candidate's subtree is rejected, its parent u moves to r = max(0, alpha_u p_u - q):
p_u <- r / sum(r) and alpha_u <- sum(r) / (sum(r) + 1 - alpha_u). On a chain this is block
verification (Sun et al., 2024), the optimal verification of a drafted block; with alpha = 1 at
every node it is MSS step for step, and with point-mass candidates only it accepts exactly as MSS
does; on sampled drafts it accepts more. Its exactness on our trees (several proposers, draws
without replacement, point masses, shared nodes tried once per proposal) is proven by exact
enumeration of every draw and coin in ``tests/test_verify_traversal.py``, on every tree shape the
drafters make.

Naive sampling (:func:`verify_naive`) draws from p at each node and follows the tree while the draw
is a child; exact too, but it ignores the SSM distributions, so it accepts less.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engines import native
from .sampling import SamplingParams, draw, inverse_cdf, probabilities, sample
from .tree import TokenTree


@dataclass
class Verdict:
    path: list[int]   # accepted merged-tree nodes, root first (the root is always accepted)
    bonus: int        # the token the LLM emits after the path


def verify_greedy(tree: TokenTree, llm_logits: np.ndarray) -> Verdict:
    """Longest path whose every token is the LLM argmax at its parent; bonus = argmax at its end."""
    path = [0]
    while True:
        best = int(llm_logits[path[-1]].argmax())
        child = tree.child(path[-1], best)
        if child is None:
            return Verdict(path, best)
        path.append(child)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The LLM's law after rejecting a draw from q: normalize(max(0, p - q))."""
    r = p - q
    np.maximum(r, 0.0, out=r)
    total = r.sum()
    # Zero mass means p <= q everywhere, i.e. p == q, where a rejection has probability zero; only
    # rounding gets here, and p itself is then the right law.
    if not total > 0:
        return p
    r /= total
    return r


def residual_draw(p: np.ndarray, q: np.ndarray, u: float) -> int:
    """The token of uniform ``u`` under :func:`residual` (p, q): the bonus after the last
    candidate's rejection, drawn in one native pass over p and q where it runs."""
    token = native.sample_residual(p, q, u)
    return inverse_cdf(residual(p, q), u) if token is None else token


def conditional_q(q: np.ndarray, drawn: list[int]) -> np.ndarray:
    """q with the tokens already drawn (without replacement) removed and renormalized."""
    if not drawn:
        return q
    q = q.copy()
    q[drawn] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


def point_mass(token: int, size: int) -> np.ndarray:
    """A deterministic candidate's proposal: all the mass on its token."""
    q = np.zeros(size)
    q[token] = 1.0
    return q


def _candidates(tree: TokenTree, u: int, vocab: int) -> list[tuple[int, int, np.ndarray]]:
    """(child, token, q) for u's children's proposals in (ssm, rank) order: q conditioned on that
    SSM's earlier sampled draws here, or the point mass on the token for a deterministic one."""
    pairs = sorted(((pr.ssm, pr.rank, c, pr.q) for c in tree.children(u) for pr in tree.proposals[c]),
                   key=lambda t: t[:2])
    out, drawn, first = [], [], 0   # first: index in pairs of this SSM's rank 0
    for i, (ssm, rank, c, q) in enumerate(pairs):
        if i and ssm != pairs[i - 1][0]:
            drawn, first = [], i
        if rank != i - first:
            raise ValueError(f"SSM {ssm} proposes ranks {[t[1] for t in pairs if t[0] == ssm]} at node {u}; "
                             "verification needs ranks 0..m-1")
        x = tree.tokens[c]
        if q is None:
            out.append((c, x, point_mass(x, vocab)))
        else:
            out.append((c, x, conditional_q(q, drawn)))
            drawn.append(x)
    return out


def verify_mss(tree: TokenTree, llm_logits: np.ndarray, params: SamplingParams,
               rng: np.random.Generator) -> Verdict:
    """SpecInfer multi-step speculative sampling (see the module docstring)."""
    path, vocab = [0], llm_logits.shape[-1]
    while True:
        u = path[-1]
        candidates = _candidates(tree, u, vocab)
        if not candidates:   # a leaf: the bonus is the LLM's own draw there (sample(p), in one native call)
            return Verdict(path, draw(llm_logits[u], params, rng))
        p = probabilities(llm_logits[u], params)
        for i, (child, x, q) in enumerate(candidates):
            # Accept with probability min(1, p[x] / q[x]), written without a division.
            if rng.random() * q[x] < p[x]:
                path.append(child)
                break
            if i == len(candidates) - 1:   # all rejected: the bonus from the residual
                return Verdict(path, residual_draw(p, q, rng.random()))
            p = residual(p, q)


def verify_naive(tree: TokenTree, llm_logits: np.ndarray, params: SamplingParams,
                 rng: np.random.Generator) -> Verdict:
    """Sample from the LLM at each node; follow the tree while the token is a child."""
    path = [0]
    while True:
        token = draw(llm_logits[path[-1]], params, rng)
        child = tree.child(path[-1], token)
        if child is None:
            return Verdict(path, token)
        path.append(child)


def accept(rng: np.random.Generator, probability: float) -> bool:
    """One coin: True with ``probability`` (the tests replace it to enumerate every outcome)."""
    return rng.random() < probability


SHAPE_AT_ONCE = 1 << 20   # logits a traversal shapes in one call at most (8 MB of float64)


def verify_traversal(tree: TokenTree, llm_logits: np.ndarray, params: SamplingParams,
                     rng: np.random.Generator) -> Verdict:
    """Traversal verification (Weng et al., NeurIPS 2025): the tree is verified bottom-up with
    sequence-level acceptance; see the module docstring."""
    vocab = llm_logits.shape[1]
    # The nodes are shaped in one call where that stays small: traversal enters each node whose
    # parent's weight for it is not zero, so on a chain all of them (5 rows of a chain of 4: 181
    # against 200 us a step here); a large tree of a large vocabulary is shaped row by row.
    shaped = probabilities(llm_logits, params) if llm_logits.size <= SHAPE_AT_ONCE else None

    def visit(u: int, alpha: float) -> Verdict | None:
        """u entered with acceptance weight ``alpha``: the verdict if a path through u is accepted,
        None if u is rejected (then its parent goes on with its residual)."""
        p = shaped[u] if shaped is not None else probabilities(llm_logits[u], params)
        for child, x, q in _candidates(tree, u, vocab):
            a = min(1.0, alpha * p[x] / q[x])
            verdict = visit(child, a) if a > 0 else None
            if verdict is not None:
                return Verdict([u] + verdict.path, verdict.bonus)
            r = alpha * p
            r -= q
            np.maximum(r, 0.0, out=r)
            total = r.sum()
            if total > 0:
                r /= total
                p, alpha = r, total / (total + 1.0 - alpha)
            elif alpha < 1.0:   # alpha p <= q everywhere: u can no longer end the path
                alpha = 0.0
            # (alpha == 1 and no mass: p == q, where a rejection has probability zero; only rounding
            # gets here, and p is then the right law, as in residual())
        # The root's weight stays 1 after any rejection: the path ends there at the latest (no coin).
        return Verdict([u], sample(p, rng)) if u == 0 or accept(rng, alpha) else None

    return visit(0, 1.0)


SAMPLING_RULES = ("mss", "traversal", "naive")


def verify(tree: TokenTree, llm_logits: np.ndarray, params: SamplingParams,
           rng: np.random.Generator, rule: str = "mss") -> Verdict:
    """Greedy verification when ``params.greedy``, else multi-step speculative sampling (``rule``
    "mss"), traversal verification ("traversal": bottom-up, accepts at least as much) or naive
    sampling ("naive", for comparison: also exact, accepts less)."""
    if params.greedy:
        return verify_greedy(tree, llm_logits)
    rules = {"mss": verify_mss, "traversal": verify_traversal, "naive": verify_naive}
    if rule not in rules:
        raise ValueError(f"unknown sampling rule {rule!r}: expected one of {', '.join(SAMPLING_RULES)}")
    return rules[rule](tree, llm_logits, params, rng)
