"""The dynamic tree's cost model and sizer: the verification cost table and the best tree size."""
import numpy as np
import pytest

from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.sampling import SamplingParams
from specinfer.generate import LocalSpeculator
from specinfer.tree_sizing import Acceptance, StepCost, TreeSizer, acceptance, step_cost, step_times, tree_sizer


def brute_force_best(llm_seconds, overhead, reach):
    rates = [(1 + sum(reach[:k])) / (llm_seconds(1 + k) + overhead) for k in range(len(reach) + 1)]
    return int(np.argmax(rates)), rates


@pytest.mark.parametrize("seed", range(20))
def test_best_count_maximises_expected_tokens_per_second(seed):
    rng = np.random.default_rng(seed)
    sizes = (1, 2, 4, 8, 16)
    cost = StepCost(sizes, tuple(np.cumsum(rng.uniform(0.0, 1.0, len(sizes))) + 1.0))
    reach = np.cumprod(rng.uniform(0.2, 1.0, 12))
    sizer = TreeSizer(cost, overhead=rng.uniform(0.0, 2.0))
    slope, intercept = np.polyfit(sizes, cost.seconds, 1)     # the sizer's line through the table
    line = lambda t: intercept + max(slope, 0) * t
    best, rates = brute_force_best(line, sizer.overhead, reach)
    assert sizer.best_count(reach) == best
    assert np.allclose(sizer.tokens_per_second(reach), rates)
    # best(): that count and its speedup over a one-token step, with drafting seconds per count.
    extra = rng.uniform(0.0, 0.5, len(reach) + 1)
    rates = [(1 + sum(reach[:k])) / (line(1 + k) + sizer.overhead + extra[k]) for k in range(len(reach) + 1)]
    count, speedup = sizer.best(reach, extra)
    assert count == int(np.argmax(rates)) and speedup == pytest.approx(max(rates) * line(1))


def test_best_count_follows_cost_and_confidence():
    reach = np.cumprod([0.9] * 8)
    free, dear = StepCost((1, 9), (1.0, 1.0)), StepCost((1, 9), (1.0, 33.0))
    assert TreeSizer(free, overhead=0.5).best_count(reach) == 8     # free tokens: keep all
    assert TreeSizer(dear, overhead=0.5).best_count(reach) == 0     # each costs two steps: none
    mid = TreeSizer(StepCost((1, 9), (1.0, 4.0)), overhead=0.5)
    assert 0 < mid.best_count(reach) < 8
    assert mid.best_count(np.cumprod([0.99] * 8)) >= mid.best_count(reach) >= mid.best_count(np.cumprod([0.5] * 8))
    # A dearer step outside the LLM makes each verified token relatively cheaper: keep more.
    assert TreeSizer(mid.cost, overhead=5.0).best_count(reach) > mid.best_count(reach)
    assert mid.best_count([]) == 0


def test_sizer_tracks_the_overhead():
    sizer = TreeSizer(StepCost((1,), (1.0,)))
    assert sizer.overhead == 0.5                     # a guess before any step
    assert sizer.llm_seconds(7) == 1.0               # one size measured: a flat line
    for _ in range(40):
        sizer.observe(2.0)
    assert sizer.overhead == pytest.approx(2.0, abs=1e-3)


def test_sizer_learns_the_llm_cost_from_the_steps_it_sees():
    """The table says a tree token costs 0.1; the steps say 1.0: the line moves to the steps, and
    the sizer keeps fewer nodes."""
    sizer = TreeSizer(StepCost((1, 9), (1.0, 1.8)), overhead=0.5)
    reach = np.cumprod([0.9] * 8)
    before = sizer.best_count(reach)
    assert sizer.llm_seconds(5) == pytest.approx(1.4)
    for t in [1, 3, 5, 7, 9] * 40:
        sizer.observe(0.5, tree_tokens=t, llm_seconds=1.0 * t)
    assert sizer.llm_seconds(5) == pytest.approx(5.0, rel=0.05)
    assert sizer.best_count(reach) < before


