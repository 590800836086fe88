"""Oracles of speculative generation, end to end through the engines.

Greedy: token for token the LLM's own incremental greedy output, for every tree shape and SSM set.
Sampling: the first generated tokens are distributed as the LLM's own sampling (chi-square).
"""
import numpy as np
import pytest

from conftest import EOS, TINY_VOCAB, chi_square_p, make_checkpoint
from specinfer import generate
from specinfer import verify as verify_module
from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.engines.torch_runtime import TorchRuntime
from specinfer.errors import SpecInferError
from specinfer.generate import Stats, generate_ids
from specinfer.sampling import SamplingParams, probabilities
from specinfer.speculate import parse_tree

PROMPTS = [[1, 294, 72, 308], [1, 5], [1] + list(range(100, 130)), [1, 33, 33, 33, 200, 17], [1, 250, 3, 99], [1, 7, 8]]
TREES = {"chain": "1,1,1,1,1,1", "wide": "4,2", "specinfer": "1,1,3,1,1,1,1,1", "dynamic": "dynamic"}


@pytest.fixture(scope="module")
def pair(served_pair):
    """The LLM, an SSM made of its first layer (agrees often) and an unrelated SSM, on ONNX Runtime."""
    close, far = served_pair["ssms"]
    return {"llm": OrtRuntime(served_pair["llm"]), "close": OrtRuntime(close), "far": OrtRuntime(far)}


def tokens(llm, prompt, n=40, eos=EOS, **kw):
    return [t for step in generate_ids(llm, prompt, max_new_tokens=n, eos_ids=[eos] if eos else [], **kw) for t in step]


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("ssms", [["close"], ["far"], ["close", "far"]])
def test_greedy_speculative_equals_incremental(pair, tree, ssms, monkeypatch, trees_against_one_token_steps):
    from specinfer.tree_sizing import Acceptance

    # Every step drafts, even where drafts would not pay on these tiny models (the test is of what
    # verification accepts; steps without a draft have a test of their own).
    monkeypatch.setattr(Acceptance, "drafting_pays", lambda self, lead=0.0: True)
    llm, drafts = pair["llm"], [pair[s] for s in ssms]
    stats = Stats()
    for prompt in PROMPTS:
        want = tokens(llm, prompt)
        assert tokens(llm, prompt, ssms=drafts, tree=parse_tree(TREES[tree]), stats=stats) == want
    assert all(rt.sequences() == [] for rt in [llm] + drafts)  # every model released its state
    assert sum(stats.tokens_per_step) == stats.new_tokens
    if "close" in ssms and tree != "wide":
        assert stats.mean_tokens_per_step > 2.0  # long paths really were accepted
        assert stats.accepted_draft_tokens > 0


def test_greedy_stays_exact_when_drafting_stops_and_starts(pair, monkeypatch):
    """Where drafts do not pay the SSM skips steps and catches up later: every other step here."""
    from specinfer.tree_sizing import Acceptance

    turns = iter(range(10**6))
    monkeypatch.setattr(Acceptance, "drafting_pays", lambda self, lead=0.0: next(turns) % 2 == 0)
    llm, close = pair["llm"], pair["close"]
    calls = []
    monkeypatch.setattr(close, "draft_chain", lambda *a, f=close.draft_chain: calls.append(1) or f(*a))
    for prompt in PROMPTS:
        stats = Stats()
        assert tokens(llm, prompt, ssms=[close], stats=stats) == tokens(llm, prompt)
        assert len(calls) <= (stats.steps + 1) // 2 < stats.steps   # half the steps drafted nothing
        calls.clear()
    assert close.sequences() == []


