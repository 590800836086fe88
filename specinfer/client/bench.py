"""`specinfer client bench`: load a deployment with N concurrent clients, M requests in all.

Each client is an :class:`~specinfer.client.AsyncClient` of its own (its own connection), run as
an asyncio task; prompts come round-robin from a file or :data:`DEFAULT_PROMPTS`. Per request:

- ``latency``: from sending the request to its last response;
- ``ttft`` (streaming): time to the first response with text;
- ``piece gaps`` (streaming): time between responses with text. A speculation step emits several
  tokens at once, so a piece usually holds several tokens;
- ``itl`` (streaming): inter-token latency, ``(latency - ttft) / (tokens - 1)``, as genai-perf counts;
- ``tokens``: generated tokens, the sum of the server's ``accepted_tokens_per_step`` (the tokens
  each step emitted), so no tokenizer is needed on the client.

Throughput is all successful requests' tokens over the wall time of the run. The bench is bounded:
M requests at most, none started after ``duration`` seconds, each limited by ``timeout``; and it
loads loopback servers only unless ``allow_remote``.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .client import DEFAULT_MODEL, AsyncClient
from .messages import ClientError, request_body, split_url

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main(argv):",
    "class TextWrapper:\n    def __init__(self, width=70):",
    "Speculative decoding lets a small model draft tokens that",
    "def wrap(text, width=70, **kwargs):",
    "# Sort a list of words by length, then alphabetically\n",
]


@dataclass
class Sample:
    """One request's measurements (seconds)."""

    prompt: int
    ok: bool = False
    latency_s: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""

    @property
    def itl_s(self) -> float | None:
        if self.ttft_s is None or self.tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.tokens - 1)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts separated by blank lines (as ``specinfer bench --prompts`` reads them)."""
    try:
        prompts = [p.strip("\n") for p in Path(path).read_text().split("\n\n") if p.strip()]
    except OSError as e:
        raise ClientError(f"cannot read prompts from {path}: {e.strerror}") from None
    if not prompts:
        raise ClientError(f"no prompts in {path}")
    return prompts


def check_loopback(host: str) -> None:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as e:
        raise ClientError(f"cannot resolve '{host}': {e}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ClientError(f"the bench loads loopback servers only; '{host}' is not one "
                          "(--allow-remote, or allow_remote=True, to override)")


async def _measure(client: AsyncClient, index: int, prompt: str, stream: bool, params: dict) -> Sample:
    sample = Sample(index)
    start = last = time.perf_counter()
    try:
        if stream:
            async for result in client.stream_results(prompt, **params):
                now = time.perf_counter()
                if result.text:
                    if sample.ttft_s is None:
                        sample.ttft_s = now - start
                    else:
                        sample.gaps_s.append(now - last)
                    last = now
                sample.tokens = result.tokens
        else:
            sample.tokens = (await client.generate(prompt, **params)).tokens
        sample.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is a measurement too
        sample.error = str(e) if isinstance(e, ClientError) else f"{type(e).__name__}: {e}"
    sample.latency_s = time.perf_counter() - start
    return sample


async def _run(clients: list[AsyncClient], prompts: list[str], requests: int, stream: bool, params: dict,
               duration: float, warmup: int) -> tuple[list[Sample], float]:
    for i in range(warmup):
        await _measure(clients[0], i, prompts[i % len(prompts)], stream, params)
    samples: list[Sample] = []
    counter = iter(range(requests))
    start = time.perf_counter()

    async def worker(client: AsyncClient) -> None:
        for i in counter:  # shared: each request index is taken by one worker
            if time.perf_counter() - start > duration:
                return
            samples.append(await _measure(client, i % len(prompts), prompts[i % len(prompts)], stream, params))

    await asyncio.gather(*(worker(c) for c in clients))
    return samples, time.perf_counter() - start


def _stats(values: list[float], scale: float = 1.0) -> dict | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples), "ok": len(ok), "errors": len(samples) - len(ok),
        "error_messages": dict(Counter(s.error for s in samples if not s.ok)),
        "wall_s": wall_s, "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_ms": _stats([s.ttft_s for s in ok if s.ttft_s is not None], 1e3),
        "itl_ms": _stats([s.itl_s for s in ok if s.itl_s is not None], 1e3),
        "piece_gap_ms": _stats([g for s in ok for g in s.gaps_s], 1e3),
        "latency_ms": _stats([s.latency_s for s in ok], 1e3),
        "tokens_per_request": _stats([s.tokens for s in ok]),
        "request_tokens_per_s": _stats([s.tokens / s.latency_s for s in ok if s.latency_s > 0]),
    }


def run_bench(url: str | None = None, protocol: str = "http", model: str = DEFAULT_MODEL, *, concurrency: int = 1,
              requests: int = 16, stream: bool = False, prompts: list[str] | None = None, timeout: float = 300.0,
              duration: float = 600.0, warmup: int = 0, allow_remote: bool = False, **params) -> dict:
    """Run the bench; return ``{"config", "summary", "samples"}`` (JSON-ready). ``params``: request
    parameters of :meth:`Client.generate` (``max_tokens``, ``temperature``, ...)."""
    if concurrency < 1 or requests < 1:
        raise ClientError(f"concurrency and requests must be >= 1, got {concurrency} and {requests}")
    request_body("", stream, **params)  # a misspelt parameter fails here, not in every request
    host, port = split_url(url, protocol)
    if not allow_remote:
        check_loopback(host)
    prompts = prompts or DEFAULT_PROMPTS

    async def main() -> tuple[list[Sample], float]:
        clients = [AsyncClient(f"{host}:{port}", protocol, model, timeout) for _ in range(min(concurrency, requests))]
        try:
            return await _run(clients, prompts, requests, stream, params, duration, warmup)
        finally:
            for c in clients:
                await c.close()

    samples, wall_s = asyncio.run(main())
    config = {"url": f"{host}:{port}", "protocol": protocol, "model": model, "concurrency": concurrency,
              "requests": requests, "stream": stream, "prompts": len(prompts), "warmup": warmup, "params": params}
    return {"config": config, "summary": summarize(samples, wall_s),
            "samples": [asdict(s) | {"itl_s": s.itl_s} for s in samples]}


def markdown(report: dict) -> str:
    """The summary as a markdown table and a line of totals."""
    s = report["summary"]
    rows = [("TTFT (ms)", "ttft_ms"), ("inter-token latency (ms)", "itl_ms"),
            ("gap between pieces (ms)", "piece_gap_ms"), ("request latency (ms)", "latency_ms"),
            ("output tokens", "tokens_per_request"), ("tokens/s per request", "request_tokens_per_s")]
    lines = ["| metric | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for label, key in rows:
        stats = s[key]
        cells = [f"{stats[k]:.1f}" for k in ("mean", "p50", "p90", "p99")] if stats else ["-"] * 4
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    c = report["config"]
    lines.append(f"\n{s['ok']} of {s['requests']} requests ok, {s['errors']} errors; {c['protocol']} "
                 f"{c['model']}{' streaming' if c['stream'] else ''}, concurrency {c['concurrency']}: "
                 f"{s['tokens']} tokens in {s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s, "
                 f"{s['requests_per_s']:.2f} requests/s")
    for message, count in s["error_messages"].items():
        lines.append(f"error ({count}x): {message}")
    return "\n".join(lines)
