"""Continuous batching (scheduler.py): many requests' steps in one LLM call, exactly as each alone;
KV memory under a budget; a failing request never takes the others of its batch with it."""
import threading
import time
import weakref

import numpy as np
import pytest

from conftest import EOS
from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.errors import RequestError, ServerBusy, ServerStopping, SpecInferError
from specinfer.generate import Stats, decode, generate_ids
from specinfer.sampling import SamplingParams
from specinfer.pipeline import Pipeline
from specinfer.scheduler import ChainsOrTrees, Scheduler, parse_bytes
from specinfer.serving.models import VerifyModel
from specinfer import tree_sizing
from specinfer.speculate import parse_tree

PROMPTS = [[1, 294, 72, 308], [1, 5], [1] + list(range(100, 130)), [1, 33, 33, 33, 200, 17], [1, 250, 3, 99],
           [1, 7, 8], [1, 60, 61], [1, 200, 201, 202, 203]]


@pytest.fixture(autouse=True)
def close_schedulers(monkeypatch):
    """Each test's schedulers stop when it ends: an idle one trims the models it runs on
    (``idle_seconds``), and these are shared with the next tests, which count their sessions."""
    made, init = [], Scheduler.__init__

    def init_and_keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(Scheduler, "__init__", init_and_keep)
    yield
    for scheduler in made:
        scheduler.close()


@pytest.fixture
def batches_draft_trees(monkeypatch):
    """Batches of greedy speculative requests draft trees, whatever ChainsOrTrees would measure
    (on these tiny models chains soon win): for tests of what the trees do in a batch."""
    monkeypatch.setattr(ChainsOrTrees, "chains", lambda self, size: False)


@pytest.fixture(scope="module")
def models(served_pair):
    close, far = served_pair["ssms"]
    return OrtRuntime(served_pair["llm"]), [OrtRuntime(close), OrtRuntime(far)]


def alone(llm, prompt, n, **kw):
    return [t for step in generate_ids(llm, prompt, max_new_tokens=n, eos_ids=[EOS], **kw) for t in step]


