"""The native float16-weight MatMul (specinfer/engines/native.py): the float32 product of the same
numbers, a row's result independent of its batch, used only where every weight is a float16
value, and an export run on it decoding as on ONNX Runtime's own MatMul."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import prompt_and_tree_logits
from specinfer.engines import native

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the native kernels need Linux x86-64 with AVX2, FMA and F16C and a C compiler")


def _session(weights: np.ndarray, k: int):
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import open_session

    node = helper.make_node(native.OP, ["a", "w"], ["c"], domain=native.DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "m", k])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(native.pack_panels(weights), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    return open_session(model.SerializeToString(), libraries=[native.library()])


def test_the_kernels_build_for_a_cpu_without_avx512_too(tmp_path):
    """The AVX2 + FMA + F16C build (kernels/simd.h) compiles whatever this CPU has, and there the
    int8 products never take the tile unit (an AMX constant read outside the AVX-512 part once
    broke that build, which falls back to ONNX Runtime's own kernels without a word in the tests
    of an AVX-512 machine)."""
    import ctypes
    import shutil

    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    out = tmp_path / "avx2.so"
    native.compile_kernels(out, compiler, ("-mavx2", "-mfma", "-mf16c"))
    assert "avx2" not in native.cpu_flags() or ctypes.CDLL(str(out)).specinfer_int8_tiles() == 0


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


def test_the_swiglu_kernel_is_silu_of_the_gate_times_the_up_product_whatever_the_batch():
    """MatMulF16WSwiGLU: silu(a Wg) * (a Wu) from the two products MatMulF16W computes, each row bit
    for bit what it is alone."""
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import open_session

    rng = np.random.default_rng(2)
    k, i = 96, 160   # 160: five 32-column halves, an odd number of panels' worth
    gate, up = ((rng.standard_normal((2, k, i)) * 0.2).astype(np.float16))
    node = helper.make_node(native.SWIGLU_OP, ["a", "w"], ["c"], domain=native.DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "m", k])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(native.pack_swiglu(gate, up), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    session = open_session(model.SerializeToString(), libraries=[native.library()])
    a = rng.standard_normal((1, 23, k)).astype(np.float32)
    together = session.run(None, {"a": a})[0]
    g, u = a.astype(np.float64) @ gate.astype(np.float64), a.astype(np.float64) @ up.astype(np.float64)
    assert together.shape == (1, 23, i)
    np.testing.assert_allclose(together, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    for m in (1, 4, 7):
        for start in (0, 5, 16):
            np.testing.assert_array_equal(session.run(None, {"a": a[:, start:start + m]})[0], together[:, start:start + m])


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_the_mlp_activation_runs_inside_the_gate_up_product(family, exported, monkeypatch):
    """Every layer's gate|up MatMul, Split, Sigmoid and two Muls become one MatMulF16WSwiGLU, and the
    logits of a branching tree agree with the graph's activation."""
    from specinfer.engines.onnxruntime import OrtRuntime

    runtime = OrtRuntime(exported[family])
    graph = native.use_swiglu(native.use_f16_weights(runtime._lowered, runtime.dir, {}), {})
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count(native.SWIGLU_OP) == runtime.config.num_layers and "Sigmoid" not in ops
    swiglu_ops = {native.SWIGLU_OP, native.NORMED_OPS[native.SWIGLU_OP]}   # the latter with its norm inside
    assert swiglu_ops & runtime.native_ops
    monkeypatch.setattr(native, "use_swiglu", lambda model, packed: model)
    unfused = OrtRuntime(exported[family])
    assert not swiglu_ops & unfused.native_ops
    logits = []
    for rt in (runtime, unfused):
        seq = rt.start()
        rt.prefill(seq, [1, 17, 42, 99, 5, 23, 8])
        logits.append(rt.score(seq, [61, 7, 9, 11], [-1, 0, 0, 1]))
        rt.release(seq)
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("swiglu", [False, True])
def test_the_normed_kernels_are_the_product_of_the_rms_norm_of_the_sum_whatever_the_batch(swiglu):
    """SkipRMSNormMatMulF16W(SwiGLU): the product (or the activation) of RMSNorm(x + skip) * gamma,
    and x + skip, each row bit for bit what it is alone; rows of 32 and more normalized on the pool
    the same as fewer. A hidden size that is no multiple of 16 (the lanes' tails) included."""
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import open_session

    rng = np.random.default_rng(3)
    k, n, eps = 72, 128, 1e-5
    w = (rng.standard_normal((2, k, n // 2) if swiglu else (k, n)) * 0.2).astype(np.float16)
    packed = native.pack_swiglu(*w) if swiglu else native.pack_panels(w)
    op = native.NORMED_OPS[native.SWIGLU_OP if swiglu else native.OP]
    gamma = (1 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    node = helper.make_node(op, ["x", "skip", "gamma", "eps", "w"], ["c", "sum"], domain=native.DOMAIN)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, "m", k]) for name in ("x", "skip")]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("c", "sum")]
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.array([eps], np.float32), "eps"),
             numpy_helper.from_array(packed, "w")]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    session = open_session(model.SerializeToString(), libraries=[native.library()])
    x, skip = rng.standard_normal((2, 1, 45, k)).astype(np.float32)
    product, total = session.run(None, {"x": x, "skip": skip})
    s = x.astype(np.float64) + skip
    normed = s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * gamma
    if swiglu:
        g, u = normed @ w[0].astype(np.float64), normed @ w[1].astype(np.float64)
        expected = g / (1 + np.exp(-g)) * u
    else:
        expected = normed @ w.astype(np.float64)
    np.testing.assert_array_equal(total, x + skip)
    np.testing.assert_allclose(product, expected, rtol=1e-5, atol=1e-5)
    for m in (1, 6, 33):   # 33: normalized on the pool
        for start in (0, 7, 12):
            part = session.run(None, {"x": x[:, start:start + m], "skip": skip[:, start:start + m]})
            np.testing.assert_array_equal(part[0], product[:, start:start + m])
            np.testing.assert_array_equal(part[1], total[:, start:start + m])


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_the_residual_norms_run_inside_the_products_they_lead(family, exported, monkeypatch):
    """Every SkipSimplifiedLayerNormalization whose output one native product reads goes inside it
    (two a layer: the MLP's, and the next layer's or the final one); logits of a prefill and a
    branching tree agree with the graph's norms."""
    from specinfer.engines.onnxruntime import OrtRuntime

    runtime = OrtRuntime(exported[family])
    unfused = native.use_swiglu(native.use_f16_weights(runtime._lowered, runtime.dir, {}), {})
    graph = native.use_skip_norms(unfused)
    ops = [n.op_type for n in graph.graph.node]
    assert "SkipSimplifiedLayerNormalization" not in ops
    normed_ops = {native.NORMED_OPS[native.OP], native.NORMED_OPS[native.SWIGLU_OP]}
    assert sum(op in normed_ops for op in ops) == 2 * runtime.config.num_layers
    assert len(ops) == len(unfused.graph.node) - 2 * runtime.config.num_layers
    assert normed_ops <= runtime.native_ops
    monkeypatch.setattr(native, "use_skip_norms", lambda model: model)
    plain = OrtRuntime(exported[family])
    assert not normed_ops & plain.native_ops
    logits = [prompt_and_tree_logits(rt, [1, 17, 42, 99, 5, 23, 8], [61, 7, 9, 11], [-1, 0, 0, 1])
              for rt in (runtime, plain)]
    for ours, theirs in zip(*logits):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


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
    assert packed["inexact.f16w"] is None and packed["narrow.f16w"] is None
    out = native.use_f16_weights(model, tmp_path, packed, products="bfloat16")   # any float32 weight
    assert [n.op_type for n in out.graph.node] == [native.BF16_OPS[native.OP]] * 2 + ["MatMul"]
    assert sorted(i.name for i in out.graph.initializer) == ["exact.bf16w", "inexact.bf16w", "narrow"]
    out = native.use_f16_weights(model, tmp_path, packed, products="int8")   # the same, each with its scales
    assert [list(n.input) for n in out.graph.node[:2]] == [["x", f"{w}.i8w", f"{w}.i8w.scales"] for w in ("exact", "inexact")]
    assert [n.op_type for n in out.graph.node] == [native.I8_OPS[native.OP]] * 2 + ["MatMul"]