def test_a_tree_must_beat_the_chain_a_step_that_drafts_nothing_takes():
    """Where steps that draft nothing take chain runs (8 tokens for 2.0 here: 0.25 a token, a
    quarter of a one-token step), keeping no node is worth the chain's rate, and a tree that beats
    one-token steps but not the chain is not worth drafting."""
    cost = StepCost((1, 9), (1.0, 1.8), chain_tokens=8, chain_seconds=2.0)
    reach = list(np.cumprod([0.8] * 8))
    one, chain = TreeSizer(cost, overhead=0.0), TreeSizer(cost, overhead=0.0, chained=True)
    assert one.idle_rate() == pytest.approx(1.0) and chain.idle_rate() == pytest.approx(4.0)
    assert one.tokens_per_second(reach)[1:] == pytest.approx(chain.tokens_per_second(reach)[1:])
    assert chain.tokens_per_second(reach)[0] == pytest.approx(4.0)
    assert one.best_count(reach) > 0 and one.speedup(reach) > 2.0      # against one-token steps: pays
    assert chain.best_count(reach) == 0 and chain.speedup(reach) == pytest.approx(1.0)
    # The chains run slower than measured: the sizer follows them, and the tree pays again.
    for _ in range(40):
        chain.observe_chain(8, 16.0)
    assert chain.idle_rate() == pytest.approx(1.0, rel=0.01) and chain.best_count(reach) == one.best_count(reach)
    # A table without chains (an LLM with no drafter graph, or a table saved before): one-token steps.
    assert TreeSizer(StepCost((1, 9), (1.0, 1.8)), chained=True).idle_rate() == pytest.approx(1.0)


def test_a_one_off_slow_chain_run_does_not_make_chains_look_dear():
    """A chain run counts for at most twice the estimate: a sampled request's first chain run
    opened its session (140-180 ms for 8 tokens, 20x a later run), which made chains look 5x dearer,
    and the sizer then drafted trees that lost to them for the rest of the request."""
    cost = StepCost((1, 9), (1.0, 1.8), chain_tokens=8, chain_seconds=2.0)
    reach = list(np.cumprod([0.8] * 8))
    sizer = TreeSizer(cost, overhead=0.0, chained=True)
    sizer.observe_chain(8, 2.0 * 20)
    assert sizer.idle_rate() == pytest.approx(4.0 / 1.2)   # 0.25 s a token -> 0.3, not 1.2
    assert sizer.best_count(reach) == 0                     # still no tree worth drafting


def test_requests_drafting_alike_share_one_sizer(exported):
    """What a step costs is learnt over requests: one sizer per LLM and drafters, not per request."""
    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    assert tree_sizer(llm, [ssm], True, True) is tree_sizer(llm, [ssm], True, True)
    assert tree_sizer(llm, [ssm], True, True) is not tree_sizer(llm, [], True, True)
    assert tree_sizer(llm, [ssm], False, True) is not tree_sizer(llm, [ssm], True, True)
    first = LocalSpeculator(llm, [ssm], lookup=True)
    second = LocalSpeculator(llm, [ssm], lookup=True)
    assert first.sizer is second.sizer and first.sizer.chain_tokens == llm.draft_depth > 1
    first.release(), second.release()


def test_a_later_ssm_at_a_gone_ones_address_gets_a_sizer_of_its_own(exported):
    """Sizers are kept by their SSMs, not by ids, which CPython gives again once an object is gone."""
    class Drafter:
        pass

    llm = OrtRuntime(exported["llama3"])
    gone = Drafter()
    stale, address = tree_sizer(llm, [gone], True, True), id(gone)
    del gone
    reused = [d for d in [Drafter() for _ in range(100)] if id(d) == address]
    if not reused:
        pytest.skip("no object took the gone SSM's address")
    assert tree_sizer(llm, reused, True, True) is not stale


def test_measured_cost_table(exported):
    rt = OrtRuntime(exported["llama3"])
    cost = StepCost.measure(rt, context=32, sizes=(1, 4, 16), repeats=3)
    assert cost.tree_tokens == (1, 4, 16) and all(s > 0 for s in cost.seconds)
    # The LLM decodes draft_depth tokens a run: the table times such a run too.
    assert cost.chain_tokens == rt.draft_depth > 1 and cost.chain_seconds > 0
    assert StepCost.from_dict(cost.to_dict()) == cost
    assert StepCost.from_dict({"tree_tokens": [1], "seconds": [0.1]}).chain_tokens == 0   # saved before
    assert rt.sequences() == []                      # the measurement left no sequence open
    assert step_cost(rt) is step_cost(rt)            # measured once per runtime