def run_together(scheduler, prompts, n, params=SamplingParams(), tree=None, start_together=True, **kw):
    """Every prompt on a thread of its own through the scheduler; each one's tokens (or exception)."""
    out: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i):
        try:
            if start_together:
                barrier.wait()
            spec = scheduler.speculator(n, params, tree, **kw)
            out[i] = [t for step in decode(spec, prompts[i], n, [EOS]) for t in step]
        except Exception as e:  # noqa: BLE001
            out[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("tree", ["dynamic", "1,1,3,1", "none"])
def test_greedy_under_batching_is_each_request_alone(models, tree):
    llm, ssms = models
    scheduler = Scheduler(llm, ssms, gather_seconds=0.01)
    got = run_together(scheduler, PROMPTS, 40, tree=parse_tree(tree), lookup=tree == "dynamic")
    want = [alone(llm, p, 40) for p in PROMPTS]     # incremental greedy decoding, one request at a time
    assert got == want
    assert scheduler.mean_batch > 1.5              # the steps really ran together
    assert scheduler.reserved == 0 and scheduler.sequences == []
    assert all(rt.sequences() == [] for rt in [llm] + ssms)   # every sequence freed


def test_a_lone_incremental_request_takes_several_tokens_a_run_as_it_would_alone(models):
    """Alone in the scheduler, a greedy incremental request steps as it would without one: several
    tokens in one LLM run (LocalSpeculator's chained steps), not one a batch; the tokens the same."""
    llm, ssms = models
    assert llm.draft_depth > 1
    scheduler = Scheduler(llm, ssms)
    n = 40
    assert run_together(scheduler, PROMPTS[:1], n, tree=[]) == [alone(llm, PROMPTS[0], n)]
    assert scheduler.batches <= 1 + n // llm.draft_depth + llm.draft_depth   # its prompt, then runs of several
    assert scheduler.reserved == 0 and llm.sequences() == []


@pytest.mark.parametrize("copies", [False, True], ids=["shared-weights", "own-weights"])
def test_an_idle_scheduler_gives_the_batches_memory_back_and_batches_again_exactly(models, served_pair, copies):
    """Once idle, the models trim: an LLM whose sessions share every weight keeps its batch
    sessions (a burst after the idle spell opens none), one whose sessions keep weights of their
    own (MLAS prepacks a product the native kernels do not take) drops them; batches are exact
    after either."""
    llm = OrtRuntime(served_pair["llm"])   # its own: no other test's scheduler trims it meanwhile
    llm.sessions_copy_weights = copies     # as _open finds it for a model the native kernels do not take
    ssms = models[1]
    scheduler = Scheduler(llm, ssms[:1], gather_seconds=0.01, idle_seconds=0.5)
    want = [alone(llm, p, 24) for p in PROMPTS[:4]]
    assert run_together(scheduler, PROMPTS[:4], 24) == want
    assert max(llm.batch_sessions) > 1          # sequences ran together, on a batched session
    sessions = dict(llm._batched)
    deadline = time.monotonic() + 20
    while scheduler.trims == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.trims == 1 and llm._scratch is None
    if copies:
        assert llm.batch_sessions == []
    else:
        assert all(llm._batched[size][0] is entry[0] for size, entry in sessions.items())
    assert run_together(scheduler, PROMPTS[:4], 24) == want   # made again, or the same
    assert llm.batch_sessions


def test_a_warm_scheduler_has_every_batch_size_session_before_its_first_request(served_pair):
    llm = OrtRuntime(served_pair["llm"])
    assert llm.batch_sessions == []
    scheduler = Scheduler(llm, warm=6, max_batch=4)
    try:
        assert llm.batch_sessions == [2, 3, 4]     # up to max_batch
        assert sorted(size for kind, _, size in llm.batch_drafters if kind == "chain") == [2, 3, 4]   # decoding's
        assert sorted(size for kind, _, size in llm.batch_drafters if kind == "sampled_chain") == (
            [2, 3, 4] if llm.samples_chains else [])   # sampled decoding's
        assert llm.sequences() == []               # the warm-up's sequences are gone
        assert ("chain", llm.draft_depth) in llm.draft_sessions and (
            ("sampled_chain", llm.draft_depth) in llm.draft_sessions) == llm.samples_chains   # a lone request's
        sessions = dict(llm._batched)
        want = [alone(llm, p, 12) for p in PROMPTS[:3]]
        assert run_together(scheduler, PROMPTS[:3], 12) == want
        assert all(llm._batched[size][0] is entry[0] for size, entry in sessions.items())   # none opened again
    finally:
        scheduler.close()
    pipe = Pipeline(served_pair["llm"], warm=3)     # the library's way in
    try:
        assert pipe.llm.batch_sessions == [2, 3]
    finally:
        pipe.scheduler.close()
    verify = VerifyModel(OrtRuntime(served_pair["llm"]), warm=3)   # the ensemble's llm model
    try:
        assert verify.runtime.batch_sessions == [2, 3]
    finally:
        verify.scheduler.close()


def test_a_pipeline_readies_its_dynamic_tree_at_load_not_in_its_first_request(served_pair, monkeypatch):
    """The dynamic tree's one-offs (the LLM's verification costs timed, the SSM's drafter depths
    opened, greedy and sampled) run when the pipeline is made: its first request waited for them
    (~0.5 s with the embedded LLM, the demo's first speculative request 0.3x incremental decoding).
    The fused server's orchestrator calls the same warm_for_requests at load."""
    pipe = Pipeline(served_pair["llm"], ssms=[served_pair["ssms"][0]])
    try:
        assert pipe.llm in tree_sizing._measured
        # and the LLM's sampled chain, whose first run opens its session
        assert pipe.llm.samples_chains and ("sampled_chain", pipe.llm.draft_depth) in pipe.llm.draft_sessions
        warmed = []
        monkeypatch.setattr(tree_sizing.StepCost, "measure", lambda *a, **k: pytest.fail("timed in a request"))
        monkeypatch.setattr(tree_sizing, "warm_shapes", lambda *a, **k: warmed.append(a))
        out = [t for step in pipe.stream_ids(PROMPTS[0], 16) for t in step]
        assert warmed == []
        assert out == alone(pipe.llm, PROMPTS[0], 16)   # greedy: the LLM's own decoding
        sampled = [t for step in pipe.stream_ids(PROMPTS[1], 12, SamplingParams(temperature=0.8, seed=3))
                   for t in step]                        # its SSM draws for it: opened sampled at load too
        assert warmed == [] and sampled
    finally:
        pipe.scheduler.close()


def test_a_closed_scheduler_refuses_requests_and_no_longer_touches_the_models(models):
    llm, ssms = models
    scheduler = Scheduler(llm, ssms[:1], idle_seconds=0.05)
    assert run_together(scheduler, PROMPTS[:2], 8) == [alone(llm, p, 8) for p in PROMPTS[:2]]
    scheduler.close()                               # returns once its thread has stopped
    trims = scheduler.trims
    assert not scheduler._thread.is_alive()
    time.sleep(0.3)                                 # idle for longer than idle_seconds
    assert scheduler.trims == trims
    with pytest.raises(ServerStopping, match="closed"):
        list(decode(scheduler.speculator(4), PROMPTS[0], 4))


def test_sampling_under_batching_is_reproducible_and_each_request_alone(models):
    """With a seed, a sampled request gives what it gives alone (its own random stream), batched,
    as long as its trees are the same (a batch that shares out fewer nodes draws other trees)."""
    llm, ssms = models
    params = SamplingParams(temperature=0.8, seed=11)
    scheduler = Scheduler(llm, ssms[:1], gather_seconds=0.01, batch_tree_tokens=4 * 64)
    got = run_together(scheduler, PROMPTS[:4], 30, params, tree=[2, 1, 1])
    single = Scheduler(llm, ssms[:1])
    want = [run_together(single, [p], 30, params, tree=[2, 1, 1])[0] for p in PROMPTS[:4]]
    assert got == want and all(isinstance(g, list) and g for g in got)


def test_sampled_incremental_requests_batched_take_chains_together_and_draw_as_alone(models, monkeypatch):
    """Sampled incremental requests (a temperature alone) batched, where the LLM draws in its graph:
    their chains run together, one run of the LLM's drafter drawing each sequence's tokens at its
    own temperature with its own uniforms; with a seed each request gives what it gives alone."""
    llm, _ = models
    if not llm.samples_chains:
        pytest.skip("sampled chains are drawn by the native kernels")
    together = []   # per decode_chains call, its sampled chains
    monkeypatch.setattr(llm, "decode_chains", lambda calls, f=llm.decode_chains:
                        together.append(sum(len(c) > 3 and c[3] is not None for c in calls)) or f(calls))
    requests = [(p, SamplingParams(temperature=t, seed=5)) for p, t in zip(PROMPTS[:4], (0.5, 0.9, 1.0, 1.6))]
    scheduler = Scheduler(llm, gather_seconds=0.01)
    got = [None] * len(requests)

    def run(i):
        prompt, params = requests[i]
        got[i] = [t for step in decode(scheduler.speculator(40, params, []), prompt, 40, []) for t in step]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    single = Scheduler(llm)
    want = [[t for step in decode(single.speculator(40, params, []), prompt, 40, []) for t in step]
            for prompt, params in requests]
    assert got == want and max(together) > 1 and len({tuple(g) for g in got}) == len(got)
    assert scheduler.reserved == 0 and llm.sequences() == []


def test_sampled_requests_draft_with_the_sampling_ssms_and_greedy_ones_with_the_others(models, monkeypatch, batches_draft_trees):
    """With sampling SSMs, a sampled request drafts with them alone and gives what it gives with them
    as the only SSMs; a greedy one drafts with the others and stays incremental greedy decoding. A
    request's KV is reserved for the dearer of the two sets."""
    llm, (close, far) = models
    calls = {close: 0, far: 0}
    for rt in calls:
        def counted(*args, rt=rt, original=rt.draft_chains, **kwargs):
            calls[rt] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(rt, "draft_chains", counted)
    scheduler = Scheduler(llm, [close], sampling_ssms=[far], gather_seconds=0.01, batch_tree_tokens=4 * 64,
                          idle_seconds=None)
    assert scheduler.bytes_per_token == llm.kv_bytes_per_token + max(close.kv_bytes_per_token, far.kv_bytes_per_token)
    params = SamplingParams(temperature=0.8, seed=3)
    got = run_together(scheduler, PROMPTS[:3], 30, params, tree=[1, 1, 1])
    assert calls[far] > 0 and calls[close] == 0
    greedy = run_together(scheduler, PROMPTS[3:5], 30, tree=[1, 1, 1])
    assert calls[close] > 0
    assert greedy == [alone(llm, p, 30) for p in PROMPTS[3:5]]
    single = Scheduler(llm, [far], idle_seconds=None)
    assert got == [run_together(single, [p], 30, params, tree=[1, 1, 1])[0] for p in PROMPTS[:3]]
    assert all(isinstance(g, list) and g for g in got)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)], ids=["greedy", "sampled"])
