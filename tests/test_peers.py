"""The peer contenders decode greedily: each one's output is our own incremental greedy output."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import EOS, make_checkpoint
from specinfer import peers
from specinfer.checkpoints import truncate_layers
from specinfer.engines.loader import load_runtime
from specinfer.generate import generate_ids

PROMPTS = [[1, 294, 72, 308], [1, 5], [1, 250, 3, 99]]
N = 16


def to_fp16(checkpoint):
    """Store the weights in fp16, as the committed checkpoints are; every contender runs them in fp32."""
    path = checkpoint / "model.safetensors"
    weights = {k: v.astype(np.float16) for k, v in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"dtype": "float16"}, indent=2))
    return checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """An LLM with untied embeddings (varied greedy output) and an SSM made of its first layer."""
    root = tmp_path_factory.mktemp("peers")
    llm = to_fp16(make_checkpoint(root / "llm", "llama3", seed=0, layers=2, tie_word_embeddings=False))
    return {"llm": llm, "ssm": truncate_layers(llm, root / "ssm", 1), "work": root / "ortgenai"}


@pytest.fixture(scope="module")
def ours(pair):
    """Our own incremental greedy decoding (no SSM) on the ONNX Runtime engine."""
    rt = load_runtime(pair["llm"], threads=1)
    return lambda prompt, eos=EOS: [t for step in generate_ids(rt, prompt, max_new_tokens=N, eos_ids=[eos])
                                    for t in step]


def contenders(pair, **kw):
    """name -> a call of each contender on the pair (onnxruntime-genai ones only when installed)."""
    llm, ssm, work = pair["llm"], pair["ssm"], pair["work"]
    runs = {"transformers greedy": lambda: peers.transformers_greedy(llm, PROMPTS, N, threads=1, **kw),
            "transformers assisted": lambda: peers.transformers_assisted(llm, ssm, PROMPTS, N, threads=1, **kw)}
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return runs
    runs["onnxruntime-genai greedy"] = lambda: peers.ortgenai_greedy(llm, PROMPTS, N, work_dir=work, threads=1, **kw)
    runs["onnxruntime-genai speculative"] = lambda: peers.ortgenai_speculative(
        llm, ssm, PROMPTS, N, work_dir=work, threads=1, **kw)
    return runs


def check(result, name, want):
    assert result.unavailable == "", result.unavailable
    assert result.name == name
    assert result.outputs == want
    assert result.new_tokens == sum(len(o) for o in want) and result.seconds > 0


def test_transformers_greedy_equals_ours(pair, ours):
    want = [ours(p) for p in PROMPTS]
    assert any(len(set(o)) > 4 for o in want)  # the models do not just repeat a token
    result = peers.transformers_greedy(pair["llm"], PROMPTS, N, threads=1)  # EOS from config.json
    check(result, "transformers greedy", want)
    assert result.tokens_per_step == []


def test_a_peer_process_runs_a_peer_as_this_process_would_and_starts_again_if_it_dies(pair, ours):
    """transformers in a process of its own (as the bench runs it): the same outputs, the process
    reused for the next call, a new one started after it was killed; only the peers it knows."""
    want = [ours(p) for p in PROMPTS]
    with peers.PeerProcess() as process:
        check(process.call("transformers_greedy", pair["llm"], PROMPTS, N, threads=1), "transformers greedy", want)
        first = process._process.pid
        check(process.call("transformers_greedy", pair["llm"], PROMPTS[:1], N, threads=1), "transformers greedy", want[:1])
        assert process._process.pid == first
        process._process.kill()
        process._process.wait()
        check(process.call("transformers_greedy", pair["llm"], PROMPTS[1:], N, threads=1), "transformers greedy", want[1:])
        assert process._process.pid != first
        with pytest.raises(ValueError, match="not one of the peers"):
            process.call("ortgenai_convert", pair["llm"])
    assert process._process.returncode == 0   # closed: it left its loop


def test_transformers_assisted_equals_greedy_and_uses_the_assistant(pair):
    want = peers.transformers_greedy(pair["llm"], PROMPTS, N, threads=1).outputs
    result = peers.transformers_assisted(pair["llm"], pair["ssm"], PROMPTS, N, threads=1)
    check(result, "transformers assisted", want)
    steps = result.tokens_per_step
    assert sum(steps) == result.new_tokens
    assert max(steps) > 1 and len(steps) < result.new_tokens  # drafts were accepted: the assistant ran


def test_ortgenai_greedy_equals_ours(pair, ours):
    pytest.importorskip("onnxruntime_genai")
    result = peers.ortgenai_greedy(pair["llm"], PROMPTS, N, work_dir=pair["work"], threads=1)
    check(result, "onnxruntime-genai greedy", [ours(p) for p in PROMPTS])
    assert result.tokens_per_step == []
    assert len([p for p in pair["work"].iterdir() if not p.name.startswith(".")]) == 1  # one cached conversion


def test_ortgenai_loads_its_model_once_for_many_calls(pair, ours):
    """As our Runtime is loaded once for a bench's prompts, so is the peer's model: one call per
    prompt (how the bench runs it) reuses it, and the outputs stay the model's own."""
    pytest.importorskip("onnxruntime_genai")
    peers._ortgenai_model.cache_clear()
    outputs = [peers.ortgenai_greedy(pair["llm"], [p], N, work_dir=pair["work"], threads=1).outputs[0] for p in PROMPTS]
    assert outputs == [ours(p) for p in PROMPTS]
    assert peers._ortgenai_model.cache_info().misses == 1


