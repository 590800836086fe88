"""The Runtime contract, run against every engine available here (ONNX Runtime, PyTorch on CPU)."""
import numpy as np
import pytest

from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.engines.torch_runtime import TorchRuntime
from specinfer.errors import SpecInferError

TOL = 1e-4
PROMPT = [1, 50, 51, 52, 53, 54, 55, 56]


@pytest.fixture(params=["onnxruntime", "torch"])
def runtime(request, exported, checkpoints):
    if request.param == "onnxruntime":
        return OrtRuntime(exported["llama3"])
    return TorchRuntime(checkpoints["llama3"], max_context=256)


@pytest.fixture
def reference(checkpoints):
    """Logits of the last token of a plain sequence, from a fresh runtime (no trees, no commits)."""
    rt = TorchRuntime(checkpoints["llama3"], max_context=256)

    def last_logits(ids):
        seq = rt.start()
        try:
            return rt.score(seq, ids)[-1]
        finally:
            rt.release(seq)
    return last_logits


def test_prefill_then_incremental_steps(runtime, reference):
    seq = runtime.start()
    ids = list(PROMPT)
    logits = runtime.prefill(seq, ids)
    for _ in range(5):
        assert np.abs(logits - reference(ids)).max() < TOL
        ids.append(int(np.argmax(logits)))
        logits = runtime.score(seq, [ids[-1]])[0]
        runtime.commit(seq, [0])
    assert runtime.length(seq) == len(ids)


def test_logits_a_caller_holds_stay_its_own(runtime, reference):
    """An engine may reuse its output buffers between runs (the ONNX Runtime one does, for steps of
    a few tokens): what score returned must not change when the sequence or another steps on."""
    s1, s2 = runtime.start(), runtime.start()
    runtime.prefill(s1, PROMPT)
    runtime.prefill(s2, PROMPT[:4])
    held = []
    for token in (5, 6, 7):
        held.append((token, runtime.score(s1, [token])[0], runtime.score_batch([(s1, [token + 1], [0]), (s2, [token], None)])))
        runtime.commit(s1, [])
        runtime.commit(s2, [0])
    for i, (token, alone, (tree, other)) in enumerate(held):
        assert np.abs(alone - reference(PROMPT + [token])).max() < TOL
        assert np.abs(tree[0] - reference(PROMPT + [token, token + 1])).max() < TOL
        assert np.abs(other[0] - reference(PROMPT[:4] + [5, 6, 7][:i + 1])).max() < TOL


def test_tree_grown_over_calls_then_commit(runtime, reference):
    seq = runtime.start()
    runtime.prefill(seq, PROMPT)
    a = runtime.score(seq, [10, 20, 30], [-1, 0, 0])          # root 10, children 20 and 30
    b = runtime.score(seq, [40, 41, 42], [2, 2, 3])           # children of 30, grandchild of 30
    assert np.abs(a[1] - reference(PROMPT + [10, 20])).max() < TOL
    assert np.abs(b[0] - reference(PROMPT + [10, 30, 40])).max() < TOL
    assert np.abs(b[2] - reference(PROMPT + [10, 30, 40, 42])).max() < TOL
    runtime.commit(seq, [0, 2, 3, 5])                          # keep 10, 30, 40, 42
    assert runtime.length(seq) == len(PROMPT) + 4
    nxt = runtime.score(seq, [7])[0]
    assert np.abs(nxt - reference(PROMPT + [10, 30, 40, 42, 7])).max() < TOL


def test_discarded_tree_leaves_cache_untouched(runtime, reference):
    seq = runtime.start()
    runtime.prefill(seq, PROMPT)
    runtime.score(seq, [3, 4, 5], [-1, -1, 1])
    runtime.commit(seq, [])
    assert runtime.length(seq) == len(PROMPT)
    assert np.abs(runtime.score(seq, [9])[0] - reference(PROMPT + [9])).max() < TOL


def test_sequences_are_independent(runtime, reference):
    s1, s2 = runtime.start(), runtime.start("client-7")
    runtime.prefill(s1, PROMPT)
    runtime.prefill(s2, [1, 2, 3])
    assert np.abs(runtime.score(s1, [5])[0] - reference(PROMPT + [5])).max() < TOL
    assert np.abs(runtime.score(s2, [5])[0] - reference([1, 2, 3, 5])).max() < TOL
    runtime.release(s1)
    assert runtime.sequences() == ["client-7"]