def test_each_ssm_drafts_for_the_whole_batch_in_one_run_exactly_as_alone(models, params, batches_draft_trees):
    """Chains (greedy, and sampled: drawn in the drafter) of every request in a batch are drafted in
    one run of each SSM's batched drafter, and each request's output is what it gives alone."""
    llm, ssms = models
    for ssm in ssms:
        ssm.trim()
    scheduler = Scheduler(llm, ssms, gather_seconds=0.01, batch_tree_tokens=4 * 64, idle_seconds=None)
    got = run_together(scheduler, PROMPTS[:5], 30, params, tree=[1, 1, 1])
    single = Scheduler(llm, ssms, idle_seconds=None)
    want = [run_together(single, [p], 30, params, tree=[1, 1, 1])[0] for p in PROMPTS[:5]]
    assert got == want and all(isinstance(g, list) and g for g in got)
    kind = "draft" if params.greedy else "sampled_draft"
    assert all(any(k == kind and size > 1 for k, _, size in ssm.batch_drafters) for ssm in ssms)


def test_tree_budget_shrinks_as_the_batch_grows(models, batches_draft_trees):
    llm, ssms = models
    seen = []
    scheduler = Scheduler(llm, ssms[:1], batch_tree_tokens=12, gather_seconds=0.01)
    original = scheduler.llm.score_batch

    def spy(calls):
        seen.append([len(c[1]) for c in calls if len(c) < 4])   # trees (a prompt's call asks for its last logits)
        return original(calls)
    scheduler.llm.score_batch = spy
    try:
        run_together(scheduler, PROMPTS[:4], 20, tree=[4, 4])
        steps = [sizes for sizes in seen if len(sizes) == 4]
        assert steps and all(max(s) <= 3 for s in steps)      # 12 tree nodes shared by 4: 3 each
        assert any(max(s) > 1 for s in steps)                 # and the SSM did draft into them
        seen.clear()
        run_together(scheduler, PROMPTS[:1], 20, tree=[4, 4])
        assert max(max(s) for s in seen[1:]) > 3              # a request alone keeps its whole tree
    finally:
        del scheduler.llm.score_batch