def test_step_times_rows(exported):
    rt = OrtRuntime(exported["llama3"])
    rows = step_times(rt, contexts=[8, 32], tree_sizes=[1, 5], repeats=2, warm_up=1)
    assert [(r["context"], r["tree_tokens"]) for r in rows] == [(8, 1), (8, 5), (32, 1), (32, 5)]
    assert all(0 < r["median_ms"] <= r["p90_ms"] for r in rows)
    assert rt.sequences() == []
    batched = step_times(rt, contexts=[8], tree_sizes=[3], repeats=2, warm_up=1, sequences=[1, 3])
    assert [(r["sequences"], "one_by_one_ms" in r) for r in batched] == [(1, False), (3, True)]
    assert batched[1]["one_by_one_ms"] > 0 and rt.sequences() == []


def test_drafting_more_pays_when_the_nodes_are_likely_and_cheap():
    sizer = TreeSizer(StepCost((1, 9), (1.0, 1.8)), overhead=0.5)
    reach = np.cumprod([0.9] * 4)
    likely, unlikely = reach[-1] * np.cumprod([0.9] * 4), reach[-1] * np.cumprod([0.05] * 4)
    assert sizer.drafting_more_pays(reach, likely, seconds=0.01)
    assert not sizer.drafting_more_pays(reach, unlikely, seconds=0.01)
    assert not sizer.drafting_more_pays(reach, likely, seconds=10.0)   # drafting them costs too much


def test_acceptance_rates_candidates_by_what_verification_accepted():
    """At first a candidate is worth the SSM's word; then what verification did with candidates of
    its probability band, per rank, and nothing outside the bands seen."""
    record = Acceptance()
    assert np.allclose(record([0.3, 0.92, 0.999], 0), [0.3, 0.92, 0.999])
    rng = np.random.default_rng(0)
    for _ in range(300):   # chain tokens the SSM gives 0.92 are accepted 46% of the time
        record.observe([0.92] * 8, [0] * 8, rng.random(8) < 0.46)
    assert record([0.92], 0)[0] == pytest.approx(0.46, abs=0.05)
    assert record([0.93], 0)[0] > record([0.91], 0)[0]     # within a band, still the SSM's order
    assert np.allclose(record([0.3, 0.999], 0), [0.3, 0.999])   # other bands, as the SSM says
    assert record([0.92], 1)[0] == pytest.approx(0.92)          # the runner-ups' record is their own
    for _ in range(300):   # later the same tokens are always accepted: old steps are forgotten
        record.observe([0.92] * 8, [0] * 8, [True] * 8)
    assert record([0.92], 0)[0] == pytest.approx(1.0, abs=0.03)


def test_drafting_stops_where_it_does_not_pay_and_tries_again():
    record = Acceptance()
    assert record.drafting_pays()                   # no draft seen yet
    record.expect(0.5)                              # a draft expected to halve the speed
    tries = [record.drafting_pays() for _ in range(14)]
    # Waits of 2, then 4, then 8 steps: each try that still does not pay doubles the wait.
    assert [i for i, t in enumerate(tries) if t] == [1, 5, 13]
    for _ in range(5):
        record.expect(1.4)                          # drafts pay again
    assert all(record.drafting_pays() for _ in range(5))
    record.expect(0.1)
    record.expect(0.1)
    assert [record.drafting_pays() for _ in range(2)] == [False, True]   # the wait starts short again


def test_the_wait_between_tries_stops_growing_at_its_most(exported):
    """Greedy records wait at most RETRY[1] steps between tries, sampled ones SAMPLED_MOST_WAIT."""
    rt = OrtRuntime(exported["llama3"])

    def waits(record, tries):
        record.expect(0.5)
        steps, gaps, last = 0, [], 0
        while len(gaps) < tries:
            steps += 1
            if record.drafting_pays():
                gaps.append(steps - last)
                last = steps
        return gaps

    most = Acceptance.RETRY[1]
    greedy = waits(acceptance(rt, SamplingParams()), 9)
    assert max(greedy) == most and greedy[-3:] == [most] * 3
    sampled = waits(acceptance(rt, SamplingParams(temperature=0.7)), 12)
    assert max(sampled) == Acceptance.SAMPLED_MOST_WAIT > most and sampled[-2:] == [Acceptance.SAMPLED_MOST_WAIT] * 2