def test_a_step_that_drafts_nothing_takes_a_chain_run(pair, monkeypatch, trees_against_one_token_steps):
    """Greedy, a step whose drafters draft nothing takes draft_depth tokens in one run of the LLM's
    drafter graph, as incremental decoding does, and the SSM catches up at its next draft: token
    for token incremental decoding. Sampled at a temperature alone, such a step takes a chain too
    where the LLM draws in its graph (Runtime.samples_chains); with a top-k cut, one token."""
    from specinfer.tree_sizing import Acceptance, step_cost

    turns = iter(range(10**6))
    monkeypatch.setattr(Acceptance, "drafting_pays", lambda self, lead=0.0: next(turns) % 3 == 0)
    llm, close = pair["llm"], pair["close"]
    step_cost(llm)   # measured at first use (its runs not counted below)
    runs, trees = [], []
    for prompt in PROMPTS:
        want = tokens(llm, prompt, n=60, eos=None)
        with monkeypatch.context() as m:
            m.setattr(llm, "decode_chain", lambda seq, t, depth, sampling=None, f=llm.decode_chain:
                      runs.append(depth) or f(seq, t, depth, sampling))
            m.setattr(llm, "score", lambda seq, t, *a, f=llm.score: trees.append(len(t)) or f(seq, t, *a))
            stats = Stats()
            assert tokens(llm, prompt, n=60, eos=None, ssms=[close], stats=stats) == want
        assert set(runs) == {llm.draft_depth} and stats.steps == len(runs) + len(trees)
        assert any(t > 1 for t in trees)    # and the other steps verified the SSM's drafts
        for params, chained in ((SamplingParams(temperature=1.0, seed=1), llm.samples_chains),
                                (SamplingParams(temperature=1.0, top_k=5, seed=1), False)):
            runs.clear(), trees.clear()
            with monkeypatch.context() as m:
                m.setattr(llm, "decode_chain", lambda seq, t, depth, sampling=None, f=llm.decode_chain:
                          runs.append(sampling is not None) or f(seq, t, depth, sampling))
                m.setattr(llm, "score", lambda seq, t, *a, f=llm.score: trees.append(len(t)) or f(seq, t, *a))
                tokens(llm, prompt, n=40, eos=None, ssms=[close], params=params)
            assert bool(runs) == chained and all(runs) and (not chained or any(t > 1 for t in trees))
        runs.clear(), trees.clear()
    assert llm.sequences() == [] and close.sequences() == []


@pytest.mark.parametrize("ssms", [[], ["close"]])
def test_greedy_with_lookup_equals_incremental(pair, ssms, trees_against_one_token_steps):
    """The dynamic tree drafting by lookup too (or only): token for token incremental decoding, and
    copies were accepted (random models repeat themselves; against one-token steps, as the tiny
    LLM's chain runs beat any tree, and whether one did hung on the machine's timing)."""
    llm, drafts = pair["llm"], [pair[s] for s in ssms]
    stats = Stats()
    for prompt in PROMPTS + [[1] + [40, 41, 42, 43] * 5]:
        assert tokens(llm, prompt, ssms=drafts, lookup=True, stats=stats) == tokens(llm, prompt)
    assert stats.accepted_draft_tokens > 0
    assert all(rt.sequences() == [] for rt in [llm] + drafts)


def test_edge_cases_stay_exact(pair):
    llm, close = pair["llm"], [pair["close"]]
    prompt = PROMPTS[0]
    free = tokens(llm, prompt, n=30)
    # a tree of one node: the budget leaves only the root
    assert tokens(llm, prompt, n=30, ssms=close, budget=1) == free
    # EOS inside an accepted path: nothing after it is emitted
    stats = Stats()
    eos = free[7]
    out = [t for s in generate_ids(llm, prompt, max_new_tokens=30, eos_ids=[eos], ssms=close, stats=stats) for t in s]
    assert out == free[:free.index(eos) + 1] and stats.stop_reason == "eos"
    # max tokens reached in the middle of an accepted path
    for n in (1, 2, 5, 11):
        stats = Stats()
        assert tokens(llm, prompt, n=n, ssms=close, stats=stats) == free[:n] and stats.new_tokens == n
    # context capacity: the LLM's context ends inside a would-be tree
    small = OrtRuntime(pair["llm"].dir, max_context=len(prompt) + 9)
    stats = Stats()
    out = tokens(small, prompt, n=30, ssms=close, stats=stats)
    assert out == free[:10] and stats.stop_reason == "context capacity"


def greedy_a_token_a_call(llm, prompt, n, eos=EOS):
    """The LLM's greedy decoding, one Runtime call per token: the oracle of incremental steps
    taken several in one run."""
    seq = llm.start()
    try:
        logits, out = llm.prefill(seq, prompt), []
        while len(out) < n and (not out or out[-1] != eos):
            out.append(int(np.argmax(logits)))
            logits = llm.score(seq, [out[-1]])[-1]
            llm.commit(seq, [0])
        return out
    finally:
        llm.release(seq)


