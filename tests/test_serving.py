"""The serving layer without a server: request validation, trees as tensors, and the whole
orchestration over in-process model objects wired as the spec_step ensemble wires them."""
import json
import os
import re
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import TINY_VOCAB, chi_square_p
from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.errors import ServerBusy, SpecInferError
from specinfer import generate
from specinfer.generate import DEFAULT_BUDGET, Stats, decode, generate_ids
from specinfer.sampling import SamplingParams, probabilities
from specinfer.serving import (DraftModel, LookupModel, Orchestrator, RemoteSpeculator, VerifyModel, build_tree,
                               tensors_to_tree, tree_to_tensors)
from specinfer.serving import models as serving_models
from specinfer.serving.triton_glue import METRICS_SECONDS
from specinfer.serving.repository import MANIFEST, write_repository
from specinfer.serving.request import read_request
from specinfer.text import TextStream, decode_piece, load_tokenizer
from specinfer.tree import Proposal, TokenTree
from specinfer.tree_sizing import acceptance, step_cost

TREE = [1, 1, 3, 1, 1, 1]


def ids(*values):
    return np.asarray(values, dtype=np.int64)


@pytest.mark.parametrize("inputs, message", [
    ({}, "missing input 'input_ids'"),
    ({"input_ids": ids()}, "the prompt is empty"),
    ({"input_ids": ids(*range(300))}, "the prompt has 300 tokens"),
    ({"input_ids": ids(1, 2), "max_tokens": np.array([0], np.int32)}, "'max_tokens' must be in 1..256"),
    ({"input_ids": ids(1, 2), "max_tokens": np.array([10**9], np.int64)}, "'max_tokens' must be in 1..256"),
    ({"input_ids": ids(1, 2), "max_tokens": np.array([1.5], np.float32)}, "'max_tokens' has the wrong type"),
    ({"input_ids": ids(1, 2), "max_tokens": np.array([1, 2], np.int32)}, "'max_tokens' must hold one value"),
    ({"input_ids": ids(1, 2), "temperature": np.array([-1], np.float32)}, "temperature must be >= 0"),
    ({"input_ids": ids(1, 2), "top_p": np.array([0], np.float32)}, "top_p must be in (0, 1]"),
    ({"input_ids": ids(1, 2), "top_p": np.array([1.5], np.float32)}, "top_p must be in (0, 1]"),
    ({"input_ids": ids(1, 2), "tree": np.array([b"1,0"], object)}, "tree widths must all be >= 1"),
    ({"input_ids": ids(1, 2), "tree": np.array([b"dynamc"], object)}, "a tree is 'dynamic' or comma-separated"),
    ({"input_ids": ids(1, 2), "stop_words": np.array([b"\xff"], object)}, "'stop_words' is not valid UTF-8"),
])
def test_bad_requests_name_the_problem(inputs, message):
    with pytest.raises(SpecInferError) as e:
        read_request(inputs, max_context=256)
    assert message in str(e.value)


def test_text_input_errors(served_pair):
    tok = load_tokenizer(served_pair["llm"])
    for inputs, message in [({}, "missing input 'text_input'"), ({"text_input": np.array([b""], object)}, "is empty"),
                            ({"text_input": np.array([b"ab\xc3"], object)}, "not valid UTF-8"),
                            ({"text_input": np.array([b"a", b"b"], object)}, "must hold one string")]:
        with pytest.raises(SpecInferError, match=message):
            read_request(inputs, 256, tokenizer=tok)
    assert read_request({"text_input": np.array([b"def f"], object)}, 256, tokenizer=tok).prompt == tok.encode("def f").ids


def test_streamed_text_is_utf8_safe(served_pair):
    tok = load_tokenizer(served_pair["llm"])
    text = "naïve café – π ≈ 3.14 🐍 fin"
    token_ids = tok.encode(text).ids[1:]  # byte-level BPE: multi-byte characters span tokens
    stream, pieces = TextStream(tok), []
    for t in token_ids:
        piece = stream.push([t])
        assert "\ufffd" not in piece
        if piece:  # what the orchestrator makes of the window is the same piece
            assert decode_piece(tok, *stream.window) == piece
            pieces.append(piece)
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert decode_piece(tok, [], token_ids) == text


