"""The embedded default models (trained here on the Python stdlib): small, correct, and useful."""
import subprocess
import sys

import torch

from specinfer.models import EMBEDDED_DIR, embedded_llm, embedded_prompts, embedded_sampling_ssms, embedded_ssms


def test_committed_size_and_layout():
    total = sum(f.stat().st_size for f in EMBEDDED_DIR.rglob("*") if f.is_file())
    assert total <= 32 * 2**20
    assert (embedded_llm() / "tokenizer.json").is_file() and len(embedded_ssms()) >= 2
    assert len(embedded_prompts()) >= 50
    for d in [embedded_llm(), *embedded_ssms(), *embedded_sampling_ssms()]:
        from safetensors import safe_open
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}


def test_llm_logits_match_transformers():
    import transformers
    from specinfer.model import load_model
    from specinfer.plugins.tree_attention import tree_mask_from_parents
    from specinfer.text import load_tokenizer

    ids = torch.tensor([load_tokenizer(embedded_llm()).encode(embedded_prompts()[0]).ids])
    ref = transformers.AutoModelForCausalLM.from_pretrained(embedded_llm(), dtype=torch.float32).eval()
    ours = load_model(embedded_llm())
    with torch.no_grad():
        expected = ref(ids).logits
        t = ids.shape[1]
        mask = torch.from_numpy(tree_mask_from_parents(list(range(-1, t - 1))))[None]
        c = ours.config
        empty = [torch.zeros(1, 0, c.num_kv_heads, c.head_dim)] * c.num_layers
        got, _, _ = ours(ids, torch.arange(t)[None], mask, empty, empty)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_speculative_equals_incremental_and_the_ssms_predict_the_llm():
    from specinfer.generate import Stats
    from specinfer.pipeline import Pipeline
    from specinfer.sampling import SamplingParams

    incremental = Pipeline(embedded_llm())
    speculative = Pipeline(embedded_llm(), ssms=embedded_ssms())
    stats = Stats()
    for prompt in embedded_prompts()[:3]:
        ids = incremental.encode(prompt)
        ref = [t for s in incremental.stream_ids(ids, 48) for t in s]
        assert [t for s in speculative.stream_ids(ids, 48, SamplingParams(), stats) for t in s] == ref
    # trained SSMs: well over one token per verification step (random ones give about 1)
    assert stats.mean_tokens_per_step > 2.0


def test_the_sampling_ssms_draws_are_accepted_more_often_than_the_greedy_ssms():
    """Drawn as the engine draws them (at DRAFT_TEMPERATURE_SCALE x the temperature), the distilled
    SSM's tokens are accepted with more probability (sum min(p, q)) than SSM 1's, on held-out code."""
    import transformers
    from specinfer.speculate import DRAFT_TEMPERATURE_SCALE
    from specinfer.text import load_tokenizer

    tok = load_tokenizer(embedded_llm())
    ids = torch.tensor([tok.encode(p).ids[:96] for p in embedded_prompts()[:8] if len(tok.encode(p).ids) >= 96])
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        p = torch.softmax(load(embedded_llm()).float()(ids).logits / 0.7, -1)
        accepted = [float(torch.minimum(p, torch.softmax(load(d).float()(ids).logits / (DRAFT_TEMPERATURE_SCALE * 0.7), -1))
                          .sum(-1).mean()) for d in (embedded_ssms()[0], embedded_sampling_ssms()[0])]
    assert len(ids) >= 4 and accepted[1] > accepted[0] + 0.05, accepted


def test_generate_works_straight_after_install():
    r = subprocess.run([sys.executable, "-m", "specinfer.cli", "generate", "def fibonacci(n):", "--max-tokens", "24",
                        "--stats"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the continuation (the prompt is not echoed)
    assert "tokens/step" in r.stderr  # speculative by default: the SSMs' statistics


def test_the_demo_shows_the_prompt_boundary_and_a_sampled_continuation(capsys):
    from specinfer.demo import main
    main(["--prompt", "def fibonacci(n):\n", "--max-tokens", "12"])
    out = capsys.readouterr().out
    greedy = out.split("== speculative, greedy ==\n")[1].split("\n-- ")[0]
    assert greedy.startswith("def fibonacci(n):\n\n>>> generated:\n") and len(greedy) > len("def fibonacci(n):\n\n>>> generated:\n")
    assert "== speculative, sampled at temperature 0.7 ==" in out
    assert "greedy speculative output identical to incremental on all 1 prompts" in out


def test_generate_on_a_terminal_dims_the_prompt():
    """On a terminal, the prompt comes first, dimmed, then the continuation; a pipe gets only the latter."""
    import os
    import pty
    main_fd, child_fd = pty.openpty()
    r = subprocess.run([sys.executable, "-m", "specinfer.cli", "generate", "def f(x):", "--max-tokens", "4"],
                       stdout=child_fd, stderr=subprocess.PIPE, timeout=900, env={k: v for k, v in os.environ.items()
                                                                                    if k != "NO_COLOR"})
    os.close(child_fd)
    out = os.read(main_fd, 65536).decode()
    os.close(main_fd)
    assert r.returncode == 0, r.stderr
    assert out.startswith("\x1b[2mdef f(x):\x1b[0m") and len(out.strip()) > len("\x1b[2mdef f(x):\x1b[0m")