def test_an_export_of_float16_values_decodes_on_the_native_kernel_as_on_ort_matmul(exported, monkeypatch):
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.generate import generate_ids

    on = OrtRuntime(exported["llama3"])
    monkeypatch.setenv("SPECINFER_NATIVE", "0")
    native.library.cache_clear()
    try:
        off = OrtRuntime(exported["llama3"])
    finally:
        monkeypatch.delenv("SPECINFER_NATIVE")
        native.library.cache_clear()
    normed_ops = {native.NORMED_OPS[native.OP], native.NORMED_OPS[native.SWIGLU_OP]}
    assert on.native_ops == {native.OP, *normed_ops, native.ATTENTION_OP} and not off.native_ops
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


def _attention_session(heads: int, kv_heads: int, d: int, capacity: int, tree_inputs: bool, native_op: bool,
                       f16_kv: bool = False):
    """One GroupQueryAttention node as the lowering writes it (rotary inside, the cache bound in
    place), or its TreeAttention rewrite (``f16_kv``: on a float16 cache)."""
    from onnx import TensorProto, helper

    from specinfer.engines.onnxruntime import open_session

    cache = [1, kv_heads, capacity, d]
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "t", (heads + 2 * kv_heads) * d]),
              helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
              helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    if tree_inputs:
        inputs += [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "t"]),
                   helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 1, "t", "total"])]
    angles = np.outer(np.arange(max(capacity, 64)), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
    tables = [helper.make_tensor(name, TensorProto.FLOAT, angles.shape, f(angles).astype(np.float32).ravel())
              for name, f in (("cos", np.cos), ("sin", np.sin))]
    node = helper.make_node("GroupQueryAttention",
                            ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin",
                             "position_ids" if tree_inputs else "", "bias" if tree_inputs else ""],
                            ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=kv_heads, scale=0.3, do_rotary=1, rotary_interleaved=0, local_window_size=-1)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache)]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs, tables),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    if native_op:
        model = native.use_tree_attention(model)
        assert [n.op_type for n in model.graph.node] == [native.ATTENTION_OP]
    if f16_kv:
        model = native.use_f16_kv(model)
        assert [n.op_type for n in model.graph.node] == [native.F16_KV_OPS[native.ATTENTION_OP]]
    return open_session(model.SerializeToString(), libraries=[native.library()] if native_op else [])


