"""An SSM's draft vocabulary (specinfer/export/draft_vocab.py): made from text, carried by the export,
drafted from by every engine alike, and exact."""
import json
import shutil

import numpy as np
import pytest

from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.engines.runtime import Runtime
from specinfer.engines.torch_runtime import TorchRuntime
from specinfer.errors import SpecInferError
from specinfer.export import export_model
from specinfer.export.draft_vocab import (DRAFT_VOCAB, most_frequent, read_draft_vocab, token_counts,
                                          write_draft_vocab)

PROMPT = [1, 50, 51, 52, 53, 54, 55, 56]


@pytest.fixture(scope="module")
def with_vocab(tmp_path_factory, checkpoints, exported):
    """(checkpoint with a draft vocabulary, its export, the vocabulary): 120 of the 320 tokens,
    leaving out the tokens the whole-vocabulary drafter drafts after PROMPT, so that the two differ."""
    full = OrtRuntime(exported["llama3"])
    seq = full.start()
    full.prefill(seq, PROMPT)
    drafted = full.draft_chain(seq, [7, 8], full.draft_depth)
    left_out = set(drafted.tokens) | set(drafted.runner_up)
    rest = [t for t in range(full.vocab_size) if t not in left_out]
    vocab = sorted(np.random.default_rng(0).choice(rest, 120, replace=False).tolist())
    root = tmp_path_factory.mktemp("draft_vocab")
    ckpt = shutil.copytree(checkpoints["llama3"], root / "ckpt")
    write_draft_vocab(ckpt, vocab[::-1], "a test's pick")
    onnx_dir = export_model(ckpt, root / "onnx", max_context=256, progress=False).out_dir
    return ckpt, onnx_dir, np.array(vocab)


def test_the_most_frequent_tokens_of_a_text_make_the_vocabulary(tmp_path, checkpoints):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoints["llama3"] / "tokenizer.json"))
    texts = ["def f(x):\n    return x\n" * 3, "def g(y):\n    return y + 1\n"]
    counts = token_counts(tok, texts, 320)
    assert counts.sum() == sum(len(tok.encode(t).ids) for t in texts)
    top = most_frequent(counts, 5)
    assert all(counts[a] >= counts[b] for a, b in zip(top, top[1:])) and counts[top[-1]] >= np.sort(counts)[-5]
    write_draft_vocab(tmp_path, top, "two functions")
    assert read_draft_vocab(tmp_path, 320).tolist() == sorted(top)
    assert read_draft_vocab(tmp_path / "elsewhere", 320) is None
    with pytest.raises(SpecInferError, match="2..320 tokens"):
        most_frequent(counts, 1)


def test_a_truncated_checkpoint_keeps_its_sources_vocabulary(tmp_path, with_vocab):
    from specinfer.checkpoints import truncate_layers

    ckpt, _, vocab = with_vocab
    assert read_draft_vocab(truncate_layers(ckpt, tmp_path / "short", 1), 320).tolist() == vocab.tolist()


@pytest.mark.parametrize("content, problem", [
    ("[1, 2, 3]", "not a draft vocabulary"),
    ('{"token_ids": [1, 2, 2]}', "lists a token twice"),
    ('{"token_ids": [1, 400]}', "must lie in 0..319"),
    ('{"token_ids": [5]}', "at least 2 token ids"),
    ('{"token_ids": "1, 2"}', "a list of integer token ids"),
    ('{"token_ids": [1.5, 2]}', "a list of integer token ids"),
])
def test_a_bad_draft_vocabulary_is_refused_by_name(tmp_path, content, problem):
    (tmp_path / DRAFT_VOCAB).write_text(content)
    with pytest.raises(SpecInferError, match=problem) as e:
        read_draft_vocab(tmp_path, 320)
    assert DRAFT_VOCAB in str(e.value)


def test_a_later_drafter_step_runs_the_decoder_on_its_one_token_and_nothing_more(with_vocab, exported):
    """ONNX Runtime pays a few microseconds a kernel, so every unrolled step after the first holds
    only the decoder over its one token (no last-row Gathers), its top tokens and the token it
    feeds on: the token ids (from the draft vocabulary's positions too) and the greedy mass are
    computed once for all steps, greedy and sampled drafters alike."""
    import onnx

    from specinfer.export.ort_lowering import DRAFT_ONNX, SAMPLED_DRAFT_ONNX

    for folder in (exported["llama3"], with_vocab[1]):
        for name, picks in ((DRAFT_ONNX, ["TopK", "Gather"]), (SAMPLED_DRAFT_ONNX, ["TopK", "Add", "ArgMax",
                                                                                     "GatherElements", "Reshape"])):
            graph = onnx.load(folder / name, load_external_data=False).graph
            layers = sum(n.op_type == "GroupQueryAttention" for n in graph.node if n.name.startswith("step0/"))
            decoder = ["Gather", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "MatMul"]
            decoder += ["MatMul", "GroupQueryAttention", "MatMul", "SkipSimplifiedLayerNormalization", "MatMul",
                        "Split", "Sigmoid", "Mul", "Mul", "MatMul"] * layers
            decoder += ["SkipSimplifiedLayerNormalization"] * (layers - 1)   # later layers' input norms
            depth = OrtRuntime(folder).draft_depth
            for j in range(1, depth):
                ops = sorted(n.op_type for n in graph.node if n.name.startswith(f"step{j}/"))
                assert ops == sorted(decoder + ["Add", "Add"] + picks), (folder, name, j)
            assert sum(n.op_type == "ReduceSum" for n in graph.node) == (name == DRAFT_ONNX)