def test_tree_tensors_round_trip():
    tree = TokenTree(7)
    q = np.full(10, 0.1)
    a = tree.add(0, 3, Proposal(0, 0, q))
    tree.add(0, 4, Proposal(0, 1, q))
    tree.add(a, 5, Proposal(1, 0, q * 2))
    tree.add(0, 3, Proposal(1, 0, q / 2))  # a second SSM proposes the same token: one node, two proposals
    tensors = tree_to_tensors(tree, 10)
    assert tensors["proposal_q"].shape == (3, 10)    # one row per distribution: SSM 0's draws at the root share q
    back = tensors_to_tree(tensors)
    assert back.tokens == tree.tokens and back.parents == tree.parents
    # q travels as float32 (exact to float32 rounding)
    assert [[(p.ssm, p.rank, float(np.float32(p.q[0]))) for p in ps] for ps in back.proposals] == \
        [[(p.ssm, p.rank, float(np.float32(p.q[0]))) for p in ps] for ps in tree.proposals]
    with pytest.raises(SpecInferError, match="does not start at the step's root"):
        build_tree(8, [tree_to_tensors(tree, 10)], 16, 10)
    with pytest.raises(SpecInferError, match="q row out of range"):
        tensors_to_tree(tensors | {"proposal_q_row": np.array([0, 0, 5, 2], np.int32)})
    with pytest.raises(SpecInferError, match="q row out of range"):
        tensors_to_tree(tensors | {"proposal_q_row": np.array([0, 0, -2, 2], np.int32)})
    chain = TokenTree(7)
    chain.add(0, 3, Proposal(0, 0, None))
    greedy = tree_to_tensors(chain, 10)
    assert greedy["proposal_q"].shape == (0, 10) and greedy["proposal_q_row"].tolist() == [-1]
    assert tensors_to_tree(greedy).proposals[1][0].q is None


@pytest.fixture(scope="module")
def models(served_pair):
    llm = OrtRuntime(served_pair["llm"])
    ssms = [OrtRuntime(d) for d in served_pair["ssms"]]
    cost = step_cost(llm)
    return llm, ssms, VerifyModel(llm), [DraftModel(rt, i, ",".join(map(str, TREE)), cost) for i, rt in enumerate(ssms)]


def local_call(verify_model, draft_models):
    """What Triton does for each model name: spec_step wires ssm_<i> (and lookup, the last draft
    model when there is one) -> tree_builder -> llm."""
    def call(name, inputs):
        if name == "llm":
            return verify_model.handle(inputs)
        if name.startswith("ssm_"):
            return draft_models[int(name[4:])].handle(inputs)
        if name == "lookup":
            return draft_models[-1].handle(inputs)
        trees = [m.handle(inputs) for m in draft_models]
        merged = build_tree(int(inputs["root"][0]), trees, int(inputs["budget"][0]), verify_model.runtime.vocab_size)
        return verify_model.handle(inputs | merged)
    return call


def orchestrator(models, cancel_after=None):
    llm, _, verify_model, draft_models = models
    tok = load_tokenizer(llm.dir)
    counter = iter(range(10**6))
    names = [f"ssm_{i}" if isinstance(m, DraftModel) and not isinstance(m, LookupModel) else "lookup"
             for i, m in enumerate(draft_models)]
    make = lambda req, stats: RemoteSpeculator(local_call(verify_model, draft_models), names,
                                               f"seq-{next(counter)}-{threading.get_ident()}", llm.max_context,
                                               req.params, req.tree, stats, rule=req.rule, max_tokens=req.max_tokens)
    return Orchestrator(tok, llm.max_context, list(llm.config.eos_token_ids), llm.vocab_size, make), tok


def request(tok, text, **extra):
    return {"text_input": np.array([text.encode()], dtype=object), "max_tokens": np.array([40], np.int32)} | extra


def text_of(response) -> str:
    return response["text_output"][0].decode()


@pytest.fixture(scope="module")
def models_with_lookup(models):
    llm, ssms, verify_model, draft_models = models
    return llm, ssms, verify_model, draft_models + [LookupModel(len(ssms), llm.vocab_size, step_cost(llm),
                                                                 ",".join(map(str, TREE)))]


def test_the_lookup_model_drafts_for_greedy_requests_only(models_with_lookup):
    """As in process (generate.LOOKUP_WHEN_SAMPLING): a sampled request gets no lookup drafts."""
    lookup = models_with_lookup[3][-1]
    assert lookup.drafts(SamplingParams()) and not lookup.drafts(SamplingParams(temperature=0.7))


@pytest.mark.parametrize("stream,tree,lookup", [(False, None, False), (True, None, False), (False, "dynamic", False),
                                               (True, "2,1", False), (False, "dynamic", True), (True, "2,1", True)])