def _attend(session, cache: np.ndarray, qkv: np.ndarray, parents: list[int] | None, past: int,
            bias: np.ndarray | None = None):
    """Run on ``cache`` ([2, 1, Hkv, S, D], bound in place as past and present) the new tokens
    ``qkv`` after ``past`` cached ones, a tree by ``parents`` (None: the drafter's form, no
    positions nor bias, a chain; ``bias``: added to the tree's); returns the attention output."""
    import onnxruntime as ort

    t, bias_in = qkv.shape[1], bias
    io = session.io_binding()
    io.bind_output("out")   # first: outputs come back in the order bound
    values = [ort.OrtValue.ortvalue_from_numpy(cache[i]) for i in range(2)]
    for value, past_name, present in zip(values, ("past_key", "past_value"), ("present_key", "present_value")):
        io.bind_ortvalue_input(past_name, value)
        io.bind_ortvalue_output(present, value)
    feeds = {"qkv": qkv, "seqlens_k": np.array([past + t - 1], np.int32), "total": np.array(past + t, np.int32)}
    if parents is not None:
        depth = []
        visible = np.eye(t, dtype=bool)
        for i, p in enumerate(parents):
            depth.append(0 if p < 0 else depth[p] + 1)
            if p >= 0:
                visible[i] |= visible[p]
        bias = np.zeros((1, 1, t, past + t), np.float32)
        bias[0, 0, :, past:][~visible] = np.finfo(np.float32).min
        feeds.update(position_ids=(past + np.asarray(depth, np.int64))[None], bias=bias + (0 if bias_in is None else bias_in))
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    session.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (4, 2, 16), (4, 4, 32), (8, 1, 48)])
@pytest.mark.parametrize("tree_inputs", [True, False])
def test_tree_attention_computes_what_group_query_attention_does(heads, kv_heads, d, tree_inputs):
    rng = np.random.default_rng(heads * d)
    past, capacity = 37, 64
    parents = [-1, 0, 0, 1, 1, 2, 5, -1] if tree_inputs else None
    qkv = rng.standard_normal((1, 8, (heads + 2 * kv_heads) * d)).astype(np.float32)
    caches = []
    for native_op in (False, True):
        cache = rng.standard_normal((2, 1, kv_heads, capacity, d)).astype(np.float32) if not caches else caches[0][0]
        cache = cache.copy()
        out = _attend(_attention_session(heads, kv_heads, d, capacity, tree_inputs, native_op), cache, qkv, parents, past)
        caches.append((cache, out))
    (theirs, expected), (ours, got) = caches
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)   # the new rows, rotated keys and values
    np.testing.assert_array_equal(ours[:, :, :, past + 8:], theirs[:, :, :, past + 8:])   # nothing else written


@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (8, 1, 48)])
def test_tree_attention_skips_the_keys_a_bias_masks_and_adds_the_others_bias(heads, kv_heads, d):
    """A bias that also masks cached keys (whole blocks of 16, parts of blocks, single keys) and
    weighs the rest: GroupQueryAttention's output, where a masked key weighs nothing."""
    rng = np.random.default_rng(d)
    past, capacity = 70, 96
    parents = [-1, 0, 0, 1, 1, 2, 5, -1]
    qkv = rng.standard_normal((1, 8, (heads + 2 * kv_heads) * d)).astype(np.float32)
    extra = rng.uniform(-2, 0.5, (1, 1, 8, past + 8)).astype(np.float32)
    extra[..., 16:32] = np.finfo(np.float32).min                   # a whole block
    extra[..., 40:45] = np.finfo(np.float32).min                   # part of one
    extra[..., rng.choice(past, 9, replace=False)] = np.finfo(np.float32).min
    cache = rng.standard_normal((2, 1, kv_heads, capacity, d)).astype(np.float32)
    expected, got = (_attend(_attention_session(heads, kv_heads, d, capacity, True, native_op), cache.copy(), qkv,
                             parents, past, extra) for native_op in (False, True))
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
    unbiased = _attend(_attention_session(heads, kv_heads, d, capacity, True, True), cache.copy(), qkv, parents, past)
    assert np.abs(got - unbiased).max() > 1e-2   # the bias counts


