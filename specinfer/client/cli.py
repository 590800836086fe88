"""`specinfer client`: generate from a running deployment, or load it with the bench.

    specinfer client "def f(x):" --url localhost:8001 --protocol grpc --stream
    specinfer client bench --concurrency 8 --requests 64 --stream --json bench.json

``client`` takes one positional word: the prompt, or ``bench``. The bench's options are refused
without it. Failures raise :class:`~specinfer.errors.SpecInferError` (one line, exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import SpecInferError

BENCH_OPTIONS = ("concurrency", "requests", "prompts", "json", "duration", "warmup", "allow_remote")


def add_client_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``client`` (and ``client bench``) on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "client", help="generate from a Triton deployment, or load it (`client bench`)",
        description="Generate from a running specinfer Triton deployment; "
                    "`specinfer client bench ...` runs the load bench.",
        epilog='examples: specinfer client "def f(x):" --protocol grpc --stream; '
               "specinfer client bench --concurrency 8 --requests 64 --stream")
    p.add_argument("prompt", help='the prompt, or "bench" for the load bench')
    p.add_argument("--url", default=None, help="host:port (default localhost:8000 for http, localhost:8001 for grpc)")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http", help="how to reach the server")
    p.add_argument("--model", default="ensemble", help="ensemble (default), ensemble_fused or ensemble_sync")
    p.add_argument("--stream", action="store_true", help="stream the text as it is generated")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    g = p.add_argument_group("request parameters (unset: the server's default)")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (the server's default)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample within the smallest set of this much mass")
    g.add_argument("--seed", type=int, default=None, help="random seed of a sampled generation")
    g.add_argument("--end-id", type=int, default=None, help="stop token id (default: the model's EOS)")
    g.add_argument("--stop-word", dest="stop_words", action="append", default=None, help="stop text (repeat)")
    g.add_argument("--tree", default=None,
                   help="speculation tree: 'dynamic' or children per depth, e.g. '1,1,3,1' (default: the server's)")
    g = p.add_argument_group("generation")
    g.add_argument("--include-input", action="store_true", help="non-streamed text starts with the prompt")
    g.add_argument("--stats", action="store_true", help="print tokens, steps and draft acceptance to stderr")
    g = p.add_argument_group("bench (specinfer client bench ...)")
    g.add_argument("--concurrency", type=int, default=None, help="concurrent clients (default 1)")
    g.add_argument("--requests", type=int, default=None, help="requests in all (default 16)")
    g.add_argument("--prompts", default=None, help="text file, prompts separated by blank lines (default: built-in)")
    g.add_argument("--json", default=None, help="also write the report as JSON here")
    g.add_argument("--duration", type=float, default=None,
                   help="start no request after this many seconds (default 600)")
    g.add_argument("--warmup", type=int, default=None, help="unmeasured requests first (default 0)")
    g.add_argument("--allow-remote", action="store_true", default=None, help="allow a server that is not on loopback")
    p.set_defaults(func=cmd_client)
    return p


def _params(a) -> dict:
    return {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p,
            "seed": a.seed, "end_id": a.end_id, "stop_words": a.stop_words, "tree": a.tree}


def cmd_client(a) -> None:
    if a.prompt == "bench":
        return cmd_bench(a)
    used = [f"--{name.replace('_', '-')}" for name in BENCH_OPTIONS if getattr(a, name) is not None]
    if used:
        raise SpecInferError(f"{', '.join(used)}: only for `specinfer client bench`")
    cmd_generate(a)


def cmd_generate(a) -> None:
    from .client import Client

    if a.max_tokens < 1:
        raise SpecInferError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    start = time.perf_counter()
    with Client(a.url, a.protocol, a.model, a.timeout) as client:
        if a.stream:
            result = None
            for result in client.stream_results(a.prompt, **_params(a)):
                sys.stdout.write(result.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            result = client.generate(a.prompt, include_input=a.include_input, **_params(a))
            print(result.text)
    if a.stats and result is not None:
        seconds, steps = time.perf_counter() - start, len(result.accepted_tokens_per_step)
        print(f"{result.tokens} tokens in {seconds:.2f} s ({result.tokens / seconds:.1f} tokens/s), {steps} steps, "
              f"{result.tokens / max(steps, 1):.2f} tokens/step, {result.total_accepted_draft_tokens} of "
              f"{result.total_draft_tokens} draft tokens accepted", file=sys.stderr)


def cmd_bench(a) -> None:
    from .bench import markdown, read_prompts, run_bench

    if a.max_tokens < 1:
        raise SpecInferError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    report = run_bench(a.url, a.protocol, a.model, concurrency=1 if a.concurrency is None else a.concurrency,
                       requests=16 if a.requests is None else a.requests,
                       stream=a.stream, prompts=read_prompts(a.prompts) if a.prompts else None, timeout=a.timeout,
                       duration=600.0 if a.duration is None else a.duration, warmup=a.warmup or 0,
                       allow_remote=bool(a.allow_remote), **_params(a))
    summary = report["summary"]
    if summary["requests"] and not summary["ok"]:
        first = next(iter(summary["error_messages"]))
        raise SpecInferError(f"all {summary['requests']} requests failed: {first}")
    print(markdown(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
