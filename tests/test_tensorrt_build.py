"""The TensorRT path: what runs here (ONNX surgery, plugin fields, profiles, manifest, CLI errors, the
plugin kernel's PTX) and what needs TensorRT and a GPU (marker ``trt``: skipped here, with the reason).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from specinfer.engines import tensorrt_build as tb
from specinfer.engines.loader import is_engine_folder, load_runtime
from specinfer.engines.onnxruntime import open_session
from specinfer.errors import SpecInferError
from specinfer.export import export_model
from specinfer.export.onnx_export import sample_inputs
from specinfer.plugins import onnx_function
from specinfer.plugins import tensorrt_plugin as tp
from specinfer.plugins.tree_attention import ancestor_matrix, pack_bits, tree_attention_reference


def _trt_reason():
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (none on our machines; run in the Docker image on an NVIDIA GPU)"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


TRT_REASON = _trt_reason()
trt = pytest.mark.skipif(TRT_REASON is not None, reason=str(TRT_REASON))
HAVE_POLYGRAPHY = importlib.util.find_spec("polygraphy") is not None
needs_polygraphy = pytest.mark.skipif(not HAVE_POLYGRAPHY, reason="polygraphy is not installed (pip install 'specinfer[kernels]')")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="OpenAI Triton is not installed (pip install 'specinfer[kernels]')")


@pytest.fixture(scope="module")
def fp16_export(tmp_path_factory, checkpoints):
    out = tmp_path_factory.mktemp("fp16") / "onnx"
    return export_model(checkpoints["llama3"], out, dtype="fp16", max_context=128, progress=False).out_dir


def manifest_of(folder):
    return json.loads((Path(folder) / "manifest.json").read_text())


# --- what a build refuses -------------------------------------------------------------------------
def test_fp32_export_is_refused_with_how_to_export_again(exported, tmp_path):
    with pytest.raises(SpecInferError, match=r"fp32 export.*strongly typed.*--dtype fp16"):
        tb.plan_build(exported["llama3"], tmp_path / "engine")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tree_tokens=300), "--max-tree-tokens must be in 1..128"),
    (dict(max_tree_tokens=0), "--max-tree-tokens"),
    (dict(max_context=1000), r"--max-context must be in 2..128"),
    (dict(max_batch=0), "--max-batch must be >= 1"),
    (dict(attention="flash"), "unknown --attention"),
])
def test_bad_build_arguments(fp16_export, tmp_path, kwargs, message):
    with pytest.raises(SpecInferError, match=message):
        tb.plan_build(fp16_export, tmp_path / "engine", **kwargs)


def test_not_an_export(tmp_path):
    with pytest.raises(SpecInferError, match="no manifest.json"):
        tb.plan_build(tmp_path, tmp_path / "engine")


# --- optimization profiles ------------------------------------------------------------------------
def test_profiles_exact_shapes(fp16_export):
    manifest = manifest_of(fp16_export)
    profiles = tb.optimization_profiles(manifest, max_batch=4, max_tree_tokens=64, max_context=128)
    assert list(profiles) == ["prefill", "tree"]
    hkv, d = manifest["config"]["num_kv_heads"], manifest["config"]["head_dim"]
    assert set(profiles["tree"]) == set(manifest["inputs"])  # every input, names from the manifest
    assert profiles["prefill"]["input_ids"] == {"min": (1, 1), "opt": (1, 128), "max": (4, 128)}
    assert profiles["prefill"]["position_ids"] == profiles["prefill"]["input_ids"]
    assert profiles["prefill"]["tree_mask"] == {"min": (1, 1, 1), "opt": (1, 128, 4), "max": (4, 128, 4)}
    assert profiles["prefill"]["past_key.0"] == {"min": (1, 0, hkv, d), "opt": (1, 0, hkv, d), "max": (4, 127, hkv, d)}
    assert profiles["tree"]["input_ids"] == {"min": (1, 1), "opt": (1, 64), "max": (4, 64)}
    assert profiles["tree"]["tree_mask"] == {"min": (1, 1, 1), "opt": (1, 64, 2), "max": (4, 64, 2)}
    for name in [n for n in manifest["inputs"] if n.startswith("past")]:
        assert profiles["tree"][name] == {"min": (1, 0, hkv, d), "opt": (1, 64, hkv, d), "max": (4, 127, hkv, d)}


def test_profiles_large_context_and_tree():
    manifest = {"inputs": {"input_ids": {"shape": ["batch", "tree"]},
                           "tree_mask": {"shape": ["batch", "tree_tokens", "mask_words"]},
                           "past_key.0": {"shape": ["batch", "past", 8, 128]}}}
    p = tb.optimization_profiles(manifest, max_batch=8, max_tree_tokens=256, max_context=4096)
    assert p["prefill"]["input_ids"] == {"min": (1, 1), "opt": (1, 512), "max": (8, 4096)}
    assert p["prefill"]["tree_mask"] == {"min": (1, 1, 1), "opt": (1, 512, 16), "max": (8, 4096, 128)}
    assert p["tree"]["tree_mask"] == {"min": (1, 1, 1), "opt": (1, 256, 8), "max": (8, 256, 8)}
    assert p["tree"]["past_key.0"] == {"min": (1, 0, 8, 128), "opt": (1, 2048, 8, 128), "max": (8, 4095, 8, 128)}


def test_pick_profile_by_shapes(fp16_export):
    manifest = manifest_of(fp16_export)
    profiles = tb.optimization_profiles(manifest, 1, 64, 128)
    kv = lambda s: {n: (1, s, 2, 16) for n in manifest["inputs"] if n.startswith("past")}
    step = lambda t, n, s: {"input_ids": (1, t), "position_ids": (1, t), "tree_mask": (1, n, -(-n // 32)), **kv(s)}
    assert tb.pick_profile(profiles, step(1, 1, 40)) == 1       # a decode step: tree profile
    assert tb.pick_profile(profiles, step(64, 64, 60)) == 1     # a full tree
    assert tb.pick_profile(profiles, step(100, 100, 0)) == 0    # a prompt: prefill profile
    assert tb.pick_profile(profiles, step(6, 70, 20)) == 0      # N = 70 > 64 tree tokens
    with pytest.raises(SpecInferError, match="no optimization profile"):
        tb.pick_profile(profiles, step(1, 1, 200))


# --- the native-attention variant -----------------------------------------------------------------
def single_node(function, hq, hkv, d):
    names = onnx_function.INPUTS
    dt = lambda n: TensorProto.INT32 if n == "tree_mask" else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, dt(n), None) for n in names]
    node = helper.make_node("TreeAttention", list(names), ["out"], domain="specinfer", num_heads=hq,
                            num_kv_heads=hkv, scale=d ** -0.5, plugin_namespace="specinfer")
    graph = helper.make_graph([node], "ta", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", onnx_function.OPSET),
                                                    helper.make_opsetid("specinfer", 1)], ir_version=10)
    model.functions.append(function)
    return model


@pytest.mark.parametrize("t, extra, past, hq, hkv, d", [(1, 0, 0, 4, 4, 8), (5, 0, 7, 4, 2, 16),
                                                       (3, 6, 10, 6, 3, 8), (40, 60, 5, 4, 1, 8)])
def test_native_body_matches_reference(t, extra, past, hq, hkv, d):
    """The native unpacking (INT64 Div/Mod/Gather, Q pre-scaled) against the float64 reference,
    including words with bit 31 set and N > T > 32."""
    rng = np.random.default_rng(t)
    n = t + extra
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    mask = np.broadcast_to(pack_bits(ancestor_matrix(parents)), (2, n, -(-n // 32))).copy()
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    feeds = [f(2, t, hq, d), f(2, t, hkv, d), f(2, t, hkv, d), f(2, past + extra, hkv, d), f(2, past + extra, hkv, d), mask]
    model = tb.native_model(single_node(onnx_function.function_proto(), hq, hkv, d))
    sess = open_session(model.SerializeToString())
    got = sess.run(None, dict(zip(onnx_function.INPUTS, feeds)))[0]
    assert np.abs(got - tree_attention_reference(*feeds)).max() < 1e-5


def test_native_graph_is_plugin_free(exported):
    model = tb.native_model(onnx.load(exported["llama3"] / "model.onnx"))
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    layers = manifest_of(exported["llama3"])["config"]["num_layers"]
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert "TreeAttention" not in ops and not model.functions
    assert ops.count("Attention") == layers
    assert not {"BitShift", "BitwiseAnd"} & set(ops)  # TensorRT's parser imports neither
    assert all(o.domain != "specinfer" for o in model.opset_import)
    for node in model.graph.node:
        if node.op_type == "Cast":
            assert helper.get_attribute_value(node.attribute[0]) != TensorProto.UINT32  # no UINT32 in TensorRT


@needs_polygraphy
def test_native_graph_same_logits_as_plugin_graph(exported, tmp_path):
    """Both graphs on ONNX Runtime through the comparator `specinfer validate` uses: within 1e-4."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    src = exported["llama3"]
    native = tb.write_native_onnx(src / "model.onnx", tmp_path / tb.NATIVE_ONNX)
    session = lambda p: (lambda: open_session(str(p)))
    runners = [OnnxrtRunner(session(native), name="native"), OnnxrtRunner(session(src / "model.onnx"), name="plugin")]

    class C:
        vocab_size, num_kv_heads, head_dim, num_layers = 320, 2, 16, 2
    cases = {"prefill": (0, sample_inputs(C, 1, list(range(-1, 20)), 0, np.float32, seed=1)),
             "tree": (1, sample_inputs(C, 2, [-1, 0, 0, 1, 1, 2, 5, -1], 9, np.float32, seed=2)),
             "wide": (1, sample_inputs(C, 1, [-1] + [0] * 69, 30, np.float32, seed=3))}
    report = tb.compare(runners, cases, atol=1e-4, rtol=0.0)
    assert max(max(d.values()) for d in report.values()) < 1e-4 and set(report["tree"]) >= {"logits", "new_key.0"}