def test_many_sequences_scored_in_one_call(runtime, reference):
    """score_batch: each sequence's logits are what it gets alone (against transformers' model),
    trees and prefills of different lengths together, and a batch larger than a bucket."""
    prompts = [PROMPT, [1, 2, 3], list(range(60, 130)), [9] * 5, [4, 8]]   # 70 tokens: past a first buffer
    seqs = [runtime.start() for _ in prompts]
    runtime.score_batch([(s, p, None) for s, p in zip(seqs, prompts)])
    for s, p in zip(seqs, prompts):
        runtime.commit(s, range(len(p)))
    trees = [([10, 20, 30], [-1, 0, 0]), ([7], None), ([5, 6], [-1, 0]), ([11, 12, 13, 14], [-1, 0, 1, 0]), ([3], [-1])]
    out = runtime.score_batch([(s, *t) for s, t in zip(seqs, trees)])
    assert [len(o) for o in out] == [3, 1, 2, 4, 1]
    assert np.abs(out[0][2] - reference(PROMPT + [10, 30])).max() < TOL
    assert np.abs(out[2][1] - reference(prompts[2] + [5, 6])).max() < TOL
    assert np.abs(out[3][3] - reference(prompts[3] + [11, 14])).max() < TOL
    alone = runtime.start()
    runtime.prefill(alone, prompts[3])
    # Bit for bit what the sequence gets alone: batching never changes a greedy decision.
    assert np.array_equal(runtime.score(alone, *trees[3]), out[3])
    runtime.commit(seqs[3], [0, 3])
    assert runtime.length(seqs[3]) == len(prompts[3]) + 2
    with pytest.raises(SpecInferError, match="twice"):
        runtime.score_batch([(seqs[0], [1], None), (seqs[0], [2], None)])
    with pytest.raises(SpecInferError, match="out of range"):   # all or nothing: no sequence changed
        runtime.score_batch([(seqs[1], [1], None), (seqs[2], [runtime.vocab_size], None)])
    assert runtime.score_batch([(seqs[1], [1], None)])[0].shape == (1, runtime.vocab_size)


def test_a_prompt_call_returns_its_last_logits_only(runtime, reference):
    """A call marked last-only (a prompt's) returns [1, V], the last token's logits, beside calls
    that return every token's; the cache holds all its tokens all the same."""
    s1, s2 = runtime.start(), runtime.start()
    prompt, tree = runtime.score_batch([(s1, PROMPT, None, True), (s2, PROMPT[:5], None)])
    assert prompt.shape == (1, runtime.vocab_size) and tree.shape == (5, runtime.vocab_size)
    assert np.abs(prompt[0] - reference(PROMPT)).max() < TOL
    assert np.abs(tree[2] - reference(PROMPT[:3])).max() < TOL
    runtime.commit(s1, range(len(PROMPT)))
    assert np.abs(runtime.score(s1, [9])[0] - reference(PROMPT + [9])).max() < TOL


def test_contract_errors(runtime):
    seq = runtime.start(capacity=10)
    with pytest.raises(SpecInferError, match="capacity 10 reached"):
        runtime.score(seq, list(range(11)))
    runtime.score(seq, [1, 2, 3], [-1, 0, 0])
    with pytest.raises(SpecInferError, match="not a chain"):
        runtime.commit(seq, [0, 2, 1])
    with pytest.raises(SpecInferError, match="parents must be -1 or an earlier node"):
        runtime.score(seq, [4], [7])
    with pytest.raises(SpecInferError, match="out of range"):
        runtime.score(seq, [runtime.vocab_size])
    with pytest.raises(SpecInferError, match="already open"):
        runtime.start(seq)
    runtime.release(seq)
    with pytest.raises(SpecInferError, match="unknown sequence"):
        runtime.length(seq)


def test_onnxruntime_writes_kv_in_place(exported):
    """No step copies the cache: new KV lands in the sequence's own buffer, which moves only when
    the sequence outgrows it (then to one twice as large)."""
    rt = OrtRuntime(exported["llama3"])
    seq = rt.start()
    buffer = rt._sequences[seq].kv
    address = buffer.ctypes.data
    assert buffer.shape[3] == min(rt.initial_slots, rt.max_context) < rt.max_context  # [L, K|V, Hkv, slot, D]
    assert rt.kv_bytes(seq) == buffer.nbytes      # what it holds now, not what it may grow to
    rt.prefill(seq, PROMPT)
    rt.score(seq, [5])
    assert rt._sequences[seq].kv is buffer and buffer.ctypes.data == address
    assert np.abs(buffer[:, :, :, len(PROMPT)]).sum() > 0      # the step's KV, written through the binding
    assert np.abs(buffer[:, :, :, len(PROMPT) + 1:]).sum() == 0  # nothing beyond it
    before = buffer[:, :, :, :len(PROMPT) + 1].copy()
    rt.score(seq, list(range(1, buffer.shape[3])))               # past the buffer's end: it grows
    grown = rt._sequences[seq].kv
    assert grown.shape[3] == 2 * buffer.shape[3] and rt.capacity(seq) == rt.max_context
    assert np.array_equal(grown[:, :, :, :len(PROMPT) + 1], before)


