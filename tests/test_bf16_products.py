"""The bfloat16 products (``matmul_dtype="bfloat16"``, specinfer/engines/kernels/f16w_matmul.c):
each output the VDPBF16PS sum of the bfloat16-rounded numbers (checked bit for bit against its
definition), a row's result independent of its batch, and an LLM on them decoding speculatively
exactly as it decodes incrementally, its logits within bfloat16's rounding of float32 ones."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import prompt_and_tree_logits
from specinfer.engines import native
from specinfer.errors import SpecInferError

pytestmark = pytest.mark.skipif(not native.bf16_products(),
                                reason="the bfloat16 kernels need the native library on a CPU with AVX512-BF16")


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


def _session(op: str, packed: np.ndarray, k: int, normed: dict | None = None):
    from onnx import TensorProto, helper, numpy_helper

    from specinfer.engines.onnxruntime import open_session

    weight = native.bf16_initializer(packed, "w")
    if normed is None:
        node = helper.make_node(op, ["a", "w"], ["c"], domain=native.DOMAIN)
        inputs, outputs, inits = ["a"], ["c"], [weight]
    else:
        node = helper.make_node(native.NORMED_OPS[op], ["a", "skip", "gamma", "eps", "w"], ["c", "sum"], domain=native.DOMAIN)
        inputs, outputs = ["a", "skip"], ["c", "sum"]
        inits = [numpy_helper.from_array(normed["gamma"], "gamma"),
                 numpy_helper.from_array(np.array([normed["eps"]], np.float32), "eps"), weight]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, "m", k]) for x in inputs],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    return open_session(model.SerializeToString(), libraries=[native.library()])


def test_the_bf16_product_is_vdpbf16ps_on_the_rounded_numbers_whatever_the_batch():
    rng = np.random.default_rng(0)
    k, n = 73, 192   # an odd K: its last pair padded with zero
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    session = _session(native.BF16_OPS[native.OP], native.pack_pair_panels(native.bf16_bits(w)), k)
    a = rng.standard_normal((1, 37, k)).astype(np.float32)
    together = session.run(None, {"a": a})[0]
    assert together.shape == (1, 37, n)
    np.testing.assert_array_equal(together[0], _vdpbf16ps(a[0], w))
    exact = a[0].astype(np.float64) @ w
    assert 1e-4 < np.abs(together[0] - exact).max() < 2e-2   # rounded, by bfloat16's 8 bits
    for m in (1, 3, 5):   # any batch: each row bit for bit what it is alone
        for start in (0, 4, 33):
            np.testing.assert_array_equal(session.run(None, {"a": a[:, start:start + m]})[0], together[:, start:start + m])


def test_pair_panels_unpack_to_the_weight():
    bits = np.arange(7 * 130, dtype=np.uint16).reshape(7, 130)
    packed = native.pack_pair_panels(bits)
    assert packed.shape == (3, 4, 128)   # ceil(130 / 64) panels, ceil(7 / 2) pairs of rows
    back = native.unpack_panels(packed, bf16=True)
    np.testing.assert_array_equal(back[:7, :130], bits)
    assert not back[7:].any() and not back[:, 130:].any()


@pytest.mark.parametrize("swiglu, normed", [(True, False), (False, True), (True, True)])
def test_the_swiglu_and_normed_bf16_kernels_are_the_product_of_their_rounded_inputs(swiglu, normed):
    """MatMulBF16SwiGLU: silu(a Wg) * (a Wu) of the two VDPBF16PS products; the normed ops: the
    product of RMSNorm(x + skip) * gamma (normalized in float32, then rounded), and x + skip; each
    row bit for bit what it is alone."""
    rng = np.random.default_rng(3)
    k, n, eps = 72, 128, 1e-5
    w = (rng.standard_normal((2, k, n // 2) if swiglu else (k, n)) * 0.2).astype(np.float32)
    bits = native.bf16_bits(w)
    packed = native.pack_swiglu(*bits, native.pack_pair_panels) if swiglu else native.pack_pair_panels(bits)
    gamma = (1 + 0.3 * rng.standard_normal(k)).astype(np.float32)
    op = native.BF16_OPS[native.SWIGLU_OP if swiglu else native.OP]
    session = _session(op, packed, k, dict(gamma=gamma, eps=eps) if normed else None)
    x, skip = rng.standard_normal((2, 1, 45, k)).astype(np.float32)
    feeds = {"a": x, "skip": skip} if normed else {"a": x}
    out = session.run(None, feeds)
    a = x[0]
    if normed:
        np.testing.assert_array_equal(out[1], x + skip)
        s = (x[0] + skip[0]).astype(np.float64)
        a = (s / np.sqrt((s * s).mean(-1, keepdims=True) + eps) * gamma).astype(np.float32)
    if swiglu:
        g, u = _vdpbf16ps(a, w[0]).astype(np.float64), _vdpbf16ps(a, w[1]).astype(np.float64)
        expected = g / (1 + np.exp(-g)) * u
    else:
        expected = _vdpbf16ps(a, w)
    # The norm in float64 here and float32 there may round a value to the other bfloat16 neighbour.
    np.testing.assert_allclose(out[0][0], expected, rtol=1e-5 if not normed else 0, atol=1e-5 if not normed else 2e-2)
    for m in (1, 6, 33):
        for start in (0, 7, 12):
            part = session.run(None, {name: v[:, start:start + m] for name, v in feeds.items()})
            for ours, whole in zip(part, out):
                np.testing.assert_array_equal(ours, whole[:, start:start + m])


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_an_llm_on_bf16_products_decodes_speculatively_as_incrementally(family, exported):
    """``OrtRuntime(matmul_dtype="bfloat16")``: every native product on bfloat16, none on float16;
    logits within bfloat16's rounding of the float32 runtime's (itself checked against transformers);
    a sequence's logits in a batch bit for bit its logits alone; greedy speculative decoding (a
    float32 SSM drafting, a fixed and the dynamic tree) token for token its incremental decoding."""
    from specinfer.engines.onnxruntime import OrtRuntime
    from specinfer.generate import generate_ids

    wide, bf16 = OrtRuntime(exported[family]), OrtRuntime(exported[family], matmul_dtype="bfloat16")
    ops = {native.BF16_OPS[native.OP], native.NORMED_OPS[native.BF16_OPS[native.OP]],
           native.NORMED_OPS[native.BF16_OPS[native.SWIGLU_OP]]}
    f16_ops = {op for product in (native.OP, native.SWIGLU_OP) for op in (product, native.NORMED_OPS[product])}
    assert ops <= bf16.native_ops and not f16_ops & bf16.native_ops and f16_ops & wide.native_ops
    prompt, tree, parents = [1, 17, 42, 99, 5, 23, 8], [61, 7, 9, 11], [-1, 0, 0, 1]
    logits = [prompt_and_tree_logits(rt, prompt, tree, parents) for rt in (wide, bf16)]
    for ours, theirs in zip(logits[1], logits[0]):
        difference = np.abs(ours - theirs).max()
        assert 1e-5 < difference < 0.05 * np.abs(theirs).max(), difference
    seqs = [bf16.start() for _ in range(3)]
    for i, seq in enumerate(seqs):
        bf16.prefill(seq, prompt[:4 + i])
    together = bf16.score_batch([(seq, tree[:1 + i], parents[:1 + i]) for i, seq in enumerate(seqs)])
    for i, seq in enumerate(seqs):
        bf16.commit(seq, [])
        np.testing.assert_array_equal(together[i], bf16.score(seq, tree[:1 + i], parents[:1 + i]))
        bf16.release(seq)
    ssm = OrtRuntime(exported[family])
    incremental = sum(generate_ids(bf16, prompt, tree=[], max_new_tokens=32), [])
    assert sum(generate_ids(bf16, prompt, ssms=[ssm], tree=[2, 1, 1], max_new_tokens=32), []) == incremental
    assert sum(generate_ids(bf16, prompt, ssms=[ssm], max_new_tokens=32), []) == incremental   # dynamic tree


def test_bf16_products_are_refused_clearly_where_they_cannot_run(exported, monkeypatch):
    from specinfer.engines.loader import load_runtime
    from specinfer.engines.onnxruntime import OrtRuntime

    with pytest.raises(SpecInferError, match="matrix product type must be one of float32, bfloat16, got 'int8'"):
        OrtRuntime(exported["llama3"], matmul_dtype="int8")
    with pytest.raises(SpecInferError, match="bfloat16 matrix products run on the onnxruntime engine only, not torch"):
        load_runtime(exported["llama3"], "torch", matmul_dtype="bfloat16")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f", "f16c", "fma"})   # an AVX-512 CPU without BF16
    with pytest.raises(SpecInferError, match=r"need the native kernels on a CPU with AVX512-BF16 \(avx512_bf16"):
        OrtRuntime(exported["llama3"], matmul_dtype="bfloat16")


def test_the_repository_gives_the_llm_its_matmul_dtype(served_pair, tmp_path, monkeypatch):
    import re

    from specinfer.serving.repository import write_repository

    param = lambda repo, model: re.search(r'key: "matmul_dtype" value: { string_value: "([^"]*)" }',
                                          (repo / model / "config.pbtxt").read_text()).group(1)
    repo = write_repository(served_pair["llm"], served_pair["ssms"][:1], tmp_path / "bf16", tree="1,1",
                            layout="both", matmul_dtype="bfloat16")
    assert {param(repo, m) for m in ("llm", "ensemble", "ensemble_fused")} == {"bfloat16"}
    assert "matmul_dtype" not in (repo / "ssm_0" / "config.pbtxt").read_text()   # the SSMs keep float32
    with pytest.raises(SpecInferError, match="bfloat16 matrix products run on ONNX Runtime only, not on TensorRT engines"):
        write_repository(served_pair["llm"], served_pair["ssms"][:1], tmp_path / "trt", engines=tmp_path / "engines",
                         matmul_dtype="bfloat16")
    monkeypatch.setattr(native, "cpu_flags", lambda: set())
    with pytest.raises(SpecInferError, match="AVX512-BF16"):   # refused here, not in a Triton model's stub
        write_repository(served_pair["llm"], served_pair["ssms"][:1], tmp_path / "no", tree="1,1",
                         matmul_dtype="bfloat16")
