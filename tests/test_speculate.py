"""SSM drafting against a real tiny model through TorchRuntime."""
import numpy as np
import pytest

from conftest import make_checkpoint
from specinfer.engines.torch_runtime import TorchRuntime
from specinfer.errors import SpecInferError
from specinfer.sampling import SamplingParams
from specinfer.speculate import (PREFILL_CATCH_UP, SSM_MIN_BUDGET, SSMDrafter, check_vocab, parse_tree, parse_widths,
                                 sample_without_replacement)

TOL = 1e-4
PROMPT = [1, 40, 41, 42, 43, 44]
GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def ssm_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ssm"), "llama2", seed=3, layers=2, hidden=32)


def counted(runtime):
    """Record every score call's (tokens, parents, logits) on ``runtime.calls``."""
    runtime.calls = []
    score = runtime.score

    def wrapper(seq, tokens, parents=None):
        logits = score(seq, tokens, parents)
        runtime.calls.append((list(tokens), parents, logits))
        return logits
    runtime.score = wrapper
    return runtime


@pytest.fixture
def drafter(ssm_dir):
    d = SSMDrafter(counted(TorchRuntime(ssm_dir, max_context=128)), index=0)
    d.prefill(PROMPT[:-1])   # the root, PROMPT[-1], is not in the cache
    yield d
    d.release()


@pytest.fixture(scope="module")
def fresh(ssm_dir):
    """Logits after a token sequence fed one token at a time to a fresh runtime."""
    rt = TorchRuntime(ssm_dir, max_context=128)

    def last_logits(tokens):
        seq = rt.start()
        for t in tokens:
            logits = rt.prefill(seq, [t])
        rt.release(seq)
        return logits
    return last_logits


def children_per_depth(tree):
    out = {}
    for n in range(len(tree)):
        out.setdefault(tree.depths[n], []).append(len(tree.children(n)))
    return out


def test_parse_tree():
    assert parse_tree("dynamic") is None and parse_tree(" Dynamic ") is None and parse_tree(None) is None
    assert parse_tree("2,1") == [2, 1] and parse_tree([1, 3]) == [1, 3]
    with pytest.raises(SpecInferError, match="'dynamic' or comma-separated"):
        parse_tree("dynamo")


def test_parse_widths():
    assert parse_widths("1,1,3,1,1,1,1,1") == [1, 1, 3, 1, 1, 1, 1, 1]
    assert parse_widths(" 2, 4 ") == [2, 4]
    for bad in ["", "1,,2", "a,b", "1,0", "-1", "1.5"]:
        with pytest.raises(SpecInferError, match="widths"):
            parse_widths(bad)


def test_check_vocab(ssm_dir, tmp_path):
    ssm = TorchRuntime(ssm_dir, max_context=32)
    check_vocab(ssm, [ssm, ssm])
    other = TorchRuntime(make_checkpoint(tmp_path / "big", "llama2", layers=1, hidden=32, vocab_size=384), max_context=32)
    with pytest.raises(SpecInferError, match="320 but the LLM has 384"):
        check_vocab(other, [ssm])


def test_sample_without_replacement():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.0, 0.3, 0.2])
    for _ in range(50):
        draw = sample_without_replacement(p, 4, rng)
        assert sorted(draw) == [0, 2, 3]   # distinct, never a zero-mass token, stops when mass runs out


def test_greedy_draft_one_call_per_depth_and_top_k(drafter, fresh):
    rt = drafter.runtime
    rt.calls.clear()
    tree = drafter.draft(PROMPT[-1], [1, 3, 2], GREEDY, np.random.default_rng(0), budget=100)
    assert children_per_depth(tree) == {0: [1], 1: [3], 2: [2, 2, 2], 3: [0] * 6}
    assert len(rt.calls) == 1 + 2   # the root call, then depths 1 and 2; depth 3 is never scored
    assert rt.calls[0][0] == PROMPT   # the prompt waited as catch-up: it goes in with the root
    # Each call's logits are the SSM's for that node's token path, and children are their top-k.
    scored = [0] + [n for n in range(1, len(tree)) if tree.depths[n] < 3]
    logits = np.concatenate([c[2][-1:] if i == 0 else c[2] for i, c in enumerate(rt.calls)])
    for node, row in zip(scored, logits):
        path = [tree.tokens[x] for x in tree.path(node)]
        np.testing.assert_allclose(row, fresh(PROMPT[:-1] + path), atol=TOL)
        top = np.argsort(-row)[:len(tree.children(node))]
        assert [tree.tokens[c] for c in tree.children(node)] == list(top)
        assert all(tree.proposals[c][0].rank == r for r, c in enumerate(tree.children(node)))
    assert rt.length(drafter.seq) == 0   # the prompt and the tree, all pending until commit