def test_ortgenai_speculative_equals_ours_and_reports_steps(pair, ours):
    pytest.importorskip("onnxruntime_genai")
    result = peers.ortgenai_speculative(pair["llm"], pair["ssm"], PROMPTS, N, work_dir=pair["work"], threads=1)
    check(result, "onnxruntime-genai speculative", [ours(p) for p in PROMPTS])
    steps = result.tokens_per_step
    assert sum(steps) == result.new_tokens
    assert max(steps) > 1 and len(steps) < result.new_tokens  # the draft model's tokens were accepted
    assert max(steps) <= 8 + 1  # draft_tokens=8 drafts and the target's own token
    # Chains of 8 drafted by the same SSM, verified greedily: transformers, told to draft the same
    # way (no confidence cut-off), accepts exactly as much at every step.
    hf = peers.transformers_assisted(pair["llm"], pair["ssm"], PROMPTS, N, threads=1, num_assistant_tokens=8,
                                     assistant_confidence_threshold=0)
    assert hf.tokens_per_step == steps


def test_every_contender_stops_after_eos_and_includes_it(pair, ours):
    # Pretend a token in the middle of a greedy output is the end of sequence (the ids differ per
    # prompt, so take one from the prompt whose output varies most).
    free = max((ours(p) for p in PROMPTS), key=lambda o: len(set(o)))
    eos = free[len(free) // 2]
    want = [ours(p, eos=eos) for p in PROMPTS]
    assert any(len(o) < N for o in want)
    for name, run in contenders(pair, eos_id=eos).items():
        result = run()
        assert result.unavailable == "", f"{name}: {result.unavailable}"
        assert result.outputs == want, name
        if result.tokens_per_step:
            assert sum(result.tokens_per_step) == result.new_tokens, name


def test_a_contender_that_cannot_run_says_why(tmp_path):
    missing = tmp_path / "nothing"
    result = peers.transformers_greedy(missing, PROMPTS, N)
    assert result.outputs is None and result.unavailable and result.new_tokens == 0
    pytest.importorskip("onnxruntime_genai")
    result = peers.ortgenai_greedy(missing, PROMPTS, N, work_dir=tmp_path / "work")
    assert result.outputs is None and result.unavailable.startswith("FileNotFoundError: no config.json")
    result = peers.ortgenai_speculative(missing, missing, PROMPTS, N, work_dir=tmp_path / "work", draft_tokens=17)
    assert "1 to 16" in result.unavailable
