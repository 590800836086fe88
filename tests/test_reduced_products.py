"""The reduced-precision products (``matmul_dtype`` "bfloat16" and "int8",
specinfer/engines/kernels/f16w_matmul.c): each output its definition bit for bit (bfloat16: the
VDPBF16PS sum of the rounded numbers; int8: the exact sum of the quantized numbers, scaled), a
row's result independent of its batch, and an LLM on them decoding speculatively exactly as it
decodes incrementally, its logits within the rounding of float32 ones."""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import prompt_and_tree_logits
from specinfer.engines import native
from specinfer.errors import SpecInferError


def _runs(dtype: str):
    return pytest.mark.skipif(not native.products_run(dtype), reason=f"the {dtype} kernels need the native "
                              f"library on a CPU with {native.PRODUCT_NAMES[dtype]}")


DTYPES = [pytest.param(dtype, marks=_runs(dtype)) for dtype in ("bfloat16", "int8")]


def _rounded(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bfloat16, as float32."""
    return (native.bf16_bits(values).astype(np.uint32) << 16).view(np.float32)


def _vdpbf16ps(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[M, K] x [K, N] as the kernel defines it: both rounded to bfloat16, each output summed over
    pairs of k in order, each pair as VDPBF16PS adds it (the odd k's exact product, then the even
    one's, each addition rounded to float32)."""
    a, w = _rounded(a), _rounded(w)
    if a.shape[1] % 2:
        a, w = np.pad(a, ((0, 0), (0, 1))), np.pad(w, ((0, 1), (0, 0)))
    acc = np.zeros((a.shape[0], w.shape[1]), np.float32)
    for k in range(0, a.shape[1], 2):
        acc = (acc + a[:, k + 1, None] * w[k + 1]) + a[:, k, None] * w[k]
    return acc


def _int8_product(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[M, K] x [K, N] as the int8 kernels define it: W quantized per column
    (:func:`native.quantize_columns`), each row of A by its largest magnitude m, q = round(a x
    (127 / m)) to nearest even, the integer products summed exactly, times (m / 127) x the column's
    scale, all in float32."""
    q, scale = native.quantize_columns(w)
    largest = np.abs(a).max(axis=-1)
    inverse = np.divide(np.float32(127), largest, out=np.zeros_like(largest), where=largest > 0)
    exact = (np.rint(a * inverse[:, None]).astype(np.int64) @ q.astype(np.int64)).astype(np.float32)
    return exact * ((largest / np.float32(127))[:, None] * scale)


PRODUCTS = {"bfloat16": _vdpbf16ps, "int8": _int8_product}


def _weights(dtype: str, w: np.ndarray, swiglu: bool = False) -> list:
    """The initializers of ``w`` ([K, N], or, ``swiglu``, [2, K, I]: gate and up) for ``dtype``'s
    ops, named "w" (int8: and "w.scales")."""
    from onnx import numpy_helper

    if dtype == "bfloat16":
        bits = native.bf16_bits(w)
        return [native.bf16_initializer(native.pack_swiglu(*bits, native.pack_pair_panels) if swiglu
                                        else native.pack_pair_panels(bits), "w")]
    if not swiglu:
        return native.packed_weight(w, "int8", "w")
    q, scale = native.quantize_columns(np.concatenate(list(w), axis=1))   # per column: as gate and up apart
    scales = native.i8_scales(q, scale)
    return [numpy_helper.from_array(native.pack_swiglu(*np.split(q, 2, axis=1), lambda v: native.pack_group_panels(v, 4)), "w"),
            numpy_helper.from_array(native.swiglu_columns(*np.split(scales, 2, axis=1)), "w.scales")]


def _session(dtype: str, swiglu: bool, weights: list, k: int, normed: dict | None = None):
    """A session of ``dtype``'s product op (or its SwiGLU op), its norm before it if ``normed``."""
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import open_session

    op = native.PRODUCT_OPS[dtype][native.SWIGLU_OP if swiglu else native.OP]
    names = [w.name for w in weights]
    if normed is None:
        node = helper.make_node(op, ["a", *names], ["c"], domain=native.DOMAIN)
        inputs, outputs, inits = ["a"], ["c"], weights
    else:
        node = helper.make_node(native.NORMED_OPS[op], ["a", "skip", "gamma", "eps", *names], ["c", "sum"], domain=native.DOMAIN)
        inputs, outputs = ["a", "skip"], ["c", "sum"]
        inits = [numpy_helper.from_array(normed["gamma"], "gamma"),
                 numpy_helper.from_array(np.array([normed["eps"]], np.float32), "eps"), *weights]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, "m", k]) for x in inputs],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    return open_session(model.SerializeToString(), libraries=[native.library()])