def test_an_ssm_gives_way_to_a_better_free_draft():
    record = Acceptance()
    record.expect(1.3)
    assert record.drafting_pays(lead=1.2)
    assert not record.drafting_pays(lead=1.5)      # the lookup's draft is expected to do better alone
    assert record.drafting_pays()                  # and the next step it has no lead: no wait


def test_acceptance_is_kept_per_ssm_and_sampling(exported):
    rt = OrtRuntime(exported["llama3"])
    greedy = acceptance(rt, SamplingParams())
    assert acceptance(rt, SamplingParams(seed=3)) is greedy              # the seed does not matter
    assert acceptance(rt, SamplingParams(temperature=1.0)) is not greedy
    assert acceptance(OrtRuntime(exported["llama3"]), SamplingParams()) is not greedy
    sampled = SamplingParams(temperature=1.0)
    # Sampled, each rule accepts differently (naive about half what traversal does): a record each.
    assert acceptance(rt, sampled, rule="naive") is not acceptance(rt, sampled)
    assert acceptance(rt, sampled, rule="mss") is acceptance(rt, sampled)
    assert acceptance(rt, SamplingParams(), rule="naive") is greedy      # greedy verification has no rule


def test_a_speculator_drafts_with_its_rules_record(exported, monkeypatch):
    from specinfer import generate
    from specinfer.generate import LocalSpeculator

    monkeypatch.setattr(generate, "LOOKUP_WHEN_SAMPLING", True)   # (off by default)

    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    params = SamplingParams(temperature=1.0, seed=0)
    spec = LocalSpeculator(llm, [ssm], None, params, rule="naive", lookup=True)
    try:
        spec.start([5, 6, 7])
        spec.step(8, 16)
        assert spec.drafters[0]._acceptance is acceptance(ssm, params, "ssm", "naive")
        assert spec.lookup.record is acceptance(llm, params, "lookup", "naive")
        assert acceptance(ssm, params, "ssm", "naive") is not acceptance(ssm, params, "ssm", "mss")
    finally:
        spec.release()


def test_drafting_seconds_per_node_count_keep_fewer_nodes():
    """A drafter that drafts as deep as the sizer keeps: each kept node also costs its drafting."""
    sizer = TreeSizer(StepCost((1, 9), (1.0, 4.0)), overhead=0.5)
    reach, n = np.cumprod([0.9] * 8), np.arange(9)
    expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach)])
    llm = np.array([sizer.llm_seconds(t) for t in 1 + n])
    assert np.allclose(sizer.tokens_per_second(reach, 0.3 * n), expected / (llm + 0.5 + 0.3 * n))
    assert sizer.best_count(reach, 0.3 * n) < sizer.best_count(reach)
    # Drafting shallower saves at most the whole overhead: a step never costs less than its LLM call.
    assert np.allclose(sizer.tokens_per_second(reach, -5.0), expected / llm)
    assert sizer.speedup(reach, extra_seconds=0.3 * n) < sizer.speedup(reach)


def test_acceptance_rate_moves_from_the_ssms_word_to_what_verification_accepted():
    record = Acceptance()
    assert record.rate(0) == pytest.approx(0.5)   # nothing seen
    rng = np.random.default_rng(0)
    for _ in range(100):   # draws the SSM gave 0.2, accepted 70% of the time
        record.observe([0.2] * 10, [0] * 10, rng.random(10) < 0.7)
    assert record.rate(0) == pytest.approx(0.7, abs=0.04)
    assert record.rate(1) == pytest.approx(0.5)   # rank 1 saw nothing


