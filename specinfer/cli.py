"""`specinfer`: a thin shell over the library. Bad input exits 2 with a one-line error."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .client.cli import add_client_parser
from .engines.loader import ENGINES
from .errors import SpecInferError


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def cmd_export(a) -> None:
    from .export import export_model

    r = export_model(a.model_dir, a.output, dtype=a.dtype, max_context=a.max_context, validate=not a.no_validate)
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
    from .sampling import SamplingParams

    params = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)  # validates before loading models
    if a.max_tokens < 1:
        raise SpecInferError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    pipe = Pipeline(a.llm, a.ssm, tree=a.tree, budget=a.budget, engine=a.engine,
                    max_context=a.max_context, threads=a.threads)
    stats = Stats()
    for piece in pipe.stream(a.prompt, a.max_tokens, params, stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.stats:
        print(stats.summary(), file=sys.stderr)


def cmd_steptime(a) -> None:
    from .benchmark import markdown_table, step_times
    from .engines.loader import load_runtime

    rt = load_runtime(a.model, a.engine, threads=a.threads)
    contexts = [int(c) for c in a.contexts.split(",")]
    trees = [int(t) for t in a.trees.split(",")]
    if max(contexts) + max(trees) > rt.max_context:
        raise SpecInferError(f"context {max(contexts)} + tree {max(trees)} exceeds the export's max context {rt.max_context}")
    rows = step_times(rt, contexts, trees, repeats=a.repeats)
    print(markdown_table(["context", "tree tokens", "median ms", "p90 ms"],
                         [[r["context"], r["tree_tokens"], f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}"] for r in rows]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


def cmd_bench(a) -> None:
    from .benchmark import compare_trees, markdown_table
    from .pipeline import Pipeline
    from .speculate import parse_widths

    a.tree = a.tree or ["1,1,1,1,1,1,1,1", "4,2,1", "1,1,3,1,1,1,1,1"]
    pipe = Pipeline(a.llm, a.ssm, engine=a.engine, threads=a.threads)
    if not pipe.ssms:
        raise SpecInferError("bench needs at least one --ssm")
    prompts = [pipe.encode(line) for line in open(a.prompts).read().split("\n\n") if line.strip()]
    trees = {t: parse_widths(t) for t in a.tree}
    rows = compare_trees(pipe.llm, pipe.ssms, trees, prompts, a.max_tokens, pipe.eos_ids)
    print(markdown_table(
        ["contender", "tree", "tokens/s", "speedup", "tokens/step", "SSM s", "LLM s", "other s"],
        [[r["contender"], r["tree"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['tokens_per_step']:.2f}",
          f"{r['ssm_s']:.2f}", f"{r['llm_s']:.2f}", f"{r['other_s']:.2f}"] for r in rows]))
    print(f"all speculative outputs identical to incremental decoding on {len(prompts)} prompts")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


def cmd_repo(a) -> None:
    from .repo import write_repository

    repo = write_repository(a.llm, a.ssm, a.output, tree=a.tree, engines=a.engines, budget=a.budget, threads=a.threads)
    print(f"wrote {repo} (models: {', '.join(sorted(p.name for p in repo.iterdir() if p.is_dir()))})")


def cmd_serve(a) -> None:
    import signal
    import tempfile
    import time

    from .repo import write_repository
    from .server import TritonServer

    repo = a.repo
    if repo is None:  # the embedded default models
        from .demo import DEMO_DIR, demo_exports
        llm, ssm = demo_exports(DEMO_DIR)
        repo = write_repository(llm, [ssm], Path(tempfile.mkdtemp(prefix="specinfer-repo-")))
    server = TritonServer(repo, a.http_port, a.grpc_port, a.metrics_port, host=a.host, log_file=a.log_file)
    print(f"starting tritonserver on {repo} ...", file=sys.stderr)
    server.start()
    print(f"ready: HTTP http://{server.http_url}/v2/models/ensemble/generate  gRPC {server.grpc_url}  "
          f"metrics {server.metrics_url}  (Ctrl-C stops)")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while server.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping tritonserver ...", file=sys.stderr)
        server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specinfer", description="Tree-based speculative inference (SpecInfer).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a Hugging Face checkpoint folder to ONNX")
    p.add_argument("model_dir")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
    p.add_argument("--max-context", type=int, default=None, help="default: max_position_embeddings")
    p.add_argument("--no-validate", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("build", help="build a TensorRT engine folder from an fp16/bf16 ONNX export (NVIDIA GPU)")
    p.add_argument("onnx_dir")
    p.add_argument("-o", "--output", required=True, help="engine folder to write")
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--max-tree-tokens", type=int, default=64, help="tokens one verification step scores (<= 256)")
    p.add_argument("--max-context", type=int, default=None, help="default: the export's max context")
    p.add_argument("--attention", choices=["plugin", "native"], default="plugin",
                   help="plugin: our tree-attention kernel (default); native: TensorRT's attention layer, no plugin")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("validate", help="compare a TensorRT engine folder with ONNX Runtime on the same inputs")
    p.add_argument("engine_dir")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("generate", help="generate text (speculative when SSMs are given)")
    p.add_argument("prompt")
    p.add_argument("--llm", "--model", dest="llm", required=True, help="LLM folder: an export or a checkpoint")
    p.add_argument("--ssm", action="append", default=[], help="SSM folder (repeat for several)")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1", help="children per depth (SpecInfer expansion)")
    p.add_argument("--budget", type=int, default=64, help="tree nodes at most, root included")
    p.add_argument("--engine", choices=ENGINES, default="onnxruntime")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stats", action="store_true", help="print tokens/s and speculation statistics")
    _add_sampling(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("steptime", help="time one Runtime step by context length and tree size")
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--trees", default="1,16,64")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--engine", choices=ENGINES, default="onnxruntime")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the rows as JSON here")
    p.set_defaults(func=cmd_steptime)
    p = sub.add_parser("repo", help="write a Triton model repository for an LLM and its SSMs")
    p.add_argument("--llm", required=True)
    p.add_argument("--ssm", action="append", default=[])
    p.add_argument("--engines", default=None, help="TensorRT engines folder (from `specinfer build`)")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads per model (0: all cores)")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_repo)

    p = sub.add_parser("serve", help="serve a model repository from tritonserver (default: the embedded models)")
    p.add_argument("repo", nargs="?", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-file", default=None)
    p.set_defaults(func=cmd_serve)

    add_client_parser(sub)

    p = sub.add_parser("bench", help="incremental vs speculative decoding, side by side, outputs checked equal")
    p.add_argument("--llm", required=True)
    p.add_argument("--ssm", action="append", default=[])
    p.add_argument("--tree", action="append", default=None, help="tree shape (repeat); default: chain, wide, SpecInfer's")
    p.add_argument("--prompts", required=True, help="text file, prompts separated by blank lines")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine", choices=ENGINES, default="onnxruntime")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json")
    p.set_defaults(func=cmd_bench)
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
