"""Incremental generation through ONNX Runtime against `transformers`' own greedy `generate`."""
import numpy as np
import pytest
import torch

from conftest import FAMILIES, EOS
from specinfer.engines.onnxruntime import OrtRuntime
from specinfer.errors import SpecInferError
from specinfer.generate import Stats, generate_ids
from specinfer.sampling import SamplingParams

PROMPTS = [[1, 294, 72, 308], [1, 5], [1] + list(range(100, 140)), [1, 33, 33, 33, 33, 33, 200, 17]]


def hf_greedy(checkpoint, prompt, n):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(family, exported, checkpoints):
    rt = OrtRuntime(exported[family])
    for prompt in PROMPTS:
        ours = [t for step in generate_ids(rt, prompt, max_new_tokens=24, eos_ids=[EOS]) for t in step]
        assert ours == hf_greedy(checkpoints[family], prompt, 24), f"{family} {prompt}"
    assert rt.sequences() == []  # every sequence released


def test_sampling_is_seeded_and_honours_top_k(exported):
    rt = OrtRuntime(exported["llama2"])
    run = lambda seed, **kw: [t for s in generate_ids(rt, [1, 5, 6], max_new_tokens=30,
                                                       params=SamplingParams(temperature=1.0, seed=seed, **kw)) for t in s]
    assert run(3) == run(3)
    assert run(3) != run(4)
    # with top_k=1 sampling is greedy whatever the seed
    greedy = [t for s in generate_ids(rt, [1, 5, 6], max_new_tokens=30) for t in s]
    assert run(11, top_k=1) == greedy == run(12, top_k=1)


def test_stops_at_eos_and_reports(exported):
    rt = OrtRuntime(exported["qwen2"])
    free = [t for s in generate_ids(rt, [1, 9, 10], max_new_tokens=12) for t in s]
    eos = free[5]  # pretend the 6th token is the end of sequence
    stats = Stats()
    out = [t for s in generate_ids(rt, [1, 9, 10], max_new_tokens=12, eos_ids=[eos], stats=stats) for t in s]
    assert out == free[:free.index(eos) + 1] and stats.stop_reason == "eos"
    assert stats.new_tokens == len(out) and stats.steps == len(out) and stats.mean_tokens_per_step == 1.0


def test_capacity_stops_generation(exported):
    rt = OrtRuntime(exported["llama2"], max_context=20)
    stats = Stats()
    out = [t for s in generate_ids(rt, list(range(1, 15)), max_new_tokens=100, stats=stats) for t in s]
    assert len(out) == 20 - 14 + 1 and stats.stop_reason == "context capacity"


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "the prompt is empty"),
    (dict(prompt=list(range(300))), "the prompt has 300 tokens; the context holds 256"),
    (dict(max_new_tokens=0), "max tokens must be >= 1"),
])
def test_bad_requests(kwargs, message, exported):
    rt = OrtRuntime(exported["llama2"])
    args = dict(prompt=[1, 2, 3], max_new_tokens=5) | kwargs
    with pytest.raises(SpecInferError, match=message):
        next(generate_ids(rt, args.pop("prompt"), **args))


def test_sampling_params_are_checked():
    with pytest.raises(SpecInferError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(SpecInferError, match="top_p must be in"):
        SamplingParams(temperature=1, top_p=0)


def test_shaped_distribution():
    from specinfer.sampling import probabilities
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.allclose(probabilities(logits, SamplingParams(1.0)), [0.5, 0.3, 0.15, 0.05])
    assert np.allclose(probabilities(logits, SamplingParams(1.0, top_k=2)), [0.625, 0.375, 0, 0])
    assert np.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.75)), [0.625, 0.375, 0, 0])
    assert np.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.81)), [0.5, 0.3, 0.15, 0] / np.float64(0.95))
    assert probabilities(logits, SamplingParams(0.0)).tolist() == [1, 0, 0, 0]
