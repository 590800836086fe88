"""ONNX export -> TensorRT 11 engine folder (``specinfer build``), and its check (``specinfer validate``).

TensorRT 11 builds strongly typed networks only: precision comes from the ONNX (an fp16 or bf16
export), never from a builder flag, so an fp32 export is refused. Two attention variants:

- ``plugin`` (default): the export as it is; each ``specinfer::TreeAttention`` node becomes our
  plugin (:mod:`specinfer.plugins.tensorrt_plugin`, the OpenAI Triton kernel compiled to PTX).
- ``native``: no plugin. The TreeAttention function is replaced by a body of ops TensorRT's parser
  imports and inlined: the standard ONNX ``Attention`` (TensorRT's built-in IAttention) with a boolean
  tree mask. The mask is unpacked from the same packed bits with INT64 ``Div``/``Mod``/``Gather``
  because TensorRT has no ``BitShift``/``BitwiseAnd`` nor UINT32, so both variants take the same
  inputs and one runtime serves both. The query is scaled before ``Attention`` (IAttention takes Q
  pre-scaled); K and V are concatenated outside it (IAttention takes no ``past_key``).

Two optimization profiles: ``prefill`` (long chains over a short or empty cache) and ``tree`` (tree
verification: up to ``--max-tree-tokens`` tokens over up to ``--max-context`` cached ones). The build
goes through polygraphy's loaders with a timing cache kept in the engine folder; a manifest beside
the engine records what the runtime needs. Validation runs TensorRT and ONNX Runtime on the same
inputs through polygraphy's comparator.

Untested here: TensorRT and a GPU are absent from our machines. Everything before the TensorRT
calls (checks, the native graph, profiles, the manifest, the comparator on two ONNX Runtime
runners) is tested here.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import SpecInferError
from ..export.draft_vocab import DRAFT_VOCAB
from ..plugins import onnx_function
from ..plugins.tree_attention import BITS_PER_WORD

FORMAT = "specinfer-tensorrt/1"
MANIFEST = "manifest.json"
ENGINE_FILE = "model.engine"
NATIVE_ONNX = "model_native.onnx"
TIMING_CACHE = "timing.cache"
ATTENTION = ("plugin", "native")
MAX_TREE_TOKENS = 256
# TensorRT against ONNX Runtime, max |difference| allowed, on logits and on the new KV. bf16 is
# compared with ONNX Runtime computing the bf16 weights in float32 (its CPU provider has no bf16).
TOLERANCE = {"fp16": {"atol": 5e-2, "rtol": 1e-2}, "bf16": {"atol": 2.5e-1, "rtol": 5e-2}}
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "config.json", DRAFT_VOCAB)


def read_export(onnx_dir: str | Path) -> dict:
    """The export's manifest, refusing what TensorRT 11 cannot build."""
    from .onnxruntime import read_manifest

    manifest = read_manifest(onnx_dir)
    if manifest.get("format") == FORMAT:
        raise SpecInferError(f"{onnx_dir} is already a TensorRT engine folder; build from an ONNX export")
    dtype = manifest.get("dtype")
    if dtype == "fp32":
        raise SpecInferError(
            f"{onnx_dir} is an fp32 export: TensorRT 11 builds strongly typed networks, whose precision comes "
            "from the ONNX, not from a builder flag. Export again in half precision: "
            "`specinfer export CHECKPOINT_DIR -o OUT_DIR --dtype fp16` (or --dtype bf16)")
    if dtype not in ("fp16", "bf16"):
        raise SpecInferError(f"{onnx_dir}: unsupported export dtype {dtype!r} (fp16 or bf16)")
    return manifest


def check_limits(manifest: dict, max_batch: int, max_tree_tokens: int, max_context: int) -> None:
    exported = manifest["max_context"]
    if max_batch < 1:
        raise SpecInferError(f"--max-batch must be >= 1, got {max_batch}")
    if not 2 <= max_context <= exported:
        raise SpecInferError(f"--max-context must be in 2..{exported} (the export's max context), got {max_context}")
    if not 1 <= max_tree_tokens <= min(MAX_TREE_TOKENS, max_context):
        raise SpecInferError(f"--max-tree-tokens must be in 1..{min(MAX_TREE_TOKENS, max_context)}, got {max_tree_tokens}")