# How far each product may be from float64's (the test's numbers: |a x w| up to ~3): bfloat16's 8
# bits; int8's 127 steps a row and a column.
FAR = {"bfloat16": (1e-4, 2e-2), "int8": (1e-3, 6e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [73, 40, 256])
def test_the_product_is_its_definition_on_the_rounded_numbers_whatever_the_batch(dtype, k):
    """Where the CPU has AMX-INT8, int8 products of 6 rows or more take the tile unit and fewer
    VPDPBUSD: both are the definition here. K: 73 not a multiple of 2 or 4 (its last pair or quad
    padded with zero) and of 19 quads (a tile's 16 and 3 left), 40 fewer quads than a tile, 256 16
    quads 4 times."""
    rng = np.random.default_rng(0)
    n = 192
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    session = _session(dtype, False, _weights(dtype, w), k)
    a = rng.standard_normal((1, 37, k)).astype(np.float32)
    a[0, 5] = 0   # a row of zeros: scale 0 (int8), zeros out
    together = session.run(None, {"a": a})[0]
    assert together.shape == (1, 37, n)
    np.testing.assert_array_equal(together[0], PRODUCTS[dtype](a[0], w))
    assert not together[0, 5].any()
    near, far = FAR[dtype]
    far *= max(1.0, np.sqrt(k / 73))   # the rounding errors of a sum grow as its root
    assert near < np.abs(together[0] - a[0].astype(np.float64) @ w).max() < far   # rounded, not more
    for m in (1, 3, 5, 7):   # any batch: each row bit for bit what it is alone
        for start in (0, 4, 30):
            np.testing.assert_array_equal(session.run(None, {"a": a[:, start:start + m]})[0], together[:, start:start + m])


@pytest.mark.skipif("amx_int8" not in native.cpu_flags() or not native.products_run("int8")
                    or os.environ.get("SPECINFER_AMX") == "0",
                    reason="needs a CPU with AMX-INT8, the native library and SPECINFER_AMX not 0")
def test_int8_products_take_the_tile_unit_where_the_cpu_has_one():
    import subprocess
    import sys

    assert native.int8_by_tiles()
    off = subprocess.run([sys.executable, "-c", "from specinfer.engines import native; print(native.int8_by_tiles())"],
                         env={**os.environ, "SPECINFER_AMX": "0"}, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "False"


@pytest.mark.parametrize("group", [1, 2, 4])
def test_group_panels_unpack_to_the_weight(group):
    values = np.arange(7 * 130, dtype=np.uint16).reshape(7, 130)
    packed = native.pack_group_panels(values, group) if group > 1 else native.pack_panels(values)
    assert packed.shape == (3, -(-7 // group), group * 64)   # ceil(130 / 64) panels, ceil(7 / group) groups of rows
    back = native.unpack_panels(packed, group)
    np.testing.assert_array_equal(back[:7, :130], values)
    assert not back[7:].any() and not back[:, 130:].any()


def test_int8_quantization_of_columns():
    w = np.array([[0.5, 0, -2], [-1.0, 0, 1], [0.25, 0, 0.0078]], np.float32)
    q, scale = native.quantize_columns(w)   # a column of zeros: scale 0
    np.testing.assert_array_equal(scale, np.float32([1.0, 0, 2.0]) / np.float32(127))
    np.testing.assert_array_equal(q, [[64, 0, -127], [-127, 0, 64], [32, 0, 0]])   # 63.5 to even, 31.75 up, 0.495 down
    np.testing.assert_array_equal(native.i8_scales(q, scale), [scale, [-31, 0, -63]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swiglu, normed", [(True, False), (False, True), (True, True)])
def test_the_swiglu_and_normed_kernels_are_the_product_of_their_rounded_inputs(dtype, swiglu, normed):
    """The SwiGLU ops: silu(a Wg) * (a Wu) of the two products; the normed ops: the product of
    RMSNorm(x + skip) * gamma (normalized in float32, then rounded), and x + skip; each row bit for
    bit what it is alone."""
    rng = np.random.default_rng(3)
    k, n, eps = 72, 128, 1e-5
    w = (rng.standard_normal((2, k, n // 2) if swiglu else (k, n)) * 0.2).astype(np.float32)
    gamma = (1 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    session = _session(dtype, swiglu, _weights(dtype, w, swiglu), k, dict(gamma=gamma, eps=eps) if normed else None)
    x, skip = rng.standard_normal((2, 1, 45, k)).astype(np.float32)
    feeds = {"a": x, "skip": skip} if normed else {"a": x}
    out = session.run(None, feeds)
    a = x[0]
    if normed:
        np.testing.assert_array_equal(out[1], x + skip)
        s = (x[0] + skip[0]).astype(np.float64)
        a = (s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * gamma).astype(np.float32)
    product = PRODUCTS[dtype]
    if swiglu:
        g, u = product(a, w[0]).astype(np.float64), product(a, w[1]).astype(np.float64)
        expected = g / (1 + np.exp(-g)) * u
    else:
        expected = product(a, w)
    # The norm in float64 here and float32 there may round a value to the other neighbour.
    np.testing.assert_allclose(out[0][0], expected, rtol=1e-5 if not normed else 0,
                               atol=1e-5 if not normed else FAR[dtype][1])
    for m in (1, 6, 33):
        for start in (0, 7, 12):
            part = session.run(None, {name: v[:, start:start + m] for name, v in feeds.items()})
            for ours, whole in zip(part, out):
                np.testing.assert_array_equal(ours, whole[:, start:start + m])


# How far an LLM's logits on the reduced products may be from its float32 logits, as a share of
# their largest magnitude (the test models' measured: bfloat16 0.002-0.005, int8 0.009-0.016).
LOGITS_FAR = 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_an_llm_on_reduced_products_decodes_speculatively_as_incrementally(family, dtype, exported):
    """``OrtRuntime(matmul_dtype=dtype)``: every native product in ``dtype``, none on float16;
    logits within its rounding of the float32 runtime's (itself checked against transformers); a
    sequence's logits in a batch bit for bit its logits alone; greedy speculative decoding (a
    float32 SSM drafting, a fixed and the dynamic tree) token for token its incremental decoding."""
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.generate import generate_ids

    wide, reduced = OrtRuntime(exported[family]), OrtRuntime(exported[family], matmul_dtype=dtype)
    product = native.PRODUCT_OPS[dtype]
    ops = {product[native.OP], native.NORMED_OPS[product[native.OP]], native.NORMED_OPS[product[native.SWIGLU_OP]]}
    f16_ops = {op for product in (native.OP, native.SWIGLU_OP) for op in (product, native.NORMED_OPS[product])}
    assert ops <= reduced.native_ops and not f16_ops & reduced.native_ops and f16_ops & wide.native_ops
    prompt, tree, parents = [1, 17, 42, 99, 5, 23, 8], [61, 7, 9, 11], [-1, 0, 0, 1]
    logits = [prompt_and_tree_logits(rt, prompt, tree, parents) for rt in (wide, reduced)]
    for ours, theirs in zip(logits[1], logits[0]):
        difference = np.abs(ours - theirs).max()
        assert 1e-5 < difference < LOGITS_FAR * np.abs(theirs).max(), difference
    seqs = [reduced.start() for _ in range(3)]
    for i, seq in enumerate(seqs):
        reduced.prefill(seq, prompt[:4 + i])
    together = reduced.score_batch([(seq, tree[:1 + i], parents[:1 + i]) for i, seq in enumerate(seqs)])
    for i, seq in enumerate(seqs):
        reduced.commit(seq, [])
        np.testing.assert_array_equal(together[i], reduced.score(seq, tree[:1 + i], parents[:1 + i]))
        reduced.release(seq)
    ssm = OrtRuntime(exported[family])
    incremental = sum(generate_ids(reduced, prompt, tree=[], max_new_tokens=32), [])
    assert sum(generate_ids(reduced, prompt, ssms=[ssm], tree=[2, 1, 1], max_new_tokens=32), []) == incremental
    assert sum(generate_ids(reduced, prompt, ssms=[ssm], max_new_tokens=32), []) == incremental   # dynamic tree


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduced_products_are_refused_clearly_where_they_cannot_run(dtype, exported, monkeypatch):
    from specinfer.engines.loader import load_runtime
    from specinfer.engines.onnxruntime import OrtRuntime

    with pytest.raises(SpecInferError, match="matrix product type must be one of float32, bfloat16, int8, got 'int4'"):
        OrtRuntime(exported["llama3"], matmul_dtype="int4")
    with pytest.raises(SpecInferError, match=f"{dtype} matrix products run on the onnxruntime engine only, not torch"):
        load_runtime(exported["llama3"], "torch", matmul_dtype=dtype)
    flag, name = native.PRODUCT_CPU_FLAGS[dtype], native.PRODUCT_NAMES[dtype]
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f", "f16c", "fma", *native.PRODUCT_CPU_FLAGS.values()} - {flag})
    with pytest.raises(SpecInferError, match=rf"{dtype} matrix products need the native kernels on a CPU with {name} \({flag}"):
        OrtRuntime(exported["llama3"], matmul_dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_repository_gives_the_llm_its_matmul_dtype(dtype, served_pair, tmp_path, monkeypatch):
    import re

    from specinfer.serving.repository import write_repository

    param = lambda repo, model: re.search(r'key: "matmul_dtype" value: { string_value: "([^"]*)" }',
                                          (repo / model / "config.pbtxt").read_text()).group(1)
    repo = write_repository(served_pair["llm"], served_pair["ssms"][:1], tmp_path / dtype, tree="1,1",
                            layout="both", matmul_dtype=dtype)
    assert {param(repo, m) for m in ("llm", "ensemble", "ensemble_fused")} == {dtype}
    assert "matmul_dtype" not in (repo / "ssm_0" / "config.pbtxt").read_text()   # the SSMs keep float32
    with pytest.raises(SpecInferError, match=f"{dtype} matrix products run on ONNX Runtime only, not on TensorRT engines"):
        write_repository(served_pair["llm"], served_pair["ssms"][:1], tmp_path / "trt", engines=tmp_path / "engines",
                         matmul_dtype=dtype)
    monkeypatch.setattr(native, "cpu_flags", lambda: set())
    with pytest.raises(SpecInferError, match=native.PRODUCT_NAMES[dtype]):   # refused here, not in a Triton model's stub
        write_repository(served_pair["llm"], served_pair["ssms"][:1], tmp_path / "no", tree="1,1",
                         matmul_dtype=dtype)