@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (8, 1, 48)])
def test_tree_attention_on_a_float16_cache_is_the_float32_one_on_its_values(heads, kv_heads, d):
    """TreeAttentionF16KV over a float16 cache: the new tokens' keys and values are written as
    TreeAttention writes them, rounded to float16, the past is left as it was, and the output is
    TreeAttention's over the same values up to that rounding of the new rows (each query also
    attends to its own, rounded, key)."""
    rng = np.random.default_rng(d)
    past, capacity, parents = 37, 64, [-1, 0, 0, 1, 1, 2, 5, -1]
    qkv = rng.standard_normal((1, 8, (heads + 2 * kv_heads) * d)).astype(np.float32)
    half = rng.standard_normal((2, 1, kv_heads, capacity, d)).astype(np.float16)
    before, wide = half.copy(), half.astype(np.float32)
    out16 = _attend(_attention_session(heads, kv_heads, d, capacity, True, True, f16_kv=True), half, qkv, parents, past)
    out32 = _attend(_attention_session(heads, kv_heads, d, capacity, True, True), wide, qkv, parents, past)
    np.testing.assert_array_equal(half, wide.astype(np.float16))
    np.testing.assert_array_equal(half[..., :past, :], before[..., :past, :])
    assert not np.array_equal(half[..., past:past + 8, :], before[..., past:past + 8, :])
    np.testing.assert_allclose(out16, out32, rtol=0, atol=2e-3)
    assert np.abs(out16 - out32).max() > 0   # the rounding of the new rows shows


def test_a_tree_node_attends_bit_for_bit_as_the_same_token_in_a_chain():
    rng = np.random.default_rng(7)
    heads, kv_heads, d, past, capacity = 6, 2, 64, 45, 64
    session = _attention_session(heads, kv_heads, d, capacity, True, True)
    parents = [-1, 0, 0, 1, 2, 3, 3, 6, 4]
    qkv = rng.standard_normal((1, len(parents), (heads + 2 * kv_heads) * d)).astype(np.float32)
    cache = rng.standard_normal((2, 1, kv_heads, capacity, d)).astype(np.float32)
    tree = _attend(session, cache.copy(), qkv, parents, past)
    for leaf in (7, 8, 5):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        chain = _attend(session, cache.copy(), qkv[:, path], list(range(-1, len(path) - 1)), past)
        np.testing.assert_array_equal(chain[0], tree[0, path])


def test_tree_attention_refuses_a_sequence_past_its_cache():
    session = _attention_session(4, 2, 16, 16, True, True)
    cache = np.zeros((2, 1, 2, 16, 16), np.float32)
    with pytest.raises(Exception, match="total_sequence_length exceeds the cache's slots"):
        _attend(session, cache, np.zeros((1, 4, 128), np.float32), [-1, 0, 1, 2], 14)


def _slots_session(heads: int, kv_heads: int, d: int, capacities: list[int]):
    """One TreeAttentionSlots node over len(capacities) sequences, each with its own cache."""
    from onnx import TensorProto, helper

    from specinfer.engines.onnxruntime import open_session

    f32, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("qkv", f32, [1, "t", (heads + 2 * kv_heads) * d]),
              helper.make_tensor_value_info("slot_tokens", i64, ["n"]),
              helper.make_tensor_value_info("position_ids", i64, [1, "t"])]
    angles = np.outer(np.arange(64), 1.0 / 10000 ** (np.arange(0, d, 2) / d))
    tables = [helper.make_tensor(name, f32, angles.shape, f(angles).astype(np.float32).ravel())
              for name, f in (("cos", np.cos), ("sin", np.sin))] + [helper.make_tensor("scale", f32, [], [0.3])]
    names, outputs = ["qkv", "slot_tokens", "position_ids", "cos", "sin", "scale"], ["out"]
    for s, capacity in enumerate(capacities):
        cache = [1, kv_heads, capacity, d]
        inputs += [helper.make_tensor_value_info(f"past_key.{s}", f32, cache),
                   helper.make_tensor_value_info(f"past_value.{s}", f32, cache),
                   helper.make_tensor_value_info(f"seqlens_k.{s}", i32, [1]),
                   helper.make_tensor_value_info(f"total.{s}", i32, []),
                   helper.make_tensor_value_info(f"bias.{s}", f32, None)]
        names += [f"past_key.{s}", f"past_value.{s}", f"seqlens_k.{s}", f"total.{s}", f"bias.{s}"]
        outputs += [f"present_key.{s}", f"present_value.{s}"]
    node = helper.make_node(native.SLOTS_OP, names, outputs, domain=native.DOMAIN)
    model = helper.make_model(helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, f32, None) for o in outputs],
                                                tables),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(native.DOMAIN, 1)], ir_version=10)
    return open_session(model.SerializeToString(), libraries=[native.library()])


def _tree_feeds(parents: list[int], past: int) -> tuple[np.ndarray, np.ndarray]:
    """A tree's positions and bias after ``past`` cached tokens."""
    depth, visible = [], np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        if p >= 0:
            visible[i] |= visible[p]
    bias = np.zeros((1, 1, len(parents), past + len(parents)), np.float32)
    bias[0, 0, :, past:][~visible] = np.finfo(np.float32).min
    return past + np.asarray(depth, np.int64), bias