# --- optimization profiles -------------------------------------------------------------------------
def optimization_profiles(manifest: dict, max_batch: int, max_tree_tokens: int,
                          max_context: int) -> dict[str, dict[str, dict[str, tuple]]]:
    """``{profile: {input: {"min"|"opt"|"max": shape}}}`` for every graph input of the export.

    The runtime runs one sequence at a time (batch opt 1); the server may batch up to ``max_batch``.
    ``tree`` = T new tokens and N tree tokens up to ``max_tree_tokens`` (opt: a full tree) over up
    to ``max_context - 1`` cached tokens (opt: half). ``prefill`` = a chain of up to ``max_context``
    tokens (opt: 512 or the context) over a cache from empty (opt) to ``max_context - 1``.
    """
    words = lambda n: -(-n // BITS_PER_WORD)
    prefill_t = min(512, max_context)
    dims = {
        "prefill": {"batch": (1, 1, max_batch), "tree": (1, prefill_t, max_context),
                    "tree_tokens": (1, prefill_t, max_context),
                    "mask_words": (1, words(prefill_t), words(max_context)), "past": (0, 0, max_context - 1)},
        "tree": {"batch": (1, 1, max_batch), "tree": (1, max_tree_tokens, max_tree_tokens),
                 "tree_tokens": (1, max_tree_tokens, max_tree_tokens),
                 "mask_words": (1, words(max_tree_tokens), words(max_tree_tokens)),
                 "past": (0, max_context // 2, max_context - 1)},
    }
    profiles = {}
    for name, table in dims.items():
        shapes = {}
        for inp, spec in manifest["inputs"].items():
            per_dim = [table[d] if isinstance(d, str) else (d, d, d) for d in spec["shape"]]
            shapes[inp] = {k: tuple(dim[i] for dim in per_dim) for i, k in enumerate(("min", "opt", "max"))}
        profiles[name] = shapes
    return profiles


def pick_profile(profiles: dict, shapes: dict[str, tuple]) -> int:
    """Index of the first profile (tree before prefill) whose ranges hold every input shape."""
    order = sorted(range(len(profiles)), key=lambda i: list(profiles)[i] != "tree")
    for i in order:
        ranges = list(profiles.values())[i]
        if all(all(lo <= s <= hi for s, lo, hi in zip(shape, ranges[n]["min"], ranges[n]["max"]))
               for n, shape in shapes.items()):
            return i
    raise SpecInferError(f"no optimization profile of the engine holds these shapes: {shapes}")


# --- the native-attention variant -------------------------------------------------------------------
def native_function_proto() -> onnx.FunctionProto:
    """TreeAttention as ops TensorRT imports: INT64 bit unpacking, Q pre-scaled, one standard Attention."""
    n = helper.make_node
    const = lambda name, dtype, dims, vals: n("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, vals))
    scale = n("Constant", [], ["scale_f"])
    scale.attribute.append(helper.AttributeProto(name="value_float", ref_attr_name="scale",
                                                 type=helper.AttributeProto.FLOAT))
    nodes = [
        const("axis1", TensorProto.INT64, [1], [1]), const("zero", TensorProto.INT64, [1], [0]),
        const("word_bits", TensorProto.INT64, [], [BITS_PER_WORD]), const("two", TensorProto.INT64, [], [2]),
        const("one_s", TensorProto.INT64, [], [1]), const("zero_s", TensorProto.INT64, [], [0]),
        const("two32", TensorProto.INT64, [], [1 << 32]),
        const("pow2", TensorProto.INT64, [BITS_PER_WORD], [1 << i for i in range(BITS_PER_WORD)]),
        const("true", TensorProto.BOOL, [1], [True]),
        n("Shape", ["query"], ["b"], start=0, end=1), n("Shape", ["query"], ["t"], start=1, end=2),
        n("Shape", ["past_key"], ["s"], start=1, end=2), n("Shape", ["tree_mask"], ["nn"], start=1, end=2),
        n("Add", ["s", "t"], ["total"]), n("Sub", ["total", "nn"], ["prefix"]), n("Sub", ["nn", "t"], ["first_row"]),
        n("Slice", ["tree_mask", "first_row", "nn", "axis1"], ["rows"]),
        # Each int32 word as its unsigned value in int64, then bit j = floor(word / 2^(j % 32)) mod 2.
        n("Cast", ["rows"], ["rows64"], to=TensorProto.INT64),
        n("Add", ["rows64", "two32"], ["rows_shifted"]), n("Mod", ["rows_shifted", "two32"], ["rows_u"]),
        n("Squeeze", ["nn", "zero"], ["n_scalar"]), n("Range", ["zero_s", "n_scalar", "one_s"], ["j"]),
        n("Div", ["j", "word_bits"], ["word"]), n("Mod", ["j", "word_bits"], ["bit"]),
        n("Gather", ["rows_u", "word"], ["words"], axis=2), n("Gather", ["pow2", "bit"], ["weight"], axis=0),
        n("Div", ["words", "weight"], ["shifted"]), n("Mod", ["shifted", "two"], ["bits"]),
        n("Equal", ["bits", "one_s"], ["tree_vis"]),
        n("Concat", ["b", "t", "prefix"], ["prefix_shape"], axis=0), n("Expand", ["true", "prefix_shape"], ["prefix_vis"]),
        n("Concat", ["prefix_vis", "tree_vis"], ["vis"], axis=2), n("Unsqueeze", ["vis", "axis1"], ["attn_mask"]),
        n("Concat", ["past_key", "key"], ["k_all"], axis=1), n("Concat", ["past_value", "value"], ["v_all"], axis=1),
        scale, n("CastLike", ["scale_f", "query"], ["scale_q"]), n("Mul", ["query", "scale_q"], ["q_scaled"]),
        n("Transpose", ["q_scaled"], ["q_t"], perm=[0, 2, 1, 3]), n("Transpose", ["k_all"], ["k_t"], perm=[0, 2, 1, 3]),
        n("Transpose", ["v_all"], ["v_t"], perm=[0, 2, 1, 3]),
        n("Attention", ["q_t", "k_t", "v_t", "attn_mask"], ["o_t"], scale=1.0),
        n("Transpose", ["o_t"], ["output"], perm=[0, 2, 1, 3]),
    ]
    return helper.make_function(onnx_function.DOMAIN, onnx_function.OP_TYPE, list(onnx_function.INPUTS), ["output"],
                                nodes, opset_imports=[helper.make_opsetid("", onnx_function.OPSET)],
                                attributes=list(onnx_function.ATTRIBUTES))


def native_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The export with every TreeAttention node inlined as :func:`native_function_proto`: standard ops only."""
    from onnx import inliner

    if not onnx_function.tree_attention_nodes(model):
        raise SpecInferError("the model has no specinfer::TreeAttention node: is it a specinfer export?")
    model = onnx.ModelProto.FromString(model.SerializeToString()) if model.ByteSize() < (1 << 31) else model
    keep = [f for f in model.functions if not (f.domain == onnx_function.DOMAIN and f.name == onnx_function.OP_TYPE)]
    del model.functions[:]
    model.functions.extend(keep + [native_function_proto()])
    model = inliner.inline_local_functions(model)
    keep_ops = [o for o in model.opset_import if o.domain != onnx_function.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep_ops)
    custom = {n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    if custom:
        raise SpecInferError(f"native variant still has custom-domain nodes: {sorted(custom)}")
    return model


def write_native_onnx(src: Path, dst: Path, external_data_bytes: int = 1 << 30) -> Path:
    model = native_model(onnx.load(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    (dst.parent / (dst.name + ".data")).unlink(missing_ok=True)
    onnx.save(model, dst, save_as_external_data=model.ByteSize() > external_data_bytes, location=dst.name + ".data")
    return dst


# --- the build ----------------------------------------------------------------------------------------
@dataclass
class BuildPlan:
    """Everything decided before TensorRT is called (all of it checked here, without TensorRT)."""

    onnx_dir: Path
    out_dir: Path
    export: dict
    attention: str
    max_batch: int
    max_tree_tokens: int
    max_context: int
    profiles: dict = field(default_factory=dict)

    @property
    def onnx_path(self) -> Path:
        """The graph TensorRT parses: the export itself (plugin), or its native rewrite in the engine folder."""
        return self.onnx_dir / self.export["onnx"] if self.attention == "plugin" else self.out_dir / NATIVE_ONNX

    def manifest(self, **extra) -> dict:
        e = self.export
        return {
            "format": FORMAT, "engine": ENGINE_FILE, "attention": self.attention,
            "plugin": {"id": "specinfer::TreeAttention", "api": "tensorrt.plugin (ahead of time: PTX from OpenAI Triton)",
                       "fields": ["num_heads", "num_kv_heads", "scale"]} if self.attention == "plugin" else None,
            "onnx_dir": str(self.onnx_dir.resolve()), "onnx": str(self.onnx_path.resolve()),
            "dtype": e["dtype"], "config": e["config"], "inputs": e["inputs"], "outputs": e["outputs"],
            "tree_mask": e.get("tree_mask"), "max_batch": self.max_batch, "max_tree_tokens": self.max_tree_tokens,
            "max_context": self.max_context, "profiles": {p: {i: {k: list(v) for k, v in r.items()} for i, r in s.items()}
                                                         for p, s in self.profiles.items()},
            "timing_cache": TIMING_CACHE, **extra,
        }


def plan_build(onnx_dir: str | Path, out_dir: str | Path, max_batch: int = 1, max_tree_tokens: int = 64,
               max_context: int | None = None, attention: str = "plugin") -> BuildPlan:
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    if attention not in ATTENTION:
        raise SpecInferError(f"unknown --attention '{attention}' (choose from {', '.join(ATTENTION)})")
    export = read_export(onnx_dir)
    max_context = max_context or export["max_context"]
    check_limits(export, max_batch, max_tree_tokens, max_context)
    if out_dir.resolve() == onnx_dir.resolve():
        raise SpecInferError("the engine folder must differ from the ONNX folder")
    plan = BuildPlan(onnx_dir, out_dir, export, attention, max_batch, max_tree_tokens, max_context)
    plan.profiles = optimization_profiles(export, max_batch, max_tree_tokens, max_context)
    return plan


def require_tensorrt():
    """``tensorrt`` and a visible CUDA GPU, or a one-line error saying which is missing."""
    try:
        import tensorrt as trt
    except ImportError:
        raise SpecInferError("TensorRT is not installed: `pip install 'specinfer[tensorrt]'` (TensorRT 11 and "
                             "polygraphy) on a machine with an NVIDIA GPU, or use the Docker image") from None
    try:
        import polygraphy  # noqa: F401
    except ImportError:
        raise SpecInferError("polygraphy is not installed: `pip install 'specinfer[tensorrt]'`") from None
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = trt.Builder(trt.Logger(trt.Logger.ERROR)) is not None
    if not gpu:
        raise SpecInferError("no CUDA GPU is visible: TensorRT builds and runs engines on an NVIDIA GPU")
    return trt


def _progress_monitor(trt):
    """A TensorRT IProgressMonitor that shows the builder's phases as tqdm bars on stderr."""
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.bars = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.bars[phase_name] = tqdm(total=num_steps, desc=phase_name, leave=parent_phase is None, file=sys.stderr)

        def step_complete(self, phase_name, step):
            self.bars[phase_name].update(1)
            return True  # never cancel

        def phase_finish(self, phase_name):
            self.bars.pop(phase_name).close()

    return Monitor()


def build_engines(onnx_dir: str | Path, out_dir: str | Path, max_batch: int = 1, max_tree_tokens: int = 64,
                  max_context: int | None = None, attention: str = "plugin", progress: bool = True) -> Path:
    """Build ``OUT_DIR/model.engine`` (+ manifest, timing cache, tokenizer) from an fp16/bf16 export."""
    plan = plan_build(onnx_dir, out_dir, max_batch, max_tree_tokens, max_context, attention)
    trt = require_tensorrt()
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, Profile, SaveEngine

    plan.out_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)
    if attention == "plugin":
        from ..plugins.tensorrt_plugin import register_plugin

        register_plugin()  # before parsing: the parser maps each TreeAttention node to it
    else:
        say(f"writing the native-attention graph {plan.onnx_path}")
        write_native_onnx(plan.onnx_dir / plan.export["onnx"], plan.onnx_path)
    profiles = []
    for shapes in plan.profiles.values():
        p = Profile()
        for name, r in shapes.items():
            p.add(name, min=r["min"], opt=r["opt"], max=r["max"])
        profiles.append(p)
    cache = plan.out_dir / TIMING_CACHE
    # Strongly typed (TensorRT 11's only mode): no precision flag; types come from the ONNX.
    config = CreateConfig(profiles=profiles, load_timing_cache=str(cache) if cache.exists() else None,
                          progress_monitor=_progress_monitor(trt) if progress else None)
    say(f"building {plan.out_dir / ENGINE_FILE} ({attention} attention, {plan.export['dtype']}, "
        f"profiles {', '.join(plan.profiles)})")
    start = time.time()
    try:
        engine = SaveEngine(EngineFromNetwork(NetworkFromOnnxPath(str(plan.onnx_path)), config,
                                              save_timing_cache=str(cache)), str(plan.out_dir / ENGINE_FILE))()
    except Exception as e:  # polygraphy raises after TensorRT has logged the details above
        raise SpecInferError(f"TensorRT could not build {plan.onnx_path}: {_first_line(e)}") from None
    import torch

    manifest = plan.manifest(tensorrt_version=trt.__version__, gpu=torch.cuda.get_device_name(),
                             num_profiles=engine.num_optimization_profiles, build_seconds=round(time.time() - start, 1),
                             built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (plan.out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for name in COPIED:
        if (plan.onnx_dir / name).is_file():
            shutil.copy(plan.onnx_dir / name, plan.out_dir / name)
    return plan.out_dir / ENGINE_FILE


def _first_line(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(e).__name__


def read_engine_manifest(engine_dir: str | Path) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise SpecInferError(f"no {MANIFEST} in {engine_dir}: is it a folder written by `specinfer build`?")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise SpecInferError(f"{engine_dir} is not a TensorRT engine folder (format {manifest.get('format')!r}): "
                             "build one with `specinfer build`")
    return manifest


# --- validation ---------------------------------------------------------------------------------------
def validation_cases(manifest: dict) -> dict[str, tuple[int, dict]]:
    """``{case: (profile index, feeds)}``: a prefill on the prefill profile, a branching tree over a cache
    on the tree profile; fp16 feeds as numpy, bf16 KV as torch bfloat16 (numpy has no bf16)."""
    from ..config import ModelConfig
    from ..export.onnx_export import sample_inputs

    config = ModelConfig.from_dict(manifest["config"])
    ctx, tree = manifest["max_context"], manifest["max_tree_tokens"]
    chain = min(16, ctx)
    parents = [-1, 0, 0, 1, 1, 2, 5, -1][:tree]
    past = min(9, ctx - len(parents))
    cases = {"prefill": (0, sample_inputs(config, 1, list(range(-1, chain - 1)), 0, np.float32, seed=1)),
             "tree": (1, sample_inputs(config, min(2, manifest["max_batch"]), parents, past, np.float32, seed=2))}
    for _, feeds in cases.values():
        for name in [n for n in feeds if n.startswith("past")]:
            if manifest["dtype"] == "fp16":
                feeds[name] = feeds[name].astype(np.float16)
            else:
                import torch

                feeds[name] = torch.from_numpy(feeds[name]).to(torch.bfloat16)
    return cases


def onnxruntime_runner(onnx_path: Path, dtype: str):
    """A polygraphy runner of the export on ONNX Runtime's CPU provider; for bf16, the graph computed
    in float32 (bf16 feeds converted on the way in, KV outputs back to bf16 on the way out)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from .onnxruntime import open_session

    if dtype != "bf16":
        return OnnxrtRunner(lambda: open_session(str(onnx_path)))
    from ..export.onnx_export import upcast_bf16

    class Float32Runner(OnnxrtRunner):
        def get_input_metadata_impl(self):
            from polygraphy.datatype import DataType

            meta = super().get_input_metadata_impl()
            for name in [n for n in meta if n.startswith("past")]:
                meta[name].dtype = DataType.BFLOAT16
            return meta

        def infer_impl(self, feed_dict):
            import torch

            feeds = {k: v.float() if getattr(v, "dtype", None) == torch.bfloat16 else v for k, v in feed_dict.items()}
            out = super().infer_impl(feeds)
            return {k: torch.as_tensor(v).to(torch.bfloat16) if k.startswith("new_") else torch.as_tensor(v)
                    for k, v in out.items()}

    proto = upcast_bf16(onnx.load(onnx_path))
    return Float32Runner(lambda: open_session(proto.SerializeToString()))


def compare(runners: list, cases: dict[str, tuple[int, dict]], atol: float, rtol: float,
            set_profile=None) -> dict[str, dict[str, float]]:
    """Run the runners on each case through polygraphy's Comparator; ``{case: {output: max |diff|}}``.
    ``set_profile(runners, index)`` picks each case's optimization profile. Raises if any output
    differs beyond ``atol + rtol * |reference|``."""
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.logger import G_LOGGER

    report = {}
    for case, (profile, feeds) in cases.items():
        active = set_profile(runners, profile) if set_profile else runners
        with G_LOGGER.verbosity(G_LOGGER.ERROR):  # our one-line summary instead of polygraphy's pages
            results = Comparator.run(active, data_loader=[feeds])
            accuracy = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=rtol))
        per_func = accuracy[0] if not hasattr(accuracy, "items") else accuracy  # polygraphy >= 0.53: a list
        diffs = {}
        for iterations in per_func.values():
            for iteration in iterations:
                for name, result in iteration.items():
                    diffs[name] = max(diffs.get(name, 0.0), float(result.max_absdiff))
        report[case] = diffs
        if not bool(per_func):
            worst = max(diffs, key=diffs.get)
            raise SpecInferError(f"validation failed on {case}: {worst} differs by {diffs[worst]:.3g} "
                                 f"(tolerance atol {atol}, rtol {rtol})")
    return report


def validate_engine(engine_dir: str | Path) -> dict[str, dict[str, float]]:
    """TensorRT against ONNX Runtime on a prefill and a tree step; tolerances :data:`TOLERANCE`."""
    manifest = read_engine_manifest(engine_dir)
    require_tensorrt()
    from polygraphy.backend.trt import EngineFromPath, TrtRunner

    source = Path(manifest["onnx_dir"])
    export = read_export(source)
    engine = Path(engine_dir) / manifest["engine"]
    ort_runner = onnxruntime_runner(source / export["onnx"], manifest["dtype"])

    def set_profile(runners, index):  # one TensorRT runner per profile
        return [TrtRunner(EngineFromPath(str(engine)), name=f"tensorrt-profile{index}", optimization_profile=index),
                runners[1]]

    try:
        report = compare([None, ort_runner], validation_cases(manifest), set_profile=set_profile,
                         **TOLERANCE[manifest["dtype"]])
    except SpecInferError:
        raise
    except Exception as e:  # a runner failed (polygraphy has logged TensorRT's or ONNX Runtime's words)
        raise SpecInferError(f"validation could not run {engine}: {_first_line(e)}") from None
    manifest["validation"] = {"max_abs_diff": report, "tolerance": TOLERANCE[manifest["dtype"]],
                              "reference": "ONNX Runtime CPU on the export"}
    (Path(engine_dir) / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return report