def test_a_sequence_open_across_a_trim_is_freed_not_kept_spare(exported):
    """Its bindings hold the sessions the trim let go: kept as a spare, it would keep them alive;
    one started after the trim is kept as before."""
    rt = OrtRuntime(exported["llama3"])
    across = rt.start()
    rt.prefill(across, PROMPT)
    rt.trim()
    after = rt.start()
    rt.prefill(after, PROMPT)
    kv = rt._get(after).kv
    rt.release(across)
    assert rt._spare == []
    rt.release(after)
    assert len(rt._spare) == 1 and rt._spare[0].kv is kv
    assert rt._get(rt.start()).kv is kv


def test_a_run_reuses_the_last_runs_logits_only_once_their_caller_let_go(exported, monkeypatch):
    """A run writes its logits into the buffer the last run returned when nothing refers to that
    one any more (no fresh 0.5 MB every tree step); while the caller holds it, or a row of it, it
    stays the caller's."""
    import specinfer.engines.onnxruntime as ort_runtime

    rt = OrtRuntime(exported["llama3"])
    seq = rt.start()
    rt.prefill(seq, PROMPT)
    parents = [-1] + list(range(11))   # 12 tokens: more than a step of a few
    fresh = []
    allocate = ort_runtime.aligned_array
    monkeypatch.setattr(ort_runtime, "aligned_array", lambda *a, **k: fresh.append(a[0]) or allocate(*a, **k))

    def step(first_token: int) -> np.ndarray:
        out = rt.score(seq, list(range(first_token, first_token + 12)), parents)
        rt.commit(seq, [])
        return out

    a = step(1)
    values, row = a.copy(), a[3]
    del a
    b = step(20)                                  # a row of the last logits is held: a fresh buffer
    assert len(fresh) == 2 and np.array_equal(row, values[3]) and not np.array_equal(b[3], row)
    del row, b
    c = step(40)                                  # nothing refers to b any more: written into it
    assert len(fresh) == 2
    d = step(60)                                  # c is held
    assert len(fresh) == 3 and not np.array_equal(c, d)
    np.testing.assert_array_equal(c, step(40))    # what c holds is still its step's


def test_kv_caches_and_bound_outputs_start_on_a_cache_line(exported):
    """Every sequence's cache, grown or not, and the logits a run writes start on a cache line:
    numpy aligns its arrays to 16 bytes only, and the native attention's 64-byte loads of each
    cached row then straddled two lines (a step's attention 1.3x slower)."""
    rt = OrtRuntime(exported["llama3"])
    seqs = [rt.start(capacity=c) for c in (40, 64, 100, 129, None)]
    for seq in seqs:
        rt.prefill(seq, PROMPT)
    first = rt._get(seqs[-1]).kv
    rt.score(seqs[-1], list(range(1, first.shape[rt.slot_axis])))   # past its buffer's end: it grows
    buffers = [rt._get(seq).kv for seq in seqs]
    assert buffers[-1] is not first
    rt.commit(seqs[-1], [])
    rt.score(seqs[-1], [5])   # a few tokens' logits: into the buffer the binding keeps
    logits = [binding.logits for binding in rt._get(seqs[-1]).bindings.values()
              if getattr(binding, "logits", None) is not None]
    assert logits and all(a.ctypes.data % 64 == 0 for a in [first] + buffers + logits)


def test_tree_on_an_empty_cache(runtime, reference):
    """A branching tree as a sequence's very first call: positions are depths, not 0..T-1."""
    seq = runtime.start()
    logits = runtime.score(seq, [10, 20, 30, 40], [-1, 0, 0, 2])
    assert np.abs(logits[2] - reference([10, 30])).max() < TOL
    assert np.abs(logits[3] - reference([10, 30, 40])).max() < TOL


def test_one_call_draft_is_the_token_by_token_draft(exported):
    """The unrolled drafter graph, called twice (the second call continuing the first's chain),
    drafts the greedy chain of the Runtime's own score calls, with the same runner-ups and
    probabilities, and leaves the same KV behind: after committing a path across the two calls,
    the next step's logits agree."""
    from specinfer.engines.runtime import Runtime

    rt = OrtRuntime(exported["llama3"])
    d = rt.draft_depth
    assert d > 1
    fast, slow = rt.start(), rt.start()
    results = []
    for seq in (fast, slow):
        rt.prefill(seq, PROMPT)
        if seq == fast:
            first = rt.draft_chain(seq, [7, 8], d)
            chain = [a + b for a, b in zip(first, rt.draft_chain(seq, first.tokens[-1:], d))]
        else:
            chain = Runtime.draft_chain(rt, seq, [7, 8], 2 * d)
        rt.commit(seq, list(range(d + 3)))         # 7, 8 and the first d + 1 drafted tokens
        results.append((chain, rt.score(seq, [chain[0][d + 1]])[0]))
    ((t1, p1, r1, rp1, *_), l1), ((t2, p2, r2, rp2, *_), l2) = results
    assert t1 == t2 and r1 == r2 and len(t1) == 2 * d
    assert all(a != b for a, b in zip(t1, r1))
    assert np.allclose(p1, p2, atol=1e-5) and np.allclose(rp1, rp2, atol=1e-5)
    assert all(1 >= p >= r > 0 for p, r in zip(p1, rp1))
    assert np.abs(l1 - l2).max() < TOL


