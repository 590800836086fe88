"""`specinfer bench`: every contender on the same prompts in one run, outputs checked, a
JSON/markdown/PNG report. (Step times of a Runtime are :func:`specinfer.tree_sizing.step_times`.)"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .engines.runtime import Runtime
from .rounds import median_ratio, median_round
from .verify import SAMPLING_RULES

if TYPE_CHECKING:
    from .generate import Stats


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


SAMPLING_TEMPERATURES = (1.0, 0.7)


@dataclass
class BenchConfig:
    """One ``specinfer bench`` run: the same prompts through every contender, greedy unless ``sampling``."""
    llm: Path                       # checkpoint folder (peers need one; ours exports it)
    ssms: list[Path]
    prompts: list[list[int]]
    trees: dict[str, list[int] | None]   # name -> widths per depth, or None for the dynamic tree
    max_new_tokens: int = 128
    threads: int | None = None
    peers: bool = True              # transformers and onnxruntime-genai
    sampling: bool = False          # sampling at SAMPLING_TEMPERATURES: the verification rules compared, ours only
    seed: int = 0
    min_confidence: float | None = None   # our drafters stop growing a branch where the SSM is less sure
                                          # (None: each tree's default, see speculate.default_min_confidence)
    lookup: bool = True             # the dynamic tree also drafts by lookup (lookup.py); a lookup-only row too
    progress: bool = True
    streams: tuple[int, ...] = ()   # greedy: also through the scheduler, with this many requests at once
    rounds: int = 1                 # every contender this many times over the prompts; the median round reported
    kv_dtype: str = "float32"       # our LLM's KV caches (float16: rounded; SSMs and peers keep their own)
    matmul_dtype: str = "float32"   # our LLM's matrix products (bfloat16, int8: rounded; SSMs and peers keep float32)


def _measured(stats: "Stats", peer: bool = False) -> dict:
    """A round's row fields from its statistics (a peer's: what the tool reports, no time split)."""
    row = dict(tokens=stats.new_tokens, seconds=stats.total_seconds, tokens_per_s=stats.tokens_per_second,
               tokens_per_step=stats.mean_tokens_per_step if stats.steps else None, histogram=stats.histogram)
    return row if peer else row | dict(ssm_s=stats.ssm_seconds, llm_s=stats.llm_seconds, other_s=stats.other_seconds)


def _ours(cfg: BenchConfig, llm: Runtime, ssms: Sequence[Runtime], tree: Sequence[int] | None, params, index: int,
          stats: "Stats", rule: str = "mss", lookup: bool = False) -> list[int]:
    """Prompt ``index`` decoded by our engine in this process, its costs added to ``stats``."""
    from .generate import generate_ids
    from .speculate import default_min_confidence

    min_confidence = default_min_confidence(tree, params) if cfg.min_confidence is None else cfg.min_confidence
    if not params.greedy:
        params = replace(params, seed=cfg.seed + index)
    return [t for step in generate_ids(llm, cfg.prompts[index], ssms=ssms, tree=tree, params=params,
                                       max_new_tokens=cfg.max_new_tokens, eos_ids=llm.config.eos_token_ids,
                                       stats=stats, rule=rule, min_confidence=min_confidence, lookup=lookup)
            for t in step]


def _scheduled(cfg: BenchConfig, llm: Runtime, ssms: Sequence[Runtime], tree: Sequence[int] | None, streams: int,
               lookup: bool, warm: bool = False) -> tuple["Stats", list[list[int]]]:
    """Every prompt through one :class:`~specinfer.scheduler.Scheduler`, ``streams`` requests at a
    time (each on a thread of its own, batched): the in-process serving engine. The stats' time is
    the run's wall time; their SSM and LLM seconds are the scheduler's drafting and verification."""
    import threading

    from .generate import Stats, decode
    from .scheduler import Scheduler, warm_batches

    if not warm:   # untimed, so that the batch sizes' sessions are made before the clock runs
        warm_batches(llm, streams)
        _scheduled(replace(cfg, prompts=cfg.prompts[:streams], max_new_tokens=4), llm, ssms, tree, streams, lookup, True)
    scheduler = Scheduler(llm, ssms)
    per_request = [Stats() for _ in cfg.prompts]
    outputs: list = [None] * len(cfg.prompts)
    pending = iter(range(len(cfg.prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            spec = scheduler.speculator(cfg.max_new_tokens, tree=tree, lookup=lookup, stats=per_request[i])
            outputs[i] = [t for step in decode(spec, cfg.prompts[i], cfg.max_new_tokens, llm.config.eos_token_ids,
                                               stats=per_request[i]) for t in step]
    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    scheduler.close()
    stats = Stats.total(per_request)
    # The requests overlapped: the run's wall time and the scheduler's own model time are the costs.
    stats.ssm_seconds, stats.llm_seconds = scheduler.seconds["draft"], scheduler.seconds["llm"]
    stats.total_seconds = time.perf_counter() - started
    return stats, outputs


class _Unavailable(Exception):
    """A peer that cannot run here (the reason is its message)."""


@dataclass
class _Job:
    """A contender: its row's fixed fields and how it runs. ``run(indices, stats)`` decodes those
    prompts, adds their costs to ``stats`` and returns their outputs; a job ``whole`` (the
    scheduler's, which serves many prompts at once) is given every prompt in one call."""
    fixed: dict
    run: Callable[[Sequence[int], "Stats"], list[list[int]]]
    whole: bool = False


def _interleaved(jobs: list[_Job], prompts: int, rounds: int, progress: bool) -> list[list[tuple["Stats", list]]]:
    """Each job's (stats, outputs) per round. Within a round the jobs take turns prompt by prompt,
    in alternating order (this machine's speed drifts within minutes, and so every contender meets
    the same drift: a ratio of two rows is a ratio of runs seconds apart, not minutes); the jobs
    ``whole`` follow, each on every prompt, in an order reversed every round (their runs are
    minutes apart, and in one order the later ones met a slower spell: the scheduler's dynamic row
    made 0.81x its incremental one at one stream where, interleaved prompt by prompt, it made
    0.99x). A peer that turns out unavailable is left out from then on and gets no
    rounds (its reason in ``jobs[i].fixed["unavailable"]``)."""
    from tqdm import tqdm

    from .generate import Stats

    results: list[list[tuple[Stats, list]]] = [[] for _ in jobs]
    by_prompt = [i for i, job in enumerate(jobs) if not job.whole]
    whole = [i for i, job in enumerate(jobs) if job.whole]
    bar = tqdm(total=rounds * (prompts + len(whole)), desc="bench", unit="run", disable=not progress, leave=False)
    turn = 0
    for round_ in range(rounds):
        stats = [Stats() for _ in jobs]
        outputs: list[list] = [[] for _ in jobs]
        # (the prompts one by one, each run by every job; then each whole job on every prompt)
        runs = [(p, [p], by_prompt) for p in range(prompts)] + \
            [(None, list(range(prompts)), [i]) for i in (whole[::-1] if round_ % 2 else whole)]
        for p, indices, order in runs:
            if p is not None:
                order, turn = (order[::-1] if turn % 2 else order), turn + 1
            for i in order:
                if "unavailable" in jobs[i].fixed:
                    continue
                try:
                    outputs[i] += jobs[i].run(indices, stats[i])
                except _Unavailable as e:
                    jobs[i].fixed["unavailable"] = str(e)
            bar.update()
        for i in range(len(jobs)):
            if "unavailable" not in jobs[i].fixed:
                results[i].append((stats[i], outputs[i]))
    bar.close()
    return results


def run_bench(cfg: BenchConfig) -> dict:
    """Every contender on the same prompts in this one run; returns the report (rows, checks, targets).

    Greedy: our incremental decoding, our speculative decoding with SSM 1 and with all SSMs for each
    tree, then the peers. Our speculative outputs must equal our incremental ones token for token
    (an AssertionError otherwise); a peer's outputs are compared and the count of equal ones reported.
    Sampling, at each of SAMPLING_TEMPERATURES: our incremental sampling, and each verification rule
    (MSS, traversal, naive) on each tree with all SSMs, on the same prompts and seeds; a row's
    speedup is against incremental sampling at its temperature. The contenders take turns prompt
    by prompt (:func:`_interleaved`); each row is its median round.
    """
    from . import peers
    from .engines.loader import load_runtime
    from .generate import Stats, drafts_by_lookup
    from .sampling import SamplingParams

    llm = load_runtime(cfg.llm, "onnxruntime", threads=cfg.threads, kv_dtype=cfg.kv_dtype, matmul_dtype=cfg.matmul_dtype)
    ssms = [load_runtime(s, "onnxruntime", threads=cfg.threads) for s in cfg.ssms]
    sets = {"SSM 1": ssms[:1]} | ({f"all {len(ssms)} SSMs": ssms} if len(ssms) > 1 else {})
    warm_up = replace(cfg, max_new_tokens=2)
    jobs: list[_Job] = []

    def ours(name: str, drafts, tree, params, rule="mss", lookup=False, tree_name="-") -> None:
        def run(indices, stats):
            outputs = []
            for i in indices:
                # untimed, 2 tokens of the prompt first, as each peer does before its prompts
                _ours(warm_up, llm, drafts, tree, params, i, Stats(), rule, lookup)
                outputs.append(_ours(cfg, llm, drafts, tree, params, i, stats, rule, lookup))
            return outputs
        jobs.append(_Job(dict(contender=name, tool="specinfer", tree=tree_name, ssms="-" if tree == [] else str(len(drafts)),
                              rule=rule, lookup=lookup, temperature=params.temperature), run))

    for params in ([SamplingParams(temperature=t, seed=cfg.seed) for t in SAMPLING_TEMPERATURES] if cfg.sampling
                   else [SamplingParams()]):
        at = f" T={params.temperature:g}" if cfg.sampling else ""
        ours("ours incremental" + at, [], [], params)
        for tree_name, tree in cfg.trees.items():
            lookup = drafts_by_lookup(tree, params, cfg.lookup)
            if cfg.sampling:
                runs = [(f"ours {rule} {tree_name}{at}", ssms, rule) for rule in SAMPLING_RULES]
            else:
                runs = [(f"ours {tree_name} {k}", v, "mss") for k, v in sets.items()]
            if lookup:
                runs = [(name + " + lookup", drafts, rule) for name, drafts, rule in runs] + \
                    [(f"ours {tree_name} lookup only{at}", [], "mss")]
            for name, drafts, rule in runs:
                ours(name, drafts, tree, params, rule, lookup, tree_name)
    if not cfg.sampling and cfg.streams:
        # The serving engine: requests at once, batched (scheduler.py); one stream is what its
        # hand-offs cost a request alone.
        tree_name, tree = next(iter(cfg.trees.items()))
        lookup = cfg.lookup and tree is None
        for n in cfg.streams:
            for name, drafts in ((f"ours incremental, {n} streams (scheduler)", []),
                                 (f"ours {tree_name} SSM 1{' + lookup' if lookup else ''}, {n} streams (scheduler)",
                                  ssms[:1])):
                def run(indices, stats, drafts=drafts, n=n):
                    measured, outputs = _scheduled(cfg, llm, drafts, [] if not drafts else tree, n, lookup and bool(drafts))
                    stats.add(measured)
                    return outputs
                jobs.append(_Job(dict(contender=name, tool="specinfer", tree=tree_name if drafts else "-",
                                      ssms=str(len(drafts)) if drafts else "-", rule="mss", lookup=lookup and bool(drafts),
                                      temperature=0.0, streams=n), run, whole=True))
    torch_process = None
    if cfg.peers and not cfg.sampling:
        from .speculate import DYNAMIC_DEPTH

        depth = max(DYNAMIC_DEPTH if t is None else len(t) for t in cfg.trees.values())
        # transformers in a process of its own: torch in this one slowed our runs (PeerProcess).
        torch_process = peers.PeerProcess()
        for name, tool, peer in [
            ("transformers greedy", "transformers", lambda **kw: torch_process.call("transformers_greedy", cfg.llm, **kw)),
            ("transformers assisted", "transformers",
             lambda **kw: torch_process.call("transformers_assisted", cfg.llm, cfg.ssms[0], **kw)),
            ("onnxruntime-genai greedy", "onnxruntime-genai", lambda **kw: peers.ortgenai_greedy(cfg.llm, **kw)),
            (f"onnxruntime-genai speculative chain {depth}", "onnxruntime-genai",
             lambda **kw: peers.ortgenai_speculative(cfg.llm, cfg.ssms[0], draft_tokens=depth, **kw)),
        ]:
            def run(indices, stats, peer=peer):
                r = peer(prompts=[cfg.prompts[i] for i in indices], max_new_tokens=cfg.max_new_tokens, threads=cfg.threads)
                if r.unavailable:
                    raise _Unavailable(r.unavailable)
                stats.add(Stats(new_tokens=r.new_tokens, total_seconds=r.seconds, tokens_per_step=list(r.tokens_per_step)))
                return r.outputs
            drafted = "speculative" in name or "assisted" in name
            jobs.append(_Job(dict(contender=name, tool=tool, tree=f"chain {depth}" if "speculative" in name else "-",
                                  ssms="1" if drafted else "-"), run))

    # Warm-up, untimed: each of our contenders once on the first prompt. A cold process runs its
    # first calls far slower, which would tax whichever contender comes first, and the sessions a
    # contender opens (a drafter's per depth: 280 ms for the LLM's own, used by incremental
    # decoding) are not to be timed in its first round.
    for job in jobs:
        if job.fixed["tool"] == "specinfer" and not job.whole:
            job.run([0], Stats())
    try:
        results = _interleaved(jobs, len(cfg.prompts), cfg.rounds, cfg.progress)
    finally:
        if torch_process is not None:
            torch_process.close()
    rows = []
    reference = None   # greedy: our incremental outputs, which every greedy contender is compared with
    for job, runs in zip(jobs, results):
        fixed = job.fixed
        if not runs:   # a peer that cannot run here
            rows.append(fixed)
            continue
        measured = [_measured(stats, peer=fixed["tool"] != "specinfer") for stats, _ in runs]
        # The round of median tokens/s stands for the contender (its time columns stay one run's).
        row = {**fixed, **median_round(measured, lambda m: m.get("tokens_per_s") or 0)}
        if cfg.rounds > 1 and not row.get("unavailable"):
            row["tokens_per_s_rounds"] = [m["tokens_per_s"] for m in measured]
        if not cfg.sampling and not row.get("unavailable"):
            outputs = [o for _, o in runs]
            reference = outputs[0] if reference is None else reference
            same = min(sum(o == ref for o, ref in zip(out, reference)) for out in outputs)
            if fixed["tool"] == "specinfer" and same != len(reference):
                raise AssertionError(f"{fixed['contender']}: {len(reference) - same} outputs differ "
                                     f"from incremental decoding")
            row["identical"] = same
        rows.append(row)
    # Speedups: against our incremental decoding (under sampling, at the row's temperature).
    base = {r.get("temperature"): r for r in rows if r["contender"].startswith("ours incremental") and "streams" not in r}
    for r in rows:
        b = base.get(r.get("temperature"), rows[0])
        r["speedup"] = ratio(r, b)
    return {"llm": str(cfg.llm), "ssms": [str(s) for s in cfg.ssms], "prompts": len(cfg.prompts),
            "max_new_tokens": cfg.max_new_tokens, "rounds": cfg.rounds,
            "mode": f"sampling (temperature {' and '.join(f'{t:g}' for t in SAMPLING_TEMPERATURES)})" if cfg.sampling
            else "greedy",
            "threads": cfg.threads or os.cpu_count(), "min_confidence": cfg.min_confidence, "kv_dtype": cfg.kv_dtype,
            "matmul_dtype": cfg.matmul_dtype,
            "native_ops": sorted(getattr(llm, "native_ops", ())),
            "rows": rows, "targets": [] if cfg.sampling else targets(rows)}


def ratio(a: dict, b: dict) -> float | None:
    """Row ``a``'s tokens/s over row ``b``'s: with rounds, :func:`~specinfer.rounds.median_ratio`
    of their rounds (prompt by prompt, seconds apart)."""
    if not (a.get("tokens_per_s") and b.get("tokens_per_s")):
        return None
    ra, rb = a.get("tokens_per_s_rounds"), b.get("tokens_per_s_rounds")
    if ra and rb and len(ra) == len(rb):
        return median_ratio(ra, rb)
    return a["tokens_per_s"] / b["tokens_per_s"]


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets as ratios within this run (greedy; best of our speculative rows)."""
    by = {r["contender"]: r for r in rows if r.get("tokens_per_s")}
    ours = [r for r in rows if r["tool"] == "specinfer" and r["tree"] != "-" and r.get("tokens_per_s")
            and "streams" not in r]   # a request alone (the rows served many at once are throughput)
    if not ours:
        return []
    best = max(ours, key=lambda r: r["tokens_per_s"])
    incremental = by.get("ours incremental")
    peer = lambda prefix: next((r for name, r in by.items() if name.startswith(prefix)), None)
    checks = [
        (f"{best['contender']} / ours incremental (tokens/s)", best, incremental, 2.0),
        (f"{best['contender']} / transformers assisted", best, peer("transformers assisted"), 2.0),
        (f"{best['contender']} / onnxruntime-genai speculative", best, peer("onnxruntime-genai speculative"), 1.3),
        ("ours incremental / onnxruntime-genai greedy", incremental, peer("onnxruntime-genai greedy"), 1.0),
    ]
    out = [{"target": name, "ratio": (r := ratio(a, b)), "goal": goal, "met": r >= goal}
           for name, a, b, goal in checks if a and b]
    if best.get("tokens_per_step") is not None:
        out.append({"target": f"{best['contender']}: mean tokens per step", "ratio": best["tokens_per_step"],
                    "goal": 3.0, "met": best["tokens_per_step"] >= 3.0})
    if best.get("ssm_s") is not None and best.get("llm_s"):   # the engine issue's drafting goal
        out.append({"target": f"{best['contender']}: SSM s / LLM s (drafting against verification)",
                    "ratio": (r := best["ssm_s"] / best["llm_s"]), "goal": 0.25, "met": r <= 0.25, "at_most": True})
    served = [r for r in rows if r.get("streams") and r.get("tokens_per_s")]
    alone = max((r for r in served if r["streams"] == 1), key=lambda r: r["tokens_per_s"], default=None)
    for n in sorted({r["streams"] for r in served} - {1}):
        most = max((r for r in served if r["streams"] == n), key=lambda r: r["tokens_per_s"])
        if alone:   # the batching issue's goal: 16 streams >= 3x one
            out.append({"target": f"{n} streams / 1 stream, best of each (tokens/s)",
                        "ratio": (r := ratio(most, alone)), "goal": 3.0, "met": r >= 3.0})
    return out


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _tokens_per_s(row: dict) -> str:
    rounds = row.get("tokens_per_s_rounds")
    return _fmt(row.get("tokens_per_s"), ".1f") + (f" ({min(rounds):.0f}-{max(rounds):.0f})" if rounds else "")


def _default_min_confidence(report: dict) -> str:
    from .speculate import DEFAULT_MIN_CONFIDENCE
    return "none (sampled drafts)" if report["mode"].startswith("sampling") else \
        f"per tree (fixed {DEFAULT_MIN_CONFIDENCE}, dynamic none)"


def report_markdown(report: dict) -> str:
    """The bench report as markdown: the contenders table, then the targets."""
    n = report["prompts"]
    rows = [[r["contender"], _tokens_per_s(r), _fmt(r.get("speedup"), ".2f", "x"),
             _fmt(r.get("tokens_per_step"), ".2f"), _fmt(r.get("ssm_s"), ".2f"), _fmt(r.get("llm_s"), ".2f"),
             _fmt(r.get("other_s"), ".2f"),
             "-" if r.get("identical") is None else f"{r['identical']}/{n}"] if not r.get("unavailable")
            else [r["contender"], f"unavailable: {r['unavailable']}", "", "", "", "", "", ""]
            for r in report["rows"]]
    rounds = report.get("rounds", 1)
    text = (f"{report['mode']}, {n} prompts, {report['max_new_tokens']} new tokens, {report['threads']} threads, "
            + (f"our LLM on native kernels ({', '.join(report['native_ops'])}), " if report.get("native_ops") else
               "our LLM on ONNX Runtime's kernels, " if "native_ops" in report else "")
            + (f"our LLM's KV caches {report['kv_dtype']}, " if report.get("kv_dtype", "float32") != "float32" else "")
            + (f"our LLM's matrix products {report['matmul_dtype']} (the peers' float32), "
               if report.get("matmul_dtype", "float32") != "float32" else "")
            + "contenders taking turns prompt by prompt, "
            + (f"{rounds} rounds (tokens/s: median round, range; ratios: median of the ratio within each round), " if rounds > 1 else "")
            + f"our drafters' min confidence "
            f"{report['min_confidence'] if report['min_confidence'] is not None else _default_min_confidence(report)}\n\n"
            + markdown_table(["contender", "tokens/s", "vs ours incremental", "tokens/step", "SSM s", "LLM s",
                              "own code s", "identical to ours incremental"], rows))
    if report["targets"]:
        text += "\n\n" + markdown_table(["target", "measured", "goal", "met"], [
            [t["target"], f"{t['ratio']:.2f}", f"{'<=' if t.get('at_most') else '>='} {t['goal']}",
             "yes" if t["met"] else "NO"] for t in report["targets"]])
    return text


def report_plot(report: dict, path: str | Path) -> None:
    """Tokens/s per contender, and the histogram of tokens per verification step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r.get("tokens_per_s")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2.5))
    left.barh([r["contender"] for r in rows][::-1], [r["tokens_per_s"] for r in rows][::-1],
              color=["tab:blue" if r["tool"] == "specinfer" else "tab:gray" for r in rows][::-1])
    left.set_xlabel("tokens/s")
    left.set_title(f"{report['mode']}: {report['prompts']} prompts x {report['max_new_tokens']} tokens")
    for r in rows:
        hist = {int(k): v for k, v in (r.get("histogram") or {}).items()}
        if r["tree"] != "-" and hist:
            total = sum(hist.values())
            xs = sorted(hist)
            right.plot(xs, [hist[x] / total for x in xs], marker="o", label=r["contender"])
    right.set_xlabel("tokens per verification step (accepted + 1)")
    right.set_ylabel("share of steps")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