@pytest.mark.parametrize("rate, deep", [(0.97, True), (0.05, False)])
def test_a_sampled_dynamic_chain_draws_as_deep_as_its_acceptance_rate_pays(exported, rate, deep,
                                                                           trees_against_one_token_steps):
    """Under sampling the dynamic tree's chain is drawn to a depth chosen before drawing, from the
    draws' acceptance rate, and every draw is verified (weighed against one-token steps: a sampled
    step that drafts nothing takes a chain run of the LLM's now, which no draft beats on these tiny
    models, whether one did hanging on the machine's timing)."""
    from specinfer.generate import LocalSpeculator
    from specinfer.speculate import DYNAMIC_DEPTH

    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    params = SamplingParams(temperature=1.0, seed=0)
    record = acceptance(ssm, params, "ssm", "mss")
    rng = np.random.default_rng(1)
    for _ in range(300):
        record.observe([0.5] * 4, [0] * 4, rng.random(4) < rate)
    spec = LocalSpeculator(llm, [ssm], None, params)
    try:
        spec.start([5, 6, 7])
        sizes = []
        for _ in range(6):
            tree = spec.propose(8, 16)
            assert tree.depths == list(range(len(tree)))   # a chain, all of its draws kept
            sizes.append(len(tree) - 1)
            spec.settle(tree, spec.llm.score(spec.seq, tree.tokens, tree.parents), 0.0)
        # Nearly always accepted: as deep as the drafter goes; nearly never: a token at most (or none).
        assert max(sizes) == DYNAMIC_DEPTH if deep else max(sizes) <= 1
    finally:
        spec.release()


def test_a_requests_first_greedy_chunk_is_as_deep_as_earlier_requests_kept(exported, trees_against_one_token_steps):
    """What an SSM's drafter calls cost and how deep the sizer keeps its chains are the SSM's, not
    a request's: a new request's first chunk asks for the chain tokens earlier requests kept (plus
    the margin), not the drafter's whole depth."""
    from specinfer.speculate import DEPTH_MARGIN, DYNAMIC_DEPTH
    from specinfer.tree_sizing import drafter_calls, warm_drafter

    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    warm_drafter(ssm)   # its runs of every depth, before the calls counted
    asked, draft_chains = [], ssm.draft_chains
    ssm.draft_chains = lambda calls: (asked.extend(depth for _, _, depth, _ in calls), draft_chains(calls))[1]
    drafter_calls(ssm, False, DYNAMIC_DEPTH).kept = 1.0   # as if the requests before had kept 1 token a chain
    spec = LocalSpeculator(llm, [ssm])
    try:
        spec.start([5, 6, 7])
        spec.propose(8, 16)   # (whether it keeps any node follows this machine's timings)
        assert asked[0] == 1 + DEPTH_MARGIN < DYNAMIC_DEPTH
        assert spec.drafters[0]._calls is drafter_calls(ssm, False, DYNAMIC_DEPTH)
        assert drafter_calls(ssm, True, DYNAMIC_DEPTH) is not spec.drafters[0]._calls   # sampled drafts: their own
    finally:
        spec.release()


@pytest.mark.parametrize("dear", [False, True])
def test_a_requests_first_sampled_chain_knows_what_drafting_costs(exported, dear, trees_against_one_token_steps):
    """A sampled dynamic chain is drawn as deep as its acceptance pays for at what a drafted token
    costs past the depth the sizer has been keeping; a request's first draft takes both from the
    SSM's earlier calls, not afresh (every token free past the drafter's whole depth): with calls
    recorded as dear past one token it draws a token at most, where nearly every draw is accepted
    and it draws deep without them."""
    from specinfer.speculate import DYNAMIC_DEPTH
    from specinfer.tree_sizing import drafter_calls

    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    params = SamplingParams(temperature=1.0, seed=0)
    record, rng = acceptance(ssm, params, "ssm", "mss"), np.random.default_rng(1)
    for _ in range(300):
        record.observe([0.5] * 4, [0] * 4, rng.random(4) < 0.97)
    if dear:   # earlier requests kept a token a chain, and a call of one token took 0.2 s
        calls = drafter_calls(ssm, True, DYNAMIC_DEPTH)
        calls.kept, calls.seconds[1] = 1.0, 0.2
    spec = LocalSpeculator(llm, [ssm], None, params)
    try:
        spec.start([5, 6, 7])
        tree = spec.propose(8, 16)
        assert len(tree) - 1 <= 1 if dear else len(tree) - 1 > 2   # (8 where the LLM's line is as measured)
    finally:
        spec.release()


