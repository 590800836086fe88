"""`specinfer client bench`: load a deployment with concurrent clients, sweeping concurrency levels
and comparing speculative with incremental decoding in one run.

:func:`run_sweep` runs every concurrency level in turn and, at each level, every contender:
``speculative`` (the server's default tree, or the ``tree`` parameter) and ``incremental`` (the
request input ``tree="none"``: no speculation, one token per step). :func:`run_bench` is one such
run: N concurrent clients, M requests. Each client has a connection of its own and runs as an
asyncio task; prompts come round-robin from a file or :data:`DEFAULT_PROMPTS`, so every level and
every contender sends the same prompts.

Per request:

- ``latency``: from sending the request to its last response;
- ``ttft`` (streaming): time to the first response with tokens;
- ``piece gaps`` (streaming): time between responses with tokens. A speculation step emits several
  tokens at once, so a piece usually holds several tokens;
- ``token itl`` (streaming): per-token inter-token latency. A piece of ``k`` tokens that arrives
  ``g`` seconds after the previous piece gives ``k`` samples of ``g / k``; the first piece's tokens
  arrive at the TTFT and give none. A request of pieces ``k0, k1, ...`` thus gives
  ``k1 + k2 + ...`` samples summing to ``latency_to_last_piece - ttft``. Percentiles are over all
  tokens of all successful requests (each token weighs the same), see :func:`token_gaps`;
- ``itl`` (streaming): genai-perf's inter-token latency, ``(latency - ttft) / (tokens - 1)``, one
  value per request;
- ``tokens``: generated tokens, the ``output_ids`` the server returned (every streamed piece's
  ids); without them, the sum of the server's ``accepted_tokens_per_step``;
- ``output_ids``: kept to check that the outputs agree: under greedy decoding the same prompt must
  give the same ids at every level and for both contenders (:func:`compare_outputs`).

Throughput is all successful requests' tokens over the wall time of the run. The bench is bounded:
M requests at most, none started after ``duration`` seconds, each limited by ``timeout``; and it
loads loopback servers only unless ``allow_remote``. ``watch_pids``: the resident memory of these
processes and all their descendants is sampled before, during (every ``memory_interval`` s, the
peak kept) and ``memory_settle`` s after the sweep (:class:`MemorySampler`).
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence

import numpy as np

from ..rounds import median_ratio, median_round
from .client import DEFAULT_MODEL
from .grpc import AsyncGrpcTransport
from .http import AsyncHttpTransport
from .messages import ClientError, request_body, split_url

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main(argv):",
    "class TextWrapper:\n    def __init__(self, width=70):",
    "Speculative decoding lets a small model draft tokens that",
    "def wrap(text, width=70, **kwargs):",
    "# Sort a list of words by length, then alphabetically\n",
]
CONTENDERS = ("speculative", "incremental")
INCREMENTAL_TREE = "none"     # the request input `tree` of no speculation
MAX_REQUESTS = 100_000        # the bound of a run limited by its duration only


def default_requests(concurrency: int) -> int:
    """Requests per level when none are given: every client sends two at least."""
    return max(16, 2 * concurrency)


@dataclass
class Sample:
    """One request's measurements (seconds)."""

    prompt: int
    ok: bool = False
    latency_s: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)        # before each piece but the first
    piece_tokens: list[int] = field(default_factory=list)    # tokens of each piece, the first one's too
    tokens: int = 0
    output_ids: list[int] | None = None                      # None: the server sent none
    error: str = ""

    @property
    def itl_s(self) -> float | None:
        """genai-perf's inter-token latency of this request."""
        if self.ttft_s is None or self.tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.tokens - 1)

    @property
    def token_gaps_s(self) -> list[float]:
        return token_gaps(self.gaps_s, self.piece_tokens)


