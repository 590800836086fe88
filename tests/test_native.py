"""The native float16-weight MatMul (specinfer/engines/native.py): the float32 product of the same
numbers, a row's result independent of its batch, used only where every weight is a float16
value, and an export run on it decoding as on ONNX Runtime's own MatMul."""
from __future__ import annotations

import numpy as np
import pytest

from specinfer.engines import native

pytestmark = pytest.mark.skipif(native.f16w_library() is None,
                                reason="the native kernel needs Linux x86-64 with AVX-512 and F16C and a C compiler")


def _session(weights: np.ndarray, k: int):
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import open_session

    node = helper.make_node(native.OP, ["a", "w"], ["c"], domain=native.DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "m", k])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(native.pack_f16w(weights), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    return open_session(model.SerializeToString(), libraries=[native.f16w_library()])


def test_the_kernel_is_the_float32_matmul_of_the_same_numbers_whatever_the_batch():
    rng = np.random.default_rng(0)
    k, n = 96, 192
    weights = (rng.standard_normal((k, n)) * 0.1).astype(np.float16)
    session = _session(weights, k)
    a = rng.standard_normal((1, 37, k)).astype(np.float32)
    together = session.run(None, {"a": a})[0]
    exact = a.astype(np.float64) @ weights.astype(np.float64)
    assert together.shape == (1, 37, n)
    np.testing.assert_allclose(together, exact, rtol=1e-5, atol=1e-5)
    for m in (1, 3, 5):   # any batch: each row bit for bit what it is alone
        for start in (0, 4, 33):
            part = session.run(None, {"a": a[:, start:start + m]})[0]
            np.testing.assert_array_equal(part, together[:, start:start + m])


def test_only_matmuls_by_float16_exact_weights_are_rewritten(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    exact = rng.standard_normal((64, 128)).astype(np.float16).astype(np.float32)
    inexact = exact.copy()
    inexact[3, 5] += 1e-6   # one value a float16 cannot hold
    narrow = rng.standard_normal((64, 96)).astype(np.float16).astype(np.float32)   # 96 columns: no whole panel
    nodes = [helper.make_node("MatMul", ["x", "exact"], ["y1"]), helper.make_node("MatMul", ["x", "inexact"], ["y2"]),
             helper.make_node("MatMul", ["x", "narrow"], ["y3"])]
    inits = [numpy_helper.from_array(w, name) for w, name in ((exact, "exact"), (inexact, "inexact"), (narrow, "narrow"))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ("y1", "y2", "y3")], inits)
    model = helper.make_model(graph)
    packed: dict = {}
    out = native.use_f16_weights(model, tmp_path, packed)
    assert [(n.op_type, n.domain) for n in out.graph.node] == [(native.OP, native.DOMAIN), ("MatMul", ""), ("MatMul", "")]
    assert sorted(i.name for i in out.graph.initializer) == ["exact.f16w", "inexact", "narrow"]
    assert [n.op_type for n in model.graph.node] == ["MatMul"] * 3   # the model given is left as it was
    assert packed["inexact"] is None and packed["narrow"] is None


def test_an_export_of_float16_values_decodes_on_the_native_kernel_as_on_ort_matmul(exported, monkeypatch):
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.generate import generate_ids

    on = OrtRuntime(exported["llama3"])
    monkeypatch.setenv("SPECINFER_NATIVE", "0")
    native.f16w_library.cache_clear()
    try:
        off = OrtRuntime(exported["llama3"])
    finally:
        monkeypatch.delenv("SPECINFER_NATIVE")
        native.f16w_library.cache_clear()
    assert on.native_matmul and not off.native_matmul
    prompt = [1, 17, 42, 99, 5, 23, 8, 61]
    logits = []
    for runtime in (on, off):
        seq = runtime.start()
        runtime.prefill(seq, prompt[:-1])
        logits.append(runtime.score(seq, [prompt[-1], 7, 9, 11], [-1, 0, 0, 1]))   # a branching tree
        runtime.release(seq)
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    tokens = [sum(generate_ids(rt, prompt, tree=[], max_new_tokens=40), []) for rt in (on, off)]
    assert tokens[0] == tokens[1]
