"""TreeAttention: the packed-bit format, and every implementation against the float64 reference."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from specinfer.engines.onnxruntime import open_session
from specinfer.plugins import onnx_function
from specinfer.plugins.tree_attention import (ancestor_matrix, pack_bits, tree_attention_reference, unpack_bits,
                                              visibility)
from specinfer.plugins.tree_attention_torch import tree_attention

TOL = 1e-5  # float32 implementations against the float64 reference


def random_parents(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def test_ancestor_matrix_follows_parents():
    m = ancestor_matrix([-1, 0, 0, 1, 3, -1])
    assert m[4].nonzero()[0].tolist() == [0, 1, 3, 4]
    assert m[2].nonzero()[0].tolist() == [0, 2]
    assert m[5].nonzero()[0].tolist() == [5]
    with pytest.raises(ValueError):
        ancestor_matrix([-1, 2, 0])


@pytest.mark.parametrize("n", [1, 31, 32, 33, 64, 100, 256])
def test_pack_unpack_roundtrip(n):
    rng = np.random.default_rng(n)
    m = ancestor_matrix(random_parents(rng, n))
    packed = pack_bits(m)
    assert packed.dtype == np.int32 and packed.shape == (n, -(-n // 32))
    assert (unpack_bits(packed, n) == m).all()
    # bit j of row i sits in word j // 32 at position j % 32
    i, j = n - 1, int(np.nonzero(m[n - 1])[0][0])
    assert (int(packed.view(np.uint32)[i, j // 32]) >> (j % 32)) & 1


def test_visibility_prefix_and_partial_tree():
    # tree of 4 (0 <- 1, 0 <- 2 <- 3); the last 2 are new queries; 3 committed tokens
    mask = pack_bits(ancestor_matrix([-1, 0, 0, 2]))[None]
    vis = visibility(mask, num_new=2, past_len=5)  # 5 cached = 3 committed + 2 pending tree tokens
    assert vis.shape == (1, 2, 7)
    assert vis[0, 0].tolist() == [1, 1, 1, 1, 0, 1, 0]  # node 2 sees prefix, node 0, itself
    assert vis[0, 1].tolist() == [1, 1, 1, 1, 0, 1, 1]  # node 3 sees prefix, 0, 2, itself


def cases():
    rng = np.random.default_rng(0)
    for b, t, extra, past, hq, hkv, d in [(1, 1, 0, 0, 4, 4, 8), (2, 5, 0, 7, 4, 2, 16), (1, 40, 0, 3, 8, 2, 8),
                                          (1, 3, 6, 10, 6, 3, 8), (2, 70, 0, 33, 4, 1, 16)]:
        n = t + extra
        parents = random_parents(rng, n)
        mask = np.broadcast_to(pack_bits(ancestor_matrix(parents)), (b, n, -(-n // 32))).copy()
        s = past + extra  # the cache holds the committed prefix and the earlier tree tokens
        f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
        yield f(b, t, hq, d), f(b, t, hkv, d), f(b, t, hkv, d), f(b, s, hkv, d), f(b, s, hkv, d), mask


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: f"T{c[0].shape[1]}-S{c[3].shape[1]}-N{c[5].shape[1]}-H{c[0].shape[2]}/{c[1].shape[2]}")
def test_torch_op_matches_reference(case):
    q, k, v, pk, pv, mask = case
    want = tree_attention_reference(q, k, v, pk, pv, mask)
    got = tree_attention(*(torch.from_numpy(x) for x in case), q.shape[2], k.shape[2], q.shape[3] ** -0.5)
    assert np.abs(got.numpy() - want).max() < TOL


def single_node_model(hq, hkv, d):
    names = onnx_function.INPUTS
    dt = lambda n: TensorProto.INT32 if n == "tree_mask" else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, dt(n), ["b", "t", "h", "d"][: 3 if n == "tree_mask" else 4]) for n in names]
    node = helper.make_node("TreeAttention", list(names), ["out"], domain="specinfer", num_heads=hq,
                            num_kv_heads=hkv, scale=d ** -0.5, plugin_namespace="specinfer")
    graph = helper.make_graph([node], "ta", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "t", "h", "d"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", onnx_function.OPSET)], ir_version=10)
    return onnx_function.attach_function(model)


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: f"T{c[0].shape[1]}-S{c[3].shape[1]}-N{c[5].shape[1]}")
def test_onnx_function_body_matches_reference(case):
    q, k, v, pk, pv, mask = case
    model = single_node_model(q.shape[2], k.shape[2], q.shape[3])
    onnx.checker.check_model(model)
    sess = open_session(model.SerializeToString())
    got = sess.run(None, dict(zip(onnx_function.INPUTS, case)))[0]
    assert np.abs(got - tree_attention_reference(*case)).max() < TOL


def test_function_inlines_to_standard_attention():
    """The `native` variant: inlining leaves standard ops only, one Attention per node."""
    from onnx import inliner
    inlined = inliner.inline_local_functions(single_node_model(4, 2, 8))
    ops = [n.op_type for n in inlined.graph.node]
    assert "TreeAttention" not in ops and ops.count("Attention") == 1
    assert all(n.domain in ("", "ai.onnx") for n in inlined.graph.node)