def test_incremental_steps_taken_several_in_one_run_are_the_llms_greedy_decoding(pair, monkeypatch):
    """Greedy incremental decoding on ONNX Runtime runs up to draft_depth steps in one run of the
    LLM's drafter graph: token for token its decoding a call per token, computing no token past
    max_new_tokens or the context. Runs are of draft_depth steps only (another depth would open
    another session); the steps left over are taken one a call. Sampling with a top-k or top-p
    cut, or a drafter with a draft vocabulary: step by step."""
    llm = pair["llm"]
    assert llm.draft_depth > 1
    runs, scored = [], []
    monkeypatch.setattr(llm, "decode_chain", lambda seq, t, depth, sampling=None, f=llm.decode_chain:
                        runs.append(depth) or f(seq, t, depth, sampling))
    monkeypatch.setattr(llm, "score", lambda seq, t, *a, f=llm.score: scored.append(len(t)) or f(seq, t, *a))
    for prompt in PROMPTS:
        for n in (1, 2, 5, llm.draft_depth, 40):
            runs.clear(), scored.clear()
            out = tokens(llm, prompt, n=n, eos=None)
            ran, one = runs.copy(), scored.copy()   # (the reference's calls are not counted)
            assert out == greedy_a_token_a_call(llm, prompt, n, eos=None)
            assert set(ran) <= {llm.draft_depth} and len(ran) == n // llm.draft_depth, (n, ran)
            assert sum(ran) + sum(one) == n and set(one) <= {1}, (n, ran, one)
        assert tokens(llm, prompt, n=40) == greedy_a_token_a_call(llm, prompt, 40)   # EOS inside a run
    small = OrtRuntime(llm.dir, max_context=len(PROMPTS[0]) + 9)
    stats = Stats()
    assert tokens(small, PROMPTS[0], n=30, eos=None, stats=stats) == greedy_a_token_a_call(llm, PROMPTS[0], 10, eos=None)
    assert stats.stop_reason == "context capacity"
    assert llm.sequences() == [] and small.sequences() == []
    for params, vocab in ((SamplingParams(temperature=1.0, top_p=0.9), None), (SamplingParams(temperature=1.0, top_k=3), None),
                          (SamplingParams(), np.arange(64)), (SamplingParams(temperature=1.0), np.arange(64))):
        monkeypatch.setattr(llm, "draft_vocab", vocab)
        speculator = generate.LocalSpeculator(llm, tree=[], params=params)
        assert not speculator.chained
        speculator.release()


def test_ssm_with_another_vocabulary_is_refused(pair, tmp_path):
    other = make_checkpoint(tmp_path / "v", "llama2", vocab_size=400)
    with pytest.raises(SpecInferError, match="SSM 0 has vocab size 400 but the LLM has 320"):
        tokens(pair["llm"], [1, 2], ssms=[TorchRuntime(other, max_context=64)])


def test_sampled_incremental_steps_taken_several_in_one_run_draw_what_a_step_a_token_draws(pair, monkeypatch):
    """Sampled at a temperature alone, incremental decoding where the LLM's graph draws
    (Runtime.samples_chains: the native kernels) runs draft_depth steps in one run of its drafter
    graph, each step's token drawn inside it: with the same seed, token for token what it draws a
    Runtime call and a draw a token (the same uniforms, one a token, the same inverse CDF on the
    same logits), at temperatures below and above 1."""
    llm = pair["llm"]
    if not llm.samples_chains:
        pytest.skip("sampled chains are drawn by the native kernels")
    runs = []
    monkeypatch.setattr(llm, "decode_chain", lambda seq, t, depth, sampling=None, f=llm.decode_chain:
                        runs.append(sampling is not None and depth) or f(seq, t, depth, sampling))
    for prompt in PROMPTS:
        for temperature in (0.6, 1.4):
            params = SamplingParams(temperature=temperature, seed=len(prompt))
            runs.clear()
            chained = tokens(llm, prompt, n=40, eos=None, params=params)
            assert runs == [llm.draft_depth] * (40 // llm.draft_depth), runs
            with monkeypatch.context() as m:
                m.setattr(llm, "samples_chains", False)
                assert tokens(llm, prompt, n=40, eos=None, params=params) == chained
    assert llm.sequences() == []


# --- multi-step speculative sampling keeps the LLM's distribution --------------------------------
V = TINY_VOCAB
TRIALS = 2500


def first_two_counts(llm, ssms, tree, params, trials=TRIALS, prompt=(3, 1, 4), lookup=False, rule="mss"):
    counts = np.zeros((V, V))
    for seed in range(trials):
        out = tokens(llm, list(prompt), n=2, eos=None, ssms=ssms, tree=tree, lookup=lookup, rule=rule,
                     params=SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed))
        counts[out[0], out[1]] += 1
    return counts


def exact_first_two(llm, params, prompt=(3, 1, 4)):
    seq, prompt = llm.start(), list(prompt)
    p1 = probabilities(llm.score(seq, prompt)[-1], params)
    llm.commit(seq, [])
    p2 = np.stack([probabilities(llm.score(seq, prompt + [x])[-1], params) for x in range(V) if llm.commit(seq, []) is None])
    llm.release(seq)
    return p1[:, None] * p2


