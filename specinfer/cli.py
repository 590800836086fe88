"""`specinfer`: a thin shell over the library. Bad input exits 2 with a one-line error."""
from __future__ import annotations

import argparse
import json
import sys

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

    p = sub.add_parser("generate", help="generate text (speculative when SSMs are given)")
    p.add_argument("prompt")
    p.add_argument("--llm", "--model", dest="llm", required=True, help="LLM folder: an export or a checkpoint")
    p.add_argument("--ssm", action="append", default=[], help="SSM folder (repeat for several)")
    p.add_argument("--tree", default="1,1,3,1,1,1,1,1", help="children per depth (SpecInfer expansion)")
    p.add_argument("--budget", type=int, default=64, help="tree nodes at most, root included")
    p.add_argument("--engine", choices=["onnxruntime", "torch"], default="onnxruntime")
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
    p.add_argument("--engine", choices=["onnxruntime", "torch"], default="onnxruntime")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the rows as JSON here")
    p.set_defaults(func=cmd_steptime)
    p = sub.add_parser("bench", help="incremental vs speculative decoding, side by side, outputs checked equal")
    p.add_argument("--llm", required=True)
    p.add_argument("--ssm", action="append", default=[])
    p.add_argument("--tree", action="append", default=None, help="tree shape (repeat); default: chain, wide, SpecInfer's")
    p.add_argument("--prompts", required=True, help="text file, prompts separated by blank lines")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine", choices=["onnxruntime", "torch"], default="onnxruntime")
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