@needs_polygraphy
def test_compare_reports_a_mismatch(exported):
    from polygraphy.backend.onnxrt import OnnxrtRunner

    src = exported["llama3"] / "model.onnx"
    model = tb.native_model(onnx.load(src))
    for node in model.graph.node:
        if node.op_type == "Attention":
            node.attribute[0].f = 1.05  # a wrong scale
    runners = [OnnxrtRunner(lambda: open_session(model.SerializeToString())),
               OnnxrtRunner(lambda: open_session(str(src)))]

    class C:
        vocab_size, num_kv_heads, head_dim, num_layers = 320, 2, 16, 2
    with pytest.raises(SpecInferError, match="validation failed on prefill: logits differs by"):
        tb.compare(runners, {"prefill": (0, sample_inputs(C, 1, list(range(-1, 9)), 0, np.float32))}, 1e-4, 0.0)


# --- plan, manifest, loader -----------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["plugin", "native"])
def test_plan_and_manifest(fp16_export, tmp_path, attention):
    plan = tb.plan_build(fp16_export, tmp_path / "engine", max_batch=2, max_tree_tokens=32, attention=attention)
    m = plan.manifest(tensorrt_version="untested")
    assert m["format"] == tb.FORMAT and m["engine"] == "model.engine" and m["dtype"] == "fp16"
    assert m["max_context"] == 128 and m["max_tree_tokens"] == 32 and m["max_batch"] == 2
    assert m["profiles"]["tree"]["input_ids"] == {"min": [1, 1], "opt": [1, 32], "max": [2, 32]}
    assert list(m["inputs"]) == list(manifest_of(fp16_export)["inputs"])
    if attention == "plugin":
        assert m["onnx"] == str((fp16_export / "model.onnx").resolve())
        assert m["plugin"]["id"] == tp.PLUGIN_ID and m["plugin"]["fields"] == list(tp.FIELDS)
    else:
        assert m["onnx"] == str((tmp_path / "engine" / tb.NATIVE_ONNX).resolve()) and m["plugin"] is None
    json.dumps(m)  # serializable as it is