def test_slot_attention_gives_each_sequence_bit_for_bit_what_it_gets_alone():
    rng = np.random.default_rng(11)
    heads, kv_heads, d = 6, 2, 64
    # (parents, cached tokens, capacity): a tree, a one-token step, a chain with no bias (causal)
    sequences = [([-1, 0, 0, 1, 2], 40, 64), ([-1], 13, 32), ([-1, 0, 1], 20, 48)]
    single = _attention_session(heads, kv_heads, d, 64, True, True)
    session = _slots_session(heads, kv_heads, d, [c for _, _, c in sequences])
    qkvs = [rng.standard_normal((1, len(p), (heads + 2 * kv_heads) * d)).astype(np.float32) for p, _, _ in sequences]
    caches = [rng.standard_normal((2, 1, kv_heads, c, d)).astype(np.float32) for _, _, c in sequences]
    feeds = {"qkv": np.concatenate(qkvs, axis=1), "slot_tokens": np.array([len(p) for p, _, _ in sequences], np.int64)}
    positions = []
    for s, ((parents, past, _), cache) in enumerate(zip(sequences, caches)):
        pos, bias = _tree_feeds(parents, past)
        positions.append(pos)
        feeds.update({f"past_key.{s}": cache[0], f"past_value.{s}": cache[1],
                      f"seqlens_k.{s}": np.array([past + len(parents) - 1], np.int32),
                      f"total.{s}": np.array(past + len(parents), np.int32),
                      f"bias.{s}": bias if s < 2 else np.zeros(0, np.float32)})   # the last: no bias
    feeds["position_ids"] = np.concatenate(positions)[None]
    out, *presents = session.run(None, feeds)
    row = 0
    for s, ((parents, past, capacity), cache, qkv) in enumerate(zip(sequences, caches, qkvs)):
        alone_cache = np.zeros((2, 1, kv_heads, 64, d), np.float32)
        alone_cache[:, :, :, :capacity] = cache
        alone = _attend(single, alone_cache, qkv, parents, past)
        np.testing.assert_array_equal(out[:, row:row + len(parents)], alone)
        for kv in range(2):   # the past kept, the new rows written as alone
            np.testing.assert_array_equal(presents[2 * s + kv][0, :, :past + len(parents)], alone_cache[kv, 0, :, :past + len(parents)])
        row += len(parents)
    feeds["slot_tokens"] = np.array([5, 1, 2], np.int64)   # one token short of qkv's
    with pytest.raises(Exception, match="slot_tokens must sum to the tokens of qkv"):
        session.run(None, feeds)
    feeds["slot_tokens"] = np.array([5, 1, 1, 1], np.int64)   # a sequence the node has no inputs for
    with pytest.raises(Exception, match="slot_tokens must name one sequence for each group"):
        session.run(None, feeds)


def test_a_batched_graph_attends_every_sequence_in_one_node_a_layer(exported):
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.export.ort_lowering import batch_drafter, batch_sequences

    runtime = OrtRuntime(exported["llama3"])
    layers = runtime.config.num_layers
    for graph in (batch_sequences(runtime._lowered, 3), batch_drafter(runtime._draft_graph("draft", 2), 3)):
        rewritten = native.use_slot_attention(native.use_tree_attention(graph))
        ops = [n.op_type for n in rewritten.graph.node]
        assert native.ATTENTION_OP not in ops
        assert ops.count(native.SLOTS_OP) == sum(n.op_type == "GroupQueryAttention" for n in graph.graph.node) // 3
        before = [n.op_type for n in graph.graph.node]
        assert before.count("Split") - ops.count("Split") >= ops.count(native.SLOTS_OP) >= layers   # q|k|v's splits gone
        assert before.count("Concat") - ops.count("Concat") == ops.count(native.SLOTS_OP)
    seqs = [runtime.start() for _ in range(3)]
    for i, seq in enumerate(seqs):
        runtime.prefill(seq, [1, 17, 42, 99, 5][:3 + i])
    runtime.score_batch([(seq, [7, 9, 11], [-1, 0, 0]) for seq in seqs])
    assert native.SLOTS_OP in runtime.native_ops


@pytest.fixture(scope="module")
def vocab_export(tmp_path_factory, checkpoints):
    """The llama3 checkpoint with a draft vocabulary of 100 tokens, exported."""
    import shutil

    from specinfer.export import export_model
    from specinfer.export.draft_vocab import write_draft_vocab

    root = tmp_path_factory.mktemp("native_vocab")
    ckpt = shutil.copytree(checkpoints["llama3"], root / "ckpt")
    write_draft_vocab(ckpt, np.random.default_rng(3).choice(np.arange(3, 320), 100, replace=False).tolist(), "a test's")
    return export_model(ckpt, root / "onnx", max_context=256, progress=False).out_dir


