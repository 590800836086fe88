"""Training the demo models: the corpus split, the tokenizer, the training loop, boost-tuning."""
import json

import numpy as np
import pytest
import torch

from specinfer.training.corpus import TEST_EVERY, code_prompts, stdlib_corpus
from specinfer.training.train import EOS, TrainConfig, encode_files, fit, llama_config, random_windows, train_tokenizer

TINY = TrainConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                   vocab_size=300, seq_len=32, batch_size=8, steps=60, lr=1e-2, warmup=5,
                   checkpoint_every=10, eval_every=10**6)


def fake_stdlib(root):
    files = ["a.py", "b/c.py", "test/t.py", "idlelib/x.py", "encodings/cp1.py", "site-packages/p/q.py"]
    files += [f"m{i:02d}.py" for i in range(40)]
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text(f"# {f}\n\ndef f_{len(f)}(x):\n    return x\n")
    return root


def test_split_is_by_sorted_path_and_keeps_tests_out(tmp_path):
    c = stdlib_corpus(fake_stdlib(tmp_path))
    rel = lambda fs: [f.relative_to(tmp_path).as_posix() for f in fs]
    kept = sorted(rel(c.train) + rel(c.test))
    assert kept == sorted(["a.py", "b/c.py"] + [f"m{i:02d}.py" for i in range(40)])
    assert rel(c.test) == [kept[i] for i in range(TEST_EVERY - 1, len(kept), TEST_EVERY)]
    assert not set(rel(c.train)) & set(rel(c.test))
    assert rel(stdlib_corpus(tmp_path).test) == rel(c.test)  # deterministic


def test_real_stdlib_split_and_prompts():
    c = stdlib_corpus()
    assert len(c.train) > 300 and len(c.test) == (len(c.train) + len(c.test)) // TEST_EVERY
    assert not any("test" in f.parts or "idlelib" in f.parts for f in c.train + c.test)
    prompts = code_prompts(c.test, 50)
    assert len(prompts) == 50 and len(set(prompts)) == 50
    assert all(p.rstrip().split("\n")[-1].lstrip().startswith(("def ", "async def ")) for p in prompts)


def test_tokenizer_round_trips_code(tmp_path):
    texts = ["def f(x):\n    return x + 1  # über\n", "class A:\n\tpass\n"] * 20
    tok = train_tokenizer(texts, 300, tmp_path)
    assert tok.token_to_id(EOS) == 0
    sample = "def g(y):\n        return 'ünïcode' * y\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    stream = encode_files(tok, texts[:2])
    assert stream[-1] == 0 and (stream == 0).sum() == 2


def _tiny_model(seed=0):
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(TINY, max_positions=64))


def test_fit_learns_and_resumes_exactly(tmp_path):
    from specinfer.training.train import evaluate
    stream = np.tile(np.arange(1, 50, dtype=np.int32), 200)  # a pattern a 1-layer model can learn
    model = _tiny_model()
    before = evaluate(model, stream, TINY.seq_len)
    fit(model, random_windows(stream, TINY.batch_size, TINY.seq_len), TINY)
    assert evaluate(model, stream, TINY.seq_len) < 0.5 * before

    # interrupted after 35 steps (trainer state saved at 30), then resumed: the same weights as in one go
    batches = random_windows(stream, TINY.batch_size, TINY.seq_len)
    calls = []

    def interrupted(rng):
        calls.append(1)
        if len(calls) > 35:
            raise KeyboardInterrupt
        return batches(rng)
    with pytest.raises(KeyboardInterrupt):
        fit(_tiny_model(), interrupted, TINY, checkpoint_dir=tmp_path)
    resumed = _tiny_model(seed=1)  # another init: everything must come from the trainer state
    fit(resumed, random_windows(stream, TINY.batch_size, TINY.seq_len), TINY, checkpoint_dir=tmp_path)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_llm_continuations_are_the_llms_greedy_decoding():
    from specinfer.training.boost_tune import llm_continuations
    model = _tiny_model().eval()
    stream = np.arange(1, 250, dtype=np.int32)
    tokens, labels = llm_continuations(model, stream, 3, prompt_len=6, new_tokens=5, rng=np.random.default_rng(0))
    assert tokens.shape == labels.shape == (3, 11)
    for row, lab in zip(tokens, labels):
        x = torch.from_numpy(row[:6].astype(np.int64))[None]
        ref = model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert row.tolist() == ref[0].tolist()
        assert (lab[5:-1] == row[6:]).all()  # in the continuation, the label is the next token
        with torch.no_grad():
            assert lab.tolist() == model(torch.from_numpy(row.astype(np.int64))[None]).logits.argmax(-1)[0].tolist()


