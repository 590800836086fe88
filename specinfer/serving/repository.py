"""`specinfer repo`: a ready Triton model repository from the templates in ``templates/`` (package data,
so an installed wheel has them too).

Every model folder's ``config.pbtxt`` is rendered from its ``config.pbtxt.in`` (``${name}``
placeholders) and its ``1/model.py`` copied as it is. Models are exported (ONNX) before the server
starts, so loading the repository never exports.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from string import Template

from ..engines.loader import load_runtime, onnx_folder
from ..engines.native import require_products
from ..engines.runtime import check_kv_dtype, check_matmul_dtype
from ..engines.onnxruntime import read_manifest
from ..errors import SpecInferError
from ..generate import DEFAULT_BUDGET
from ..scheduler import BATCH_TREE_TOKENS, PREFILL_CHUNK_TOKENS
from ..speculate import DYNAMIC, parse_tree
from ..tree_sizing import StepCost
from .triton_glue import KEY_FILE, METRICS_SECONDS, STREAM_INTERVAL

TREE_FIELDS = (("tree_tokens", "TYPE_INT64", "-1"), ("tree_parents", "TYPE_INT32", "-1"),
               ("proposal_node", "TYPE_INT32", "-1"), ("proposal_ssm", "TYPE_INT32", "-1"),
               ("proposal_rank", "TYPE_INT32", "-1"), ("proposal_q_row", "TYPE_INT32", "-1"),
               ("proposal_q", "TYPE_FP32", "-1, -1"))
SSM_INPUTS = ("op", "sequence_id", "caller_key", "tokens", "root", "budget", "tree", "temperature", "top_k", "top_p", "random_seed")
# The client-facing orchestrators of each layout, (name, mode, decoupled). Decoupled ones stream and
# answer /generate; the "_sync" twin answers HTTP and gRPC infer, which Triton refuses for decoupled
# models. Mode "fused" runs the models in its own process; mode "ensemble" calls the llm, ssm_<i>,
# lookup and tree_builder models, each its own process; mode "relay" passes each request on to the
# layout's fused ``ensemble`` (RELAY_TO). Each layout loads each model in one process only: the
# models of Triton's Python backend cannot share one, so a fused orchestrator beside the ensemble's
# models holds a second copy of every model ("both", for comparing the two).
RELAY_TO = "ensemble"
ORCHESTRATORS = {
    "fused": (("ensemble", "fused", True), ("ensemble_sync", "relay", False)),
    "ensemble": (("ensemble", "ensemble", True), ("ensemble_sync", "ensemble", False)),
    "both": (("ensemble", "ensemble", True), ("ensemble_fused", "fused", True), ("ensemble_sync", "ensemble", False)),
}
LAYOUTS = tuple(ORCHESTRATORS)
DEFAULT_LAYOUT = "fused"
MANIFEST = "specinfer_repository.json"
IDLE_TIMEOUT = 120.0   # seconds after which llm and ssm_<i> reclaim a sequence no one steps


def is_repository(path: str | Path) -> bool:
    """Whether ``path`` is a model repository that `specinfer repo` wrote (any layout)."""
    path = Path(path)
    return (path / MANIFEST).is_file() or (path / "spec_step").is_dir()   # spec_step: before the manifest


def templates_dir() -> Path:
    """The model folders' templates: ``templates/`` inside this installed package, or $SPECINFER_TEMPLATES."""
    path = Path(os.environ.get("SPECINFER_TEMPLATES") or Path(__file__).resolve().parent / "templates")
    if not (path / "llm" / "config.pbtxt.in").is_file():
        raise SpecInferError(f"model repository templates not found in {path} (set SPECINFER_TEMPLATES)")
    return path


def _render(template: Path, out: Path, **values) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(Template(template.read_text()).substitute(**{k: str(v) for k, v in values.items()}))


def _model(src: str, dst_name: str, repo: Path, **values) -> None:
    tpl = templates_dir() / src
    _render(tpl / "config.pbtxt.in", repo / dst_name / "config.pbtxt", **values)
    (repo / dst_name / "1").mkdir(parents=True, exist_ok=True)
    if (tpl / "1" / "model.py").is_file():
        shutil.copy(tpl / "1" / "model.py", repo / dst_name / "1" / "model.py")


def measure_step_cost(llm_dir: Path, engine: str, threads: int, kv_dtype: str, required: bool,
                      matmul_dtype: str = "float32") -> StepCost | None:
    """The LLM's verification cost table on this machine with the engine the repository serves it
    with (the dynamic tree's cost model). None when that engine cannot run here and no one needs it."""
    try:
        runtime = load_runtime(llm_dir, engine, threads=threads or None, kv_dtype=kv_dtype, matmul_dtype=matmul_dtype)
    except (SpecInferError, ImportError, OSError) as e:   # e.g. no TensorRT on this machine
        if required:
            raise SpecInferError(f"the dynamic tree needs the LLM's verification cost, measured with its {engine} "
                                 f"engine, which cannot run here ({e}); write the repository where it runs, or "
                                 f"give a fixed --tree") from None
        return None
    return StepCost.measure(runtime)


