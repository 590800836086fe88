"""`specinfer`: a thin shell over the library. Bad input exits 2 with a one-line error."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .client.cli import add_client_parser
from .engines.loader import ENGINES
from .engines.runtime import KV_DTYPES, MATMUL_DTYPES
from .export.draft_vocab import DRAFT_VOCAB_SIZE
from .scheduler import BATCH_TREE_TOKENS, PREFILL_CHUNK_TOKENS, parse_bytes
from .serving.triton_glue import METRICS_SECONDS, STREAM_INTERVAL
from .serving.repository import DEFAULT_LAYOUT, LAYOUTS
from .speculate import DEFAULT_MIN_CONFIDENCE, DYNAMIC, default_min_confidence, parse_tree
from .errors import SpecInferError
from .verify import SAMPLING_RULES


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within the smallest set of this much mass")
    p.add_argument("--seed", type=int, default=None, help="random seed of a sampled generation (default: random)")
    p.add_argument("--rule", choices=SAMPLING_RULES, default="mss",
                   help="verification under sampling: multi-step speculative sampling, traversal verification "
                        "(accepts at least as much) or naive; all keep the LLM's distribution exactly")


def _add_min_confidence(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-confidence", type=float, default=None,
                   help="an SSM stops growing a branch where its top token's probability is below this "
                        f"(0: full tree; default {DEFAULT_MIN_CONFIDENCE} for a fixed tree, greedy; 0 for the "
                        "dynamic one and under sampling); the output is exact either way")


def _add_lookup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-lookup", action="store_true",
                   help="the dynamic tree drafts with the SSMs only, not also by lookup in the sequence's own "
                        "tokens (default: both)")


THREADS_HELP = "ONNX Runtime threads, a pool per model (default: one pool of all cores shared by the models)"
TREE_HELP = ("'dynamic' (sized each step to this machine's verification cost and the SSMs' confidence) "
             "or children per depth, SpecInfer's expansion (e.g. 1,1,3,1,1,1,1,1)")


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse then names the flag in its one-line error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _utf8(text: str, what: str) -> str:
    """Text from the command line that must be UTF-8 (Python keeps undecodable bytes as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecInferError(f"{what} is not valid UTF-8 text") from None
    return text


def _warn_if_cut(tree: list[int] | None, budget: int) -> None:
    """Say so when a fixed tree is larger than the node budget (each step keeps its first nodes)."""
    if tree is None:
        return
    nodes, level = 1, 1
    for width in tree:
        level *= width
        nodes += level
    if nodes > budget:
        print(f"specinfer: warning: --tree {','.join(map(str, tree))} has up to {nodes} nodes per SSM; each step "
              f"keeps the first {budget} in all (--budget)", file=sys.stderr)


def _sampling_params(a):
    """The sampling flags as SamplingParams; an error names the flag (--top-k, not top_k)."""
    from .sampling import SamplingParams

    try:
        return SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)
    except SpecInferError as e:   # its messages start with the field's name
        raise SpecInferError("--" + str(e).replace("top_k", "top-k").replace("top_p", "top-p")) from None


def _prompt(a) -> str:
    """generate's prompt: the argument, stdin for ``-``, or ``--prompt-file`` (prompts longer than
    the shell's argument limit)."""
    if (a.prompt is None) == (a.prompt_file is None):
        raise SpecInferError("give the prompt as an argument, - for stdin, or --prompt-file FILE (one of them)")
    if a.prompt_file is not None:
        try:
            data = Path(a.prompt_file).read_bytes()
        except OSError as e:
            raise SpecInferError(f"--prompt-file {a.prompt_file}: {e.strerror or e}") from None
        what = f"--prompt-file {a.prompt_file}"
    elif a.prompt == "-":
        data, what = sys.stdin.buffer.read(), "the prompt on stdin"
    else:
        return _utf8(a.prompt, "the prompt")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecInferError(f"{what} is not valid UTF-8 text") from None


def _check_min_confidence(value: float | None) -> None:
    if value is not None and not 0.0 <= value < 1.0:
        raise SpecInferError(f"--min-confidence must be in [0, 1), got {value}")


def cmd_export(a) -> None:
    from .export import export_model

    r = export_model(a.model_dir, a.output, dtype=a.dtype, max_context=a.max_context, validate=not a.no_validate,
                     force=a.force)
    msg = f"wrote {r.onnx_path}"
    if r.max_abs_diff:
        msg += " (validated, max |logit diff| vs PyTorch: " + \
            ", ".join(f"{k} {v:.2e}" for k, v in r.max_abs_diff.items()) + ")"
    print(msg)