def test_sampled_continuations_keep_greedy_labels():
    """Sampled rows: the text is the LLM's sample (not its greedy decoding), the labels are still
    its greedy next tokens on that text, and the same seed gives the same samples."""
    from specinfer.training.boost_tune import llm_continuations
    model = _tiny_model().eval()
    stream = np.arange(1, 250, dtype=np.int32)
    args = (model, stream, 8, 6, 12)
    tokens, labels = llm_continuations(*args, rng=np.random.default_rng(1), temperature=1.0)
    again, _ = llm_continuations(*args, rng=np.random.default_rng(1), temperature=1.0)
    greedy, _ = llm_continuations(*args, rng=np.random.default_rng(1))
    assert (tokens == again).all()
    assert (tokens[:, :6] == greedy[:, :6]).all() and (tokens[:, 6:] != greedy[:, 6:]).any()
    with torch.no_grad():
        assert (labels == model(torch.from_numpy(tokens.astype(np.int64))).logits.argmax(-1).numpy()).all()


@pytest.mark.parametrize("threshold", [0.0, 1.01])
def test_boost_tuning_drops_the_prompts_ssm1_agrees_on(tmp_path, threshold):
    from specinfer.training.boost_tune import BoostConfig, boost_tune
    from specinfer.training.corpus import Corpus
    from specinfer.training.train import save_checkpoint

    corpus = stdlib_corpus()
    corpus = Corpus(corpus.root, corpus.train[:6], corpus.test[:2])
    tok = train_tokenizer(corpus.texts(corpus.train), 300, tmp_path / "tok")
    save_checkpoint(_tiny_model(), tmp_path / "llm", tmp_path / "tok")
    cfg = BoostConfig(num_ssms=3, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32, prompts=24,
                      sampled_prompts=8, test_prompts=4, prompt_len=8, new_tokens=8, steps=10, batch_size=4,
                      agree_threshold=threshold, tree_prompts=0)
    report = boost_tune(tmp_path / "llm", corpus, tmp_path / "ssms", cfg)
    assert tok.get_vocab_size() == 300
    ssms = report["ssms"]
    if threshold == 0.0:  # SSM 1 "agrees" with every prompt: nothing left for SSM 2
        assert len(ssms) == 1 and ssms[0]["dropped_prompts"] == 32
    else:  # agrees on none: every SSM trains on all prompts, greedy and sampled
        assert [s["train_prompts"] for s in ssms] == [32, 32, 32]
    for s in ssms:
        assert 0 <= s["agreement_held_out"] <= report["held_out_any_ssm_agrees"] <= 1
        config = json.loads((tmp_path / "ssms" / f"ssm{s['ssm']}" / "config.json").read_text())
        assert config["vocab_size"] == 300 and config["hidden_size"] == 16 and config.get("dtype", config.get("torch_dtype")) == "float16"
    assert json.loads((tmp_path / "ssms" / "boost_tuning.json").read_text())["ssms"] == ssms


def test_teacher_targets_are_the_llms_likeliest_tokens():
    from specinfer.training.distill import teacher_targets
    model = _tiny_model().eval()
    tokens = np.random.default_rng(0).integers(1, 300, (5, 9)).astype(np.int32)
    indices, probs = teacher_targets(model, tokens, 7, batch=2)
    assert indices.shape == probs.shape == (5, 9, 7)
    with torch.no_grad():
        p = torch.softmax(model(torch.from_numpy(tokens.astype(np.int64))).logits.float(), -1).numpy()
    assert np.allclose(np.take_along_axis(p, indices.astype(np.int64), -1), probs.astype(np.float32), atol=1e-3)
    assert (np.diff(probs.astype(np.float32), axis=-1) <= 0).all()   # likeliest first
    assert np.allclose(np.sort(p, -1)[..., ::-1][..., :7], probs.astype(np.float32), atol=1e-3)