def write_repository(llm: str | Path, ssms: list[str | Path], out: str | Path, tree: str = DYNAMIC, *,
                     sampling_ssms: list[str | Path] = (),
                     engines: str | Path | None = None, budget: int = DEFAULT_BUDGET, threads: int = 0,
                     kv_dtype: str = "float32", matmul_dtype: str = "float32",
                     lookup: bool = True, idle_timeout: float = IDLE_TIMEOUT, kv_budget: int | None = None,
                     batch_tree_tokens: int = BATCH_TREE_TOKENS, prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
                     stream_interval: float = STREAM_INTERVAL, metrics_seconds: float = METRICS_SECONDS,
                     layout: str = DEFAULT_LAYOUT) -> Path:
    """Write the repository to ``out`` and return it. ``tree``: the default tree spec (``dynamic``
    or widths; a request may ask for another). ``sampling_ssms``: SSMs that draft for sampled
    requests instead of ``ssms`` (e.g. a distilled one); they follow ``ssms`` as ``ssm_<i>``
    models, each drafting for one kind of request. ``engines``: a folder of TensorRT engines
    (``llm/``, ``ssm_<i>/`` for ``ssms`` then ``sampling_ssms``, from ``specinfer build``) to run
    instead of ONNX Runtime.
    ``lookup``: the dynamic tree also drafts by lookup (a ``lookup`` draft model beside the SSMs).
    ``idle_timeout``: seconds after which the stateful models release a sequence no one steps.
    ``kv_dtype``: the LLM's KV caches, float32 or float16 (ONNX Runtime's native kernels only; the
    SSMs keep float32 caches, small ones, which their drafter node reads). ``matmul_dtype``: the
    LLM's matrix products, float32, bfloat16 or int8 (native kernels; bfloat16 on a CPU with
    AVX512-BF16 only).
    ``kv_budget``: bytes of KV cache the fused orchestrator's scheduler may hand out, and the ``llm``
    model's (each its own; None: half the memory available when it loads); ``batch_tree_tokens``:
    tree nodes the fused orchestrator's batch's trees share (the ensemble keeps whole trees);
    ``prefill_chunk_tokens``: prompt tokens a batch takes while other requests step;
    ``stream_interval``: seconds between a streamed request's responses at least (what it generated
    meanwhile goes out as one response; 0: a response every step); ``metrics_seconds``: seconds
    between two hand-overs of a model's metrics to Triton's (a scrape sees them that late at most;
    0: as soon as the last is done).
    ``layout``: which models serve (``ORCHESTRATORS``). "fused" (the default): ``ensemble`` runs
    every model in its process, every request's steps batched by one scheduler, and ``ensemble_sync``
    (KServe infer, which Triton refuses for decoupled models) relays to it. "ensemble": ``ensemble`` and
    ``ensemble_sync`` call one model per process (``spec_step``: ``ssm_<i>`` and ``lookup`` ->
    ``tree_builder`` -> ``llm``). "both": the two, the fused one as ``ensemble_fused``, with a
    second copy of every model."""
    if layout not in ORCHESTRATORS:
        raise SpecInferError(f"unknown repository layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if stream_interval < 0:
        raise SpecInferError(f"the stream interval must be >= 0 seconds, got {stream_interval}")
    if metrics_seconds < 0:
        raise SpecInferError(f"the metrics interval must be >= 0 seconds, got {metrics_seconds}")
    check_kv_dtype(kv_dtype)
    check_matmul_dtype(matmul_dtype)
    if engines is None:   # refused here, not in a Triton model's stub
        require_products(matmul_dtype)
    dynamic = parse_tree(tree) is None
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not is_repository(out):
        raise SpecInferError(f"{out} exists and is not a specinfer model repository")
    llm_dir = onnx_folder(llm).resolve()
    ssm_dirs = [onnx_folder(s).resolve() for s in [*ssms, *sampling_ssms]]
    manifest = read_manifest(llm_dir)
    vocab = manifest["config"]["vocab_size"]
    for d in ssm_dirs:
        if read_manifest(d)["config"]["vocab_size"] != vocab:
            raise SpecInferError(f"SSM {d} has another vocabulary size than the LLM ({vocab})")
    engine = "onnxruntime"
    if engines is not None:
        dtypes = {"KV caches": kv_dtype, "matrix products": matmul_dtype}
        refused = [f"{dtype} {what}" for what, dtype in dtypes.items() if dtype != "float32"]
        if refused:
            raise SpecInferError(f"{' and '.join(refused)} run on ONNX Runtime only, not on TensorRT engines (an engine "
                                 f"computes in its export's dtype)")
        engine, engines = "tensorrt", Path(engines).resolve()
        llm_dir, ssm_dirs = engines / "llm", [engines / f"ssm_{i}" for i in range(len(ssm_dirs))]
    # Which requests each ssm_<i> drafts for: all of them, unless some SSMs are for sampled ones.
    drafts_for = (["greedy"] * len(ssms) + ["sampled"] * len(sampling_ssms)) if sampling_ssms else ["all"] * len(ssms)
    # The ensemble's models (llm, ssm_<i>, lookup, tree_builder, spec_step): the drafters' dynamic
    # tree needs the LLM's cost table, measured here; a fused orchestrator measures its own at load.
    ensemble_models = any(mode == "ensemble" for _, mode, _ in ORCHESTRATORS[layout])
    cost = (measure_step_cost(llm_dir, engine, threads, kv_dtype, required=dynamic, matmul_dtype=matmul_dtype)
            if ensemble_models and (ssm_dirs or lookup) else None)
    lookup = lookup and (cost is not None or not ensemble_models)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    common = dict(engine=engine, threads=threads, kv_dtype=kv_dtype, matmul_dtype=matmul_dtype,
                  metrics_seconds=metrics_seconds)
    if ensemble_models:
        _write_ensemble_models(out, llm_dir, ssm_dirs, drafts_for, lookup, cost, tree, vocab, idle_timeout, kv_budget,
                               prefill_chunk_tokens, common)
    tokenizer_dir = onnx_folder(llm).resolve()
    for name, mode, decoupled in ORCHESTRATORS[layout]:
        _model("orchestrator", name, out, name=name, mode=mode, decoupled=str(decoupled).lower(),
               relay_to=RELAY_TO if mode == "relay" else "", llm_dir=llm_dir,
               ssm_dirs=os.pathsep.join(map(str, ssm_dirs[:len(ssms)])),
               sampling_ssm_dirs=os.pathsep.join(map(str, ssm_dirs[len(ssms):])), tokenizer_dir=tokenizer_dir,
               tree=tree, budget=budget,
               lookup=int(lookup), kv_budget="" if kv_budget is None else int(kv_budget),
               batch_tree_tokens=batch_tree_tokens, prefill_chunk_tokens=prefill_chunk_tokens,
               stream_interval=stream_interval, **common)
    (out / MANIFEST).write_text(json.dumps(
        {"llm": str(llm_dir), "ssms": [str(d) for d in ssm_dirs[:len(ssms)]],
         "sampling_ssms": [str(d) for d in ssm_dirs[len(ssms):]], "tree": tree, "engine": engine, "lookup": lookup,
         "layout": layout}, indent=2))
    return out


def _write_ensemble_models(out: Path, llm_dir: Path, ssm_dirs: list[Path], drafts_for: list[str], lookup: bool,
                           cost: StepCost | None, tree: str, vocab: int, idle_timeout: float, kv_budget: int | None,
                           prefill_chunk_tokens: int, common: dict) -> None:
    """The models an "ensemble" orchestrator calls: ``llm``, ``ssm_<i>``, ``lookup``, ``tree_builder``,
    and ``spec_step``, the Triton ensemble that runs the drafters and then the tree builder."""
    cost_file = ""
    if cost is not None:
        cost_file = out / "step_cost.json"
        cost_file.write_text(json.dumps(cost.to_dict(), indent=2))
    # The orchestrator's key to the stateful models: only it may open and release their sequences.
    key_file = out / KEY_FILE
    key_file.touch(mode=0o600)
    key_file.write_text(secrets.token_hex(16))
    _model("llm", "llm", out, model_dir=llm_dir, idle_timeout=idle_timeout, kv_budget="" if kv_budget is None else int(kv_budget),
           prefill_chunk_tokens=prefill_chunk_tokens, **common)
    drafters = [f"ssm_{i}" for i in range(len(ssm_dirs))] + (["lookup"] if lookup else [])
    for i, name in enumerate(drafters):
        _model("ssm", name, out, name=name, drafter="lookup" if name == "lookup" else "ssm",
               model_dir=ssm_dirs[i] if i < len(ssm_dirs) else "", index=i, tree=tree, step_cost=cost_file,
               drafts_for=drafts_for[i] if i < len(ssm_dirs) else "all",
               vocab_size=vocab, idle_timeout=idle_timeout, **common)
    n = len(drafters)
    ssm_inputs = "".join(f',\n  {{ name: "{f}_{i}" data_type: {t} dims: [ {d} ] }}' for i in range(n) for f, t, d in TREE_FIELDS)
    _model("tree_builder", "tree_builder", out, ssm_inputs=ssm_inputs, num_ssms=n, vocab_size=vocab)
    ssm_steps = "".join(
        f'\n    {{\n      model_name: "{drafters[i]}"\n      model_version: -1\n'
        + "".join(f'      input_map {{ key: "{k}" value: "{k}" }}\n' for k in SSM_INPUTS)
        + "".join(f'      output_map {{ key: "{f}" value: "{f}_{i}" }}\n' for f, _, _ in TREE_FIELDS)
        + "    },"
        for i in range(n))
    builder_inputs = "".join(f'\n      input_map {{ key: "{f}_{i}" value: "{f}_{i}" }}' for i in range(n) for f, _, _ in TREE_FIELDS)
    _model("spec_step", "spec_step", out, ssm_steps=ssm_steps, builder_inputs=builder_inputs)