def test_the_sizer_learns_a_drafts_cost_without_its_prefill_of_the_prompt(exported, trees_against_one_token_steps,
                                                                          monkeypatch):
    """A request's first draft takes its prompt into the SSM by a prefill: paid once a request
    whatever its trees, so the sizer learns the draft's cost without it (with it, every request's
    first draft taught it that drafting costs that much each step)."""
    from specinfer.speculate import PREFILL_CATCH_UP

    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    speculator = LocalSpeculator(llm, [ssm])
    learnt = []
    monkeypatch.setattr(speculator.sizer, "observe", lambda seconds, *args, **kw: learnt.append(seconds))
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, llm.vocab_size, PREFILL_CATCH_UP + 8)]
    speculator.start(prompt[:-1])
    speculator.step(prompt[-1], 8)
    drafter = speculator.drafters[0]
    assert drafter.catch_up_seconds > 0 and len(learnt) == 1
    assert learnt[0] == pytest.approx(drafter.seconds - drafter.catch_up_seconds, abs=1e-3)
    assert learnt[0] < drafter.seconds - drafter.catch_up_seconds / 2
    speculator.release()


def test_the_cost_table_runs_every_tree_size_up_to_its_largest_before_timing(exported, monkeypatch):
    """An engine may plan a shape at its first run (the embedded LLM: 0.4-0.7 ms more); the sizes
    between the measured ones meet decoding too, so the measurement runs each of them once first."""
    rt = OrtRuntime(exported["llama3"])
    sizes, score_batch = [], rt.score_batch   # every tree call, not the prefills (last logits only)
    monkeypatch.setattr(rt, "score_batch", lambda calls: sizes.extend(len(c[1]) for c in calls if len(c) == 3)
                        or score_batch(calls))
    StepCost.measure(rt, context=16, sizes=(1, 6), repeats=1)
    first = sizes[:sizes.index(16)] if 16 in sizes else sizes   # before the timed context's prefill
    assert first[:6] == [1, 2, 3, 4, 5, 6]
    assert rt.sequences() == []


def test_an_ssm_runs_every_drafter_depth_once_before_its_first_timed_draft(exported, monkeypatch):
    """An SSM's first chain of a depth opens that depth's drafter session (5-7 ms for the embedded
    SSM 1): the dynamic tree's drafter warms them all once per SSM and sampling kind, before its
    clock starts, so that the sizer never learns a session's opening as a draft's cost."""
    import time

    from specinfer import tree_sizing

    llm, ssm = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    warm_seconds, warm_shapes = [], tree_sizing.warm_shapes

    def timed_warm(*args, **kw):
        start = time.perf_counter()
        warm_shapes(*args, **kw)
        if kw.get("chain_depths"):   # the drafter's (the LLM's cost table warms its tree sizes)
            warm_seconds.append(time.perf_counter() - start)
    monkeypatch.setattr(tree_sizing, "warm_shapes", timed_warm)
    speculator = LocalSpeculator(llm, [ssm])
    learnt = []
    monkeypatch.setattr(speculator.sizer, "observe", lambda seconds, *args, **kw: learnt.append(seconds))
    assert ssm.draft_sessions == []
    speculator.start([1, 50, 51])
    _, bonus = speculator.step(52, 16)
    assert ssm.draft_sessions == [("draft", d) for d in range(1, ssm.draft_depth + 1)]
    sessions = dict(ssm._draft_sessions)
    speculator.step(bonus, 16)
    again = LocalSpeculator(llm, [ssm])
    again.start([1, 60, 61])
    again.step(62, 16)
    assert ssm._draft_sessions == sessions and len(warm_seconds) == 1   # once per SSM, not per step or request
    again.release()
    speculator.release()
    # Each draft's learnt seconds are its own: under what opening one depth's session took.
    drafts = [s for s in learnt if s is not None]
    assert drafts and max(drafts) < warm_seconds[0] / ssm.draft_depth
    assert ssm.sequences() == [] and llm.sequences() == []