def test_sampled_draft(drafter):
    rt = drafter.runtime
    rt.calls.clear()
    tree = drafter.draft(PROMPT[-1], [3, 2], SAMPLE, np.random.default_rng(0), budget=100)
    assert children_per_depth(tree) == {0: [3], 1: [2, 2, 2], 2: [0] * 6}
    assert len(rt.calls) == 2
    for node in range(len(tree)):
        kids = tree.children(node)
        assert len({tree.tokens[c] for c in kids}) == len(kids)
        for rank, c in enumerate(kids):
            (pr,) = tree.proposals[c]
            assert (pr.ssm, pr.rank) == (0, rank) and pr.q[tree.tokens[c]] > 0
            assert pr.q.dtype == np.float64 and abs(pr.q.sum() - 1) < 1e-9 and (pr.q > 0).sum() <= 50


def test_budget_is_honoured(drafter):
    rt = drafter.runtime
    rt.calls.clear()
    tree = drafter.draft(PROMPT[-1], [2, 2, 2], GREEDY, np.random.default_rng(0), budget=5)
    assert len(tree) == 5 and children_per_depth(tree)[1] == [2, 0]   # breadth-first
    assert len(rt.calls) == 2   # the budget is spent at depth 2, so its nodes are not scored
    drafter.commit([PROMPT[-1]])
    tree = drafter.draft(tree.tokens[1], [4, 4], GREEDY, np.random.default_rng(0), budget=1)
    assert len(tree) == 1


def test_a_budget_with_room_for_one_draft_node_makes_no_call(drafter):
    """Under SSM_MIN_BUDGET an SSM call costs about what a longer draft does: no call, and the
    tokens wait as the next draft's catch-up."""
    rt = drafter.runtime
    rt.calls.clear()
    assert len(drafter.draft(PROMPT[-1], [1, 1], GREEDY, np.random.default_rng(0), budget=SSM_MIN_BUDGET - 1)) == 1
    assert rt.calls == [] and not drafter.drafted
    drafter.commit([PROMPT[-1]])
    assert drafter.catch_up == PROMPT
    tree = drafter.draft(7, [1, 1], GREEDY, np.random.default_rng(0), budget=SSM_MIN_BUDGET)
    assert len(tree) == SSM_MIN_BUDGET and rt.calls[0][0] == [*PROMPT, 7]   # catch-up + root in one call


def test_a_prompt_waits_for_the_first_draft_and_a_long_one_goes_in_by_a_prefill(ssm_dir, fresh):
    """prefill() runs nothing: the prompt waits as catch-up, so a request that never drafts never
    runs its SSM. The first draft puts a catch-up of PREFILL_CATCH_UP tokens or more in by a
    prefill, then scores the root alone; a shorter one goes in with the root."""
    rt = counted(TorchRuntime(ssm_dir, max_context=128))
    prompt = [1] + list(range(40, 40 + PREFILL_CATCH_UP))
    drafter = SSMDrafter(rt)
    drafter.prefill(prompt)
    assert rt.calls == [] and rt.length(drafter.seq) == 0 and drafter.catch_up == prompt
    tree = drafter.draft(7, [1, 1], GREEDY, np.random.default_rng(0), budget=10)
    assert rt.length(drafter.seq) == len(prompt) and drafter.catch_up == []
    assert [c[0] for c in rt.calls] == [[7], [tree.tokens[1]]]   # after the prefill, the root alone
    np.testing.assert_allclose(rt.calls[0][2][-1], fresh(prompt + [7]), atol=TOL)
    assert len(tree) == 3
    short = SSMDrafter(rt)
    short.prefill(prompt[:PREFILL_CATCH_UP - 1])
    short.draft(7, [1, 1], GREEDY, np.random.default_rng(0), budget=10)
    assert rt.calls[-2][0] == prompt[:PREFILL_CATCH_UP - 1] + [7]