@pytest.mark.parametrize("tree", ["dynamic", "2,1,1"])
def test_requests_left_no_tree_take_chains_together_and_their_drafters_catch_up_exactly(models, tree):
    """Where the batch's share leaves each request one node (no draft), greedy requests that draft
    take several tokens a step, every sequence's in one LLM run of chains; once fewer run they draft
    again, their SSMs and lookup caught up on the chains: the tokens are each request's alone."""
    llm, ssms = models
    chains, original = [], llm.decode_chains
    llm.decode_chains = lambda calls: chains.append(len(calls)) or original(calls)
    try:
        scheduler = Scheduler(llm, ssms, batch_tree_tokens=4, gather_seconds=0.01)   # 8 requests: 1 node each
        n = 40
        got = run_together(scheduler, PROMPTS, n, tree=parse_tree(tree), lookup=tree == "dynamic")
    finally:
        del llm.decode_chains
    assert got == [alone(llm, p, n) for p in PROMPTS]
    assert max(chains) > 1                                 # many sequences' chains in one run
    assert scheduler.reserved == 0 and all(rt.sequences() == [] for rt in [llm] + ssms)


def test_steps_whose_drafters_draft_nothing_take_chains_where_no_tree_is_verified(models, monkeypatch, batches_draft_trees):
    """Requests with room for trees whose SSMs draft nothing (drafts that do not pay) take chains,
    as a request alone does, every sequence's in one run: the tokens are each request's alone."""
    from specinfer.tree_sizing import Acceptance

    llm, ssms = models
    monkeypatch.setattr(Acceptance, "drafting_pays", lambda self, lead=0.0: False)
    chains, original = [], llm.decode_chains
    monkeypatch.setattr(llm, "decode_chains", lambda calls: chains.append(len(calls)) or original(calls))
    scheduler = Scheduler(llm, ssms, gather_seconds=0.01)
    n = 40
    got = run_together(scheduler, PROMPTS[:4], n, tree=None, lookup=False)
    monkeypatch.undo()
    assert got == [alone(llm, p, n) for p in PROMPTS[:4]]
    assert chains and max(chains) > 1          # chains, many sequences' in one run
    assert scheduler.reserved == 0 and all(rt.sequences() == [] for rt in [llm] + ssms)


def test_chains_or_trees_measures_trees_then_chains_then_goes_the_faster_way_trying_the_other_now_and_then():
    ways = ChainsOrTrees()
    assert ways.chains(4) is False                 # trees first
    ways.observe("trees", 4, 30, 0.010)            # 3000 tokens/s
    assert ways.chains(4) is True                  # then chains
    ways.observe("chains", 4, 32, 0.008)           # 4000 tokens/s: chains lead
    picks = [ways.chains(4) for _ in range(200)]
    tries = [i for i, chains in enumerate(picks) if not chains]
    assert tries[0] == ChainsOrTrees.RETRY[0] - 1
    assert [b - a for a, b in zip(tries, tries[1:])][:5] == [8, 16, 32, 64, 64]   # the wait doubles, to the most
    assert ways.chains(8) is False                 # every batch size on its own
    for _ in range(10):                            # trees, tried again, now do better
        ways.observe("trees", 4, 50, 0.010)
    assert sum(not ways.chains(4) for _ in range(20)) >= 18