def token_gaps(gaps_s: Sequence[float], piece_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies of one streamed request: ``gaps_s[i]`` is the time before
    piece ``i + 1``, which holds ``piece_tokens[i + 1]`` = k tokens; each gives k samples of
    ``gap / k``. The first piece's tokens (at the TTFT) give none."""
    if len(piece_tokens) != len(gaps_s) + 1 and (gaps_s or piece_tokens):
        raise ValueError(f"{len(gaps_s)} gaps for {len(piece_tokens)} pieces (expected one gap fewer)")
    out: list[float] = []
    for gap, k in zip(gaps_s, piece_tokens[1:]):
        out += [gap / k] * k if k > 0 else []
    return out


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


def _transport(host: str, port: int, protocol: str, timeout: float):
    return (AsyncHttpTransport if protocol == "http" else AsyncGrpcTransport)(host, port, timeout)


# --- one run ------------------------------------------------------------------------------------------
async def _measure(transport, model: str, index: int, prompt: str, stream: bool, params: dict) -> Sample:
    sample = Sample(index)
    start = last = time.perf_counter()
    stats_tokens = 0
    try:
        async for outputs in transport.responses(model, request_body(prompt, stream, **params)):
            now = time.perf_counter()
            ids = outputs.get("output_ids")
            if ids is not None:
                sample.output_ids = (sample.output_ids or []) + ids
            k = len(ids) if ids is not None else int(bool(outputs.get("text_output")))
            if stream and k:
                if sample.ttft_s is None:
                    sample.ttft_s = now - start
                else:
                    sample.gaps_s.append(now - last)
                sample.piece_tokens.append(k)
                last = now
            stats_tokens = sum(outputs.get("accepted_tokens_per_step") or []) or stats_tokens
        sample.tokens = len(sample.output_ids) if sample.output_ids is not None else stats_tokens
        sample.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is a measurement too
        sample.error = str(e) if isinstance(e, ClientError) else f"{type(e).__name__}: {e}"
    sample.latency_s = time.perf_counter() - start
    return sample


async def _run(transports: list, model: str, prompts: list[str], requests: int, stream: bool, params: dict,
               duration: float, warmup: int) -> tuple[list[Sample], float]:
    for i in range(warmup):
        await _measure(transports[0], model, i, prompts[i % len(prompts)], stream, params)
    samples: list[Sample] = []
    counter = iter(range(requests))
    start = time.perf_counter()

    async def worker(transport) -> None:
        for i in counter:  # shared: each request index is taken by one worker
            if time.perf_counter() - start > duration:
                return
            samples.append(await _measure(transport, model, i % len(prompts), prompts[i % len(prompts)], stream,
                                          params))

    await asyncio.gather(*(worker(t) for t in transports))
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
        "token_itl_ms": _stats([g for s in ok for g in s.token_gaps_s], 1e3),
        "itl_ms": _stats([s.itl_s for s in ok if s.itl_s is not None], 1e3),
        "piece_gap_ms": _stats([g for s in ok for g in s.gaps_s], 1e3),
        "tokens_per_piece": _stats([k for s in ok for k in s.piece_tokens]),
        "latency_ms": _stats([s.latency_s for s in ok], 1e3),
        "tokens_per_request": _stats([s.tokens for s in ok]),
        "request_tokens_per_s": _stats([s.tokens / s.latency_s for s in ok if s.latency_s > 0]),
    }


def _check(concurrency: int, requests: int, stream: bool, params: dict, allow_remote: bool,
           url: str | None, protocol: str) -> tuple[str, int]:
    if concurrency < 1 or requests < 1:
        raise ClientError(f"concurrency and requests must be >= 1, got {concurrency} and {requests}")
    request_body("", stream, **params)  # a misspelt parameter fails here, not in every request
    host, port = split_url(url, protocol)
    if not allow_remote:
        check_loopback(host)
    return host, port


def _bench(host: str, port: int, protocol: str, model: str, concurrency: int, requests: int, stream: bool,
           prompts: list[str], timeout: float, duration: float, warmup: int, params: dict) -> dict:
    async def main() -> tuple[list[Sample], float]:
        transports = [_transport(host, port, protocol, timeout) for _ in range(min(concurrency, requests))]
        try:
            return await _run(transports, model, prompts, requests, stream, params, duration, warmup)
        finally:
            for t in transports:
                await t.close()

    samples, wall_s = asyncio.run(main())
    return {"summary": summarize(samples, wall_s),
            "samples": [asdict(s) | {"itl_s": s.itl_s} for s in samples]}


