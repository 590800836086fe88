"""`make demo`: the whole path on the embedded default, ONNX Runtime on CPU.

The embedded models (trained here on the Python standard library: a 12.6M-parameter LLM, the first
of its boost-tuned SSMs, and that SSM distilled for sampled requests) -> ONNX export with the
TreeAttention op (once, cached) -> ONNX Runtime -> incremental and speculative generation of
held-out prompts -> the same text, faster, with the speed and acceptance statistics of each.
"""
from __future__ import annotations

import argparse
import os
import sys

from .generate import Stats
from .models import embedded_llm, embedded_prompts, embedded_sampling_ssms, embedded_ssms
from .sampling import SamplingParams
from .text import shown_prompt


def main(argv: list[str] | None = None) -> None:
    from .pipeline import Pipeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt (repeat); default: 'def fibonacci(n):' and two held-out stdlib prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args(argv)

    prompts = a.prompt or ["def fibonacci(n):\n"] + embedded_prompts()[:2]
    # The defaults of `specinfer generate`: the dynamic tree, SSM 1 and lookup for greedy requests,
    # the distilled SSM 1 for sampled ones.
    runs = {"incremental": Pipeline(embedded_llm(), lookup=False),
            "speculative": Pipeline(embedded_llm(), ssms=embedded_ssms()[:1], sampling_ssms=embedded_sampling_ssms())}
    totals = {name: Stats() for name in runs}
    for prompt in prompts:
        texts = {}
        for name, pipe in runs.items():
            stats = Stats()
            texts[name] = _show(f"{name}, greedy", prompt, pipe.stream(prompt, a.max_tokens, SamplingParams(), stats))
            print(f"-- {stats.summary()}")
            for field in ("new_tokens", "total_seconds", "ssm_seconds", "llm_seconds"):
                setattr(totals[name], field, getattr(totals[name], field) + getattr(stats, field))
            totals[name].tokens_per_step += stats.tokens_per_step
        if texts["incremental"] != texts["speculative"]:
            raise SystemExit("speculative output differs from incremental decoding: this is a bug")
    # A 12M model's greedy text soon repeats itself; sampling shows what else it writes, with the
    # same pipeline, drafting with the distilled SSM (distributed exactly as the LLM's own sampling,
    # not equal to it token for token).
    stats, sampled = Stats(), SamplingParams(temperature=0.7, seed=0)
    _show("speculative, sampled at temperature 0.7", prompts[0], runs["speculative"].stream(prompts[0], a.max_tokens,
                                                                                          sampled, stats))
    print(f"-- {stats.summary()}")
    inc, spec = totals["incremental"], totals["speculative"]
    print(f"\ngreedy speculative output identical to incremental on all {len(prompts)} prompts; "
          f"{spec.tokens_per_second:.0f} vs {inc.tokens_per_second:.0f} tokens/s "
          f"({spec.tokens_per_second / inc.tokens_per_second:.2f}x), "
          f"{spec.mean_tokens_per_step:.2f} tokens per verification step")


def _show(title: str, prompt: str, pieces) -> str:
    """Print the prompt (dimmed on a terminal; after a '>>>' rule elsewhere), then stream its
    continuation; return the continuation."""
    print(f"\n== {title} ==")
    if not sys.stdout.isatty() or os.environ.get("NO_COLOR"):
        print(f"{prompt}\n>>> generated:")
    else:
        print(shown_prompt(prompt, sys.stdout), end="")
    text = "".join(print(piece, end="", flush=True) or piece for piece in pieces)
    print()
    return text


if __name__ == "__main__":
    main()