def _drafts(onnx_dir, graph_drafter: bool, monkeypatch, calls):
    """Each (step-0 tokens, depth, sampled) call's ChainDraft after the same prompt, and the KV cache
    after it, from a fresh OrtRuntime whose drafter is the DraftChain node or (``graph_drafter``) the graph."""
    from specinfer.engines.onnxruntime import OrtRuntime

    with monkeypatch.context() as m:
        if graph_drafter:
            m.setattr(native, "DRAFT_CHAIN_MAX_WEIGHTS", -1)
        runtime = OrtRuntime(onnx_dir)
        out = []
        for i, (tokens, depth, sampled) in enumerate(calls):
            seq = runtime.start()
            runtime.prefill(seq, [1, 17, 42, 99, 5, 23, 8, 61, 9, 14][: 4 + i])
            noise = np.random.default_rng(i).gumbel(size=(depth, runtime.draft_candidates)).astype(np.float32) \
                if sampled else None
            draft = runtime.draft_chain(seq, tokens, depth, noise)
            state = runtime._get(seq)
            out.append((draft, state.kv[..., :state.length + state.pending, :].copy()))
            runtime.release(seq)
    assert ({"DraftChain", "DraftChainSampled"} & runtime.native_ops) == (set() if graph_drafter else
                                                                         {"DraftChain", "DraftChainSampled"})
    return out


