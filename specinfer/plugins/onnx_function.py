"""``specinfer::TreeAttention`` in ONNX: its schema and a model-local function body of standard ops.

The node keeps its own op type in a custom domain so that TensorRT can put our plugin in its place
(the node carries ``plugin_namespace``, which makes the parser prefer a registered plugin over the
local function). Every other ONNX consumer, ONNX Runtime included, runs the function body: the
packed ancestor bits unpacked into a bool mask, then one standard opset-23 ``Attention``.
Inlining the function gives the ``native`` variant (no plugin) for free.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN = "specinfer"
OP_TYPE = "TreeAttention"
OPSET = 23  # the standard Attention op appeared in opset 23
INPUTS = ("query", "key", "value", "past_key", "past_value", "tree_mask")
ATTRIBUTES = ("num_heads", "num_kv_heads", "scale", "plugin_namespace")


def register_schema() -> None:
    """Register the op's schema with onnx (the dynamo exporter needs it to emit the node)."""
    try:
        onnx.defs.get_schema(OP_TYPE, 1, DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    P = onnx.defs.OpSchema.FormalParameter
    A = onnx.defs.OpSchema.Attribute
    AT = onnx.defs.OpSchema.AttrType
    schema = onnx.defs.OpSchema(
        OP_TYPE, DOMAIN, 1,
        doc="Attention of T new tokens over a KV cache and their token tree (specinfer.plugins.tree_attention).",
        inputs=[P("query", "T"), P("key", "T"), P("value", "T"), P("past_key", "T"),
                P("past_value", "T"), P("tree_mask", "M")],
        outputs=[P("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations"),
                          ("M", ["tensor(int32)"], "packed ancestor bits")],
        attributes=[A("num_heads", AT.INT, "query heads"), A("num_kv_heads", AT.INT, "key/value heads"),
                    A("scale", AT.FLOAT, "q.k multiplier"),
                    A("plugin_namespace", AT.STRING, "TensorRT plugin namespace")],
    )
    onnx.defs.register_schema(schema)


def function_proto() -> onnx.FunctionProto:
    """The body: [B,T,H,D] in and out; the mask [B,T,S+T] built from the packed bits."""
    n = helper.make_node
    i64 = lambda name, v: n("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(v)], v))
    nodes = [
        i64("one", [1]), i64("two", [2]), i64("word_bits", [32]), i64("axis1", [1]), i64("zero", [0]),
        n("Constant", [], ["u1"], value=helper.make_tensor("u1", TensorProto.UINT32, [], [1])),
        n("Constant", [], ["true"], value=helper.make_tensor("true", TensorProto.BOOL, [1], [True])),
        # Shapes: B, T (new tokens), S (cached tokens), N (tree tokens).
        n("Shape", ["query"], ["b"], start=0, end=1),
        n("Shape", ["query"], ["t"], start=1, end=2),
        n("Shape", ["past_key"], ["s"], start=1, end=2),
        n("Shape", ["tree_mask"], ["nn"], start=1, end=2),
        n("Add", ["s", "t"], ["total"]),
        n("Sub", ["total", "nn"], ["prefix"]),
        n("Sub", ["nn", "t"], ["first_row"]),
        # Rows of the new queries, unpacked: bit j of row r -> tree token j visible.
        n("Slice", ["tree_mask", "first_row", "nn", "axis1"], ["rows"]),
        n("Cast", ["rows"], ["rows_u"], to=TensorProto.UINT32),
        n("Squeeze", ["nn", "zero"], ["n_scalar"]),
        n("Constant", [], ["zero_s"], value=helper.make_tensor("zero_s", TensorProto.INT64, [], [0])),
        n("Constant", [], ["one_s"], value=helper.make_tensor("one_s", TensorProto.INT64, [], [1])),
        n("Range", ["zero_s", "n_scalar", "one_s"], ["j"]),
        n("Div", ["j", "word_bits"], ["word"]),
        n("Mod", ["j", "word_bits"], ["bit"]),
        n("Gather", ["rows_u", "word"], ["words"], axis=2),
        n("Cast", ["bit"], ["bit_u"], to=TensorProto.UINT32),
        n("BitShift", ["words", "bit_u"], ["shifted"], direction="RIGHT"),
        n("BitwiseAnd", ["shifted", "u1"], ["bits"]),
        n("Cast", ["bits"], ["tree_vis"], to=TensorProto.BOOL),
        n("Concat", ["b", "t", "prefix"], ["prefix_shape"], axis=0),
        n("Expand", ["true", "prefix_shape"], ["prefix_vis"]),
        n("Concat", ["prefix_vis", "tree_vis"], ["vis"], axis=2),
        n("Unsqueeze", ["vis", "axis1"], ["attn_mask"]),  # [B, 1, T, S+T]
        # Keys and values: cache then new, heads first.
        n("Concat", ["past_key", "key"], ["k_all"], axis=1),
        n("Concat", ["past_value", "value"], ["v_all"], axis=1),
        n("Transpose", ["query"], ["q_t"], perm=[0, 2, 1, 3]),
        n("Transpose", ["k_all"], ["k_t"], perm=[0, 2, 1, 3]),
        n("Transpose", ["v_all"], ["v_t"], perm=[0, 2, 1, 3]),
        n("Attention", ["q_t", "k_t", "v_t", "attn_mask"], ["o_t"]),
        n("Transpose", ["o_t"], ["output"], perm=[0, 2, 1, 3]),
    ]
    scale = helper.AttributeProto(name="scale", ref_attr_name="scale", type=helper.AttributeProto.FLOAT)
    nodes[-2].attribute.append(scale)
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS), ["output"], nodes,
        opset_imports=[helper.make_opsetid("", OPSET)], attributes=list(ATTRIBUTES),
    )


def attach_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the function body and the custom domain's opset import to an exported model."""
    keep = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend(keep + [function_proto()])
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def tree_attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.domain == DOMAIN and node.op_type == OP_TYPE]