def test_the_export_carries_the_vocabulary_and_its_drafters_draft_from_it(with_vocab, exported):
    """The one-call drafters (greedy and sampled, cut, and batched for many sequences) draft only
    the vocabulary's tokens, exactly as the token-by-token draft does over the same logits within
    it, and differently from the same model drafting from every token."""
    ckpt, onnx_dir, vocab = with_vocab
    assert json.loads((onnx_dir / DRAFT_VOCAB).read_text())["source"] == "a test's pick"
    rt, full = OrtRuntime(onnx_dir), OrtRuntime(exported["llama3"])
    assert rt.draft_vocab.tolist() == vocab.tolist() and full.draft_vocab is None
    d = rt.draft_depth
    a, b, c = rt.start(), rt.start(), full.start()
    for runtime, seq in ((rt, a), (rt, b), (full, c)):
        runtime.prefill(seq, PROMPT)
    one_call = rt.draft_chain(a, [7, 8], d)
    by_token = Runtime.draft_chain(rt, b, [7, 8], d)
    assert one_call.tokens == by_token.tokens and one_call.runner_up == by_token.runner_up
    assert np.allclose(one_call.probability, by_token.probability, atol=1e-5)
    assert set(one_call.tokens + one_call.runner_up) <= set(vocab.tolist())
    assert one_call.tokens != full.draft_chain(c, [7, 8], d).tokens
    for runtime, seq in ((rt, a), (rt, b), (full, c)):
        runtime.commit(seq, [])

    k = rt.draft_candidates
    noise = (0.8 * np.random.default_rng(3).gumbel(size=(d, k))).astype(np.float32)
    sampled, by_token = rt.draft_chain(a, [7, 8], 3, noise), Runtime.draft_chain(rt, b, [7, 8], 3, noise)
    assert sampled.tokens == by_token.tokens
    assert all(set(c.tolist()) <= set(vocab.tolist()) and list(c) == list(t)
               for c, t in zip(sampled.candidates, by_token.candidates))
    rt.commit(a, [])
    rt.commit(b, [])
    together = rt.draft_chains([(a, [7, 8], 2, None), (b, [9], 2, None)])
    for seq, tokens, draft in zip((a, b), ([7, 8], [9]), together):
        rt.commit(seq, [])
        alone = Runtime.draft_chain(rt, seq, tokens, 2)
        assert draft.tokens[:2] == alone.tokens and draft.runner_up[:2] == alone.runner_up
        rt.commit(seq, [])


def test_every_engine_drafts_from_the_checkpoints_vocabulary(with_vocab):
    """The PyTorch engine reads the vocabulary from the checkpoint, and drafts what ONNX Runtime's
    drafter drafts from the export."""
    ckpt, onnx_dir, vocab = with_vocab
    torch_rt, ort_rt = TorchRuntime(ckpt), OrtRuntime(onnx_dir)
    assert torch_rt.draft_vocab.tolist() == vocab.tolist()
    drafts = []
    for rt in (torch_rt, ort_rt):
        seq = rt.start()
        rt.prefill(seq, PROMPT)
        drafts.append(rt.draft_chain(seq, [7, 8], 4).tokens[:4])
    assert drafts[0] == drafts[1]


def test_speculation_with_a_draft_vocabulary_stays_greedy_exact(with_vocab, exported):
    """Greedy speculative decoding with the SSM drafting from its vocabulary is the LLM's own greedy
    decoding, token for token."""
    from specinfer.generate import LocalSpeculator, Stats, decode

    _, onnx_dir, _ = with_vocab
    llm = OrtRuntime(exported["llama3"])
    ssm = OrtRuntime(onnx_dir)
    for prompt in (PROMPT, [1, 200, 17, 90]):
        plain = [t for ids in decode(LocalSpeculator(llm, [], tree=[]), prompt, 24, [2], 16, Stats()) for t in ids]
        stats = Stats()
        speculator = LocalSpeculator(llm, [ssm], tree=[1, 1, 1, 1], stats=stats)
        spec = [t for ids in decode(speculator, prompt, 24, [2], 16, stats) for t in ids]
        assert spec == plain
        assert stats.draft_tokens > 0


def test_the_cli_writes_a_checkpoints_vocabulary_from_a_corpus_folder(tmp_path, checkpoints, capsys):
    """`specinfer draft-vocab` counts the corpus's tokens with the given tokenizer and writes the most
    frequent into the checkpoint's folder; a corpus with no files is refused by name."""
    from tokenizers import Tokenizer

    from specinfer.cli import main

    ckpt = shutil.copytree(checkpoints["llama3"], tmp_path / "ssm", ignore=shutil.ignore_patterns("tokenizer*"))
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "pkg" / "a.py").write_text("import os\nprint(os.getcwd())\n" * 4)
    (corpus / "notes.txt").write_text("zzzz qqqq " * 50)   # not *.py: not counted
    assert main(["draft-vocab", str(ckpt), "--corpus", str(corpus), "--size", "4"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["draft-vocab", str(ckpt), "--tokenizer", str(checkpoints["llama3"]), "--corpus", str(corpus),
                 "--size", "4"]) == 0
    tok = Tokenizer.from_file(str(checkpoints["llama3"] / "tokenizer.json"))
    counts = token_counts(tok, [(corpus / "pkg" / "a.py").read_text()], 320)
    written = json.loads((ckpt / DRAFT_VOCAB).read_text())
    assert written["token_ids"] == most_frequent(counts, 4) and "1 files" in written["source"]
    assert main(["draft-vocab", str(ckpt), "--tokenizer", str(checkpoints["llama3"]), "--corpus",
                 str(tmp_path / "empty")]) == 2
    assert "is not a file or a folder" in capsys.readouterr().err