def run_bench(url: str | None = None, protocol: str = "http", model: str = DEFAULT_MODEL, *, concurrency: int = 1,
              requests: int = 16, stream: bool = False, prompts: list[str] | None = None, timeout: float = 300.0,
              duration: float = 600.0, warmup: int = 0, allow_remote: bool = False, **params) -> dict:
    """One run; return ``{"config", "summary", "samples"}`` (JSON-ready). ``params``: request
    parameters of :meth:`Client.generate` (``max_tokens``, ``temperature``, ``tree``, ...)."""
    host, port = _check(concurrency, requests, stream, params, allow_remote, url, protocol)
    prompts = prompts or DEFAULT_PROMPTS
    report = _bench(host, port, protocol, model, concurrency, requests, stream, prompts, timeout, duration, warmup,
                    params)
    config = {"url": f"{host}:{port}", "protocol": protocol, "model": model, "concurrency": concurrency,
              "requests": requests, "stream": stream, "prompts": len(prompts), "warmup": warmup, "params": params}
    return {"config": config} | report


# --- server memory ------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (/proc/<pid>/task/*/children; a scan of /proc where the kernel lacks it)."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        files = [t / "children" for t in tasks.iterdir()]
    except OSError:
        return []
    if files and files[0].exists():
        out = []
        for f in files:
            try:
                out += [int(c) for c in f.read_text().split()]
            except OSError:
                pass  # the thread ended
        return out
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (those alive now)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in seen and Path(f"/proc/{p}").exists():
            seen.append(p)
            todo += _children(p)
    return seen