@pytest.mark.parametrize("way", ["chains", "trees"])
def test_a_batch_of_greedy_speculative_requests_goes_the_way_chosen_for_its_size_exactly(models, monkeypatch, way,
                                                                                        trees_against_one_token_steps):
    """Where chains are faster for the batch's size, its greedy speculative requests take chains,
    every sequence's in one run, and their SSMs do not draft; where trees are, they draft and one
    LLM call verifies their trees. Either way the tokens are each request's alone."""
    llm, ssms = models
    monkeypatch.setattr(ChainsOrTrees, "chains", lambda self, size: way == "chains")
    # Fresh acceptance and drafter-call records: the models' are shared with the earlier tests,
    # whose drafts may have left them judging that drafts do not pay (then no SSM drafts here: seen
    # once in 3 runs), or that they keep nothing (what a drafted token costs, learnt there).
    monkeypatch.setattr(tree_sizing, "_acceptance", weakref.WeakKeyDictionary())
    monkeypatch.setattr(tree_sizing, "_drafter_calls", weakref.WeakKeyDictionary())
    chains, drafts, trees = [], [], []
    chain_runs, drafter_runs, score = llm.decode_chains, ssms[0].draft_chains, llm.score_batch
    monkeypatch.setattr(llm, "decode_chains", lambda calls: chains.append(len(calls)) or chain_runs(calls))
    monkeypatch.setattr(ssms[0], "draft_chains", lambda calls: drafts.append(len(calls)) or drafter_runs(calls))
    monkeypatch.setattr(llm, "score_batch", lambda calls: trees.append(sum(len(c[1]) > 1 for c in calls if len(c) == 3))
                        or score(calls))
    scheduler = Scheduler(llm, ssms[:1], gather_seconds=0.01)
    n = 40
    got = run_together(scheduler, PROMPTS[:4], n, tree=None, lookup=False)
    monkeypatch.undo()
    assert got == [alone(llm, p, n) for p in PROMPTS[:4]]
    if way == "chains":   # (a request alone, before the others came, drafts as its sizer says)
        assert max(chains) > 1 and max(trees, default=0) <= 1 and max(drafts, default=0) <= 1
    else:
        assert max(drafts) > 1 and max(trees) > 1   # many sequences' drafts in one run, trees in one call
    assert scheduler.reserved == 0 and all(rt.sequences() == [] for rt in [llm] + ssms)


def test_the_scheduler_measures_both_ways_for_the_batch_sizes_it_runs(models, trees_against_one_token_steps):
    llm, ssms = models
    scheduler = Scheduler(llm, ssms[:1], gather_seconds=0.01)
    n = 40
    got = run_together(scheduler, PROMPTS[:4], n, tree=None, lookup=False)
    assert got == [alone(llm, p, n) for p in PROMPTS[:4]]
    measured = {}
    for way, size in scheduler.ways.rates:
        measured.setdefault(size, set()).add(way)
    assert {"trees", "chains"} in measured.values()


@pytest.mark.parametrize("tree", [None, [2, 1, 1]])
def test_after_chained_steps_a_request_drafts_as_one_that_had_seen_every_token(models, tree, trees_against_one_token_steps):
    """A drafting request's chains (the scheduler's, where it is left no tree) reach its SSMs and
    lookup before their next draft: that draft is the one of a request prefilled with the prompt
    and the chains' tokens."""
    from specinfer.generate import LocalSpeculator

    llm, ssms = models
    prompt = PROMPTS[2]
    chained = LocalSpeculator(llm, ssms, tree=tree, lookup=True)
    chained.start(prompt[:-1])
    root, seen = prompt[-1], list(prompt[:-1])
    for _ in range(2):   # two chains in a row, as under load
        depth = chained.chain_depth(budget=16, share=1)
        assert depth == llm.draft_depth and chained.chain_depth(budget=16, share=4) is None
        path, root = chained.settle_chain(root, llm.decode_chain(chained.seq, [root], depth), 0.0)
        seen += path
    fresh = LocalSpeculator(llm, ssms, tree=tree, lookup=True)
    fresh.start(seen)
    try:
        a, b = chained.propose(root, 8), fresh.propose(root, 8)
        assert len(a) > 1 and (a.tokens, a.parents) == (b.tokens, b.parents)
        if tree is None:   # the dynamic tree drafts by lookup too
            assert chained.lookup.tokens == fresh.lookup.tokens == seen
        seen_by = lambda spec: [d.runtime.length(d.seq) + len(d.catch_up) for d in spec.drafters]   # in KV or to come
        assert seen_by(chained) == seen_by(fresh) == [len(seen)] * len(ssms)
    finally:
        chained.release()
        fresh.release()