def test_engine_folders_open_on_tensorrt_only(tmp_path, exported, checkpoints):
    folder = tmp_path / "engine"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": tb.FORMAT}))
    assert is_engine_folder(folder) and not is_engine_folder(exported["llama3"])
    with pytest.raises(SpecInferError, match="runs on the tensorrt engine only"):
        load_runtime(folder, engine="torch")
    with pytest.raises(SpecInferError, match="needs an engine folder"):
        load_runtime(exported["llama3"], engine="tensorrt")
    with pytest.raises(SpecInferError, match="unknown engine"):
        load_runtime(exported["llama3"], engine="tvm")
    with pytest.raises(SpecInferError, match="not a TensorRT engine folder"):
        tb.read_engine_manifest(exported["llama3"])
    if TRT_REASON is not None:
        with pytest.raises(SpecInferError, match="TensorRT is not installed|no CUDA GPU"):
            load_runtime(folder)


# --- the plugin -----------------------------------------------------------------------------------
def test_node_maps_onto_plugin(exported):
    """Op type -> plugin name, plugin_namespace -> namespace, the other attributes -> the plugin's fields."""
    node = onnx_function.tree_attention_nodes(onnx.load(exported["llama3"] / "model.onnx"))[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == tp.PLUGIN_NAME and attrs["plugin_namespace"].decode() == tp.PLUGIN_NAMESPACE
    assert set(attrs) - {"plugin_namespace"} == set(tp.FIELDS)
    assert tp.PLUGIN_ID == "specinfer::TreeAttention"


@needs_triton
def test_kernel_parameters_follow_tensorrt_aot_order():
    import inspect

    from specinfer.plugins import triton_kernels
    params = list(inspect.signature(triton_kernels.tree_attention_kernel.fn).parameters)
    assert params == list(tp.INPUTS + tp.SCALARS + tp.OUTPUTS + tp.CONSTEXPRS)
    sig = tp.kernel_signature("bf16")
    assert list(sig) == params and sig["Q"] == "*bf16" and sig["MASK"] == "*i32" and sig["T"] == "i32"


def test_launch_args_are_contiguous_strides():
    import torch
    b, t, s, n, hq, hkv, d = 2, 5, 9, 7, 8, 2, 16
    q, k, past = torch.empty(b, t, hq, d), torch.empty(b, t, hkv, d), torch.empty(b, s, hkv, d)
    mask = torch.empty(b, n, 1, dtype=torch.int32)
    grid, scalars = tp.launch_args(q.shape, past.shape, mask.shape, hq, hkv, block_m=16)
    assert scalars == [t, s, n, *q.stride()[:3], *k.stride()[:3], *past.stride()[:3], *mask.stride()[:2], *q.stride()[:3]]
    assert grid == (2, 4)  # ceil(5 tokens x 4 query heads a KV head / 16 rows), batch x KV heads


def test_drop_unused_params():
    ptx = (".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .u64 .ptr .global .align 1 k_param_3\n)\n"
           "{\n\tld.param.b64 %rd1, [k_param_0];\n\tld.param.b32 %r1, [k_param_1];\n}\n")
    out = tp.drop_unused_params(ptx, "k", 2)
    assert "k_param_1\n)" in out and "k_param_2" not in out and "[k_param_1]" in out
    with pytest.raises(SpecInferError, match="uses its parameter 1"):
        tp.drop_unused_params(ptx, "k", 1)


@needs_triton
def test_plugin_kernel_compiles_to_ptx_for_the_engine():
    """What `specinfer build` hands TensorRT, compiled here for A100 (sm_80) and H100 (sm_90a) without a
    GPU, in a fresh process (this one may hold the interpreter's kernels), then checked by ptxas."""
    script = r"""
import re, subprocess, sys, tempfile
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from specinfer.plugins import tensorrt_plugin as tp
keep = len(tp.INPUTS) + len(tp.SCALARS) + len(tp.OUTPUTS)
for cc, arch in ((80, "sm_80"), (90, "sm_90a")):
    for dtype in ("fp16", "bf16"):
        for block_m, head_dim in ((16, 128), (64, 64)):
            name, ptx, meta = tp.compile_ptx(dtype, 32, 8, head_dim, head_dim ** -0.5, block_m,
                                             target=GPUTarget("cuda", cc, 32), ptx_version=84)
            entry = ptx[ptx.index(".entry"):ptx.index(")")]
            assert len(re.findall(r"\.param ", entry)) == keep, entry
            assert meta.shared <= 48 * 1024 and meta.num_warps == tp.NUM_WARPS
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx); f.flush()
                r = subprocess.run([get_ptxas(cc).path, "-arch=" + arch, f.name, "-o", "/dev/null"],
                                   capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_register_plugin_without_tensorrt_says_so():
    with pytest.raises(SpecInferError, match="TensorRT's Python plugin API is not available"):
        tp.register_plugin()


# --- bf16 exports -----------------------------------------------------------------------------------
def test_bf16_export_validates_in_float32(tmp_path, checkpoints):
    r = export_model(checkpoints["qwen2"], tmp_path / "bf16", dtype="bf16", max_context=64, progress=False)
    assert r.manifest["dtype"] == "bf16" and max(r.max_abs_diff.values()) <= 1e-3
    assert "float32" in r.manifest["validation"]["method"]
    inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(r.onnx_path).graph.input}
    assert inputs["past_key.0"] == TensorProto.BFLOAT16
    plan = tb.plan_build(r.out_dir, tmp_path / "engine", max_tree_tokens=16)  # accepted for a build
    assert plan.export["dtype"] == "bf16"


# --- the CLI ----------------------------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, "-m", "specinfer.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def one_line_error(r, message):
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr, r.stderr


def test_cli_build_and_validate_errors(exported, fp16_export, tmp_path):
    one_line_error(cli("build", exported["llama3"], "-o", tmp_path / "e"), "--dtype fp16")
    one_line_error(cli("build", fp16_export, "-o", tmp_path / "e", "--max-tree-tokens", 300), "--max-tree-tokens")
    one_line_error(cli("build", tmp_path / "nothing", "-o", tmp_path / "e"), "no manifest.json")
    one_line_error(cli("validate", fp16_export), "not a TensorRT engine folder")
    r = cli("build", fp16_export, "-o", tmp_path / "e", "--attention", "flash")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    if TRT_REASON is not None:
        r = cli("build", fp16_export, "-o", tmp_path / "e")
        one_line_error(r, "TensorRT is not installed" if "TensorRT is not" in TRT_REASON else "no CUDA GPU")
        assert not (tmp_path / "e").exists()  # nothing written before the check


# --- on TensorRT and a GPU (the Docker image); skipped here ---------------------------------------
@trt
@pytest.mark.trt
@pytest.mark.parametrize("attention", ["plugin", "native"])
def test_build_validate_and_run(fp16_export, tmp_path, attention, checkpoints):
    from specinfer.engines.tensorrt_runtime import TrtRuntime
    from specinfer.engines.torch_runtime import TorchRuntime

    engine_dir = tmp_path / attention
    tb.build_engines(fp16_export, engine_dir, max_batch=2, max_tree_tokens=32, attention=attention, progress=False)
    m = manifest_of(engine_dir)
    assert m["num_profiles"] == 2 and (engine_dir / "model.engine").is_file() and (engine_dir / "timing.cache").is_file()
    report = tb.validate_engine(engine_dir)
    assert set(report) == {"prefill", "tree"}
    rt, ref = TrtRuntime(engine_dir), TorchRuntime(checkpoints["llama3"], max_context=128)
    seq = rt.start()
    buffer = rt._sequences[seq].kv
    address = buffer.data_ptr()
    prompt = [1, 50, 51, 52, 53, 54, 55, 56]
    rt.prefill(seq, prompt)
    a = rt.score(seq, [10, 20, 30], [-1, 0, 0])
    b = rt.score(seq, [40, 41, 42], [2, 2, 3])
    rt.commit(seq, [0, 2, 3, 5])
    c = rt.score(seq, [7])[0]
    assert buffer.data_ptr() == address and buffer.is_cuda  # the device cache never moved

    def last(ids):
        s = ref.start()
        try:
            return ref.score(s, ids)[-1]
        finally:
            ref.release(s)
    tol = 5e-2 * 4  # fp16 engine against the fp32 PyTorch model, logits of magnitude ~10
    assert np.abs(a[1] - last(prompt + [10, 20])).max() < tol
    assert np.abs(b[2] - last(prompt + [10, 30, 40, 42])).max() < tol
    assert np.abs(c - last(prompt + [10, 30, 40, 42, 7])).max() < tol


@trt
@pytest.mark.trt
def test_speculative_generation_on_tensorrt_equals_incremental(tmp_path, checkpoints):
    from specinfer import Pipeline
    from specinfer.checkpoints import truncate_layers

    from conftest import make_checkpoint
    llm = make_checkpoint(tmp_path / "llm", "llama3", seed=5, layers=4)
    ssm = truncate_layers(llm, tmp_path / "ssm", 1)
    engines = []
    for name, ckpt in (("llm", llm), ("ssm", ssm)):
        onnx_dir = export_model(ckpt, tmp_path / f"{name}_onnx", dtype="fp16", max_context=256, progress=False).out_dir
        tb.build_engines(onnx_dir, tmp_path / f"{name}_engine", max_tree_tokens=64, progress=False)
        engines.append(tmp_path / f"{name}_engine")
    plain = Pipeline(engines[0]).generate("def f(x):", 24)
    speculative = Pipeline(engines[0], ssms=[engines[1]]).generate("def f(x):", 24)
    assert speculative == plain


@trt
@pytest.mark.trt
def test_bf16_engine_builds_and_validates(tmp_path, checkpoints):
    onnx_dir = export_model(checkpoints["qwen2"], tmp_path / "bf16", dtype="bf16", max_context=64, progress=False).out_dir
    tb.build_engines(onnx_dir, tmp_path / "engine", max_tree_tokens=16, progress=False)
    assert set(tb.validate_engine(tmp_path / "engine")) == {"prefill", "tree"}