def test_orchestration_equals_in_process_greedy(models, models_with_lookup, stream, tree, lookup):
    models = models_with_lookup if lookup else models
    llm, ssms, verify_model, draft_models = models
    orch, tok = orchestrator(models)
    extra = {} if tree is None else {"tree": np.array([tree.encode()], object)}
    for text in ["def f(x):", "import os\n", "class A:"]:
        want = [t for s in generate_ids(llm, tok.encode(text).ids, ssms=ssms, tree=TREE, max_new_tokens=40,
                                        eos_ids=llm.config.eos_token_ids) for t in s]
        responses = list(orch.run(request(tok, text, stream=np.array([stream]), exclude_input_in_output=np.array([True]),
                                          **extra)))
        assert [final for _, final in responses] == [False] * (len(responses) - 1) + [True]
        pieces = [text_of(t) for t, _ in responses]
        assert "".join(pieces) == tok.decode(want)
        steps = [int(x) for x in responses[-1][0]["accepted_tokens_per_step"][0].decode().split(",")]
        assert sum(steps) == len(want)
        if stream:   # the last step's tokens come with the final response, not in one of their own
            assert responses[-1][0]["output_ids"].tolist()[-steps[-1]:] == want[-steps[-1]:]
            assert len(responses) <= len(steps)
    assert len(verify_model.sequences) == 0 and all(len(m.sequences) == 0 for m in draft_models)
    assert llm.sequences() == [] and all(rt.sequences() == [] for rt in ssms)
    if lookup and tree == "dynamic":   # the lookup model drafted, and learnt what was accepted
        assert sum(acceptance(draft_models[-1], SamplingParams(), "lookup")._seen[0]) > 0


def test_incremental_requests_call_the_llm_model_alone(models):
    """Tree "none": each step is one call of the llm model (no drafter, no tree_builder), the SSMs
    never hold the sequence, and the output is the LLM's own greedy decoding."""
    llm, _, verify_model, draft_models = models
    calls = []
    inner = local_call(verify_model, draft_models)
    tok = load_tokenizer(llm.dir)
    make = lambda req, stats: RemoteSpeculator(lambda name, t: calls.append((name, t["op"][0])) or inner(name, t),
                                               ["ssm_0", "ssm_1"], "s-none", llm.max_context, req.params, req.tree,
                                               stats, max_tokens=req.max_tokens)
    orch = Orchestrator(tok, llm.max_context, list(llm.config.eos_token_ids), llm.vocab_size, make)
    text = "def f(x):"
    want = [t for s in generate_ids(llm, tok.encode(text).ids, max_new_tokens=40, eos_ids=llm.config.eos_token_ids)
            for t in s]
    (out, _), = orch.run(request(tok, text, tree=np.array([b"none"], object)))
    assert out["output_ids"].tolist()[-len(want):] == want
    steps = [int(x) for x in out["accepted_tokens_per_step"][0].decode().split(",")]
    assert steps == [1] * len(want)
    assert {name for name, _ in calls} == {"llm"}
    assert [op for _, op in calls] == [b"start"] + [b"step"] * len(want) + [b"release"]
    assert len(verify_model.sequences) == 0 and llm.sequences() == []


def test_dynamic_tree_needs_a_cost_table(served_pair):
    model = DraftModel(OrtRuntime(served_pair["ssms"][0]), 0, "2,1")   # a repository without a cost table
    model.start("s", [1, 2, 3], SamplingParams())
    assert len(tensors_to_tree(model.step("s", [], 4, SamplingParams(), 16))) == 5   # its fixed tree works
    with pytest.raises(SpecInferError, match="dynamic tree needs the LLM's verification cost table"):
        model.step("s", [4], 5, SamplingParams(), 16, tree="dynamic")
    model.release("s")


def test_prompt_in_output_end_id_and_stop_words(models):
    orch, tok = orchestrator(models)
    (full, _), = orch.run(request(tok, "def f(x):"))
    text = text_of(full)
    assert text.startswith("def f(x):")
    generated = text[len("def f(x):"):]
    word = generated[5:8]
    (stopped, _), = orch.run(request(tok, "def f(x):", stop_words=np.array([word.encode()], object)))
    stopped_text = text_of(stopped)
    assert word in stopped_text and len(stopped_text) < len(text)
    # the output ends with the token that completes the stop word: without it, no stop word
    without_last = tok.decode(stopped["output_ids"].tolist()[:-1])
    assert text.startswith(stopped_text) and word not in without_last[len("def f(x):"):]
    first = int(tok.encode("def f(x):" + generated).ids[len(tok.encode("def f(x):").ids)])
    (ended, _), = orch.run(request(tok, "def f(x):", end_id=np.array([first], np.int32),
                                   exclude_input_in_output=np.array([True])))
    assert ended["output_ids"].tolist() == [first]