def test_a_request_that_fails_leaves_the_others_of_its_batch_exact(models, monkeypatch, batches_draft_trees):
    """One request's verification raises mid-generation: it alone fails; the others finish
    exactly and nothing leaks."""
    llm, ssms = models
    from specinfer import generate

    real = generate.verify
    calls = {"n": 0}

    def flaky(tree, logits, params, rng, rule):
        if params.top_k == 7:   # the marked request, at its third step (its own: the others' steps
            calls["n"] += 1     # may all come after its last, where it runs ahead of them)
            if calls["n"] > 2:
                raise RuntimeError("injected fault")
        return real(tree, logits, params, rng, rule)
    monkeypatch.setattr(generate, "verify", flaky)
    scheduler = Scheduler(llm, ssms, gather_seconds=0.01)
    out: list = [None] * 4

    def run(i):
        params = SamplingParams(top_k=7) if i == 0 else SamplingParams()
        try:
            out[i] = [t for s in decode(scheduler.speculator(40, params, [1, 1, 1]), PROMPTS[i], 40, [EOS]) for t in s]
        except Exception as e:  # noqa: BLE001
            out[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert isinstance(out[0], RuntimeError)
    monkeypatch.setattr(generate, "verify", real)
    assert out[1:] == [alone(llm, p, 40) for p in PROMPTS[1:4]]
    assert scheduler.reserved == 0 and all(rt.sequences() == [] for rt in [llm] + ssms)


def test_long_prompts_go_in_by_chunks_while_others_step(models):
    """Chunked prefill: a prompt that arrives while other requests step goes into the LLM a chunk per
    batch (no batch with steps in it takes more than the chunk of prompt tokens for each token its
    steps take: chains of several tokens, as incremental requests take, a chunk as many times),
    and every output is still what the request gives alone."""
    llm, ssms = models
    chunk, long_prompts = 8, [[1] + list(range(200, 260)), [1] + list(range(100, 137))]
    scheduler = Scheduler(llm, ssms[:1], gather_seconds=0.01, prefill_chunk_tokens=chunk)
    batches = []   # per LLM scoring call: its batch, the prompt tokens in it, whether it verified steps too
    chained = set()   # the batches that ran chains
    score, chains = llm.score_batch, llm.decode_chains

    def spy(calls):
        batches.append((scheduler.batches, sum(len(call[1]) for call in calls if call[2] is None),
                        any(call[2] is not None for call in calls)))
        return score(calls)

    def chain_spy(calls):
        chained.add(scheduler.batches)
        return chains(calls)
    llm.score_batch, llm.decode_chains = spy, chain_spy
    n = 240
    try:
        got: dict = {}

        def late(i, prompt):
            # Once the short requests are stepping (a fixed sleep was flaky: on a fast machine they
            # could all but finish first), with 20 or more chains of 8 to go.
            deadline = time.monotonic() + 60
            while scheduler.batches < 6 and time.monotonic() < deadline:
                time.sleep(0.001)
            got[i] = [t for step in decode(scheduler.speculator(20, tree=[1, 1]), prompt, 20, [EOS]) for t in step]
        threads = [threading.Thread(target=late, args=(i, p)) for i, p in enumerate(long_prompts)]
        for t in threads:
            t.start()
        short = run_together(scheduler, PROMPTS[:3], n, tree=[], start_together=False)
        for t in threads:
            t.join(120)
    finally:
        del llm.score_batch, llm.decode_chains
    assert short == [alone(llm, p, n) for p in PROMPTS[:3]]
    assert [got[i] for i in range(2)] == [alone(llm, p, 20, ssms=ssms[:1], tree=[1, 1]) for p in long_prompts]
    per_token = lambda batch: llm.draft_depth if batch in chained else 1
    assert all(prompt <= chunk * per_token(batch) for batch, prompt, steps in batches if steps or batch in chained)
    assert any(prompt and (steps or batch in chained) for batch, prompt, steps in batches)   # beside steps
    assert scheduler.prefill_chunks >= 3
    assert scheduler.reserved == 0 and llm.sequences() == []


def test_kv_budget_admits_what_fits_and_the_rest_waits_or_is_refused(models):
    llm, ssms = models
    per_token = llm.kv_bytes_per_token + ssms[0].kv_bytes_per_token
    prompt, n = [1] + list(range(10, 40)), 20
    need = (len(prompt) + n + 64) * per_token          # prompt, max tokens and one tree
    # Room for two requests at once: six of them finish, never more than two running.
    scheduler = Scheduler(llm, ssms[:1], kv_budget=2 * need + need // 2, gather_seconds=0.005)
    peak = []
    original = scheduler.llm.score_batch

    def spy(calls):
        peak.append(len(scheduler.running))
        assert scheduler.kv_bytes() <= scheduler.kv_budget
        return original(calls)
    scheduler.llm.score_batch = spy
    got = run_together(scheduler, [prompt] * 6, n)
    del scheduler.llm.score_batch
    assert got == [alone(llm, prompt, n)] * 6
    assert max(peak) == 2 and scheduler.reserved == 0
    # Larger than the whole budget: a clear client error at once.
    with pytest.raises(RequestError, match="KV cache .* budget"):
        list(decode(Scheduler(llm, kv_budget=need // 2).speculator(n), prompt, n))
    # A full queue: refused with ServerBusy; a wait that lasts too long: ServerBusy too.
    tight = Scheduler(llm, kv_budget=(len(prompt) + n + 64) * llm.kv_bytes_per_token, max_waiting=0)
    holder = tight.speculator(n)
    holder.start(prompt[:-1])
    with pytest.raises(ServerBusy, match="busy"):
        list(decode(tight.speculator(n), prompt, n))
    tight.max_waiting, tight.wait_seconds = 4, 0.2
    started = time.monotonic()
    with pytest.raises(ServerBusy, match="no KV memory came free"):
        list(decode(tight.speculator(n), prompt, n))
    assert time.monotonic() - started >= 0.2
    holder.release()
    assert tight.reserved == 0
    assert alone(llm, prompt, n) == [t for s in decode(tight.speculator(n), prompt, n, [EOS]) for t in s]


def test_kv_buffers_grow_with_the_sequence_and_report_what_they_hold(models):
    llm, _ = models
    scheduler = Scheduler(llm)
    n = llm.max_context - 10
    spec = scheduler.speculator(n)
    gen = decode(spec, [1, 2, 3], n, [])
    next(gen)
    small = scheduler.kv_bytes()
    assert 0 < small <= llm.initial_slots * llm.kv_bytes_per_token    # not the whole context it reserved
    assert spec.reserved >= 4 * small and llm.max_context >= 4 * llm.initial_slots
    produced = 0
    for step in gen:   # past the first buffer (steps may take several tokens: a lone one runs chained)
        produced += len(step)
        if produced > 2 * llm.initial_slots:
            break
    assert scheduler.kv_bytes() > small
    gen.close()
    assert scheduler.kv_bytes() == 0 and scheduler.reserved == 0


def test_an_ssm_with_a_shorter_context_drafts_less_instead_of_failing(served_pair):
    """The SSM holds 16 tokens; a 30-token prompt gets no drafts from it, and the output is exact."""
    llm, ssm = OrtRuntime(served_pair["llm"]), OrtRuntime(served_pair["ssms"][0], max_context=16)
    prompt = PROMPTS[2]
    stats = Stats()
    got = [t for s in generate_ids(llm, prompt, ssms=[ssm], tree=[1, 1], max_new_tokens=20, eos_ids=[EOS],
                                   stats=stats) for t in s]
    assert got == alone(llm, prompt, 20) and stats.draft_tokens == 0
    short = [1, 5]
    stats = Stats()
    got = [t for s in generate_ids(llm, short, ssms=[ssm], tree=[1, 1], max_new_tokens=30, eos_ids=[], stats=stats)
           for t in s]
    assert got == [t for s in generate_ids(llm, short, max_new_tokens=30, eos_ids=[]) for t in s]
    assert stats.draft_tokens > 0          # it drafted while the sequence fitted it


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512 MiB") == 512 << 20 and parse_bytes("1000") == 1000
    assert parse_bytes("1.5G") == 1_500_000_000
    for bad in ("lots", "-1G", "0", "3 parsecs"):
        with pytest.raises(SpecInferError):
            parse_bytes(bad)


def test_sampling_under_batching_keeps_the_llm_distribution(tiny_vocab):
    """Sampled requests batched together, their trees cut to what the batch shares out (so a
    request's tree changes with the others running): the first two tokens are distributed as the
    LLM's own (chi-square against the exact probabilities)."""
    from conftest import chi_square_p
    from test_speculative_generation import TRIALS, V, exact_first_two

    (llm, a, b), _ = tiny_vocab
    params = SamplingParams(temperature=1.0)
    scheduler = Scheduler(llm, [a, b], batch_tree_tokens=24, gather_seconds=0.002)
    counts = np.zeros((V, V))
    lock = threading.Lock()

    def worker(first):
        for seed in range(first, TRIALS, 8):
            spec = scheduler.speculator(2, SamplingParams(1.0, seed=seed), [3, 2])
            out = [t for s in decode(spec, [3, 1, 4], 2, []) for t in s]
            with lock:
                counts[out[0], out[1]] += 1
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert counts.sum() == TRIALS and scheduler.mean_batch > 2
    p = chi_square_p(counts, exact_first_two(llm, params))
    assert p > 1e-3, f"first two tokens not distributed as the LLM's under batching (chi-square p = {p:.2e})"


def test_the_next_step_runs_before_it_is_asked_for_and_a_stop_wastes_only_that_step(models):
    """A settled step's successor is queued at once (the scheduler's next batch need not wait for
    the request's thread); its accounting reaches the request's statistics only when taken, and a
    request that stops frees it with the rest."""
    llm, ssms = models
    scheduler = Scheduler(llm, ssms)
    prompt, n = PROMPTS[0], 30
    stats = Stats()
    spec = scheduler.speculator(n, tree=parse_tree("1,1,1"), stats=stats)
    steps = decode(spec, prompt, n, [EOS], stats=stats)
    first = next(steps)
    deadline = time.monotonic() + 10
    while not (spec.ahead is not None and spec.ahead.done.is_set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spec.ahead is not None and spec.ahead.done.is_set()   # ran before the loop asked for it
    assert (stats.steps, stats.draft_tokens) == (1, 3)            # ...and is not counted yet
    assert stats.accepted_draft_tokens == len(first) - 1
    second = next(steps)
    assert (stats.steps, stats.draft_tokens) == (2, 6)
    assert stats.accepted_draft_tokens == len(first) + len(second) - 2
    assert first + second == alone(llm, prompt, n)[:len(first + second)]
    with pytest.raises(SpecInferError, match="has run already"):   # a sequence goes on from its bonus
        deadline = time.monotonic() + 10
        while not spec.ahead.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        spec.step(second[-1] + 1, 4)
    steps.close()
    assert scheduler.reserved == 0 and scheduler.sequences == []
    assert all(rt.sequences() == [] for rt in [llm] + ssms)
    assert run_together(scheduler, PROMPTS[:2], 20) == [alone(llm, p, 20) for p in PROMPTS[:2]]


def test_no_batch_waits_for_a_sequence_whose_tokens_are_all_made(models):
    """A batch gives running sequences ``gather_seconds`` to ask for their next step, but not one
    whose last step made its last tokens (its request only has to end): before, every batch while
    such a request had not yet ended waited the whole gather time for it."""
    llm, _ = models
    scheduler = Scheduler(llm, [], gather_seconds=5.0)
    done = scheduler.speculator(3, tree=[])
    steps = decode(done, PROMPTS[0], 3, [EOS])
    made = []
    while len(made) < 3:
        made += next(steps)   # all its tokens, its loop not yet back to end it
    assert done.finished and scheduler.sequences == [done]
    started = time.monotonic()
    assert run_together(scheduler, PROMPTS[1:2], 20, tree=[]) == [alone(llm, PROMPTS[1], 20)]
    assert time.monotonic() - started < 4.0   # three batches at least: 15 s if each waited
    steps.close()
    assert scheduler.sequences == [] and llm.sequences() == []


def test_requests_that_start_while_a_batch_runs_go_in_at_the_next_batch(models, monkeypatch):
    """Requests whose start waits for the running batch (their sequences' state is made between
    batches) go in together at the next one: before, the scheduler's thread took the run lock
    again at once, and their prompts went in only when it had nothing to run."""
    llm, _ = models
    scheduler = Scheduler(llm, [], gather_seconds=2.0)
    batches, slow = [], threading.Event()
    run, chains = Scheduler._run, llm.decode_chains

    def recording(self, jobs):
        batches.append(sum(job.prefix is not None for job in jobs))
        return run(self, jobs)

    def slow_once(calls):
        if not slow.is_set():
            slow.set()
            time.sleep(1.0)   # the others start meanwhile, and wait for this batch
        return chains(calls)
    monkeypatch.setattr(Scheduler, "_run", recording)
    monkeypatch.setattr(llm, "decode_chains", slow_once)
    out = {}
    first = threading.Thread(target=lambda: out.update(first=run_together(scheduler, PROMPTS[:1], 40, tree=[])))
    first.start()
    assert slow.wait(60)
    time.sleep(0.2)
    started = len(batches)
    rest = run_together(scheduler, PROMPTS[1:4], 12, tree=[])
    first.join(60)
    assert rest == [alone(llm, p, 12) for p in PROMPTS[1:4]] and out["first"] == [alone(llm, PROMPTS[0], 40)]
    assert batches[started] == 3, batches   # the batch after the slow one took all three prompts
