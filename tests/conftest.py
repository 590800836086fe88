"""Tiny random checkpoints of each supported family, made with `transformers` and saved as HF folders."""
from __future__ import annotations

import logging
import os
import sysconfig
import tempfile
from pathlib import Path

import pytest

# Checkpoints given to the CLI are exported into this cache: keep it out of the user's home.
os.environ.setdefault("SPECINFER_CACHE", tempfile.mkdtemp(prefix="specinfer-cache-"))

# The tiny checkpoints' MatMuls run the native float16-weight kernel too (where it builds), however
# small: in this process it is the kernel the tests exercise, not its size threshold.
from specinfer.engines import native  # noqa: E402

native.MIN_WEIGHT_VALUES = 0

VOCAB = 320
BOS, EOS = 1, 2

# (family, transformers classes, config overrides): covers llama2, llama3 RoPE scaling, GQA,
# Mistral, Qwen2 attention bias, tied and untied embeddings.
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=500000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
}


def make_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE trained on a stdlib file: real merges, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    tok.train_from_iterator([corpus.read_text()], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(path: Path, family: str = "llama3", seed: int = 0, layers: int = 2,
                    hidden: int = 64, heads: int = 4, **overrides) -> Path:
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, vocab_size=VOCAB, max_position_embeddings=512,
                  bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    # Random init is too flat to make greedy choices robust; widen the logits.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0) if not kwargs.get("tie_word_embeddings") else \
            model.get_input_embeddings().weight.mul_(4.0)
        for p in model.parameters():   # float16 values, as a checkpoint saved in float16: the native MatMul runs
            p.copy_(p.half().float())
    path.mkdir(parents=True, exist_ok=True)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> checkpoint folder (made once per test session)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {f: make_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def exported(tmp_path_factory, checkpoints):
    """family -> exported ONNX folder (fp32, max context 256)."""
    from specinfer.export import export_model

    root = tmp_path_factory.mktemp("onnx")
    return {f: export_model(d, root / f, max_context=256, progress=False).out_dir for f, d in checkpoints.items()}


TINY_VOCAB = 8


@pytest.fixture(scope="session")
def tiny_vocab(tmp_path_factory):
    """An LLM and two unrelated SSMs over 8 tokens, so that p and q really differ: (runtimes, checkpoints)."""
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.export import export_model

    root = tmp_path_factory.mktemp("tiny_vocab")
    ckpts = [make_checkpoint(root / name, "llama2", seed=seed, vocab_size=TINY_VOCAB, hidden=32, eos_token_id=None)
             for name, seed in (("llm", 1), ("ssm_a", 2), ("ssm_b", 3))]
    runtimes = [OrtRuntime(export_model(c, root / f"{c.name}_onnx", max_context=32, progress=False).out_dir, threads=1)
                for c in ckpts]
    return runtimes, ckpts


@pytest.fixture
def trees_against_one_token_steps(monkeypatch):
    """The dynamic tree weighs its nodes against one-token steps, not against the LLM's chain runs
    (which on these tiny models no tree beats, so none would be drafted): for tests of what the
    trees do once drafted."""
    from specinfer import generate
    from specinfer.tree_sizing import TreeSizer, step_cost

    monkeypatch.setattr(generate, "tree_sizer", lambda llm, *drafters: TreeSizer(step_cost(llm)))


def prompt_and_tree_logits(runtime, prompt, tree, parents):
    """A new sequence's logits on ``runtime``: its prompt's (prefill), then a tree's after it
    (score); the sequence released."""
    seq = runtime.start()
    try:
        return runtime.prefill(seq, prompt), runtime.score(seq, tree, parents)
    finally:
        runtime.release(seq)


def chi_square_p(counts, expected_probs) -> float:
    """Chi-square p-value of observed counts against exact probabilities (rare cells pooled)."""
    import numpy as np
    from scipy.stats import chisquare

    mask = expected_probs.reshape(-1) * counts.sum() >= 5  # the usual validity rule for chi-square cells
    obs, exp = counts.reshape(-1), expected_probs.reshape(-1) * counts.sum()
    if (~mask).any():  # pool the rare cells into one (none at all if they cannot happen)
        rare_obs, rare_exp = obs[~mask].sum(), exp[~mask].sum()
        if rare_exp == 0:
            return 0.0 if rare_obs else chisquare(obs[mask], exp[mask] * obs[mask].sum() / exp[mask].sum()).pvalue
        obs, exp = np.append(obs[mask], rare_obs), np.append(exp[mask], rare_exp)
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served_pair(tmp_path_factory, checkpoints):
    """An LLM, an SSM made of its first layer (agrees often) and an unrelated SSM, exported (fp32)."""
    from specinfer.checkpoints import truncate_layers
    from specinfer.export import export_model

    root = tmp_path_factory.mktemp("served")
    llm = make_checkpoint(root / "llm", "llama3", seed=5, layers=4)
    close = truncate_layers(llm, root / "close", 1)
    export = lambda d, name: export_model(d, root / f"{name}_onnx", max_context=256, progress=False).out_dir
    return {"llm": export(llm, "llm"), "ssms": [export(close, "close"), export(checkpoints["qwen2"], "far")]}


_server_failure: list[str] = []   # why the session's tritonserver did not start, once it did not


@pytest.fixture(scope="session")
def _session_server(tmp_path_factory, served_pair):
    """The session's tritonserver, or the reason it could not start (with its log's tail)."""
    import importlib.util
    if importlib.util.find_spec("pytriton") is None and not __import__("shutil").which("tritonserver"):
        pytest.skip("no tritonserver here (pip install --no-deps nvidia-pytriton)")
    from specinfer.serving.repository import write_repository
    from specinfer.serving.server import TritonServer

    root = tmp_path_factory.mktemp("triton")
    # Metrics pushed as soon as the last push is done: tests read them while requests run.
    repo = write_repository(served_pair["llm"], served_pair["ssms"], root / "repo", tree="1,1,3,1,1,1", layout="both",
                            metrics_seconds=0.0)
    log = root / "server.log"
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=log)
    try:
        server.start(timeout=240)
    except Exception as e:  # noqa: BLE001 - reported once, by the first test that needs the server
        server.stop()
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no log)"
        yield f"tritonserver did not start: {e}\n--- the end of its log ---\n{tail}"
        return
    yield server
    server.stop()


@pytest.fixture
def triton_server(_session_server):
    """A real tritonserver on 127.0.0.1 serving a repository of `served_pair`, for the whole session.
    HTTP goes through the gateway (`http_url`); the administrative APIs need `admin_headers` (HTTP)
    or `grpc_admin_headers` (gRPC).
    If it cannot start, the first test that needs it fails with the server's log tail and the
    others are skipped, rather than every one of them erroring with the same start-up failure."""
    if isinstance(_session_server, str):
        if _server_failure:
            pytest.skip("tritonserver did not start (the first test that needed it failed with its log)")
        _server_failure.append(_session_server)
        pytest.fail(_session_server, pytrace=False)
    return _session_server