def cmd_build(a) -> None:
    from .engines.tensorrt_build import build_engines

    path = build_engines(a.onnx_dir, a.output, max_batch=a.max_batch, max_tree_tokens=a.max_tree_tokens,
                         max_context=a.max_context, attention=a.attention, progress=not a.quiet)
    print(f"wrote {path} ({a.attention} attention); check it with `specinfer validate {a.output}`")


def cmd_validate(a) -> None:
    from .engines.tensorrt_build import TOLERANCE, read_engine_manifest, validate_engine

    report = validate_engine(a.engine_dir)
    tol = TOLERANCE[read_engine_manifest(a.engine_dir)["dtype"]]
    for case, diffs in report.items():
        print(f"{case}: max |TensorRT - ONNX Runtime| " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    print(f"passed (atol {tol['atol']}, rtol {tol['rtol']})")


def cmd_generate(a) -> None:
    from .generate import Stats
    from .pipeline import Pipeline
    from .text import shown_prompt

    params = _sampling_params(a)   # validates before loading models
    prompt = _prompt(a)
    _check_min_confidence(a.min_confidence)
    if a.max_tokens < 1:
        raise SpecInferError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    tree = parse_tree(a.tree)
    _warn_if_cut(tree, a.budget)
    min_confidence = default_min_confidence(tree, params) if a.min_confidence is None else a.min_confidence
    llm, ssms = _models(a, all_ssms=False)
    pipe = Pipeline(llm, [] if a.no_speculation else ssms, tree=tree, budget=a.budget, engine=a.engine,
                    sampling_ssms=[] if a.no_speculation or params.greedy else _sampling_ssms(a),
                    max_context=a.max_context, threads=a.threads, min_confidence=min_confidence,
                    lookup=not (a.no_lookup or a.no_speculation), rule=a.rule, kv_dtype=a.kv_dtype,
                    matmul_dtype=a.matmul_dtype)
    stats = Stats()
    if sys.stdout.isatty():   # a terminal sees the prompt, dimmed, then its continuation; a pipe only the latter
        sys.stdout.write(shown_prompt(prompt, sys.stdout))
    for piece in pipe.stream(prompt, a.max_tokens, params, stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.stats:
        print(stats.summary(), file=sys.stderr)


def cmd_cache(a) -> None:
    from .benchmark import markdown_table
    from .cache import cache_dir, cached_exports, clear
    from .export.onnx_export import EXPORT_FORMAT

    if a.action == "clear":
        removed, freed = clear(stale_only=a.stale, current_format=EXPORT_FORMAT)
        print(f"removed {removed} cached export{'s' * (removed != 1)} ({freed / 1e6:.1f} MB) from {cache_dir() / 'onnx'}")
        return
    rows = cached_exports()
    print(f"{len(rows)} cached export{'s' * (len(rows) != 1)} in {cache_dir() / 'onnx'}, "
          f"{sum(r['bytes'] for r in rows) / 1e6:.1f} MB (this version writes {EXPORT_FORMAT})")
    if rows:
        print(markdown_table(["folder", "checkpoint", "format", "max context", "MB"],
                             [[r["folder"].name, r["source"], r["format"], r["max_context"], f"{r['bytes'] / 1e6:.1f}"]
                              for r in rows]))


def cmd_steptime(a) -> None:
    from .benchmark import markdown_table
    from .tree_sizing import step_times
    from .engines.loader import load_runtime

    rt = load_runtime(a.model, a.engine, threads=a.threads, kv_dtype=a.kv_dtype, matmul_dtype=a.matmul_dtype)
    contexts = [int(c) for c in a.contexts.split(",")]
    trees = [int(t) for t in a.trees.split(",")]
    if max(contexts) + max(trees) > rt.max_context:
        raise SpecInferError(f"context {max(contexts)} + tree {max(trees)} exceeds the export's max context {rt.max_context}")
    sequences = [int(n) for n in a.sequences.split(",")]
    rows = step_times(rt, contexts, trees, repeats=a.repeats, sequences=sequences)
    one_by_one = lambda r: (f"{r['one_by_one_ms']:.2f} ({r['one_by_one_ms'] / r['median_ms']:.2f}x)"
                            if "one_by_one_ms" in r else "")
    print(markdown_table(["sequences", "context", "tree tokens each", "median ms", "p90 ms", "one by one ms"],
                         [[r["sequences"], r["context"], r["tree_tokens"], f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}",
                           one_by_one(r)] for r in rows]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


def load_prompts(source: str | None, count: int | None) -> list[str]:
    """Benchmark prompts: the embedded held-out ones, a ``.json`` list of strings, a text file of
    prompts separated by blank lines, or a folder of ``.py`` files (prompts cut at ``def`` lines)."""
    from .models import embedded_prompts
    from .training.corpus import code_prompts

    if source is None:
        prompts = embedded_prompts()
    else:
        path = Path(source)
        if path.is_dir():
            prompts = code_prompts(sorted(path.rglob("*.py")), count or 10**9)
        elif path.is_file():
            text = path.read_text()
            prompts = json.loads(text) if path.suffix == ".json" else [p for p in text.split("\n\n") if p.strip()]
        else:
            raise SpecInferError(f"--prompts {source}: no such file or folder")
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
            raise SpecInferError(f"--prompts {source}: expected non-empty prompt strings")
    prompts = prompts[:count] if count else prompts
    if not prompts:
        raise SpecInferError(f"no prompts found in {source}")
    return prompts


def _models(a, all_ssms: bool = True, sampling: bool = False) -> tuple[Path, list[Path]]:
    """--llm/--ssm, or the embedded models when no --llm is given: the LLM with all its SSMs, or
    with SSM 1 alone (the fastest on 2 CPU cores: each SSM adds its own draft calls); ``sampling``:
    with the SSMs that draft for sampled requests instead."""
    from .models import embedded_llm, embedded_sampling_ssms, embedded_ssms

    if a.llm is None:
        embedded = embedded_sampling_ssms() if sampling else embedded_ssms()[:None if all_ssms else 1]
        return embedded_llm(), [Path(s) for s in a.ssm] or embedded
    return Path(a.llm), [Path(s) for s in a.ssm]


def _sampling_ssms(a) -> list[Path]:
    """The SSMs that draft for sampled requests beside --ssm's: the embedded ones when the models
    are the embedded defaults, else none (--ssm's draft for every request)."""
    return _models(a, sampling=True)[1] if a.llm is None and not a.ssm else []


# The trees `bench` runs unless given --tree. Greedy: the chain of 8 shows what a long one costs.
# Under sampling a drafted token is accepted far less often than under greedy decoding, so short
# chains are the fixed trees that pay there (docs/benchmarks.md: chains of 3 and 4 at T=0.7).
GREEDY_BENCH_TREES = [DYNAMIC, "1,1,1,1,1,1,1,1", "1,1,3,1,1,1,1,1"]
SAMPLED_BENCH_TREES = [DYNAMIC, "1,1,1", "1,1,1,1"]


def bench_trees(given: list[str] | None, sampling: bool) -> dict[str, list[int] | None]:
    """The trees `bench` runs, name -> widths per depth (None: dynamic): those given, else its mode's."""
    return {t: parse_tree(t) for t in (given or (SAMPLED_BENCH_TREES if sampling else GREEDY_BENCH_TREES))}


def cmd_bench(a) -> None:
    from .benchmark import BenchConfig, report_markdown, report_plot, run_bench
    from .text import load_tokenizer

    llm, ssms = _models(a, sampling=a.sampling)
    if not ssms:
        raise SpecInferError("bench needs at least one --ssm")
    if not (llm / "config.json").is_file():
        raise SpecInferError(f"--llm {llm}: bench needs a Hugging Face checkpoint folder (the peers convert it)")
    if a.max_tokens < 1:
        raise SpecInferError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    _check_min_confidence(a.min_confidence)
    if a.rounds < 1:
        raise SpecInferError(f"--rounds must be >= 1, got {a.rounds}")
    trees = bench_trees(a.tree, a.sampling)
    tokenizer = load_tokenizer(llm)
    prompts = [tokenizer.encode(p).ids for p in load_prompts(a.prompts, a.num_prompts)]
    report = run_bench(BenchConfig(llm, ssms, prompts, trees, a.max_tokens, a.threads, peers=not a.no_peers,
                                   sampling=a.sampling, seed=a.seed, min_confidence=a.min_confidence,
                                   lookup=not a.no_lookup, rounds=a.rounds, kv_dtype=a.kv_dtype,
                                   matmul_dtype=a.matmul_dtype,
                                   streams=tuple(int(n) for n in a.streams.split(",")) if a.streams else ()))
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench-sampling" if a.sampling else "bench"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    text = report_markdown(report)
    (out / f"{stem}.md").write_text(text + "\n")
    report_plot(report, out / f"{stem}.png")
    print(text)
    print(f"\nwrote {out / stem}.json, .md and .png")


def _given(config, **options):
    """``config`` with the options the user gave (not None) in place of its defaults."""
    from dataclasses import replace

    return replace(config, **{k: v for k, v in options.items() if v is not None})


def cmd_train(a) -> None:
    from .training.corpus import stdlib_corpus
    from .training.train import TrainConfig, train_llm

    cfg = _given(TrainConfig(), steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, seed=a.seed)
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.seq_len < 8:
        raise SpecInferError("--steps and --batch-size must be >= 1, --seq-len >= 8")
    out = train_llm(stdlib_corpus(a.stdlib), a.output, cfg)
    print(f"wrote {out}")


def cmd_boost_tune(a) -> None:
    from .training.boost_tune import BoostConfig, boost_tune
    from .training.corpus import stdlib_corpus

    if not (Path(a.llm) / "tokenizer.json").is_file():
        raise SpecInferError(f"{a.llm} is not a checkpoint folder with a tokenizer.json")
    cfg = _given(BoostConfig(), num_ssms=a.num_ssms, steps=a.steps, prompts=a.prompts,
                 sampled_prompts=a.sampled_prompts, seed=a.seed, hidden_size=a.hidden_size, num_layers=a.layers,
                 intermediate_size=a.intermediate_size, num_heads=a.heads, num_kv_heads=a.kv_heads)
    if cfg.num_ssms < 1 or cfg.steps < 2 or cfg.prompts < 0 or cfg.sampled_prompts < 0 or \
            cfg.prompts + cfg.sampled_prompts < 1:
        raise SpecInferError("--num-ssms must be >= 1, --steps >= 2, --prompts and --sampled-prompts >= 0 "
                             "and not both 0")
    if min(cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads) < 1 or \
            cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise SpecInferError(f"an SSM's sizes must be >= 1, its hidden size ({cfg.hidden_size}) a multiple of "
                             f"--heads ({cfg.num_heads}) and --heads a multiple of --kv-heads ({cfg.num_kv_heads})")
    boost_tune(a.llm, stdlib_corpus(a.stdlib), a.output, cfg)
    print(f"wrote {a.output}")


def cmd_draft_vocab(a) -> None:
    from tokenizers import Tokenizer

    from .config import load_config
    from .export.draft_vocab import most_frequent, token_counts, write_draft_vocab
    from .training.corpus import Corpus, stdlib_corpus

    tokenizer_file = Path(a.tokenizer or a.model_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise SpecInferError(f"no tokenizer.json in {tokenizer_file.parent} (give the LLM's folder as --tokenizer)")
    vocab_size = load_config(a.model_dir).vocab_size
    if a.corpus is None:
        files, source = stdlib_corpus().train, "the standard library's training split (specinfer train's corpus)"
    else:
        corpus = Path(a.corpus)
        files = sorted(corpus.rglob(a.glob)) if corpus.is_dir() else [corpus]
        source = f"{a.glob} under {corpus}" if corpus.is_dir() else str(corpus)
    if not files or not all(f.is_file() for f in files):
        raise SpecInferError(f"no corpus files: {a.corpus} has no {a.glob} files" if files == [] else
                             f"{a.corpus} is not a file or a folder")
    counts = token_counts(Tokenizer.from_file(str(tokenizer_file)), Corpus.texts(files), vocab_size)
    ids = most_frequent(counts, a.size)
    path = write_draft_vocab(a.model_dir, ids, f"the {a.size} most frequent of {int(counts.sum())} tokens "
                                               f"in {len(files)} files: {source}")
    print(f"wrote {path}: {a.size} tokens, {counts[ids].sum() / max(counts.sum(), 1):.1%} of the corpus's tokens")


def cmd_distill(a) -> None:
    from .training.corpus import stdlib_corpus
    from .training.distill import DistillConfig, distill

    for folder in (a.llm, a.ssm):
        if not (Path(folder) / "config.json").is_file():
            raise SpecInferError(f"{folder} is not a checkpoint folder (no config.json)")
    if not (Path(a.llm) / "tokenizer.json").is_file():
        raise SpecInferError(f"{a.llm} has no tokenizer.json")
    cfg = _given(DistillConfig(), steps=a.steps, seed=a.seed)
    if cfg.steps < 2:
        raise SpecInferError("--steps must be >= 2")
    distill(a.llm, a.ssm, stdlib_corpus(a.stdlib), a.output, cfg)
    print(f"wrote {a.output}")


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except SpecInferError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_batching(p, tree_tokens: int | None) -> None:
    """The fused orchestrator's scheduler: its KV budget and its batch's tree budget."""
    p.add_argument("--kv-budget", type=_bytes, default=None,
                   help="KV cache memory the batched requests may hold, e.g. 2GiB (default: half the memory "
                        "available when the server loads); a request that does not fit waits or is refused")
    _add_precision(p, None)
    p.add_argument("--batch-tree-tokens", type=_positive_int, default=tree_tokens,
                   help=f"tree nodes the trees of one batch share in the fused orchestrator (a request alone: "
                        f"its whole --budget; default {BATCH_TREE_TOKENS}); the ensemble-mode one keeps whole trees")
    p.add_argument("--prefill-chunk-tokens", type=_positive_int, default=None,
                   help=f"prompt tokens a batch takes while other requests step: a longer prompt goes in by "
                        f"chunks, so that it does not hold their next tokens (default {PREFILL_CHUNK_TOKENS})")
    p.add_argument("--stream-interval", type=float, default=None,
                   help=f"seconds between a streamed request's responses at least: what it generates meanwhile "
                        f"goes out as one response, so that many streams cost the server and the clients fewer "
                        f"responses (default {STREAM_INTERVAL}; 0: a response every step)")
    p.add_argument("--metrics-seconds", type=float, default=None,
                   help=f"seconds between two hand-overs of a model's metrics to Triton's metrics port (each "
                        f"changed series a round trip between processes; a scrape sees them that late at most) "
                        f"(default {METRICS_SECONDS})")


def _add_precision(p, default: str | None = "float32") -> None:
    """--kv-dtype and --matmul-dtype: what the LLM keeps its caches and computes its products in."""
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=default,
                   help="the LLM's KV caches: float16 halves their memory and the bytes a step of many sequences "
                        "reads, and rounds K and V (logits move by ~1e-3; native kernels only; the SSMs keep "
                        "float32) (default float32)")
    p.add_argument("--matmul-dtype", choices=MATMUL_DTYPES, default=default,
                   help="the LLM's matrix products: bfloat16 rounds weights and activations to bfloat16 and sums "
                        "in float32, as a GPU's bfloat16 products do, at twice the arithmetic rate of float32 "
                        "(a verified tree token ~35%% cheaper; logits move by ~1e-2, so greedy output may differ "
                        "from float32's; native kernels on a CPU with AVX512-BF16 only); int8 quantizes weights per "
                        "column and activations per row and sums exactly, at twice bfloat16's rate and half its "
                        "weight bytes (a step ~1.6-2x faster than bfloat16's; logits move by ~1-2%% of their range, "
                        "greedy output differs from float32's more often; AVX512-VNNI, or AVX2 at ~1.4x float32's one token). The SSMs keep float32 "
                        "(default float32)")


def _add_layout(p, default: str | None) -> None:
    p.add_argument("--layout", choices=LAYOUTS, default=default,
                   help=f"which models serve: 'fused' (ensemble holds every model in its one process, all "
                        f"requests batched by one scheduler; ensemble_sync relays unary infer to it), "
                        f"'ensemble' (ensemble and ensemble_sync call one Triton model per part of a step: "
                        f"ssm_<i>, lookup, tree_builder, llm) or 'both' (the fused one as ensemble_fused, with a "
                        f"second copy of every model) (default {DEFAULT_LAYOUT})")


def cmd_repo(a) -> None:
    from .serving.repository import write_repository

    repo = write_repository(a.llm, a.ssm, a.output, tree=a.tree, sampling_ssms=a.sampling_ssm, engines=a.engines,
                            budget=a.budget, threads=a.threads, kv_dtype=a.kv_dtype or "float32",
                            matmul_dtype=a.matmul_dtype or "float32",
                            lookup=not a.no_lookup, kv_budget=a.kv_budget, batch_tree_tokens=a.batch_tree_tokens,
                            prefill_chunk_tokens=a.prefill_chunk_tokens or PREFILL_CHUNK_TOKENS,
                            stream_interval=STREAM_INTERVAL if a.stream_interval is None else a.stream_interval,
                            metrics_seconds=METRICS_SECONDS if a.metrics_seconds is None else a.metrics_seconds,
                            layout=a.layout)
    print(f"wrote {repo} (models: {', '.join(sorted(p.name for p in repo.iterdir() if p.is_dir()))})")


def cmd_serve(a) -> None:
    import os
    import shutil
    import signal
    import tempfile
    import time

    from .serving.repository import write_repository
    from .serving.server import ADMIN_KEY_ENV, TritonServer, describe_exit

    # SIGTERM stops like Ctrl-C (and the cleanup below runs). SIGINT must stop the server even when
    # our parent ignored it (a child inherits SIG_IGN, and Python then installs no KeyboardInterrupt
    # handler): seen under pytest after onnxruntime-genai had run in the same process.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    repo, made = a.repo, None
    if repo is None:  # the embedded default models, in a folder of ours (deleted when we stop)
        from .models import embedded_llm, embedded_sampling_ssms, embedded_ssms
        made = Path(tempfile.mkdtemp(prefix="specinfer-repo-"))
    try:
        if made is not None:
            # SSM 1 alone, as `generate` drafts by default: it is the faster speculation of the two
            # (bench, embedded prompts: SSM 1 + lookup 1.68x incremental, both SSMs + lookup 1.19x);
            # sampled requests draft with the distilled SSM 1, as they do in `generate`.
            repo = write_repository(embedded_llm(), embedded_ssms()[:1], made, sampling_ssms=embedded_sampling_ssms(),
                                    kv_budget=a.kv_budget, kv_dtype=a.kv_dtype or "float32",
                                    matmul_dtype=a.matmul_dtype or "float32",
                                    batch_tree_tokens=a.batch_tree_tokens or BATCH_TREE_TOKENS,
                                    prefill_chunk_tokens=a.prefill_chunk_tokens or PREFILL_CHUNK_TOKENS,
                                    stream_interval=STREAM_INTERVAL if a.stream_interval is None else a.stream_interval,
                                    metrics_seconds=METRICS_SECONDS if a.metrics_seconds is None else a.metrics_seconds,
                                    layout=a.layout or DEFAULT_LAYOUT)
        elif any(v is not None for v in (a.kv_budget, a.kv_dtype, a.matmul_dtype, a.batch_tree_tokens, a.prefill_chunk_tokens,
                                         a.stream_interval, a.metrics_seconds, a.layout)):
            raise SpecInferError("--kv-budget, --kv-dtype, --matmul-dtype, --batch-tree-tokens, --prefill-chunk-tokens, "
                                 "--stream-interval, --metrics-seconds and --layout belong to the repository: "
                                 "give them to `specinfer repo` (or serve the embedded models)")
        server = TritonServer(repo, a.http_port, a.grpc_port, a.metrics_port, host=a.host, log_file=a.log_file,
                              gateway=not a.no_gateway, max_request_bytes=a.max_request_bytes, admin_key=a.admin_key,
                              open_admin_api=a.open_admin_api, grace_period=a.grace_period)
        print(f"starting tritonserver on {repo} ...", file=sys.stderr)
        try:
            server.start(timeout=a.ready_timeout)
            if server.admin_key is None:
                admin = "open (--open-admin-api)"
            elif a.admin_key or os.environ.get(ADMIN_KEY_ENV):
                admin = "need the header 'specinfer-admin-key' with the given key"
            else:
                admin = "need the header 'specinfer-admin-key' with a random key (give --admin-key to use them)"
            print(f"ready: HTTP http://{server.http_url}/v2/models/ensemble/generate  gRPC {server.grpc_url}  "
                  f"metrics {server.metrics_url}  (Ctrl-C stops)", flush=True)
            print(f"administrative APIs {admin}; tritonserver's log: {server.log_file}; shared memory: "
                  f"/dev/shm/{server.shm_prefix}*", file=sys.stderr)
            while server.process.poll() is None:
                time.sleep(0.5)
            # Died under us: no half-alive state (`finally` stops the gateway too), one clear line,
            # non-zero exit.
            raise SpecInferError(f"tritonserver stopped unexpectedly with {describe_exit(server.process.returncode)}; "
                                 f"its log: {server.log_file}")
        except KeyboardInterrupt:
            print("stopping tritonserver ...", file=sys.stderr)
        finally:
            server.stop()
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and "default" not in text and action.default not in (None, False, [],
                                                                                      argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="specinfer", description="Tree-based speculative inference (SpecInfer).")
    parser.add_argument("--version", action="version", version=f"specinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a Hugging Face checkpoint folder to ONNX")
    p.add_argument("model_dir", help="a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("-o", "--output", required=True, help="the export folder to write")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="weights' and activations' type")
    p.add_argument("--max-context", type=_positive_int, default=None, help="default: max_position_embeddings")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty folder that is not an earlier export of this model")
    p.add_argument("--no-validate", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("build", help="build a TensorRT engine folder from an fp16/bf16 ONNX export (NVIDIA GPU)")
    p.add_argument("onnx_dir", help="an export folder (specinfer export)")
    p.add_argument("-o", "--output", required=True, help="engine folder to write")
    p.add_argument("--max-batch", type=_positive_int, default=1, help="sequences one engine call serves at most")
    p.add_argument("--max-tree-tokens", type=_positive_int, default=64, help="tokens one verification step scores (<= 256)")
    p.add_argument("--max-context", type=_positive_int, default=None, help="default: the export's max context")
    p.add_argument("--attention", choices=["plugin", "native"], default="plugin",
                   help="plugin: our tree-attention kernel (default); native: TensorRT's attention layer, no plugin")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("validate", help="compare a TensorRT engine folder with ONNX Runtime on the same inputs")
    p.add_argument("engine_dir", help="an engine folder (specinfer build)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("generate", help="generate text (speculative when SSMs are given)")
    p.add_argument("prompt", nargs="?", default=None, help="the text to continue; - reads it from stdin")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file (UTF-8)")
    p.add_argument("--llm", "--model", dest="llm", default=None,
                   help="LLM folder: an export or a checkpoint (default: the embedded LLM, with its SSM 1)")
    p.add_argument("--ssm", action="append", default=[], help="SSM folder (repeat for several)")
    p.add_argument("--no-speculation", action="store_true", help="incremental decoding, no SSMs and no lookup")
    _add_lookup(p)
    _add_min_confidence(p)
    p.add_argument("--tree", default=DYNAMIC, help=TREE_HELP)
    p.add_argument("--budget", type=_positive_int, default=64, help="tree nodes at most, root included (default 64)")
    p.add_argument("--engine", choices=ENGINES, default="onnxruntime", help="the runtime to run the models on")
    p.add_argument("--max-context", type=_positive_int, default=None, help="default: the export's max context")
    p.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    _add_precision(p)
    p.add_argument("--stats", action="store_true", help="print tokens/s and speculation statistics")
    _add_sampling(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("cache", help="list or clear the exports of checkpoints cached in $SPECINFER_CACHE")
    p.add_argument("action", choices=["list", "clear"], help="list the cached exports, or remove them")
    p.add_argument("--stale", action="store_true",
                   help="clear only exports of another export format than this version's, or unfinished")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("steptime", help="time one Runtime step by context length and tree size")
    p.add_argument("--model", required=True, help="an export or checkpoint folder")
    p.add_argument("--contexts", default="128,1024", help="cached tokens to time over, comma-separated")
    p.add_argument("--trees", default="1,16,64", help="tree sizes to time, comma-separated")
    p.add_argument("--repeats", type=_positive_int, default=20, help="timed calls per size")
    p.add_argument("--sequences", default="1", help="sequences verified together (one call), comma-separated, "
                                                   "e.g. 1,4,16: each also timed one by one")
    p.add_argument("--engine", choices=ENGINES, default="onnxruntime", help="the runtime to time")
    p.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    _add_precision(p)
    p.add_argument("--json", help="also write the rows as JSON here")
    p.set_defaults(func=cmd_steptime)
    p = sub.add_parser("train", help="train the demo tokenizer and LLM on the Python standard library")
    p.add_argument("-o", "--output", required=True, help="checkpoint folder to write (trainer state goes beside it)")
    p.add_argument("--stdlib", default=None, help="stdlib folder (default: this interpreter's)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the recipe's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the recipe's)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the recipe's)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("boost-tune", help="collective boost-tuning of SSMs on an LLM's continuations")
    p.add_argument("--llm", required=True, help="the LLM checkpoint folder (with tokenizer.json)")
    p.add_argument("-o", "--output", required=True, help="folder for ssm1, ssm2, ... and boost_tuning.json")
    p.add_argument("--stdlib", default=None, help="stdlib folder (default: this interpreter's)")
    p.add_argument("--num-ssms", type=int, default=None, help="SSMs to train (default: the recipe's)")
    p.add_argument("--steps", type=int, default=None, help="training steps of SSM 1 (later ones: half)")
    p.add_argument("--prompts", type=int, default=None, help="training prompts with the LLM's greedy continuation")
    p.add_argument("--sampled-prompts", type=int, default=None,
                   help="training prompts with the LLM's sampled continuation (temperature 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the recipe's)")
    for flag, what in (("--hidden-size", "hidden size"), ("--layers", "layers"), ("--intermediate-size", "MLP size"),
                       ("--heads", "query heads"), ("--kv-heads", "key/value heads")):
        p.add_argument(flag, type=int, default=None, help=f"each SSM's {what} (default: the recipe's)")
    p.set_defaults(func=cmd_boost_tune)

    p = sub.add_parser("draft-vocab", help="write an SSM's draft vocabulary: its drafts come from the tokens "
                                           "most frequent in a corpus (draft_vocab.json in its folder)")
    p.add_argument("model_dir", help="the SSM's checkpoint folder (the file is written there)")
    p.add_argument("--tokenizer", default=None, help="folder with the tokenizer.json (default: model_dir; "
                                                    "an SSM's is usually the LLM's)")
    p.add_argument("--corpus", default=None, help="a text file or a folder of them (default: the standard "
                                                  "library's training split, the demo models' corpus)")
    p.add_argument("--glob", default="*.py", help="files to read under a --corpus folder (default: *.py)")
    p.add_argument("--size", type=_positive_int, default=DRAFT_VOCAB_SIZE,
                   help=f"tokens to keep (default: {DRAFT_VOCAB_SIZE})")
    p.set_defaults(func=cmd_draft_vocab)

    p = sub.add_parser("distill", help="fine-tune an SSM on the LLM's whole next-token distribution "
                                       "(for sampling)")
    p.add_argument("--llm", required=True, help="the LLM checkpoint folder (with tokenizer.json)")
    p.add_argument("--ssm", required=True, help="the SSM checkpoint folder to start from")
    p.add_argument("-o", "--output", required=True, help="folder for the distilled SSM and distillation.json")
    p.add_argument("--stdlib", default=None, help="stdlib folder (default: this interpreter's)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the recipe's)")
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("repo", help="write a Triton model repository for an LLM and its SSMs")
    p.add_argument("--llm", required=True, help="the LLM: an export or checkpoint folder")
    p.add_argument("--ssm", action="append", default=[], help="an SSM: an export or checkpoint folder (repeat for several)")
    p.add_argument("--sampling-ssm", action="append", default=[],
                   help="an SSM that drafts for sampled requests instead of --ssm's, e.g. one made by `specinfer "
                        "distill` (repeat for several; default none: --ssm's draft for every request)")
    p.add_argument("--engines", default=None, help="TensorRT engines folder (from `specinfer build`): llm/ and "
                                                   "ssm_<i>/ for each --ssm, then each --sampling-ssm")
    p.add_argument("--tree", default=DYNAMIC, help=TREE_HELP)
    p.add_argument("--budget", type=_positive_int, default=64, help="tree nodes at most, root included (default 64)")
    p.add_argument("--threads", type=int, default=0,
                   help=THREADS_HELP + " (0: the shared pool, but behind the ensemble each model's process has "
                        "a pool of its own: one thread for a small SSM, every core for the LLM)")
    _add_lookup(p)
    _add_batching(p, BATCH_TREE_TOKENS)
    _add_layout(p, DEFAULT_LAYOUT)
    p.add_argument("-o", "--output", required=True, help="the repository folder to write")
    p.set_defaults(func=cmd_repo)

    p = sub.add_parser("serve", help="serve a model repository from tritonserver (default: the embedded models)")
    p.add_argument("repo", nargs="?", default=None, help="a repository (specinfer repo); default: the embedded models' one, written to a temporary folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (the gateway's)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=8002, help="metrics port")
    p.add_argument("--log-file", default=None, help="write tritonserver's log here (default: a temporary file, "
                                                    "deleted on a clean stop, kept if the server fails)")
    # 1 MiB: serving.gateway.DEFAULT_MAX_REQUEST_BYTES, not imported here (aiohttp loads only to serve).
    p.add_argument("--max-request-bytes", type=_positive_int, default=1 << 20,
                   help="larger HTTP request bodies are refused (413)")
    p.add_argument("--admin-key", default=None, help="the key (header 'specinfer-admin-key', HTTP and gRPC) that "
                                                     "opens the administrative APIs: model repository, config, "
                                                     "statistics, trace, logging, shared memory (default: "
                                                     "$SPECINFER_ADMIN_KEY, else random)")
    p.add_argument("--open-admin-api", action="store_true", help="no key needed for the administrative APIs")
    p.add_argument("--grace-period", type=float, default=5.0,
                   help="seconds in-flight requests get when the server stops, before it is killed")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds the models get to load")
    p.add_argument("--no-gateway", action="store_true", help="clients reach tritonserver's own HTTP port (which "
                                                             "a large form-urlencoded body crashes)")
    _add_batching(p, None)
    _add_layout(p, None)
    p.set_defaults(func=cmd_serve)

    add_client_parser(sub, _HelpWithDefaults)

    p = sub.add_parser("bench", help="our incremental and speculative decoding vs transformers and onnxruntime-genai, "
                                      "side by side, outputs checked equal (default: the embedded models)")
    p.add_argument("--llm", default=None, help="LLM checkpoint folder (default: the embedded LLM and its SSMs)")
    p.add_argument("--ssm", action="append", default=[], help="SSM checkpoint folder (repeat for several)")
    p.add_argument("--tree", action="append", default=None,
                   help="a tree to run (repeat): 'dynamic' or children per depth; default: dynamic, a chain of 8 "
                        "and SpecInfer's 1,1,3,1,1,1,1,1; with --sampling: dynamic, chains of 3 and 4")
    p.add_argument("--prompts", default=None, help="a .json list, a text file (blank-line separated) or a folder "
                                                  "of .py files (default: the embedded held-out prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    _add_precision(p)
    p.add_argument("--streams", default=None,
                   help="greedy: also serve the prompts through the scheduler (the serving engine), this many "
                        "requests at once, comma-separated, e.g. 1,16 (the first --tree, SSM 1; and incremental)")
    p.add_argument("--sampling", action="store_true",
                   help="sampling at temperatures 1 and 0.7: MSS, traversal and naive verification on each tree")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (prompt i uses seed + i)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every contender over the prompts this many times (the contenders take turns prompt "
                        "by prompt, as this machine's speed drifts within minutes); report each one's median "
                        "round and the range, and a ratio of two as the median of their ratios within a round")
    p.add_argument("--no-peers", action="store_true", help="skip transformers and onnxruntime-genai")
    _add_lookup(p)
    _add_min_confidence(p)
    p.add_argument("-o", "--output-dir", default="bench-results", help="where bench.json, .md and .png go")
    p.set_defaults(func=cmd_bench)
    for command in sub.choices.values():
        command.formatter_class = _HelpWithDefaults
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecInferError as e:
        print(f"specinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
