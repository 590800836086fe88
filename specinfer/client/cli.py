"""`specinfer client`: generate from a running deployment, or load it with the bench.

    specinfer client generate "def f(x):" --url localhost:8001 --protocol grpc --stream
    specinfer client bench --concurrency 1,4,16,32 --stream --max-tokens 64 --json bench.json

Two subcommands, so that no prompt (not even the word "bench") is taken for a command. Failures
raise :class:`~specinfer.errors.SpecInferError` (one line, exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import SpecInferError


def _connection_and_request(formatter) -> argparse.ArgumentParser:
    """The options both subcommands take: where the server is, and the request's parameters."""
    p = argparse.ArgumentParser(add_help=False, formatter_class=formatter)
    p.add_argument("--url", default=None, help="host:port (default localhost:8000 for http, localhost:8001 for grpc)")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http", help="how to reach the server")
    p.add_argument("--model", default="ensemble",
                   help="ensemble or ensemble_sync (every layout), ensemble_fused (where the repository's layout has it)")
    p.add_argument("--stream", action="store_true", help="stream the text as it is generated")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    g = p.add_argument_group("request parameters (unset: the server's default)")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (the server's default)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample within the smallest set of this much mass")
    g.add_argument("--seed", type=int, default=None, help="random seed of a sampled generation")
    g.add_argument("--end-id", type=int, default=None, help="stop token id (default: the model's EOS)")
    g.add_argument("--stop-word", dest="stop_words", action="append", default=None, help="stop text (repeat)")
    g.add_argument("--tree", default=None,
                   help="speculation tree: 'dynamic' or children per depth, e.g. '1,1,3,1' (default: the server's)")
    g.add_argument("--rule", choices=["mss", "traversal", "naive"], default=None,
                   help="verification under sampling (default: the server's, mss)")
    return p


def add_client_parser(subparsers, formatter=argparse.HelpFormatter) -> argparse.ArgumentParser:
    """Register ``client generate`` and ``client bench`` on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "client", help="generate from a Triton deployment (`client generate`), or load it (`client bench`)",
        description="Talk to a running specinfer Triton deployment.", formatter_class=formatter,
        epilog='examples: specinfer client generate "def f(x):" --protocol grpc --stream; '
               "specinfer client bench --concurrency 1,4,16 --stream --watch-pid PID")
    sub = p.add_subparsers(dest="client_command", required=True, metavar="{generate,bench}",
                           help="generate from one prompt, or load the deployment")
    common = _connection_and_request(formatter)
    g = sub.add_parser("generate", parents=[common], formatter_class=formatter, help="generate from one prompt",
                       description="Generate from one prompt and print the text.")
    g.add_argument("prompt", help="the prompt")
    g.add_argument("--include-input", action="store_true", help="non-streamed text starts with the prompt")
    g.add_argument("--stats", action="store_true", help="print tokens, steps and draft acceptance to stderr")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", parents=[common], formatter_class=formatter,
                       help="load the deployment: concurrency levels in turn, speculative and incremental decoding",
                       description="Load the deployment with concurrent clients, one concurrency level after "
                                   "another, each with speculative and incremental decoding (tree 'none'); "
                                   "report tokens/s, inter-token latency, TTFT and their ratios, check that "
                                   "greedy outputs agree everywhere (exit 2 if not), and watch server memory.")
    b.add_argument("--concurrency", type=_levels, default="1", metavar="N[,N...]",
                   help="concurrent clients; a list such as 1,4,16,32 runs each level in turn")
    b.add_argument("--contenders", type=_contenders, default="speculative,incremental",
                   metavar="NAME[,NAME]", help="speculative (the server's tree, or --tree) and/or incremental "
                                              "(tree 'none': no speculation)")
    b.add_argument("--requests", type=int, default=None,
                   help="requests per level and contender (default: max(16, 2 x concurrency); with only "
                        "--duration, as many as fit)")
    b.add_argument("--prompts", default=None, help="text file, prompts separated by blank lines (default: built-in)")
    b.add_argument("--json", default=None, help="also write the whole report (every request too) as JSON here")
    b.add_argument("--duration", type=float, default=None,
                   help="seconds per level and contender: start no request after them (default 600)")
    b.add_argument("--warmup", type=int, default=0, help="unmeasured requests before each contender's first level")
    b.add_argument("--rounds", type=int, default=1,
                   help="run the contenders this many times at each level, in alternating order (this machine's "
                        "speed drifts within minutes); report each one's median round")
    b.add_argument("--watch-pid", dest="watch_pids", type=int, action="append", default=None, metavar="PID",
                   help="sample the RSS of this process and its descendants (specinfer serve's or "
                        "tritonserver's pid) before, during and 3 s after the run (repeat)")
    b.add_argument("--details", action="store_true", help="also print each run's table of every metric")
    b.add_argument("--allow-remote", action="store_true", help="allow a server that is not on loopback")
    b.set_defaults(func=cmd_bench)
    return p


def _params(a) -> dict:
    return {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p,
            "seed": a.seed, "end_id": a.end_id, "stop_words": a.stop_words, "tree": a.tree, "rule": a.rule}


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


def _levels(text: str) -> list[int]:
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... (e.g. 1,4,16,32), got '{text}'") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got '{text}'")
    return list(dict.fromkeys(levels))


def _contenders(text: str) -> list[str]:
    from .bench import CONTENDERS

    names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names or any(n not in CONTENDERS for n in names):
        raise argparse.ArgumentTypeError(f"expected {' and/or '.join(CONTENDERS)}, got '{text}'")
    return names


def cmd_bench(a) -> None:
    from .bench import markdown, read_prompts, run_line, run_sweep, sweep_markdown

    if a.max_tokens < 1:
        raise SpecInferError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.requests is not None and a.requests < 1:
        raise SpecInferError(f"--requests must be >= 1, got {a.requests}")

    def progress(level: int, contender: str, run: dict) -> None:
        print(run_line(level, contender, run), flush=True)
        if a.details:
            print(markdown(run) + "\n", flush=True)

    report = run_sweep(a.url, a.protocol, a.model, levels=a.concurrency, contenders=a.contenders,
                       requests=a.requests, stream=a.stream, prompts=read_prompts(a.prompts) if a.prompts else None,
                       timeout=a.timeout, duration=a.duration, warmup=a.warmup, allow_remote=a.allow_remote,
                       watch_pids=a.watch_pids or (), rounds=a.rounds, progress=progress, **_params(a))
    print()
    print(sweep_markdown(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    for level in report["levels"]:
        for name, run in level["contenders"].items():
            for s in run.get("round_summaries") or [run["summary"]]:
                if s["requests"] and not s["ok"]:
                    first = next(iter(s["error_messages"]))
                    raise SpecInferError(f"all {s['requests']} requests failed ({name}, concurrency "
                                         f"{level['concurrency']}): {first}")
    outputs = report["outputs"]
    if outputs["checked"] and not outputs["identical"]:
        raise SpecInferError(f"greedy outputs differ: {outputs['mismatches']} of {outputs['compared']} outputs "
                             "are not the reference's (the same prompt's output of the incremental contender at "
                             "the lowest level); see --json for where")