def rss_bytes(pid: int) -> int:
    """VmRSS of one process (0 if it is gone, or a kernel thread)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tree_rss(pids: Sequence[int]) -> tuple[int, list[int]]:
    """Summed RSS in bytes of ``pids`` and all their descendants (each process counted once, shared
    pages once per process that maps them), and the processes summed."""
    procs = sorted({p for pid in pids for p in process_tree(pid)})
    return sum(rss_bytes(p) for p in procs), procs


class MemorySampler:
    """Samples :func:`tree_rss` of ``pids`` in a thread every ``interval`` s between :meth:`start`
    and :meth:`stop`; :meth:`sample` takes one now. ``samples``: (perf_counter time, MB) pairs."""

    def __init__(self, pids: Sequence[int], interval: float = 0.5):
        missing = [p for p in pids if not Path(f"/proc/{p}/status").exists()]
        if missing:
            raise ClientError(f"no process {', '.join(map(str, missing))} to watch (a pid of this machine)")
        self.pids, self.interval = list(pids), interval
        self.samples: list[tuple[float, float]] = []
        self.processes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> float:
        rss, procs = tree_rss(self.pids)
        self.processes = max(self.processes, len(procs))
        self.samples.append((time.perf_counter(), rss / 2**20))
        return rss / 2**20

    def peak(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        values = [mb for t, mb in self.samples if since <= t <= until]
        return max(values) if values else None

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.sample()
        self._thread = threading.Thread(target=loop, name="bench-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# --- the sweep ----------------------------------------------------------------------------------------
def is_greedy(params: dict) -> bool:
    """Greedy decoding: no temperature (the server's default, greedy), 0, or top_k 1."""
    return not params.get("temperature") or params.get("top_k") == 1


def compare_outputs(runs: list[tuple[int, str, list[dict]]]) -> dict:
    """``runs``: (concurrency, contender, samples) in run order. The reference output of a prompt is
    its first successful sample of the incremental contender at the lowest level (else the first
    successful one at all); every other successful sample of that prompt must have the same ids."""
    def rank(run):
        level, contender, _ = run
        return (contender != "incremental", level)

    reference: dict[int, list[int]] = {}
    for level, contender, samples in sorted(runs, key=rank):
        for s in samples:
            if s["ok"] and s["output_ids"] is not None:
                reference.setdefault(s["prompt"], s["output_ids"])
    compared, mismatches, details = 0, Counter(), []
    for level, contender, samples in runs:
        for s in samples:
            if not s["ok"] or s["output_ids"] is None:
                continue
            compared += 1
            want, got = reference[s["prompt"]], s["output_ids"]
            if got != want:
                mismatches[(level, contender)] += 1
                at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                if len(details) < 20:
                    details.append({"concurrency": level, "contender": contender, "prompt": s["prompt"],
                                    "first_difference": at, "reference_tokens": len(want), "tokens": len(got)})
    missing = sum(1 for _, _, samples in runs for s in samples if s["ok"] and s["output_ids"] is None)
    return {"compared": compared, "prompts": len(reference), "mismatches": sum(mismatches.values()),
            "mismatches_by_run": [{"concurrency": c, "contender": n, "mismatches": m}
                                  for (c, n), m in mismatches.items()],
            "without_ids": missing, "details": details}


def run_sweep(url: str | None = None, protocol: str = "http", model: str = DEFAULT_MODEL, *,
              levels: Sequence[int] = (1,), contenders: Sequence[str] = CONTENDERS, requests: int | None = None,
              stream: bool = False, prompts: list[str] | None = None, timeout: float = 300.0,
              duration: float | None = None, warmup: int = 0, allow_remote: bool = False,
              watch_pids: Sequence[int] = (), memory_interval: float = 0.5, memory_settle: float = 3.0,
              rounds: int = 1, progress: Callable[[int, str, dict], None] | None = None, **params) -> dict:
    """Every concurrency level in ``levels``, and at each every contender, one :func:`run_bench`
    run each (in that order), ``rounds`` times (the contenders in alternating order, as this
    machine's speed drifts within minutes; each contender's median round stands for it, with its
    tokens/s of every round in ``tokens_per_s_rounds``). ``requests``: per run (default
    :func:`default_requests` of the level; with only a ``duration``, as many as fit in it,
    :data:`MAX_REQUESTS` at most). ``duration``: no request starts after this many seconds of a run
    (default 600). ``warmup``: unmeasured requests before each contender's first run.
    ``progress(level, contender, run)`` after each run. Return ``{"config", "levels", "rows",
    "outputs", "memory"}`` (JSON-ready): ``rows`` one per level, see :func:`sweep_markdown`."""
    levels, contenders = [int(c) for c in levels], list(contenders)
    if not levels or not contenders:
        raise ClientError("give one concurrency level and one contender at least")
    if rounds < 1:
        raise ClientError(f"rounds must be >= 1, got {rounds}")
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown or len(set(contenders)) != len(contenders):
        raise ClientError(f"contenders are {' and '.join(CONTENDERS)} (each once), got {', '.join(contenders)}")
    if duration is not None and duration <= 0:
        raise ClientError(f"duration must be > 0, got {duration}")
    if requests is None and duration is not None:
        per_level = {c: MAX_REQUESTS for c in levels}
    else:
        per_level = {c: requests if requests is not None else default_requests(c) for c in levels}
    duration = 600.0 if duration is None else duration
    host, port = "", 0
    for c in levels:
        host, port = _check(c, per_level[c], stream, params, allow_remote, url, protocol)
    prompts = prompts or DEFAULT_PROMPTS
    sampler = MemorySampler(watch_pids, memory_interval) if watch_pids else None
    memory: dict = {"pids": list(watch_pids)}
    if sampler:
        memory["before_mb"] = sampler.sample()
        sampler.start()
    results: list[dict] = []
    every_run: list[tuple[int, str, list[dict]]] = []   # (level, contender, samples) of every round
    try:
        for i, level in enumerate(levels):
            entry = {"concurrency": level, "requests": per_level[level], "contenders": {}}
            runs: dict[str, list[dict]] = {c: [] for c in contenders}
            for r in range(rounds):
                for contender in contenders if r % 2 == 0 else contenders[::-1]:
                    tree = INCREMENTAL_TREE if contender == "incremental" else params.get("tree")
                    start = time.perf_counter()
                    run = _bench(host, port, protocol, model, level, per_level[level], stream, prompts, timeout,
                                 duration, warmup if i == 0 and r == 0 else 0, params | {"tree": tree})
                    run["tree"] = tree
                    if sampler:
                        run["memory_peak_mb"] = sampler.peak(start)
                    runs[contender].append(run)
                    every_run.append((level, contender, run["samples"]))
                    if progress:
                        progress(level, contender, run)
            for contender, done in runs.items():
                median = median_round(done, lambda run: run["summary"]["tokens_per_s"])
                entry["contenders"][contender] = median | {
                    "tokens_per_s_rounds": [run["summary"]["tokens_per_s"] for run in done],
                    "round_summaries": [run["summary"] for run in done]}
            results.append(entry)
    finally:
        if sampler:
            sampler.stop()
    if sampler:
        memory["peak_mb"] = max(mb for _, mb in sampler.samples)
        time.sleep(memory_settle)
        memory["after_mb"] = sampler.sample()
        memory["after_s"], memory["interval_s"] = memory_settle, memory_interval
        memory["processes"] = sampler.processes
    greedy = is_greedy(params)
    outputs = compare_outputs(every_run)
    outputs["checked"] = greedy and outputs["prompts"] > 0   # prompts: those with a reference output
    outputs["greedy"] = greedy
    outputs["identical"] = outputs["mismatches"] == 0 if outputs["checked"] else None
    config = {"url": f"{host}:{port}", "protocol": protocol, "model": model, "levels": levels,
              "contenders": contenders, "requests": {str(c): n for c, n in per_level.items()}, "stream": stream,
              "prompts": len(prompts), "warmup": warmup, "duration_s": duration, "rounds": rounds, "params": params}
    return {"config": config, "levels": results, "rows": sweep_rows(results, outputs), "outputs": outputs,
            "memory": memory}


def sweep_rows(results: list[dict], outputs: dict | None = None) -> list[dict]:
    """One row per level: per contender tokens/s, per-token ITL p50/p99, genai-perf ITL p50, TTFT
    p50, failures, tokens/s over the lowest level's; and speculative over incremental tokens/s."""
    def p(stats: dict | None, q: str) -> float | None:
        return stats[q] if stats else None

    base_level = min(e["concurrency"] for e in results)
    base = next(e for e in results if e["concurrency"] == base_level)
    mismatches = Counter()
    for m in (outputs or {}).get("mismatches_by_run", []):
        mismatches[m["concurrency"]] += m["mismatches"]
    checked = (outputs or {}).get("checked", True)   # sampled outputs are not compared: no count
    rows = []
    for e in results:
        row: dict = {"concurrency": e["concurrency"], "requests": e["requests"], "failures": 0,
                     "mismatches": mismatches[e["concurrency"]] if checked else None}
        for name, run in e["contenders"].items():
            s = run["summary"]
            errors = sum(r["errors"] for r in run.get("round_summaries") or [s])   # every round's
            first = base["contenders"][name]["summary"]["tokens_per_s"]
            row[name] = {"tokens_per_s": s["tokens_per_s"], "token_itl_p50_ms": p(s["token_itl_ms"], "p50"),
                         "token_itl_p99_ms": p(s["token_itl_ms"], "p99"), "itl_p50_ms": p(s["itl_ms"], "p50"),
                         "ttft_p50_ms": p(s["ttft_ms"], "p50"), "requests": s["requests"], "failures": errors,
                         "over_lowest_level": s["tokens_per_s"] / first if first else None,
                         "memory_peak_mb": run.get("memory_peak_mb")}
            row["failures"] += errors
        if "speculative" in row and "incremental" in row:
            # round by round (the runs of one round were seconds apart), the median of the ratios
            spec, inc = (e["contenders"][n].get("tokens_per_s_rounds") or [row[n]["tokens_per_s"]]
                         for n in ("speculative", "incremental"))
            row["speculative_over_incremental"] = median_ratio(spec, inc)
        rows.append(row)
    return rows


def _f(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def sweep_markdown(report: dict) -> str:
    """The sweep's table (one row per level) and lines on the outputs' agreement and server memory."""
    rows, contenders = report["rows"], report["config"]["contenders"]
    base = min(r["concurrency"] for r in rows)
    short = {"speculative": "spec", "incremental": "incr"}
    head = ["concurrency"]
    for n in contenders:
        s = short[n]
        head += [f"{s} tok/s", f"{s} ITL p50/p99 (ms)", f"{s} TTFT p50 (ms)", f"{s} tok/s ÷ c={base}"]
    both = "speculative" in contenders and "incremental" in contenders
    head += ["spec ÷ incr tok/s"] if both else []
    head += ["failures", "mismatches"]
    watched = "peak_mb" in report["memory"]
    head += ["peak RSS (MB)"] if watched else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r["concurrency"])]
        for n in contenders:
            c = r[n]
            cells += [_f(c["tokens_per_s"]), f"{_f(c['token_itl_p50_ms'])} / {_f(c['token_itl_p99_ms'])}",
                      _f(c["ttft_p50_ms"]), _f(c["over_lowest_level"], 2, "x")]
        cells += [_f(r.get("speculative_over_incremental"), 2, "x")] if both else []
        cells += [str(r["failures"]), "-" if r["mismatches"] is None else str(r["mismatches"])]
        if watched:
            cells.append(_f(max((r[n]["memory_peak_mb"] or 0.0) for n in contenders), 0))
        lines.append("| " + " | ".join(cells) + " |")
    rounds = report["config"].get("rounds", 1)
    if rounds > 1:
        lines.append(f"\n{rounds} rounds at each level, the contenders in alternating order: each contender's "
                     f"median round; spec ÷ incr is the median of their ratios within a round")
    o = report["outputs"]
    if o["checked"]:
        lines.append(f"\noutputs identical: {'yes' if o['identical'] else 'no'} ({o['mismatches']} mismatches; "
                     f"{o['compared']} outputs of {o['prompts']} prompts compared across levels and contenders)")
    elif not o["greedy"]:
        lines.append("\noutputs not compared: sampled decoding (temperature > 0) need not repeat itself")
    else:
        lines.append("\noutputs not compared: the server returned no output_ids")
    m = report["memory"]
    if watched:
        lines.append(f"server memory (RSS of pid {', '.join(map(str, m['pids']))} and descendants, "
                     f"{m['processes']} processes): before {m['before_mb']:.0f} MB, peak {m['peak_mb']:.0f} MB, "
                     f"after {m['after_mb']:.0f} MB ({m['after_s']:g} s after the run)")
    return "\n".join(lines)