@pytest.mark.parametrize("copies", [False, True], ids=["shared-weights", "own-weights"])
def test_a_trim_keeps_open_sequences_exact_and_gives_new_ones_new_sessions(exported, copies):
    """trim (the idle scheduler's) drops the spare slots' cache, and the batched sessions where a
    session keeps weights of its own (``sessions_copy_weights``), also while sequences are open
    (another scheduler's, a direct caller's): those go on with the sessions they were bound to,
    and every score, batch and draft is bit for bit what it is with no trim."""
    def run(trim: bool) -> list:
        rt = OrtRuntime(exported["llama3"])
        rt.sessions_copy_weights = copies   # as _open finds it where the native kernels take no product
        before, during = rt.start(), rt.start()
        for seq in (before, during):
            rt.prefill(seq, PROMPT)
        rt.score_batch([(before, [7, 8], None), (during, [7, 8], None)])   # a batched session, and bindings
        batched = dict(rt._batched)
        if trim:
            rt.trim()
            assert rt._scratch is None
            assert rt.batch_sessions == ([] if copies else sorted(batched))
        after = rt.start()
        rt.prefill(after, PROMPT)
        rt.score(after, [7, 8])
        tree = ([5, 6, 9], [-1, 0, 0])
        out = [rt.score(seq, *tree) for seq in (before, after)]
        out += rt.score_batch([(seq, *tree) for seq in (during, after)])   # (copies: on a new session)
        for seq in (before, after):
            rt.commit(seq, [0, 1])                                      # 7, 8
        return out + [np.array(rt.draft_chain(seq, [3], rt.draft_depth)[:4]) for seq in (before, after)]

    kept, trimmed = run(False), run(True)
    assert all(np.array_equal(a, b) for a, b in zip(kept, trimmed, strict=True))


def test_a_session_copies_the_weights_of_the_products_onnx_runtime_runs_itself():
    """copies_weights: a MatMul or Gemm of a constant weight (MLAS prepacks it per session) copies;
    one of two activations, or a native node holding the same weight, does not."""
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import copies_weights

    def graph(op: str, domain: str = "", weight_is_constant: bool = True):
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("x", "y")]
        node = helper.make_node(op, ["x", "w" if weight_is_constant else "y"], ["z"], domain=domain)
        g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2])],
                              [numpy_helper.from_array(np.eye(2, dtype=np.float32), "w")])
        return helper.make_model(g)

    assert copies_weights(graph("MatMul")) and copies_weights(graph("Gemm"))
    assert not copies_weights(graph("MatMul", weight_is_constant=False))
    assert not copies_weights(graph("MatMulI8", domain="specinfer"))


def test_every_session_of_a_runtime_reads_one_copy_of_its_weights(exported, monkeypatch):
    """The single-sequence, batched and drafter sessions are given the runtime's weights, one copy
    for all (ONNX Runtime reads them where the runtime keeps them): a change to that copy reaches
    every session, those opened before it and after."""
    import specinfer.engines.onnxruntime as ort_runtime

    monkeypatch.setattr(ort_runtime, "SHARED_MIN_VALUES", 1024)   # the test model's weights are small
    rt = OrtRuntime(exported["llama3"])
    seqs = [rt.start() for _ in range(3)]
    for seq in seqs:
        rt.prefill(seq, PROMPT)

    def run(batch: int) -> list:
        out = []
        for token in (5, 6):
            out.append(rt.score(seqs[0], [token]))
            rt.commit(seqs[0], [])
        out += rt.score_batch([(seq, [5 + i], None) for i, seq in enumerate(seqs[:batch])])
        for seq in seqs:
            rt.commit(seq, [])
        draft = rt.draft_chain(seqs[0], [5], rt.draft_depth)
        rt.commit(seqs[0], [])
        return out + [np.array(draft.probability)]

    before = run(2)
    shared = {key[0]: array for key, (array, _) in rt._shared.items()}
    assert "embed_tokens" in shared and len(rt._shared) == len(shared)   # one copy of each weight
    shared["embed_tokens"][...] = 0          # every token's hidden state 0: the same logits for all
    after = run(2) + run(3)[2:5]             # the batch of 3's session opened now
    assert len(rt._shared) == len(shared)
    assert all(not np.allclose(a, b) for a, b in zip(before, after))
    assert np.array_equal(after[0], after[1]) and np.array_equal(after[2][0], after[3][0])