def test_concurrent_sequences_do_not_see_each_other(models):
    orch, tok = orchestrator(models)
    prompts = ["def f(x):", "import sys", "class B(A):", "for i in range(3):"]
    alone = {p: list(orch.run(request(tok, p)))[-1][0]["output_ids"].tolist() for p in prompts}
    results = {}

    def worker(p):
        results[p] = list(orch.run(request(tok, p)))[-1][0]["output_ids"].tolist()
    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def test_the_llm_model_keeps_kv_under_its_budget(served_pair):
    """A start the KV budget cannot hold is refused at once (a batch cannot wait for a release), with
    a clear error; after a release it fits."""
    llm = OrtRuntime(served_pair["llm"])
    one = (3 + 1 + 20 + DEFAULT_BUDGET) * llm.kv_bytes_per_token    # a 4-token prompt and max_tokens 20
    model = VerifyModel(llm, kv_budget=int(1.5 * one))
    model.start("first", [1, 2, 3], SamplingParams(), max_tokens=20)
    with pytest.raises(ServerBusy, match="busy"):
        model.start("second", [1, 2, 3], SamplingParams(), max_tokens=20)
    assert list(model.sequences.items) == ["first"] and llm.sequences() == ["first"]
    model.release("first")
    model.start("second", [1, 2, 3], SamplingParams(), max_tokens=20)
    model.release("second")
    assert model.scheduler.reserved == 0 and llm.sequences() == []