def test_capacity_shrinks_the_tree(ssm_dir):
    rt = counted(TorchRuntime(ssm_dir, max_context=128))
    drafter = SSMDrafter(rt, capacity=len(PROMPT) + 3)
    drafter.prefill(PROMPT[:-1])
    rt.calls.clear()
    tree = drafter.draft(PROMPT[-1], [2, 2, 2], GREEDY, np.random.default_rng(0), budget=100)
    # 4 free slots: the root, both depth-1 nodes, one depth-2 node; only that one is expanded.
    assert children_per_depth(tree) == {0: [2], 1: [2, 2], 2: [2, 0, 0, 0], 3: [0, 0]}
    assert [len(c[0]) for c in rt.calls] == [len(PROMPT), 2, 1]   # the prompt went in with the root
    path = [tree.tokens[n] for n in tree.path(tree.children(tree.children(tree.children(0)[0])[0])[0])]
    drafter.commit(path)
    assert rt.length(drafter.seq) == len(PROMPT) + 2 and drafter.catch_up == path[3:]
    # Full cache: no speculation, the accepted tokens wait as catch-up.
    tree = drafter.draft(7, [2], GREEDY, np.random.default_rng(0), budget=100)
    assert len(tree) == 1
    drafter.commit([7])
    assert drafter.catch_up == path[3:] + [7] and rt.length(drafter.seq) == len(PROMPT) + 2


@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sample"])
def test_commit_then_next_draft_matches_a_fresh_runtime(drafter, fresh, params):
    rt, rng = drafter.runtime, np.random.default_rng(1)
    emitted, root = list(PROMPT[:-1]), PROMPT[-1]
    for step in range(5):
        rt.calls.clear()
        tree = drafter.draft(root, [2, 2, 1], params, rng, budget=100)
        # The first call scores catch-up + root and nothing else; its last row is the root's logits.
        tokens, _, logits = rt.calls[0]
        assert tokens == drafter.catch_up + [root]
        np.testing.assert_allclose(logits[-1], fresh(emitted + [root]), atol=TOL)
        # An accepted path: down the SSM's own tree for a random depth (up to the unscored leaves),
        # sometimes continued by a token another SSM proposed.
        node = 0
        for _ in range(rng.integers(0, 4)):
            node = tree.children(node)[rng.integers(len(tree.children(node)))]
        path = [tree.tokens[n] for n in tree.path(node)]
        if step % 2 and tree.children(node):
            other = next(t for t in range(300, 320) if tree.child(node, t) is None)
            path.append(other)
        before = rt.length(drafter.seq)
        expected_catch_up = drafter.catch_up
        drafter.commit(path)
        scored = min(len(path) - 1, 2, tree.depths[node])   # depth 3 is never scored
        assert rt.length(drafter.seq) == before + len(expected_catch_up) + 1 + scored
        assert drafter.catch_up == path[1 + scored:]
        emitted += path
        root = int(rng.integers(3, 320))   # the bonus token


def test_draft_misuse(drafter):
    drafter.draft(PROMPT[-1], [1], GREEDY, np.random.default_rng(0), budget=10)
    with pytest.raises(SpecInferError, match="commit"):
        drafter.draft(PROMPT[-1], [1], GREEDY, np.random.default_rng(0), budget=10)
    with pytest.raises(SpecInferError, match="root"):
        drafter.commit([PROMPT[-1] + 1])
    drafter.commit([PROMPT[-1]])
    # A step the caller did not draft for: the SSM has seen none of its tokens.
    drafter.commit([9, 10])
    assert drafter.catch_up == [9, 10]


def test_draft_distribution_is_the_candidates_softmax_at_the_draw_temperature():
    """A sampled draft's law: softmax of its candidates' logits at the temperature it was drawn
    at, as sampling.probabilities shapes it, and nothing on any other token; the draws follow it
    (Gumbel-max over the candidates, as the engines draw)."""
    from specinfer.engines.runtime import chain_draw
    from specinfer.sampling import probabilities
    from specinfer.speculate import draft_distribution

    rng = np.random.default_rng(3)
    for temperature in (0.35, 1.0, 2.5):
        logits = (rng.standard_normal(40) * 3).astype(np.float32)
        candidates = np.argsort(-logits, kind="stable")[:6]
        q = draft_distribution(candidates, logits[candidates], temperature, 40)
        expected = np.zeros(40)
        expected[candidates] = probabilities(logits[candidates], SamplingParams(temperature=temperature))
        np.testing.assert_allclose(q, expected, rtol=1e-12, atol=0)
        assert q.sum() == pytest.approx(1.0) and np.count_nonzero(q) == 6
    draws = np.bincount([chain_draw(logits, temperature * rng.gumbel(size=6))[0] for _ in range(20000)], minlength=40)
    assert set(np.flatnonzero(draws)) <= set(candidates.tolist())
    expected_counts = 20000 * q
    kept = expected_counts > 5
    chi2 = (((draws - expected_counts)[kept]) ** 2 / expected_counts[kept]).sum()
    assert chi2 < 25.7   # chi-square, 5 degrees of freedom at most, p = 1e-4