def test_a_sequence_keeps_its_slot_in_a_batched_session(exported, monkeypatch):
    """A batched session binds only the caches new to it: a sequence keeps the slot it had, in
    whatever order the calls come, a new one takes a leaver's slot and the spare slots keep the
    scratch cache; each sequence's logits are bit for bit what it gets alone."""
    import specinfer.engines.onnxruntime as ort_runtime

    bound = []
    bind = ort_runtime._bind_kv
    monkeypatch.setattr(ort_runtime, "_bind_kv", lambda io, seq, *names: (bound.append(seq), bind(io, seq, *names)))
    batched, single = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    names = "abcdef"
    seqs = {name: (batched.start(), single.start()) for name in names}
    for i, name in enumerate(names):
        for rt, seq in zip((batched, single), seqs[name]):
            rt.prefill(seq, PROMPT[:4 + i])
    # (order of the calls, slots the batch should bind): 5 sequences in a session of 6 slots (one spare),
    # shuffled, then one leaving and one joining
    batches = [("abcde", 6), ("ecadb", 0), ("bfdce", 1), ("cfbed", 0)]
    for step, (order, binds) in enumerate(batches):
        bound.clear()
        tokens = {name: [7 + step, 9] for name in order}
        got = batched.score_batch([(seqs[name][0], tokens[name], [-1, 0]) for name in order])
        assert len(bound) == binds
        for name, logits in zip(order, got):
            assert np.array_equal(logits, single.score(seqs[name][1], tokens[name], [-1, 0]))
            for rt, seq in zip((batched, single), seqs[name]):
                rt.commit(seq, [0])
    # A sequence whose cache moved (it outgrew its buffer) is bound again, in the slot it had.
    grown = seqs["c"][0]
    old = batched._get(grown).kv
    for rt, seq in zip((batched, single), seqs["c"]):
        rt.score(seq, list(range(1, old.shape[batched.slot_axis])))
        rt.commit(seq, [])
    assert batched._get(grown).kv is not old
    bound.clear()
    got = batched.score_batch([(seqs[name][0], [5, 6], [-1, 0]) for name in "cfbed"])
    assert bound == [batched._get(grown)]
    for name, logits in zip("cfbed", got):
        assert np.array_equal(logits, single.score(seqs[name][1], [5, 6], [-1, 0]))


def test_one_call_sampled_draft_is_the_token_by_token_draft(exported):
    """The sampled drafter graph (draft_sampled.ort.onnx), called twice, draws the chain the
    Runtime's own score calls draw with the same noise: the same candidates (the likeliest,
    best first), logits and tokens; and the noise decides the draw (large noise on one candidate
    picks it)."""
    from specinfer.engines.runtime import Runtime

    rt = OrtRuntime(exported["llama3"])
    d, k = rt.draft_depth, rt.draft_candidates
    noise = (0.8 * np.random.default_rng(3).gumbel(size=(2 * d, k))).astype(np.float32)
    fast, slow = rt.start(), rt.start()
    for seq in (fast, slow):
        rt.prefill(seq, PROMPT)
    first = rt.draft_chain(fast, [7, 8], d, noise[:d])
    one_call = [a + b for a, b in zip(first, rt.draft_chain(fast, first.tokens[-1:], d, noise[d:]))]
    by_token = Runtime.draft_chain(rt, slow, [7, 8], 2 * d, noise)
    assert one_call[0] == by_token[0] and len(one_call[0]) == 2 * d
    assert one_call[1] == one_call[2] == [] and by_token[1] == by_token[2] == []
    for ours, theirs, logits, token in zip(one_call[4], by_token[4], one_call[5], one_call[0]):
        assert list(ours) == list(theirs) and len(ours) == k and token in ours
        assert np.all(np.diff(logits) <= 0)
    assert np.allclose(np.concatenate(one_call[5]), np.concatenate(by_token[5]), atol=1e-4)
    # The draw is the noise's: a large push on the 5th candidate of step 0 draws it.
    push = np.zeros((d, k), np.float32)
    push[0, 4] = 1e4
    for seq in (fast, slow):
        rt.commit(seq, [])
    assert rt.draft_chain(fast, [7, 8], 1, push).tokens[0] == int(one_call[4][0][4])