@pytest.mark.parametrize("family", ["llama3", "qwen2", "draft_vocab"])
def test_the_native_drafter_drafts_what_the_drafter_graph_does(family, exported, vocab_export, monkeypatch):
    """Greedy and sampled chains, cut short and full, after one step-0 token or several: the same
    tokens, their probabilities (or candidates' logits) to float rounding, the same cache rows.
    qwen2 has a q|k|v bias; the draft vocabulary makes the head score 100 tokens."""
    onnx_dir = vocab_export if family == "draft_vocab" else exported[family]
    calls = [([7], 1, False), ([7, 8, 9, 10], 3, False), ([11], 8, False), ([12, 13, 14], 8, False),
             ([7], 1, True), ([15, 16], 4, True), ([17], 8, True)]
    node, graph = (_drafts(onnx_dir, g, monkeypatch, calls) for g in (False, True))
    for (a, cache_a), (b, cache_b), (_, depth, sampled) in zip(node, graph, calls):
        assert a.tokens == b.tokens and len(a.tokens) == depth
        if sampled:
            assert [c.tolist() for c in a.candidates] == [c.tolist() for c in b.candidates]
            np.testing.assert_allclose(np.array(a.candidate_logits), np.array(b.candidate_logits), rtol=1e-4, atol=1e-4)
        else:
            assert a.runner_up == b.runner_up
            np.testing.assert_allclose(a.probability + a.runner_up_probability,
                                       b.probability + b.runner_up_probability, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(cache_a, cache_b, rtol=1e-4, atol=1e-5)


def test_the_native_drafter_names_a_bad_input(exported):
    from specinfer.engines.onnxruntime import OrtRuntime

    runtime = OrtRuntime(exported["llama3"])
    seq = runtime.start()
    runtime.prefill(seq, [1, 17, 42])
    runtime.draft_chain(seq, [7], 3)
    binding = runtime._get(seq).bindings["draft", 3]
    binding.feed("input_ids", np.array([[runtime.vocab_size + 5]]))   # past the runtime's own check
    with pytest.raises(Exception, match="DraftChain: a token id is outside the vocabulary"):
        binding.session.run_with_iobinding(binding.io)
    binding.set("seqlens_k", 1000)
    binding.feed("input_ids", np.array([[7]]))
    with pytest.raises(Exception, match="DraftChain: seqlens_k must be total_sequence_length - 1"):
        binding.session.run_with_iobinding(binding.io)


def _drafter_node_with_presents(keep):
    """native.use_draft_chain with the node's presents chosen by ``keep(graph's presents per step)``."""
    rewrite = native.use_draft_chain

    def use_draft_chain(model, weights_dir, packed):
        out = rewrite(model, weights_dir, packed)
        if out is model:
            return out
        steps: dict[str, list] = {}   # each step's presents, step 0 first, as the graph lists them
        for o in model.graph.output:
            if ".step" in o.name:
                steps.setdefault(o.name.rsplit(".step", 1)[1], []).append(o)
        presents = keep(list(steps.values()))
        node = out.graph.node[0]
        del node.output[3:]
        node.output.extend(o.name for o in presents)
        del out.graph.output[3:]
        out.graph.output.extend(presents)
        return out
    return use_draft_chain


def test_the_native_drafter_writes_one_present_a_layer_and_takes_the_graphs_per_step_ones(exported, monkeypatch):
    """The node's outputs are the draft's three, then one present key and value a layer, which a
    runtime binds to the cache (2 a layer at any depth, where the graph had them for every step).
    Given the graph's presents of every step (all bound to the cache) it drafts the same, bit for
    bit, cache rows included; any other count of outputs is refused by name."""
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.export.ort_lowering import drafter_present_names

    runtime = OrtRuntime(exported["llama3"])
    layers = runtime.config.num_layers
    graph = runtime._draft_graph("draft", 4)
    node = native.use_draft_chain(graph, runtime.dir, {})
    assert [o.name for o in node.graph.output] == [o.name for o in graph.graph.output][:3] + drafter_present_names(layers, 4)[0]
    assert list(node.graph.node[0].output) == [o.name for o in node.graph.output]

    def drafts(rt):
        seq = rt.start()
        rt.prefill(seq, [1, 17, 42, 9])
        chains = [rt.draft_chain(seq, [7], 4)]
        rt.commit(seq, [0, 1, 2])
        chains.append(rt.draft_chain(seq, [8, 3], 2))
        kv = rt._get(seq).kv.copy()
        rt.release(seq)
        return chains, kv

    compact, compact_kv = drafts(runtime)
    monkeypatch.setattr(native, "use_draft_chain", _drafter_node_with_presents(lambda steps: [o for step in steps for o in step]))
    every_step = OrtRuntime(exported["llama3"])
    full, full_kv = drafts(every_step)
    assert "DraftChain" in every_step.native_ops
    for a, b in zip(compact, full):
        assert a.tokens == b.tokens and a.probability == b.probability and a.runner_up == b.runner_up
    np.testing.assert_array_equal(compact_kv, full_kv)
    monkeypatch.setattr(native, "use_draft_chain", _drafter_node_with_presents(lambda steps: steps[0][:2]))
    short = OrtRuntime(exported["llama3"])
    seq = short.start()
    short.prefill(seq, [1, 17, 42])
    with pytest.raises(Exception, match="DraftChain: the outputs must be the draft's three"):
        short.draft_chain(seq, [7], 3)


def test_the_native_drafter_refuses_two_sequences_with_different_inputs_on_one_cache(exported):
    """A batch's spare slots share one scratch cache and draft the same, drafted once; two slots on
    one cache with different tokens would write it at once, so the node refuses them."""
    from specinfer.engines.onnxruntime import OrtRuntime

    runtime = OrtRuntime(exported["llama3"])
    first, second = runtime.start(), runtime.start()
    for seq in (first, second):
        runtime.prefill(seq, [1, 17, 42])
    runtime._get(second).kv = runtime._get(first).kv   # bound as one cache in the batch
    with pytest.raises(Exception, match="DraftChain: two sequences with different inputs share a cache"):
        runtime.draft_chains([(first, [7], 3, None), (second, [8], 3, None)])


def test_a_large_models_drafter_stays_a_graph_on_the_pool(exported, monkeypatch):
    """The LLM drafting its own chain (incremental decoding) keeps its graph: the node runs on one thread."""
    from specinfer.engines.onnxruntime import OrtRuntime

    monkeypatch.setattr(native, "DRAFT_CHAIN_MAX_WEIGHTS", 1000)
    runtime = OrtRuntime(exported["llama3"])
    seq = runtime.start()
    runtime.prefill(seq, [1, 17, 42])
    runtime.draft_chain(seq, [7], 3)
    assert "DraftChain" not in runtime.native_ops and native.ATTENTION_OP in runtime.native_ops


def test_a_batched_drafter_becomes_one_node_that_drafts_each_sequence_as_alone(exported):
    """Greedy and sampled batches with spare slots (9 in a batch of 12, 10 in 12: the spare slots
    share one scratch cache, drafted once): each sequence bit for bit what it drafts alone."""
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.export.ort_lowering import batch_drafter

    runtime = OrtRuntime(exported["llama3"])
    for kind in ("draft", "sampled_draft"):
        batched = native.use_draft_chain(batch_drafter(runtime._draft_graph(kind, 3), 4), runtime.dir, {})
        assert [n.op_type for n in batched.graph.node] == [native.DRAFT_OPS["draft_mass" if kind == "draft" else "draft_choice"]]
    rng = np.random.default_rng(5)
    k = runtime.draft_candidates
    calls = [([1] + rng.integers(3, 300, 3 + i).tolist(), rng.integers(3, 300, 1 + i % 3).tolist(), 1 + i % 3,
              None if i < 9 else (0.8 * rng.gumbel(size=(3, k))).astype(np.float32)) for i in range(19)]
    drafts = []
    for together in (True, False):
        seqs = [runtime.start() for _ in calls]
        for seq, (prompt, *_) in zip(seqs, calls):
            runtime.prefill(seq, prompt)
        chains = [(seq, tokens, depth, None if noise is None else noise[:depth])
                  for seq, (_, tokens, depth, noise) in zip(seqs, calls)]
        drafts.append(runtime.draft_chains(chains) if together else [runtime.draft_chain(*c) for c in chains])
        for seq in seqs:
            runtime.release(seq)
    assert runtime.batch_drafters == [("draft", 3, 12), ("sampled_draft", 3, 12)]
    assert {"DraftChain", "DraftChainSampled"} <= runtime.native_ops
    for together, alone in zip(*drafts):   # bit for bit: the same computation per sequence
        assert all(np.array_equal(a, b) for a, b in zip(together, alone))


def test_float16_kv_caches_decode_as_float32_ones_up_to_their_rounding(exported, monkeypatch):
    """An LLM on float16 caches (``OrtRuntime(kv_dtype="float16")``): half the bytes a token, logits
    within the caches' rounding of float32 ones, a sequence's logits in a batch bit for bit its
    logits alone, greedy speculative decoding token for token its incremental decoding (the SSM on
    float16 caches too, drafting as a graph), and a clear refusal where it cannot run."""
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.errors import SpecInferError
    from specinfer.generate import generate_ids

    wide, half = OrtRuntime(exported["llama3"]), OrtRuntime(exported["llama3"], kv_dtype="float16")
    assert half.kv_bytes_per_token * 2 == wide.kv_bytes_per_token
    prompt, tree, parents = [1, 17, 42, 99, 5, 23, 8], [61, 7, 9, 11], [-1, 0, 0, 1]
    logits = []
    for rt in (wide, half):
        seq = rt.start()
        first = rt.prefill(seq, prompt)
        logits.append((first, rt.score(seq, tree, parents)))
        assert rt._get(seq).kv.dtype == rt.kv_dtype
        rt.release(seq)
    assert native.F16_KV_OPS[native.ATTENTION_OP] in half.native_ops
    for ours, theirs in zip(*logits):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=5e-3)
    seqs = [half.start() for _ in range(3)]
    for i, seq in enumerate(seqs):
        half.prefill(seq, prompt[:4 + i])
    together = half.score_batch([(seq, tree[:1 + i], parents[:1 + i]) for i, seq in enumerate(seqs)])
    assert native.F16_KV_OPS[native.SLOTS_OP] in half.native_ops
    for i, seq in enumerate(seqs):
        half.commit(seq, [])
        np.testing.assert_array_equal(together[i], half.score(seq, tree[:1 + i], parents[:1 + i]))
        half.release(seq)
    ssm = OrtRuntime(exported["llama3"], kv_dtype="float16")
    incremental = sum(generate_ids(half, prompt, tree=[], max_new_tokens=24), [])
    assert sum(generate_ids(half, prompt, ssms=[ssm], tree=[2, 1, 1], max_new_tokens=24), []) == incremental
    assert not set(native.DRAFT_OPS.values()) & ssm.native_ops
    drafts = []   # an SSM's chains drafted for several sequences in one run: each as alone
    for together in (True, False):
        seqs = [ssm.start() for _ in range(3)]
        for i, seq in enumerate(seqs):
            ssm.prefill(seq, prompt[:3 + i])
        calls = [(seq, [7 + i], 3, None) for i, seq in enumerate(seqs)]
        drafts.append(ssm.draft_chains(calls) if together else [ssm.draft_chain(*c) for c in calls])
        for seq in seqs:
            ssm.release(seq)
    assert ssm.batch_drafters and native.F16_KV_OPS[native.SLOTS_OP] in ssm.native_ops
    for a, b in zip(*drafts):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(SpecInferError, match="KV cache type must be one of float32, float16"):
        OrtRuntime(exported["llama3"], kv_dtype="bfloat16")
    monkeypatch.setenv("SPECINFER_NATIVE", "0")
    native.library.cache_clear()
    try:
        with pytest.raises(SpecInferError, match="float16 KV caches need the native kernels"):
            OrtRuntime(exported["llama3"], kv_dtype="float16")
    finally:
        monkeypatch.delenv("SPECINFER_NATIVE")
        native.library.cache_clear()