def test_the_llm_and_ssm_models_serve_a_batch_of_requests_in_one_call(served_pair, monkeypatch):
    """handle_batch (what Triton's batcher hands the llm and ssm models): the prompts go in with one
    LLM call, then each step drafts every sequence's chain with one SSM call and verifies every
    sequence's tree with one LLM call; every sequence decodes as it does alone, and a bad request
    in a batch fails alone."""
    llm, ssm = OrtRuntime(served_pair["llm"]), OrtRuntime(served_pair["ssms"][0])
    verify_model, draft_model = VerifyModel(llm), DraftModel(ssm, 0, "1,1,1")
    calls, drafts = [], []
    real, real_drafts = llm.score_batch, ssm.draft_chains
    monkeypatch.setattr(llm, "score_batch", lambda batch: calls.append(len(batch)) or real(batch))
    monkeypatch.setattr(ssm, "draft_chains", lambda batch: drafts.append(len(batch)) or real_drafts(batch))
    text = lambda s: np.array([s.encode()], dtype=object)

    def decode(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        starts = [{"op": text("start"), "sequence_id": text(n), "tokens": ids(*p[:-1])} for n, p in prompts.items()]
        assert all(isinstance(a, dict) for a in verify_model.handle_batch(starts))
        out, accepted, roots = {n: [] for n in prompts}, {n: [] for n in prompts}, {n: p[-1] for n, p in prompts.items()}
        for n, p in prompts.items():
            draft_model.start(n, p[:-1], SamplingParams())
        for _ in range(4):
            asks = [{"op": text("step"), "sequence_id": text(n), "tokens": ids(*accepted[n]), "root": ids(roots[n]),
                     "budget": np.array([8], np.int32)} for n in prompts]
            trees = draft_model.handle_batch(asks + [asks[0] | {"sequence_id": text("nobody")}])
            assert isinstance(trees[-1], SpecInferError) and "unknown sequence" in str(trees[-1])
            steps = [{"op": text("step"), "sequence_id": text(n)} | tree for n, tree in zip(prompts, trees)]
            answers = verify_model.handle_batch(steps + [steps[0] | {"sequence_id": text("nobody")}])
            assert isinstance(answers[-1], SpecInferError) and "unknown sequence" in str(answers[-1])
            for n, a in zip(prompts, answers):
                accepted[n], roots[n] = a["accepted_tokens"].tolist(), int(a["bonus"][0])
                out[n] += accepted[n][1:] + [roots[n]]
        for n in prompts:
            verify_model.release(n)
            draft_model.release(n)
        return out

    prompts = {"a": [1, 5, 9, 13], "b": [7, 3], "c": [2, 2, 2, 4, 6]}
    together = decode(prompts)
    assert calls == [3] * 5   # the three prompts, then each step's three trees
    assert drafts == [3] * 4  # each step's three chains
    alone = {n: decode({n + "-alone": p})[n + "-alone"] for n, p in prompts.items()}
    assert together == alone and all(len(o) >= 4 for o in together.values())
    assert llm.sequences() == [] and ssm.sequences() == []


def test_cancellation_releases_every_model(models):
    _, _, verify_model, draft_models = models
    orch, tok = orchestrator(models)
    calls = iter(range(100))
    responses = list(orch.run(request(tok, "def f(x):", stream=np.array([True])), cancelled=lambda: next(calls) >= 2))
    assert responses[-1][1] and len(responses) <= 4
    assert len(verify_model.sequences) == 0 and all(len(m.sequences) == 0 for m in draft_models)


def test_sampled_requests_are_reproducible(models):
    orch, tok = orchestrator(models)
    r = lambda seed: list(orch.run(request(tok, "x = ", temperature=np.array([1.0], np.float32),
                                           random_seed=np.array([seed], np.uint64))))[-1][0]["output_ids"].tolist()
    assert r(5) == r(5) and r(5) != r(6)


def test_each_ssm_model_drafts_only_for_its_kind_of_request(models):
    """A repository with an SSM for sampled requests (e.g. a distilled one): ssm_0 drafts for greedy
    requests only, ssm_1 for sampled ones only; the other holds no sequence and answers a bare root.
    The greedy output is still the LLM's own."""
    llm, ssms, verify_model, _ = models
    routed = [DraftModel(rt, i, ",".join(map(str, TREE)), step_cost(llm), drafts_for=kind)
              for i, (rt, kind) in enumerate(zip(ssms, ("greedy", "sampled")))]
    drafted, held = [0, 0], [0, 0]     # per model: steps with a draft, most sequences held at once

    def watched(model):
        handle = model.handle

        def call(t):
            out = handle(t)
            held[model.index] = max(held[model.index], len(model.sequences))
            drafted[model.index] += t["op"][0] == b"step" and len(out["tree_tokens"]) > 1
            return out
        return call

    for m in routed:
        m.handle = watched(m)
    orch, tok = orchestrator((llm, ssms, verify_model, routed))
    text = "def f(x):"
    want = [t for s in generate_ids(llm, tok.encode(text).ids, ssms=ssms[:1], tree=TREE, max_new_tokens=40,
                                    eos_ids=llm.config.eos_token_ids) for t in s]
    (out, _), = orch.run(request(tok, text, exclude_input_in_output=np.array([True])))
    assert text_of(out) == tok.decode(want)
    assert drafted[0] > 0 and drafted[1] == 0 and held == [1, 0]
    sampled = list(orch.run(request(tok, text, temperature=np.array([0.7], np.float32),
                                    random_seed=np.array([3], np.uint64))))
    assert text_of(sampled[-1][0])
    assert drafted[1] > 0 and held == [1, 1]
    drafted_greedy = drafted[0]
    list(orch.run(request(tok, "x = ", temperature=np.array([1.0], np.float32))))
    assert drafted[0] == drafted_greedy
    assert all(len(m.sequences) == 0 for m in routed) and all(rt.sequences() == [] for rt in ssms)
    with pytest.raises(SpecInferError, match="drafts_for must be one of all, greedy, sampled"):
        DraftModel(ssms[0], 0, drafts_for="sampling")


def test_the_repository_names_the_requests_each_ssm_drafts_for(served_pair, tmp_path):
    close, far = served_pair["ssms"]
    repo = write_repository(served_pair["llm"], [close], tmp_path / "repo", tree="1,1", sampling_ssms=[far],
                            lookup=False, layout="both")
    alone = write_repository(served_pair["llm"], [close], tmp_path / "alone", tree="1,1", lookup=False, layout="both")
    param = lambda repo, model, key: re.search(rf'key: "{key}" value: {{ string_value: "([^"]*)" }}',
                                               (repo / model / "config.pbtxt").read_text()).group(1)
    assert [param(repo, m, "drafts_for") for m in ("ssm_0", "ssm_1")] == ["greedy", "sampled"]
    assert param(repo, "ssm_1", "model_dir") == str(far.resolve())
    for name in ("ensemble", "ensemble_fused"):
        assert param(repo, name, "ssm_dirs") == str(close.resolve())
        assert param(repo, name, "sampling_ssm_dirs") == str(far.resolve())
        assert param(alone, name, "sampling_ssm_dirs") == ""
    assert '"ssm_1"' in (repo / "spec_step" / "config.pbtxt").read_text()   # the ensemble steps both
    assert param(alone, "ssm_0", "drafts_for") == "all" and not (alone / "ssm_1").exists()


def test_the_repository_gives_every_model_its_kv_dtype_and_metrics_interval(served_pair, tmp_path):
    close, far = served_pair["ssms"]
    param = lambda repo, model, key: re.search(rf'key: "{key}" value: {{ string_value: "([^"]*)" }}',
                                               (repo / model / "config.pbtxt").read_text()).group(1)
    half = write_repository(served_pair["llm"], [close], tmp_path / "half", tree="1,1", sampling_ssms=[far],
                            layout="both", kv_dtype="float16")
    plain = write_repository(served_pair["llm"], [close], tmp_path / "plain", tree="1,1", layout="both")
    for model in ("llm", "ensemble", "ensemble_fused"):   # the LLM's caches; the SSMs keep float32 ones
        assert param(half, model, "kv_dtype") == "float16"
    assert 'key: "kv_dtype"' not in (half / "ssm_0" / "config.pbtxt").read_text()
    assert param(plain, "ensemble_fused", "kv_dtype") == param(plain, "llm", "kv_dtype") == "float32"
    # Every model that reports metrics is told how often to push them.
    assert {param(half, m, "metrics_seconds") for m in ("llm", "ssm_0", "ssm_1", "ensemble", "ensemble_fused")} \
        == {str(METRICS_SECONDS)}
    with pytest.raises(SpecInferError, match="KV cache type must be one of float32, float16, got 'int8'"):
        write_repository(served_pair["llm"], [close], tmp_path / "bad", kv_dtype="int8")
    with pytest.raises(SpecInferError, match="float16 KV caches run on ONNX Runtime only"):
        write_repository(served_pair["llm"], [close], tmp_path / "trt", engines=tmp_path / "engines", kv_dtype="float16")


def test_repo_on_the_command_line_writes_its_metrics_interval(served_pair, tmp_path):
    from specinfer.cli import main
    main(["repo", "--llm", str(served_pair["llm"]), "--ssm", str(served_pair["ssms"][0]), "--tree", "1,1",
          "--metrics-seconds", "2.5", "-o", str(tmp_path / "repo")])
    assert 'key: "metrics_seconds" value: { string_value: "2.5" }' in (tmp_path / "repo" / "ensemble" / "config.pbtxt").read_text()


def test_each_layout_loads_each_model_in_one_model_only(served_pair, tmp_path):
    """The default layout is one fused ``ensemble`` (every model in its process); "ensemble" is the
    Triton-native composition without a fused copy; "both" has the two. Which folders each model
    loads is read from its config: an ONNX folder appears in one loading model only, except in "both"."""
    close, far = served_pair["ssms"]
    param = lambda repo, model, key: re.search(rf'key: "{key}" value: {{ string_value: "([^"]*)" }}',
                                               (repo / model / "config.pbtxt").read_text()).group(1)

    def loaded(repo):   # ONNX folder -> the models that load it
        where = {}
        for model in sorted(p.name for p in repo.iterdir() if p.is_dir()):
            config = (repo / model / "config.pbtxt").read_text()
            if 'key: "mode"' in config:   # an orchestrator: only a fused one loads models
                fused = param(repo, model, "mode") == "fused"
                dirs = ([param(repo, model, "llm_dir")] + param(repo, model, "ssm_dirs").split(os.pathsep)
                        + param(repo, model, "sampling_ssm_dirs").split(os.pathsep)) if fused else []
            else:
                dirs = [param(repo, model, "model_dir")] if 'key: "model_dir"' in config else []
            for d in filter(None, dirs):
                where.setdefault(d, []).append(model)
        return where

    models = {}
    for layout in ("fused", "ensemble", "both"):
        repo = write_repository(served_pair["llm"], [close], tmp_path / layout, tree="dynamic", sampling_ssms=[far],
                                layout=layout)
        models[layout] = sorted(p.name for p in repo.iterdir() if p.is_dir())
        assert json.loads((repo / MANIFEST).read_text())["layout"] == layout
        where = loaded(repo)
        assert sorted(where) == sorted(str(d.resolve()) for d in (served_pair["llm"], close, far)), where
        assert all(len(m) == (2 if layout == "both" else 1) for m in where.values()), (layout, where)
    assert models["fused"] == ["ensemble", "ensemble_sync"]   # the second relays unary infer to the first
    assert models["ensemble"] == ["ensemble", "ensemble_sync", "llm", "lookup", "spec_step", "ssm_0", "ssm_1",
                                  "tree_builder"]
    assert models["both"] == sorted(models["ensemble"] + ["ensemble_fused"])
    assert not (tmp_path / "fused" / "step_cost.json").exists()   # the fused model measures its own at load
    with pytest.raises(SpecInferError, match="unknown repository layout 'fast'"):
        write_repository(served_pair["llm"], [close], tmp_path / "bad", layout="fast")


# --- sampling through the served models keeps the LLM's distribution ------------------------------
def transformers_first_two(checkpoint, prompt, params) -> np.ndarray:
    """The LLM's own law of its first two tokens, from transformers' logits (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().numpy()
        after = model(torch.tensor([prompt + [x] for x in range(TINY_VOCAB)])).logits[:, -1].double().numpy()
    return probabilities(first, params)[:, None] * probabilities(after, params)


def served_first_two(tiny_vocab, params, budget, trials=2000, prompt=(3, 1, 4), rule="mss") -> np.ndarray:
    """Counts of the first two tokens sampled through ssm_0, ssm_1 (drafting by sampling, tree
    3,2), tree_builder and llm, their trees and q as tensors between them."""
    (llm, a, b), _ = tiny_vocab
    call = local_call(VerifyModel(llm), [DraftModel(rt, i, "3,2") for i, rt in enumerate((a, b))])
    counts = np.zeros((TINY_VOCAB, TINY_VOCAB))
    for seed in range(trials):
        speculator = RemoteSpeculator(call, ["ssm_0", "ssm_1"], f"s{seed}", llm.max_context,
                                      replace(params, seed=seed), None, Stats(), rule=rule)
        out = [t for step in decode(speculator, list(prompt), 2, budget=budget) for t in step]
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("params,budget,rule", [(SamplingParams(temperature=1.0), 64, "mss"),
                                                (SamplingParams(temperature=0.8, top_k=6), 3, "mss"),
                                                (SamplingParams(temperature=1.0), 64, "traversal")],
                         ids=["free", "budget 3", "traversal"])
def test_served_sampling_keeps_the_llm_distribution(tiny_vocab, params, budget, rule):
    counts = served_first_two(tiny_vocab, params, budget, rule=rule)
    p = chi_square_p(counts, transformers_first_two(tiny_vocab[1][0], [3, 1, 4], params))
    assert p > 1e-3, f"first two tokens not distributed as the LLM's (chi-square p = {p:.2e})"


def test_a_wrong_q_on_the_wire_fails_the_same_test(tiny_vocab, monkeypatch):
    """The same test with every draft's q sent as uniform (not what the SSM drew from) fails."""
    right = serving_models.tree_to_tensors

    def uniform_q(tree, vocab_size):
        t = right(tree, vocab_size)
        return t | {"proposal_q": np.full_like(t["proposal_q"], 1.0 / vocab_size)}

    monkeypatch.setattr(serving_models, "tree_to_tensors", uniform_q)
    params = SamplingParams(temperature=1.0)
    counts = served_first_two(tiny_vocab, params, 64)
    assert chi_square_p(counts, transformers_first_two(tiny_vocab[1][0], [3, 1, 4], params)) < 1e-6


# --- the stateful models' own protection: only the orchestrator, and no sequence kept forever --------
def test_stateful_models_answer_only_the_orchestrator(served_pair):
    llm = OrtRuntime(served_pair["llm"])
    model = VerifyModel(llm, key="secret")
    start = {"op": np.array([b"start"], object), "sequence_id": np.array([b"s1"], object), "tokens": ids(1, 2, 3)}
    for key in (None, b"guess", b""):
        with pytest.raises(SpecInferError, match="internal to specinfer's orchestrator"):
            model.handle(start | ({} if key is None else {"caller_key": np.array([key], object)}))
    assert len(model.sequences) == 0 and llm.sequences() == []
    model.handle(start | {"caller_key": np.array([b"secret"], object)})   # what RemoteSpeculator sends
    assert len(model.sequences) == 1
    model.release("s1")


def test_idle_sequences_are_reclaimed(served_pair):
    ssm = OrtRuntime(served_pair["ssms"][0])
    model = DraftModel(ssm, 0, "2,1")
    model.start("forgotten", [1, 2, 3], SamplingParams())
    model.start("busy", [1, 2, 3], SamplingParams())
    time.sleep(0.05)
    model.step("busy", [], 4, SamplingParams(), 8)      # used just now
    assert model.reclaim(idle_seconds=0.03) == 1
    assert list(model.sequences.items) == ["busy"] and ssm.sequences() == ["busy"]
    with pytest.raises(SpecInferError, match="idle too long"):
        model.step("forgotten", [], 4, SamplingParams(), 8)
    assert model.reclaim(idle_seconds=60) == 0
    model.release("busy")


def test_the_rule_is_read_checked_and_sent_to_the_llm():
    assert read_request({"input_ids": ids(1, 2)}, 256).rule == "mss"
    assert read_request({"input_ids": ids(1, 2), "rule": np.array([b"traversal"], object)}, 256).rule == "traversal"
    with pytest.raises(SpecInferError, match="'rule' must be one of mss, traversal, naive, got 'best'$"):
        read_request({"input_ids": ids(1, 2), "rule": np.array([b"best"], object)}, 256)
    with pytest.raises(SpecInferError, match="'rule' must be one of mss, traversal, naive, got 1000 bytes$"):
        read_request({"input_ids": ids(1, 2), "rule": np.array([b"m" * 1000], object)}, 256)
    sent = {}
    speculator = RemoteSpeculator(lambda name, t: sent.setdefault(name, t), ["ssm_0"], "s", 256,
                                  SamplingParams(temperature=1.0), None, Stats(), rule="traversal", max_tokens=7)
    speculator.start([1, 2])
    # The llm model's sequence verifies with the rule it starts with, and reserves KV for max_tokens.
    assert sent["llm"]["rule"].tolist() == [b"traversal"] and sent["llm"]["max_tokens"].tolist() == [7]
    assert "rule" not in sent["ssm_0"] and "max_tokens" not in sent["ssm_0"]


def test_the_fused_metrics_update_their_gauges_when_a_sequence_starts_or_ends(models):
    """MeteredSpeculator: step time and accepted tokens every step; the gauges (sequences, KV) only
    on start and release, the only times they change, not on every streamed piece."""
    from specinfer.generate import LocalSpeculator
    from specinfer.serving.triton_glue import MeteredSpeculator
    llm, ssms, _, _ = models

    class Recorded:
        def __init__(self):
            self.values = []

        def observe(self, v):
            self.values.append(v)

    class FakeMetrics:
        step_seconds, accepted = Recorded(), Recorded()
        gauges = []

        def update(self, model):   # as glue.Metrics.update reads a model
            self.gauges.append((len(model.sequences), model.kv_bytes()))

    class Models:   # as the fused orchestrator's FusedModels, over the LLM alone
        @property
        def sequences(self):
            return llm.sequences()

        def kv_bytes(self):
            return sum(llm.kv_bytes(s) for s in llm.sequences())

    metrics = FakeMetrics()
    speculator = MeteredSpeculator(LocalSpeculator(llm, ssms[:1], TREE, SamplingParams()), metrics, Models())
    steps = [len(ids) for ids in decode(speculator, [1, 2, 3], 12)]
    assert len(metrics.accepted.values) == len(steps) == len(metrics.step_seconds.values)
    assert len(metrics.gauges) == 2 and metrics.gauges[0][0] == 1 and metrics.gauges[0][1] > 0
    assert metrics.gauges[1] == (0, 0)


def test_the_fused_step_time_is_the_steps_own_compute_not_the_wait_for_it():
    """A scheduler's step may have run ahead: what the request waited is not what the step cost."""
    from specinfer.generate import Stats
    from specinfer.serving.triton_glue import MeteredSpeculator

    class RanAhead:   # each step ran before it was asked for: 2 ms of drafting and 3 of LLM, then a wait
        max_context, stats = 64, Stats()

        def step(self, root, budget):
            time.sleep(0.05)
            self.stats.ssm_seconds += 0.002
            self.stats.llm_seconds += 0.003
            return [root], root + 1

    observed = {"step_seconds": [], "accepted": []}
    metrics = SimpleNamespace(**{name: SimpleNamespace(observe=values.append) for name, values in observed.items()})
    speculator = MeteredSpeculator(RanAhead(), metrics, None)
    assert speculator.step(5, 4) == ([5], 6) and speculator.step(6, 4) == ([6], 7)
    assert observed == {"step_seconds": pytest.approx([0.005, 0.005]), "accepted": [1, 1]}


def test_a_verification_that_raises_leaves_the_sequence_usable(served_pair, monkeypatch):
    """verify failing after the LLM scored the tree drops the tree's pending nodes: the sequence's
    next step (here the same tree again) verifies as in a run that never failed."""
    llm, ssm = OrtRuntime(served_pair["llm"]), OrtRuntime(served_pair["ssms"][0])
    verify_model, draft_model = VerifyModel(llm), DraftModel(ssm, 0, "2,1,1")
    params, prompt = SamplingParams(), [1, 5, 9, 13]

    def run(seq_id, fail_at=None):
        verify_model.start(seq_id, prompt[:-1], params)
        draft_model.start(seq_id, prompt[:-1], params)
        out, accepted, root = [], [], prompt[-1]
        try:
            for step in range(4):
                tree = tensors_to_tree(draft_model.step(seq_id, accepted, root, params, 8))
                if step == fail_at:
                    real = generate.verify

                    def broken(*args, **kwargs):
                        monkeypatch.setattr(generate, "verify", real)   # once
                        raise RuntimeError("verification failed")
                    monkeypatch.setattr(generate, "verify", broken)
                    with pytest.raises(RuntimeError, match="verification failed"):
                        verify_model.step(seq_id, tree)
                    assert llm._get(seq_id).pending == 0    # nothing left of the failed step's tree
                accepted, bonus = verify_model.step(seq_id, tree)
                out += accepted[1:] + [bonus]
                root = bonus
        finally:
            verify_model.release(seq_id)
            draft_model.release(seq_id)
        return out

    clean = run("clean")
    assert len(clean) >= 4
    assert run("faulty", fail_at=1) == clean
    assert llm.sequences() == [] and ssm.sequences() == []


@pytest.mark.parametrize("option, name", [("stream_interval", "stream interval"), ("metrics_seconds", "metrics interval")])
def test_a_negative_interval_is_refused_before_anything_is_written(tmp_path, option, name):
    with pytest.raises(SpecInferError, match=f"the {name} must be >= 0 seconds, got -1"):
        write_repository(tmp_path / "no-llm", [], tmp_path / "repo", **{option: -1})
    assert not (tmp_path / "repo").exists()