def test_a_shorter_draft_runs_a_cut_drafter_that_drafts_the_full_ones_first_steps_exactly(exported):
    """A draft of 3 runs the drafter cut to 3 steps (fewer kernels), and drafts exactly what the
    full drafter drafts first, greedy and sampled: same tokens, probabilities and candidates bit
    for bit, and the same cache after commit (the next scores equal)."""
    import onnx

    from specinfer.export.ort_lowering import truncate_drafter

    rt = OrtRuntime(exported["llama3"])
    d, k = rt.draft_depth, rt.draft_candidates
    noise = (0.7 * np.random.default_rng(5).gumbel(size=(d, k))).astype(np.float32)
    for sampled in (None, noise):
        drafts, after = [], []
        for depth in (d, 3):
            seq = rt.start()
            rt.prefill(seq, PROMPT)
            drafts.append(rt.draft_chain(seq, [7, 8], depth, None if sampled is None else sampled[:depth]))
            rt.commit(seq, [0, 1, 2, 3])                  # 7, 8 and the first two drafted tokens
            after.append(rt.score(seq, [drafts[-1].tokens[2]]))
            rt.release(seq)
        full, cut = drafts
        assert len(full.tokens) == d and len(cut.tokens) == 3
        for mine, theirs in zip(cut, full):
            assert len(mine) == (3 if len(theirs) else 0)
            assert all(np.array_equal(a, b) for a, b in zip(mine, theirs))
        assert np.array_equal(after[0], after[1])
    graph = onnx.load(exported["llama3"] / "draft.ort.onnx", load_external_data=False)
    assert len(truncate_drafter(graph, 3).graph.node) < 0.5 * len(graph.graph.node)
    with pytest.raises(ValueError, match=f"cannot be cut to {d + 1}"):
        truncate_drafter(graph, d + 1)


def test_many_sequences_drafts_in_one_call_are_each_ones_draft_alone(exported):
    """draft_chains drafts several sequences' chains in one run of the batched drafter, greedy
    and sampled ones side by side, of different catch-ups, depths and context lengths, and a
    batch size with spare slots: each sequence's draft is bit for bit what it drafts alone, and so
    is its cache after commit (the next scores equal). A chain the drafter cannot hold runs alone."""
    rt, alone = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"])
    d, k = rt.draft_depth, rt.draft_candidates
    rng = np.random.default_rng(11)
    calls = []   # (prompt, tokens, depth, noise)
    for i in range(8):
        noise = None if i % 3 else (0.9 * rng.gumbel(size=(d, k))).astype(np.float32)
        depth = [3, d, 2, 5, 1, 4, d, 2][i]
        calls.append(((PROMPT * 3)[:5 + 2 * i], [7, 8, 9][:1 + i % 3], depth, None if noise is None else noise[:depth]))
    drafts = []
    for runtime in (rt, alone):
        seqs = [runtime.start() for _ in calls]
        for seq, (prompt, *_) in zip(seqs, calls):
            runtime.prefill(seq, prompt)
        chains = [(seq, tokens, depth, noise) for seq, (_, tokens, depth, noise) in zip(seqs, calls)]
        out = runtime.draft_chains(chains) if runtime is rt else [runtime.draft_chain(*c) for c in chains]
        after = []
        for seq, draft, (_, tokens, depth, _) in zip(seqs, out, calls):
            runtime.commit(seq, range(len(tokens) + min(depth, 2) - 1))
            after.append(runtime.score(seq, [draft.tokens[min(depth, 2) - 1]]))
        drafts.append((out, after))
    (batched, after_batched), (single, after_single) = drafts
    assert rt.batch_drafters == [("draft", d, 6), ("sampled_draft", d, 3)]   # 5 greedy in a batch of 6
    for mine, theirs, depth in zip(batched, single, [c[2] for c in calls]):
        assert len(mine.tokens) == depth
        for a, b in zip(mine, theirs):
            assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert all(np.array_equal(a, b) for a, b in zip(after_batched, after_single))
    seq = rt.start(capacity=len(PROMPT) + 4)
    rt.prefill(seq, PROMPT)
    other = rt.start()
    rt.prefill(other, PROMPT)
    near_full, roomy = rt.draft_chains([(seq, [7], 3, None), (other, [7], d, None)])
    assert len(near_full.tokens) == 3 and len(roomy.tokens) == d
    with pytest.raises(Exception, match="twice"):
        rt.draft_chains([(other, [7], 2, None), (other, [8], 2, None)])
    rt.commit(seq, [])
    rt.commit(other, [])
    with pytest.raises(Exception, match="out of range"):   # before any sequence changes
        rt.draft_chains([(other, [7], 2, None), (seq, [rt.vocab_size], 2, None)])
    assert rt.draft_chains([(other, [7], 2, None), (seq, [7], 2, None)])[0].tokens == roomy.tokens[:2]


