"""PyTorch -> ONNX: one graph per model that scores a token tree over a KV cache.

Graph inputs: ``input_ids`` int64 [B, T], ``position_ids`` int64 [B, T], ``tree_mask`` int32
[B, N, W] (see :mod:`specinfer.plugins.tree_attention`), and per layer ``past_key.i`` /
``past_value.i`` [B, S, Hkv, D]. Outputs: ``logits`` float32 [B, T, V] and per layer ``new_key.i``
/ ``new_value.i`` [B, T, Hkv, D]: the runtime writes those into its own cache, so the graph never
copies the cache into an output. B, T, N, W and S are dynamic. Attention is one
``specinfer::TreeAttention`` node per layer with a model-local function body.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ModelConfig, check_context, load_config
from ..errors import SpecInferError
from ..plugins import onnx_function
from ..plugins.tree_attention import tree_mask_from_parents
from .draft_vocab import DRAFT_VOCAB, read_draft_vocab

MANIFEST = "manifest.json"
ONNX_FILE = "model.onnx"
# Bumped whenever the exported graph changes, so cached exports of checkpoints are redone.
EXPORT_FORMAT = "specinfer-onnx/7"  # 2: RoPE as one RotaryEmbedding node; 3: the ONNX Runtime lowering;
                                    # 5: the drafter gives each step's runner-up token; 6: a sampled drafter;
                                    # 7: the drafters' steps trimmed to fewer kernels
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "config.json")
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf caps a file at 2 GiB; stay well under it
DTYPES = ("fp32", "fp16", "bf16")
# Max abs logit difference, ONNX Runtime vs PyTorch, that validation accepts.
# bf16 is checked in float32 on both sides (see validate_export), hence the fp32 tolerance.
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 1e-3}


def input_names(num_layers: int) -> list[str]:
    past = [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "position_ids", "tree_mask"] + past


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [f"new_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]


def _flat_module(model):
    import torch

    class FlatModel(torch.nn.Module):
        """The model with flat tensor arguments and outputs, as ONNX wants them."""

        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, position_ids, tree_mask, *past):
            logits, keys, values = self.inner(input_ids, position_ids, tree_mask,
                                              list(past[0::2]), list(past[1::2]))
            return (logits, *[t for kv in zip(keys, values) for t in kv])

    return FlatModel().eval()


def sample_inputs(config, batch: int, parents: list[int], past_len: int, dtype, seed: int = 0):
    """Random but valid inputs: a tree over a cache of ``past_len`` tokens (numpy, by input name)."""
    rng = np.random.default_rng(seed)
    t = len(parents)
    mask = tree_mask_from_parents(parents)
    depth = np.zeros(t, dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    feeds = {
        "input_ids": rng.integers(0, config.vocab_size, (batch, t), dtype=np.int64),
        "position_ids": np.broadcast_to(past_len + depth, (batch, t)).copy(),
        "tree_mask": np.broadcast_to(mask, (batch,) + mask.shape).copy(),
    }
    shape = (batch, past_len, config.num_kv_heads, config.head_dim)
    for name in input_names(config.num_layers)[3:]:
        feeds[name] = rng.standard_normal(shape).astype(dtype)
    return feeds


@dataclass
class ExportResult:
    out_dir: Path
    onnx_path: Path
    manifest: dict
    max_abs_diff: dict[str, float] | None  # per validation case, None when skipped


def _progress(steps: list[str]):
    from tqdm import tqdm

    bar = tqdm(total=len(steps), desc="export", unit="step", leave=True)

    def advance(i: int):
        bar.set_postfix_str(steps[i])
        if i:
            bar.update(1)
    return bar, advance


def check_output_folder(out_dir: Path, config: ModelConfig, force: bool = False) -> None:
    """Refuse, before any work, an output that is a file, or a non-empty folder that is not an
    earlier export of the same model (its files would be overwritten or mixed with ours)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecInferError(f"{out_dir} is a file: the export writes a folder there")
    if force or not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    manifest = out_dir / MANIFEST
    try:
        same = json.loads(manifest.read_text()).get("config") == json.loads(json.dumps(config.to_dict()))
    except (OSError, ValueError):
        same = False
    if not same:
        raise SpecInferError(f"{out_dir} is not empty and is not an export of this model: choose another folder, "
                             f"or --force to write over it")


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "fp32",
    max_context: int | None = None,
    validate: bool = True,
    external_data_bytes: int = EXTERNAL_DATA_BYTES,
    progress: bool = True,
    force: bool = False,
) -> ExportResult:
    """Export a Hugging Face checkpoint folder to ``OUT_DIR/model.onnx`` plus a manifest.
    ``OUT_DIR`` must be new, empty or an earlier export of the same model, unless ``force``."""
    import onnx
    import torch

    from ..model import load_model

    if dtype not in DTYPES:
        raise SpecInferError(f"unsupported dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config(model_dir)
    check_output_folder(out_dir, config, force)
    max_context = config.max_position_embeddings if max_context is None else max_context
    if max_context < 2:
        raise SpecInferError(f"--max-context must be at least 2, got {max_context}")
    check_context(config, max_context)
    draft_vocab = read_draft_vocab(model_dir, config.vocab_size)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    steps = ["load weights", "trace to ONNX", "write", "validate", "lower for ONNX Runtime"]
    bar, advance = _progress(steps) if progress else (None, lambda i: None)

    advance(0)
    model = load_model(model_dir, torch_dtype)
    flat = _flat_module(model)

    advance(1)
    onnx_function.register_schema()
    names = input_names(config.num_layers)
    # A sample with B, T, N and S all distinct and > 1, so that no dimension is specialised.
    feeds = sample_inputs(config, 2, [-1, 0, 0, 1, 2], 3, np.float32)
    args = tuple(torch.from_numpy(feeds[n]).to(torch_dtype) if n.startswith("past") else torch.from_numpy(feeds[n])
                 for n in names)
    Dim = torch.export.Dim
    batch, tree, ntree, words, past = Dim("batch"), Dim("tree"), Dim("tree_tokens"), Dim("mask_words"), Dim("past")
    dynamic = {"input_ids": {0: batch, 1: tree}, "position_ids": {0: batch, 1: tree},
               "tree_mask": {0: batch, 1: ntree, 2: words},
               "past": tuple({0: batch, 1: past} for _ in names[3:])}
    import logging
    import warnings
    # The exporter logs a warning per missing optional package (torchvision ops): noise to a user.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            flat, args, dynamo=True, input_names=names, output_names=output_names(config.num_layers),
            dynamic_shapes=dynamic, opset_version=onnx_function.OPSET, optimize=True, verbose=False,
            custom_translation_table={torch.ops.specinfer.tree_attention.default: _tree_attention_onnx()},
        )
    proto = onnx_function.attach_function(program.model_proto)
    if len(onnx_function.tree_attention_nodes(proto)) != config.num_layers:
        raise SpecInferError("export produced no TreeAttention node per layer (exporter changed?)")

    advance(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / ONNX_FILE
    (out_dir / (ONNX_FILE + ".data")).unlink(missing_ok=True)
    large = proto.ByteSize() > external_data_bytes
    onnx.save(proto, onnx_path, save_as_external_data=large, location=ONNX_FILE + ".data")
    for name in TOKENIZER_FILES + (DRAFT_VOCAB,):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    manifest = {
        "format": EXPORT_FORMAT,
        "source": str(model_dir.resolve()),
        "onnx": ONNX_FILE,
        "external_data": large,
        "dtype": dtype,
        "max_context": max_context,
        "config": config.to_dict(),
        "inputs": {n: _io_spec(n, config, dtype) for n in names},
        "outputs": {n: _io_spec(n, config, dtype) for n in output_names(config.num_layers)},
        "tree_mask": "int32 [B, N, ceil(N/32)] packed ancestor bits; see specinfer.plugins.tree_attention",
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    diffs = None
    advance(3)
    if validate:
        diffs = validate_export(onnx_path, flat, config, dtype)
        manifest["validation"] = {"max_abs_logit_diff": diffs, "tolerance": TOLERANCE[dtype]}
        if dtype == "bf16":
            manifest["validation"]["method"] = ("bf16 weights computed in float32 on both sides (ONNX Runtime's CPU "
                                                "provider has no bf16 kernels); bf16 activations unchecked")
    advance(4)
    _write_ort_lowering(model.float(), flat, out_dir, max_context, validate, manifest, draft_vocab)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if bar is not None:
        bar.update(1)
        bar.close()
    return ExportResult(out_dir, onnx_path, manifest, diffs)


def _write_ort_lowering(model, flat, out_dir: Path, max_context: int, validate: bool, manifest: dict,
                        draft_vocab: np.ndarray | None = None) -> None:
    """Write the graphs the ONNX Runtime engine runs (the model, and its one-call chain drafter,
    scoring ``draft_vocab`` only when given), and check the model's against the float32 PyTorch
    model. The graphs read one weights file."""
    from . import ort_lowering

    files = ort_lowering.save(model, out_dir, max_context, ort_lowering.DRAFT_DEPTH, draft_vocab)
    if validate:
        diffs = ort_lowering.validate_lowering(str(out_dir / files["ort_onnx"]), flat, model.config, max_context,
                                               TOLERANCE["fp32"])
        manifest.setdefault("validation", {})["ort_lowering_max_abs_logit_diff"] = diffs
    manifest.update(files)


def _io_spec(name: str, config, dtype: str) -> dict:
    kv = ["batch", "past", config.num_kv_heads, config.head_dim]
    new_kv = ["batch", "tree", config.num_kv_heads, config.head_dim]
    act = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[dtype]
    table = {
        "input_ids": ("int64", ["batch", "tree"]),
        "position_ids": ("int64", ["batch", "tree"]),
        "tree_mask": ("int32", ["batch", "tree_tokens", "mask_words"]),
        "logits": ("float32", ["batch", "tree", config.vocab_size]),
    }
    if name in table:
        t, shape = table[name]
    else:
        t, shape = act, kv if name.startswith("past") else new_kv
    return {"dtype": t, "shape": shape}


def _tree_attention_onnx():
    """The exporter's translation of torch.ops.specinfer.tree_attention into our ONNX node."""
    import onnxscript

    op = onnxscript.values.Opset(onnx_function.DOMAIN, 1)

    def tree_attention(q, k, v, past_k, past_v, tree_mask, num_heads: int, num_kv_heads: int, scale: float):
        return op.TreeAttention(q, k, v, past_k, past_v, tree_mask, num_heads=num_heads,
                                num_kv_heads=num_kv_heads, scale=scale,
                                plugin_namespace=onnx_function.DOMAIN)
    return tree_attention


def upcast_bf16(model):
    """The same graph computed in float32: bf16 initializers, constants, casts and I/O become float32.
    ONNX Runtime's CPU provider has almost no bf16 kernels (no bf16 MatMul)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT

    def tensor(t):
        if t.data_type == bf16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    def nodes(ns):
        for n in ns:
            for a in n.attribute:
                if a.name == "to" and a.i == bf16:
                    a.i = f32
                if a.type == onnx.AttributeProto.TENSOR:
                    tensor(a.t)
                if a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)

    def graph(g):
        for t in g.initializer:
            tensor(t)
        for v in list(g.input) + list(g.output) + list(g.value_info):
            if v.type.tensor_type.elem_type == bf16:
                v.type.tensor_type.elem_type = f32
        nodes(g.node)

    graph(model.graph)
    for f in model.functions:
        nodes(f.node)
    return model


def validate_export(onnx_path: Path, flat_model, config, dtype: str) -> dict[str, float]:
    """ONNX Runtime against PyTorch on a prefill and on a branching tree step over a cache.

    bf16: ONNX Runtime's CPU provider cannot run the bf16 graph, so the check runs the graph with its
    bf16 weights in float32 (:func:`upcast_bf16`) against the PyTorch model with the same
    bf16-rounded weights in float32: it checks the graph and its weights, not bf16 rounding of
    activations (``specinfer validate`` on a TensorRT engine checks that part)."""
    import torch

    from ..engines.onnxruntime import open_session

    np_dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}[dtype]
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.float32}[dtype]
    try:
        if dtype == "bf16":
            import onnx

            flat_model = flat_model.float()
            upcast = upcast_bf16(onnx.load(onnx_path))
            if upcast.ByteSize() < (1 << 31) - (1 << 26):
                session = open_session(upcast.SerializeToString())
            else:  # protobuf's 2 GiB limit: through a file with external data
                import tempfile

                tmp = Path(tempfile.mkdtemp(prefix="specinfer-bf16-")) / "model.onnx"
                onnx.save(upcast, tmp, save_as_external_data=True, location="model.onnx.data")
                session = open_session(str(tmp))
        else:
            session = open_session(str(onnx_path))
    except Exception as e:  # noqa: BLE001 - report ORT's own words
        raise SpecInferError(f"ONNX Runtime cannot load the export for validation ({e}); "
                             f"export again with --no-validate to skip this check") from None
    cases = {
        "prefill": sample_inputs(config, 1, list(range(-1, 11)), 0, np_dtype, seed=1),
        "tree_step": sample_inputs(config, 2, [-1, 0, 0, 1, 1, 2, 5, -1], 9, np_dtype, seed=2),
    }
    diffs = {}
    for case, feeds in cases.items():
        got = session.run(["logits"], feeds)[0]
        with torch.no_grad():
            args = [torch.from_numpy(v).to(torch_dtype) if v.dtype.kind == "f" else torch.from_numpy(v)
                    for v in feeds.values()]
            want = flat_model(*args)[0].float().numpy()
        diffs[case] = float(np.abs(got - want).max())
        if not diffs[case] <= TOLERANCE[dtype]:
            raise SpecInferError(f"validation failed: ONNX Runtime and PyTorch logits differ by "
                                 f"{diffs[case]:.3g} on {case} (tolerance {TOLERANCE[dtype]})")
    return diffs