@pytest.mark.parametrize("setup", ["one SSM", "two merged SSMs", "dynamic tree, two SSMs", "dynamic tree, SSM and lookup"])
def test_mss_keeps_the_llm_distribution(tiny_vocab, setup, monkeypatch):
    (llm, a, b), _ = tiny_vocab
    ssms = [a] if setup in ("one SSM", "dynamic tree, SSM and lookup") else [a, b]
    lookup = setup.endswith("lookup")
    monkeypatch.setattr(generate, "LOOKUP_WHEN_SAMPLING", True)   # off by default; exact either way
    prompt = (4, 1, 3, 4) if lookup else (3, 1, 4)   # the lookup copies "1 3 4" after the root 4
    params = SamplingParams(temperature=1.0)
    counts = first_two_counts(llm, ssms, None if setup.startswith("dynamic") else [3, 2], params, prompt=prompt,
                              lookup=lookup)
    p = chi_square_p(counts, exact_first_two(llm, params, prompt))
    assert p > 1e-3, f"first two tokens not distributed as the LLM's (chi-square p = {p:.2e})"


def test_sampled_chain_runs_keep_the_llm_distribution(tiny_vocab, monkeypatch):
    """Sampled incremental decoding in chain runs of the LLM's drafter graph (the first two of a
    run's tokens): distributed as the LLM's own sampling (chi-square against the exact
    probabilities)."""
    (llm, _, _), _ = tiny_vocab
    if not llm.samples_chains:
        pytest.skip("sampled chains are drawn by the native kernels")
    runs = []
    monkeypatch.setattr(llm, "decode_chain", lambda seq, t, depth, sampling=None, f=llm.decode_chain:
                        runs.append(depth) or f(seq, t, depth, sampling))
    params, counts = SamplingParams(temperature=0.8), np.zeros((V, V))
    for seed in range(TRIALS):
        out = tokens(llm, [3, 1, 4], n=llm.draft_depth, eos=None, params=SamplingParams(0.8, seed=seed))
        counts[out[0], out[1]] += 1
    assert runs == [llm.draft_depth] * TRIALS
    p = chi_square_p(counts, exact_first_two(llm, params))
    assert p > 1e-3, f"first two tokens not distributed as the LLM's (chi-square p = {p:.2e})"


def test_a_sampled_requests_dynamic_tree_drafts_no_lookup(tiny_vocab):
    """Lookup drafts are point masses, which sampling rarely accepts: only greedy requests' dynamic
    trees draft by lookup (generate.LOOKUP_WHEN_SAMPLING)."""
    (llm, a, _), _ = tiny_vocab
    for params, drafts in ((SamplingParams(), True), (SamplingParams(temperature=0.7, seed=0), False)):
        spec = generate.LocalSpeculator(llm, [a], None, params, lookup=True)
        try:
            assert (spec.lookup is not None) == drafts
        finally:
            spec.release()


@pytest.mark.parametrize("tree", [[1, 1, 1], [3, 2]], ids=["sampled chain", "sampled tree 3,2"])
def test_traversal_keeps_the_llm_distribution(tiny_vocab, tree):
    (llm, a, b), _ = tiny_vocab
    params = SamplingParams(temperature=0.7)
    counts = first_two_counts(llm, [a, b], tree, params, rule="traversal")
    p = chi_square_p(counts, exact_first_two(llm, params))
    assert p > 1e-3, f"first two tokens not distributed as the LLM's (chi-square p = {p:.2e})"


def test_a_wrong_acceptance_rule_fails_the_same_test(tiny_vocab, monkeypatch):
    (llm, a, _), _ = tiny_vocab
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p)  # forget the rejected mass
    counts = first_two_counts(llm, [a], [3, 2], params)
    assert chi_square_p(counts, exact_first_two(llm, params)) < 1e-6


def test_cli_speculative_equals_incremental(pair):
    import subprocess
    import sys
    run = lambda *extra: subprocess.run(
        [sys.executable, "-m", "specinfer.cli", "generate", "--llm", str(pair["llm"].dir), "def f(x):",
         "--max-tokens", "24", *extra], capture_output=True, text=True, timeout=120)
    plain = run()
    spec = run("--ssm", str(pair["close"].dir), "--ssm", str(pair["far"].dir), "--tree", "1,1,3,1,1", "--stats")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "tokens/step" in spec.stderr