@pytest.mark.parametrize("drafter_node", [True, False])
def test_decoding_chains_are_the_drafters_greedy_tokens_from_a_graph_without_probabilities(exported, drafter_node,
                                                                                          monkeypatch):
    """Greedy incremental decoding's chains (decode_chain, decode_chains) run the greedy drafter
    cut to its tokens: the mass's softmax sums over every step's logits are gone, and the tokens,
    alone and several sequences in one run, are draft_chain's bit for bit, as is the cache after
    commit (the next scores equal); with the drafter as one native node or as ONNX Runtime's graph
    (a model too large for the node)."""
    import onnx

    from specinfer.engines import native
    from specinfer.export.ort_lowering import tokens_only, truncate_drafter

    if not drafter_node:
        monkeypatch.setattr(native, "DRAFT_CHAIN_MAX_WEIGHTS", -1)

    graph = truncate_drafter(onnx.load(exported["llama3"] / "draft.ort.onnx", load_external_data=False), 3)
    cut = tokens_only(graph)
    ops = lambda g: {node.op_type for node in g.graph.node}
    assert {"Exp", "ReduceSum"} <= ops(graph) and not {"Exp", "ReduceSum"} & ops(cut)
    assert [o.name for o in cut.graph.output] == [o.name for o in graph.graph.output
                                                 if o.name not in ("draft_logits", "draft_mass")]
    rt = OrtRuntime(exported["llama3"])
    d = rt.draft_depth
    calls = [((PROMPT * 2)[:6 + 3 * i], [7, 8][:1 + i % 2], [d, 3, 2][i]) for i in range(3)]
    results = []
    for decoding in (False, True):
        seqs = [rt.start() for _ in calls]
        for seq, (prompt, *_) in zip(seqs, calls):
            rt.prefill(seq, prompt)
        chains = [(seq, tokens, depth) for seq, (_, tokens, depth) in zip(seqs, calls)]
        alone = rt.decode_chain(*chains[0]) if decoding else rt.draft_chain(*chains[0]).tokens
        rt.commit(seqs[0], [])
        together = (rt.decode_chains(chains) if decoding
                    else [draft.tokens for draft in rt.draft_chains([(*c, None) for c in chains])])
        after = []
        for seq, tokens, (_, fed, _) in zip(seqs, together, calls):
            rt.commit(seq, range(len(fed) + 1))
            after.append(rt.score(seq, [tokens[1]]))
            rt.release(seq)
        results.append((alone, together, after))
    (alone, together, after), (decoded_alone, decoded, decoded_after) = results
    assert decoded_alone == alone == together[0] and decoded == together
    assert [len(t) for t in decoded] == [depth for *_, depth in calls]
    assert all(np.array_equal(a, b) for a, b in zip(after, decoded_after))
    assert ("chain", d) in rt.draft_sessions and ("chain", d, 3) in rt.batch_drafters


def test_sampled_decoding_chains_draw_each_token_as_a_call_a_token_does(exported):
    """Sampled incremental decoding's chains (decode_chain, decode_chains with a ChainSampling) run
    the greedy drafter with each step's token drawn inside it (native.sampled_decoding: no TopK
    left, a SampleSoftmax a step): the tokens, alone and several sequences in one run at
    temperatures of their own, are the base class's, a Runtime call and sampling.draw_at a token
    with the same uniforms; the cache after commit is the same (the next scores equal). Uniforms
    past a chain's depth are never read."""
    import onnx

    from specinfer.engines import native
    from specinfer.engines.runtime import ChainSampling, Runtime
    from specinfer.export.ort_lowering import truncate_drafter

    rt = OrtRuntime(exported["llama3"])
    if not rt.samples_chains:
        pytest.skip("sampled chains are drawn by the native kernels")
    graph = native.sampled_decoding(truncate_drafter(onnx.load(exported["llama3"] / "draft.ort.onnx",
                                                               load_external_data=False), 3))
    ops = [node.op_type for node in graph.graph.node]
    assert ops.count(native.SAMPLE_OP) == 3 and "TopK" not in ops
    assert [o.name for o in graph.graph.output][0] == "draft_tokens"
    d, rng = rt.draft_depth, np.random.default_rng(0)
    calls = [((PROMPT * 2)[:6 + 3 * i], [7, 8][:1 + i % 2], [d, 3, d][i], ChainSampling([0.5, 1.0, 1.7][i], rng.random(d)))
             for i in range(3)]
    results = []
    for engine in ("graph", "base"):
        seqs = [rt.start() for _ in calls]
        for seq, (prompt, *_) in zip(seqs, calls):
            rt.prefill(seq, prompt)
        chains = [(seq, tokens, depth, sampling) for seq, (_, tokens, depth, sampling) in zip(seqs, calls)]
        if engine == "graph":
            alone = rt.decode_chain(*chains[0])
            rt.commit(seqs[0], [])
            together = rt.decode_chains(chains)
        else:
            together = [Runtime.decode_chain(rt, *chain) for chain in chains]
            alone = together[0]
        after = []
        for seq, tokens, (_, fed, *_) in zip(seqs, together, calls):
            rt.commit(seq, range(len(fed) + 1))
            after.append(rt.score(seq, [tokens[1]]))
            rt.release(seq)
        results.append((alone, together, after))
    (alone, together, after), (_, base, base_after) = results
    assert alone == together[0] and together == base
    assert [len(t) for t in together] == [depth for _, _, depth, _ in calls]
    assert len({tuple(t) for t in together}) == 3   # (the draws differ: the test sees tokens, not a constant)
    assert all(np.array_equal(a, b) for a, b in zip(after, base_after))
    assert ("sampled_chain", d) in rt.draft_sessions and ("sampled_chain", d, 3) in rt.batch_drafters