def run_line(level: int, contender: str, run: dict) -> str:
    """One line on one run (printed as the sweep goes)."""
    s = run["summary"]
    itl = s["token_itl_ms"]
    line = (f"concurrency {level}, {contender} (tree {run.get('tree') or 'default'}): {s['ok']} of {s['requests']} "
            f"requests ok, {s['errors']} errors; {s['tokens']} tokens in {s['wall_s']:.2f} s = "
            f"{s['tokens_per_s']:.1f} tokens/s")
    if itl:
        line += f", ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms"
    return line + "".join(f"\n  error ({n}x): {m}" for m, n in s["error_messages"].items())


def markdown(report: dict) -> str:
    """One run's summary (:func:`run_bench`, or one run of a sweep) as a markdown table and a line of
    totals."""
    s = report["summary"]
    rows = [("TTFT (ms)", "ttft_ms"), ("inter-token latency, per token (ms)", "token_itl_ms"),
            ("inter-token latency, genai-perf (ms)", "itl_ms"), ("gap between pieces (ms)", "piece_gap_ms"),
            ("tokens per piece", "tokens_per_piece"), ("request latency (ms)", "latency_ms"),
            ("output tokens", "tokens_per_request"), ("tokens/s per request", "request_tokens_per_s")]
    lines = ["| metric | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for label, key in rows:
        stats = s[key]
        cells = [f"{stats[k]:.1f}" for k in ("mean", "p50", "p90", "p99")] if stats else ["-"] * 4
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    c = report.get("config")
    if c:
        lines.append(f"\n{s['ok']} of {s['requests']} requests ok, {s['errors']} errors; {c['protocol']} "
                     f"{c['model']}{' streaming' if c['stream'] else ''}, concurrency {c['concurrency']}: "
                     f"{s['tokens']} tokens in {s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s, "
                     f"{s['requests_per_s']:.2f} requests/s")
        for message, count in s["error_messages"].items():
            lines.append(f"error ({count}x): {message}")
    return "\n".join(lines)