def test_folding_the_draft_temperature_scales_the_logits_and_keeps_the_greedy_token():
    from specinfer.training.distill import fold_draft_temperature
    model = _tiny_model().eval()
    x = torch.from_numpy(np.random.default_rng(1).integers(1, 300, (2, 7)))
    with torch.no_grad():
        before = model(x).logits
        after = fold_draft_temperature(model, 1.5)(x).logits
    assert torch.allclose(after, 1.5 * before, rtol=1e-5, atol=1e-5)
    # drawn at 1.5x a temperature, the folded model has the law the unfolded one has at it
    assert torch.allclose(torch.softmax(after / (1.5 * 0.7), -1), torch.softmax(before / 0.7, -1), atol=1e-6)


def test_distillation_moves_the_ssms_law_toward_the_llms(tmp_path):
    """Soft targets: a tiny SSM fine-tuned on a tiny LLM's distributions overlaps the LLM's law
    (sum min(p, q) on held-out continuations) more than before, and the report and checkpoint are
    written."""
    import transformers

    from specinfer.training.corpus import Corpus
    from specinfer.export.draft_vocab import write_draft_vocab
    from specinfer.training.distill import DistillConfig, distill
    from specinfer.training.train import save_checkpoint

    corpus = stdlib_corpus()
    corpus = Corpus(corpus.root, corpus.train[:6], corpus.test[:2])
    train_tokenizer(corpus.texts(corpus.train), 300, tmp_path / "tok")
    llm = _tiny_model()
    with torch.no_grad():   # logits 10x: a peaked law that a random SSM does not overlap
        llm.model.norm.weight.mul_(10)
    save_checkpoint(llm, tmp_path / "llm", tmp_path / "tok", dtype="float32")
    torch.manual_seed(3)
    small = transformers.LlamaForCausalLM(llama_config(TrainConfig(
        hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, vocab_size=300), 64))
    save_checkpoint(small, tmp_path / "ssm", tmp_path / "tok", tokenizer=False)
    write_draft_vocab(tmp_path / "ssm", list(range(100)), "a test")
    cfg = DistillConfig(greedy_prompts=8, sampled_prompts=16, cool_prompts=8, prompt_len=8, new_tokens=8,
                        top_k=300, steps=80, batch_size=8, lr=1e-2, test_prompts=8)
    report = distill(tmp_path / "llm", tmp_path / "ssm", corpus, tmp_path / "out", cfg)
    before, after = report["held_out_before"], report["held_out_after"]
    assert after["T=1.0"] > before["T=1.0"] + 0.1 and after["T=0.7"] > before["T=0.7"]
    assert report["teacher_mass_kept"] == pytest.approx(1.0, abs=1e-2)   # top_k = the vocabulary
    assert json.loads((tmp_path / "out" / "distillation.json").read_text())["held_out_after"] == after
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == 16
    # the same SSM drafts from the same tokens
    assert (tmp_path / "out" / "draft_vocab.json").read_text() == (tmp_path / "ssm" / "draft_vocab.json").read_text()


def test_boost_tune_cli_takes_the_ssms_sizes_and_refuses_sizes_that_cannot_make_a_model(tmp_path, monkeypatch, capsys):
    from specinfer import cli
    from specinfer.training import boost_tune as bt

    (tmp_path / "tokenizer.json").write_text("{}")
    given = []
    monkeypatch.setattr(bt, "boost_tune", lambda llm, corpus, out, cfg: given.append(cfg))
    monkeypatch.setattr("specinfer.training.corpus.stdlib_corpus", lambda root=None: None)
    base = ["boost-tune", "--llm", str(tmp_path), "-o", str(tmp_path / "out")]
    assert cli.main(base + ["--hidden-size", "96", "--layers", "3", "--intermediate-size", "256",
                            "--heads", "6", "--kv-heads", "2"]) == 0
    (cfg,) = given
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads) == (96, 3, 256, 6, 2)
    assert cfg.steps == bt.BoostConfig().steps   # what was not given keeps the recipe's
    for bad in (["--hidden-size", "100", "--heads", "6"], ["--heads", "4", "--kv-heads", "3"], ["--layers", "0"]):
        assert cli.main(base + bad) == 2
        assert "an SSM's sizes" in capsys.readouterr().err
    assert len(given) == 1