def test_draft_chain_continues_only_a_chain(exported):
    rt = OrtRuntime(exported["llama3"])
    seq = rt.start()
    rt.prefill(seq, PROMPT)
    rt.score(seq, [5, 6, 7], [-1, 0, 0])           # a pending tree, not a chain
    with pytest.raises(SpecInferError, match="pending tree"):
        rt.draft_chain(seq, [9], rt.draft_depth)


def test_session_threads():
    """By default a session runs on the process's shared pool; given threads before the process
    shares one, on a pool of its own that spins within a run where it has workers, and stops
    spinning when the run ends."""
    from specinfer.engines.onnxruntime import session_options

    from specinfer.engines import onnxruntime as engine

    spin, stop = "session.intra_op.allow_spinning", "session.force_spinning_stop"
    shared, engine._shared_pool = engine._shared_pool, []    # as in a process with no shared pool yet
    try:
        assert session_options(2).use_per_session_threads is True
        assert session_options(2).get_session_config_entry(spin) == "1"
        assert session_options(2).get_session_config_entry(stop) == "1"
        assert session_options(1).get_session_config_entry(spin) == "0"
        with pytest.raises(Exception, match="does not have configuration"):   # one thread: nothing to stop
            session_options(1).get_session_config_entry(stop)
    finally:
        engine._shared_pool = shared
    assert session_options(None).use_per_session_threads is False
    assert session_options(2).use_per_session_threads is False   # ONNX Runtime allows no other then


def test_a_model_in_a_process_of_its_own_gets_one_thread_when_small_and_every_core_when_large(tmp_path, exported):
    """Behind the ensemble each SSM has a process; a small one on all cores fought the others for them."""
    import json
    import os

    from specinfer.engines.onnxruntime import read_manifest, threads_beside_others

    assert threads_beside_others(exported["llama3"]) == 1
    manifest = read_manifest(exported["llama3"])
    manifest["config"].update(hidden_size=1024, intermediate_size=4096, num_layers=8)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert threads_beside_others(tmp_path) == (os.cpu_count() or 1)
    # what the llm and ssm_<i> models load with: the repository's threads, else the above
    from specinfer.serving.triton_glue import model_threads
    assert model_threads({"threads": "0", "engine": "onnxruntime", "model_dir": str(tmp_path)}) == (os.cpu_count() or 1)
    assert model_threads({"threads": "0", "engine": "onnxruntime", "model_dir": str(exported["llama3"])}) == 1
    assert model_threads({"threads": "3", "engine": "onnxruntime", "model_dir": str(tmp_path)}) == 3
    assert model_threads({"threads": "0", "engine": "tensorrt", "model_dir": str(tmp_path)}) is None


def test_a_released_sequence_is_the_next_ones_zeroed_with_its_bindings(exported, monkeypatch):
    """ONNX Runtime keeps released sequences (``spare_sequences``): the next start takes one, its
    used slots zeroed and its bindings still good (no new binding: ~0.2 ms each), and scores bit
    for bit what a fresh runtime scores; a start that asks less capacity than a spare's buffer
    has gets a buffer of its own, and trim drops the spares."""
    def run(rt, seq):
        rt.prefill(seq, PROMPT)
        out = [rt.score(seq, [5, 6, 9], [-1, 0, 0])]
        rt.commit(seq, [0, 1])
        out.append(np.array(rt.draft_chain(seq, [3], rt.draft_depth)[:4]))
        rt.commit(seq, [])
        return out

    other = OrtRuntime(exported["llama3"])
    fresh = run(other, other.start())
    rt = OrtRuntime(exported["llama3"])
    first = rt.start()
    run(rt, first)
    kv = rt._get(first).kv
    rt.release(first)
    assert not kv.any()                                   # zeroed as it went spare
    binds = []
    bind = rt._bind_cache
    monkeypatch.setattr(rt, "_bind_cache", lambda *a: binds.append(a) or bind(*a))
    second = rt.start()
    assert rt._get(second).kv is kv and rt.length(second) == 0 and rt.kv_bytes() == kv.nbytes
    again = run(rt, second)
    assert binds == []
    assert all(np.array_equal(a, b) for a, b in zip(fresh, again, strict=True))
    rt.release(second)
    small = rt.start(capacity=kv.shape[rt.slot_axis] - 1)  # a spare larger than it may grow
    assert rt._get(small).kv is not kv
    rt.release(small)
    rt.trim()
    assert rt._get(rt.start()).kv is not kv