def test_the_sample_op_draws_each_row_as_the_native_draw_does():
    """SampleSoftmax (sampled decoding's draw inside a graph): each row of logits at its own
    temperature and uniform gives the token native.sample_softmax gives it (sampling.draw's draw);
    a row without mass gives -1; a temperature not above 0 or a uniform outside [0, 1) is refused
    with a message that names them."""
    from onnx import TensorProto, helper

    from specinfer.engines.onnxruntime import open_session

    rows, vocab = 9, 300
    node = helper.make_node(native.SAMPLE_OP, ["logits", "temperature", "uniform"], ["tokens"], domain=native.DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, rows, vocab]),
                                            helper.make_tensor_value_info("temperature", TensorProto.DOUBLE, [1, rows]),
                                            helper.make_tensor_value_info("uniform", TensorProto.DOUBLE, [1, rows])],
                              [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, rows])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(native.DOMAIN, 1)],
                              ir_version=10)
    session = open_session(model.SerializeToString(), libraries=[native.library()])
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((1, rows, vocab)) * 3).astype(np.float32)
    logits[0, -1] = np.nan
    temperature, uniform = rng.uniform(0.2, 2.0, (1, rows)), rng.random((1, rows))
    uniform[0, 0] = 0.0
    tokens = session.run(None, {"logits": logits, "temperature": temperature, "uniform": uniform})[0]
    expected = [native.sample_softmax(logits[0, r], temperature[0, r], uniform[0, r]) for r in range(rows)]
    assert tokens[0].tolist() == expected and expected[-1] == -1 and len(set(expected)) > 3
    for bad in ({"temperature": np.zeros((1, rows))}, {"uniform": np.ones((1, rows))}):
        feeds = {"logits": logits, "temperature": temperature, "uniform": uniform} | bad
        with pytest.raises(Exception, match="each temperature must be > 0 and each uniform in"):
            session.run(None, feeds)
