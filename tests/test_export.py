"""Export: one TreeAttention node per layer, a manifest, dynamic shapes, and the self-check."""
import json

import numpy as np
import onnx
import pytest

from conftest import FAMILIES, make_checkpoint
from specinfer.engines.onnxruntime import open_session
from specinfer.errors import SpecInferError
from specinfer.export import export_model, input_names
from specinfer.export.onnx_export import sample_inputs
from specinfer.plugins.onnx_function import tree_attention_nodes


@pytest.mark.parametrize("family", FAMILIES)
def test_export_graph_and_manifest(family, exported):
    out = exported[family]
    manifest = json.loads((out / "manifest.json").read_text())
    model = onnx.load(out / "model.onnx")
    assert model.ir_version <= 13  # onnxruntime 1.31 refuses local functions above IR 13
    nodes = tree_attention_nodes(model)
    assert len(nodes) == manifest["config"]["num_layers"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_namespace"] == b"specinfer"  # makes TensorRT's parser prefer our plugin
    assert attrs["num_heads"] == manifest["config"]["num_heads"]
    assert attrs["num_kv_heads"] == manifest["config"]["num_kv_heads"]
    assert [f.name for f in model.functions] == ["TreeAttention"]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert all(isinstance(d, str) for d in dims["input_ids"] + dims["tree_mask"] + dims["past_key.0"][:2])
    assert list(manifest["inputs"]) == input_names(manifest["config"]["num_layers"])
    assert manifest["validation"]["max_abs_logit_diff"]["tree_step"] <= manifest["validation"]["tolerance"]
    assert (out / "tokenizer.json").is_file() and manifest["max_context"] == 256


def test_dynamic_shapes_run_in_onnxruntime(exported):
    out = exported["llama3"]
    cfg = json.loads((out / "manifest.json").read_text())["config"]
    sess = open_session(str(out / "model.onnx"))

    class C:  # sample_inputs wants attribute access
        vocab_size, num_kv_heads, head_dim, num_layers = (cfg[k] for k in ("vocab_size", "num_kv_heads", "head_dim", "num_layers"))
    for batch, parents, past in [(1, [-1], 0), (3, [-1, 0, 1], 50), (1, list(range(-1, 99)), 2)]:
        feeds = sample_inputs(C, batch, parents, past, np.float32)
        logits, new_key = sess.run(["logits", "new_key.0"], feeds)
        assert logits.shape == (batch, len(parents), cfg["vocab_size"])
        assert new_key.shape == (batch, len(parents), cfg["num_kv_heads"], cfg["head_dim"])


def test_fp16_and_external_data(tmp_path):
    src = make_checkpoint(tmp_path / "src", "qwen2")
    r = export_model(src, tmp_path / "fp16", dtype="fp16", max_context=64, external_data_bytes=1, progress=False)
    assert r.manifest["external_data"] and (tmp_path / "fp16" / "model.onnx.data").is_file()
    assert max(r.max_abs_diff.values()) <= 5e-2
    inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(r.onnx_path, load_external_data=False).graph.input}
    assert inputs["past_key.0"] == onnx.TensorProto.FLOAT16


def test_export_errors(tmp_path, checkpoints):
    with pytest.raises(SpecInferError, match="model folder not found"):
        export_model(tmp_path / "missing", tmp_path / "o", progress=False)
    with pytest.raises(SpecInferError, match="unsupported dtype"):
        export_model(checkpoints["llama2"], tmp_path / "o", dtype="int3", progress=False)
    with pytest.raises(SpecInferError, match="sliding-window"):
        export_model(checkpoints["mistral"], tmp_path / "o", max_context=5000, progress=False)
