"""TreeAttention lowered for ONNX Runtime's CPU provider: the graph ONNX Runtime actually runs.

The portable export (``model.onnx``) keeps one ``specinfer::TreeAttention`` node per layer for
TensorRT's plugin. On a CPU that graph pays per node and copies the whole cache every step (its
function body concatenates past and new KV). This lowering writes the same model the way ONNX
Runtime runs fastest, the recipe of onnxruntime-genai's builder plus a tree:

* attention is ``com.microsoft::GroupQueryAttention`` with rotary inside (``do_rotary``, cos/sin
  tables of the model's own RoPE), the tree as ``attention_bias`` and ``position_ids`` (a node's
  position is the prefix length plus its depth);
* the KV cache is one fixed-capacity buffer per layer and K|V, ``[B, Hkv, capacity, D]``, bound by
  the runtime as both ``past_*`` and ``present_*``: the kernel then reads the cache in place and
  writes only the new rows (slots ``seqlens_k + 1 - T`` onwards), so no step copies the cache;
* q, k and v are one MatMul, gate and up one MatMul, and residual adds are fused into the RMS norms
  (``SkipSimplifiedLayerNormalization``): about 14 nodes a layer instead of about 38.

Weights are float32 whatever the export's dtype (ONNX Runtime's CPU kernels are float32 kernels).
Inputs: ``input_ids``, ``position_ids`` int64 [B, T]; ``attention_bias`` float32 [B, 1, T, P + T]
(0 where a key is visible, the lowest float elsewhere); ``seqlens_k`` int32 [B] (= P + T - 1);
``total_sequence_length`` int32 scalar (= P + T); ``past_key.i``/``past_value.i``. Outputs:
``logits`` float32 [B, T, V] and ``present_key.i``/``present_value.i``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

    from ..model import LlamaModel

ORT_ONNX = "model.ort.onnx"
DRAFT_ONNX = "draft.ort.onnx"
SAMPLED_DRAFT_ONNX = "draft_sampled.ort.onnx"
WEIGHTS = "weights.ort.bin"   # both graphs' initializers, written once
DRAFT_DEPTH = 8               # tokens one drafter call proposes (a drafter may call again to go on)
# Candidates a sampled draft draws among at each depth: the model's likeliest. Held-out code, SSM 1
# at 1.5x the LLM's temperature 0.7: the LLM accepts a draw from its top 16 about as often as one
# from its whole vocabulary (0.56 vs 0.57 a token; 0.52 from its top 8).
DRAFT_CANDIDATES = 16
DRAFT_OUTPUTS = ("draft_tokens", "draft_logits", "draft_mass", "draft_choice")
DRAFT_INDICES, DRAFT_ALL_LOGITS = "draft_indices", "draft_all_logits"   # the steps' values joined inside
# A sampled decoding chain's inputs (native.sampled_decoding): each sequence's temperature, and each
# step's uniform (".{step}"), float64 [1, sequences].
SAMPLING_TEMPERATURE, SAMPLING_UNIFORM = "sampling_temperature", "sampling_uniform"
PER_SEQUENCE_ROWS = ("draft_noise.", SAMPLING_TEMPERATURE, SAMPLING_UNIFORM)   # inputs with a row a sequence
MS = "com.microsoft"


def input_names(num_layers: int) -> list[str]:
    kv = [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "position_ids", "attention_bias", "seqlens_k", "total_sequence_length"] + kv


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [f"present_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]


def lowered_head_dim(head_dim: int) -> int:
    """GroupQueryAttention's CPU kernel takes head sizes that are multiples of 16: smaller or odd
    heads are zero-padded to the next one (exact: padded q and k columns add 0 to q.k, padded v
    columns give output columns that o_proj multiplies by zero rows)."""
    return -(-head_dim // 16) * 16


def _pad_heads(w: np.ndarray, heads: int, d: int, axis: int) -> np.ndarray:
    """Pad each head's d entries along ``axis`` to lowered_head_dim(d), half by half, so that
    rotate-half RoPE still pairs entry i with entry i + D/2."""
    dp = lowered_head_dim(d)
    if dp == d:
        return w
    w = np.moveaxis(w, axis, 0)
    parts = w.reshape(heads, 2, d // 2, *w.shape[1:])
    pad = np.zeros((heads, 2, (dp - d) // 2, *w.shape[1:]), dtype=w.dtype)
    return np.moveaxis(np.concatenate([parts, pad], axis=2).reshape(heads * dp, *w.shape[1:]), 0, axis)


def rope_tables(model: "LlamaModel", max_context: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_context, D'/2] computed exactly as the PyTorch model computes them
    (D' the lowered head size; padded entries rotate zeros)."""
    import torch

    freqs = torch.arange(max_context)[:, None].float() * model.inv_freq.float()
    cos, sin = freqs.cos().numpy(), freqs.sin().numpy()
    extra = (lowered_head_dim(model.config.head_dim) - model.config.head_dim) // 2
    return np.pad(cos, ((0, 0), (0, extra)), constant_values=1.0), np.pad(sin, ((0, 0), (0, extra)))


class _Graph:
    """Nodes and float32 weights of a graph being written; weights are shared by name."""

    def __init__(self, model: "LlamaModel", max_context: int):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.model, self.config = model, model.config
        self.nodes: list = []
        self.weights: dict[str, object] = {}
        cos, sin = rope_tables(model, max_context)
        self.weight("cos_cache", cos)
        self.weight("sin_cache", sin)

    def weight(self, name: str, array) -> str:
        if name not in self.weights:
            self.weights[name] = self.numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name)
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        self.nodes.append(self.helper.make_node(op, inputs, outputs, name=outputs[0], domain=domain, **attrs))
        return outputs

    def project(self, x: str, tag: str, name: str, *modules, heads: tuple[int, ...] = (), rows: int = 0) -> str:
        """x @ W (+ b) for one or more nn.Linear stacked along their outputs (one MatMul for all).
        ``heads`` (per module, its head count) pads attention heads' output columns, ``rows`` (a
        head count) the input rows of o_proj, to the lowered head size."""
        d = self.config.head_dim
        ws = [m.weight.detach().float().numpy().T for m in modules]
        bs = [m.bias.detach().float().numpy() if m.bias is not None else np.zeros(m.out_features, np.float32)
              for m in modules]
        if heads:
            ws = [_pad_heads(w, h, d, axis=1) for w, h in zip(ws, heads)]
            bs = [_pad_heads(b, h, d, axis=0) for b, h in zip(bs, heads)]
        if rows:
            ws = [_pad_heads(w, rows, d, axis=0) for w in ws]
        out = self.node("MatMul", [x, self.weight(f"{name}.weight", np.concatenate(ws, axis=1))], [f"{tag}{name}.out"])[0]
        if all(m.bias is None for m in modules):
            return out
        return self.node("Add", [out, self.weight(f"{name}.bias", np.concatenate(bs))], [f"{tag}{name}.biased"])[0]

    def norm(self, module, name: str) -> str:
        return self.weight(name, module.weight.detach().float().numpy())

    def decoder(self, tag: str, input_ids: str, position_ids: str, seqlens_k: str, total: str,
                bias: str, presents: list[tuple[str, str]], last_only: bool = False,
                head_rows: np.ndarray | None = None, input_rows: np.ndarray | None = None) -> str:
        """The model over new tokens ``input_ids``; returns its logits' name ([B, T, V], or [B, 1, V]
        with ``last_only``). ``presents[i]`` names layer i's present key and value outputs.
        ``head_rows``: the tokens the head scores (all when None); ``input_rows``: the tokens
        ``input_ids`` index (they are positions in it; token ids when None)."""
        c, eps = self.config, float(self.config.rms_norm_eps)
        node = self.node
        table = self.model.model.embed_tokens.weight.detach().float().numpy()
        if input_rows is not None:
            table = self.weight("embed_tokens.draft_vocab", table[input_rows])
        else:
            table = self.weight("embed_tokens", table)
        hidden = node("Gather", [table, input_ids], [f"{tag}embedded"])[0]
        residual, pending = hidden, None   # pending: the last sub-block's output, not yet in residual
        for i, layer in enumerate(self.model.model.layers):
            p = f"{tag}layers.{i}"
            attn, mlp, w = layer.self_attn, layer.mlp, f"layers.{i}"
            w_in = self.norm(layer.input_layernorm, f"{w}.input_norm")
            if pending is None:
                x = node("SimplifiedLayerNormalization", [residual, w_in], [f"{p}.input_norm.out"],
                         epsilon=eps, axis=-1, stash_type=1)[0]
            else:
                x, residual = node("SkipSimplifiedLayerNormalization", [residual, pending, w_in],
                                   [f"{p}.input_norm.out", "", "", f"{p}.residual_in"], domain=MS, epsilon=eps)[::3]
            qkv = self.project(x, tag, f"{w}.qkv", attn.q_proj, attn.k_proj, attn.v_proj,
                               heads=(c.num_heads, c.num_kv_heads, c.num_kv_heads))
            a = node("GroupQueryAttention",
                     [qkv, "", "", f"past_key.{i}", f"past_value.{i}", seqlens_k, total,
                      "cos_cache", "sin_cache", position_ids, bias],
                     [f"{p}.attn", *presents[i]], domain=MS,
                     num_heads=c.num_heads, kv_num_heads=c.num_kv_heads, scale=1.0 / float(np.sqrt(c.head_dim)),
                     do_rotary=1, rotary_interleaved=0, local_window_size=-1)[0]
            o = self.project(a, tag, f"{w}.o_proj", attn.o_proj, rows=c.num_heads)
            w_post = self.norm(layer.post_attention_layernorm, f"{w}.post_norm")
            x, residual = node("SkipSimplifiedLayerNormalization", [residual, o, w_post],
                               [f"{p}.post_norm.out", "", "", f"{p}.residual_mid"], domain=MS, epsilon=eps)[::3]
            gate_up = self.project(x, tag, f"{w}.gate_up", mlp.gate_proj, mlp.up_proj)
            gate, up = node("Split", [gate_up], [f"{p}.gate", f"{p}.up"], axis=-1, num_outputs=2)
            act = node("Mul", [gate, node("Sigmoid", [gate], [f"{p}.sigmoid"])[0]], [f"{p}.silu"])[0]
            pending = self.project(node("Mul", [act, up], [f"{p}.act"])[0], tag, f"{w}.down", mlp.down_proj)
        if last_only:  # only the last token's logits are read: skip the head for the others
            last = self.constant("last_index", np.array([-1], np.int64))
            residual = node("Gather", [residual, last], [f"{tag}residual_last"], axis=1)[0]
            pending = node("Gather", [pending, last], [f"{tag}pending_last"], axis=1)[0]
        x = node("SkipSimplifiedLayerNormalization", [residual, pending, self.norm(self.model.model.norm, "final_norm")],
                 [f"{tag}final_norm.out"], domain=MS, epsilon=eps)[0]
        lm_head = self.model.lm_head.weight.detach().float().numpy().T
        if head_rows is not None:   # logits of these tokens only, in their order
            return node("MatMul", [x, self.weight("lm_head.draft_vocab", lm_head[:, head_rows])], [f"{tag}logits"])[0]
        return node("MatMul", [x, self.weight("lm_head", lm_head)], [f"{tag}logits"])[0]

    def constant(self, name: str, array: np.ndarray) -> str:
        if name not in self.weights:
            self.weights[name] = self.numpy_helper.from_array(array, name)
        return name

    def model_proto(self, inputs, outputs) -> "onnx.ModelProto":
        h = self.helper
        graph = h.make_graph(self.nodes, "specinfer_ort", inputs, outputs, list(self.weights.values()))
        return h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid(MS, 1)],
                            ir_version=10, producer_name="specinfer")


def _kv_values(c, names: list[str]):
    from onnx import TensorProto, helper

    shape = ["batch", c.num_kv_heads, "capacity", lowered_head_dim(c.head_dim)]
    return [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names]


def _step_inputs(c, with_bias: bool):
    from onnx import TensorProto, helper

    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "tree"]),
              helper.make_tensor_value_info("position_ids", i64, ["batch", "tree"])]
    if with_bias:
        inputs.append(helper.make_tensor_value_info("attention_bias", f32, ["batch", 1, "tree", "total"]))
    inputs += [helper.make_tensor_value_info("seqlens_k", i32, ["batch"]),
               helper.make_tensor_value_info("total_sequence_length", i32, [])]
    return inputs + _kv_values(c, input_names(c.num_layers)[5:])


def lower(model: "LlamaModel", max_context: int) -> "onnx.ModelProto":
    """The ONNX Runtime graph of ``model`` (see the module docstring)."""
    from onnx import TensorProto, helper

    c = model.config
    g = _Graph(model, max_context)
    presents = output_names(c.num_layers)[1:]
    g.decoder("", "input_ids", "position_ids", "seqlens_k", "total_sequence_length", "attention_bias",
              list(zip(presents[0::2], presents[1::2])))
    g.nodes[-1].output[0] = "logits"
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "tree", c.vocab_size])]
    return g.model_proto(_step_inputs(c, with_bias=True), outputs + _kv_values(c, presents))


def draft_candidates(vocab_size: int, draft_vocab: np.ndarray | None = None) -> int:
    """The tokens a sampled drafter's step draws among: ``DRAFT_CANDIDATES``, or all the tokens
    it drafts from (its draft vocabulary's, else the vocabulary's) when fewer."""
    return min(DRAFT_CANDIDATES, vocab_size if draft_vocab is None else len(draft_vocab))


def drafter_present_names(num_layers: int, depth: int) -> list[list[str]]:
    """Per unrolled step, its present outputs (layer-major key, value), all bound to the one cache."""
    return [[f"present_{kv}.{i}.step{j}" for i in range(num_layers) for kv in ("key", "value")]
            for j in range(depth)]


def drafter_presents_by_layer(num_layers: int, depth: int, suffix: str = "") -> list[list[str]]:
    """Per layer, every step's present key and value (in :func:`batch_drafter`, sequence
    ``suffix`` = ``.s``'s): the outputs a runtime binds to that layer's cache."""
    steps = drafter_present_names(num_layers, depth)
    return [[name + suffix for step in steps for name in step[2 * i:2 * i + 2]] for i in range(num_layers)]


def lower_drafter(model: "LlamaModel", max_context: int, depth: int, sampled: bool = False,
                  draft_vocab: np.ndarray | None = None) -> "onnx.ModelProto":
    """A chain of ``depth`` tokens drafted in one session run: greedy, or ``sampled``.

    Step 0 scores ``input_ids`` (tokens the model has not seen, the root last), every later step
    the token the step before chose. Greedy outputs, per step: ``draft_tokens`` int64
    [1, depth, 2], its two most likely tokens (the chain follows the first; the second is the
    runner-up a dynamic tree may add as a leaf); ``draft_logits`` float32 [1, depth, 2], their
    logits; ``draft_mass`` float32 [1, depth, 1], sum(exp(logits - max)), so that a token's
    probability (temperature 1) is exp(its logit - max) / mass.
    Sampled: step j draws among its K likeliest tokens by Gumbel-max (:func:`draft_candidates`), the
    argmax of their logits plus input ``draft_noise.{j}`` float32 [1, 1, K] (the caller feeds
    temperature x Gumbel(0, 1) noise, so the draw follows softmax(logits / temperature) over
    them); outputs ``draft_tokens`` and ``draft_logits`` [1, depth, K] (the candidates, likeliest
    first) and ``draft_choice`` int64 [1, depth, 1], the index among them of the token drawn.
    ``draft_vocab`` (sorted token ids, see ``draft_vocab.py``): the head scores those tokens only
    (the outputs still name tokens by their ids).
    The cache gains the KV of the inputs and of the first depth - 1 draft tokens.
    Every new token sees everything before it (the cache holds only committed tokens when a draft
    starts) and its position is its slot, so the graph takes neither a bias nor positions: the
    attention kernel derives them from ``seqlens_k``. ORT pays a few microseconds per kernel here,
    so each unrolled step is kept to 27 kernels for the embedded SSM's two layers (34 before the
    token ids and the mass were computed once for all steps: 223 kernels for a chain of 8 against
    272, its draft 0.55-0.62 ms against 0.61-0.67 at the median in decoding). Where the native
    kernels run, a small model's drafter runs as one node instead (``native.use_draft_chain``).
    """
    from onnx import TensorProto, helper

    c = model.config
    g = _Graph(model, max_context)
    presents = drafter_present_names(c.num_layers, depth)
    one = g.constant("one_i32", np.array(1, np.int32))
    ids, seqlens, total = "input_ids", "seqlens_k", "total_sequence_length"
    k = draft_candidates(c.vocab_size, draft_vocab) if sampled else 2
    # Per step: its candidates' positions in the head's rows, their logits, every logit, and the
    # choice (sampled). Later steps feed a position, not a token id: their embedding table is the
    # head's rows' (one Gather a step, not two), and the positions become token ids once, at the end.
    indices, top_logits, all_logits, choices = [], [], [], []
    for j in range(depth):
        tag = f"step{j}/"
        if j:
            seqlens = g.node("Add", [seqlens, one], [f"{tag}seqlens_k"])[0]
            total = g.node("Add", [total, one], [f"{tag}total"])[0]
        # Step 0 scores the catch-up and the root (its last row is read); a later step, one token.
        logits = g.decoder(tag, ids, "", seqlens, total, "", list(zip(presents[j][0::2], presents[j][1::2])),
                           last_only=j == 0, head_rows=draft_vocab, input_rows=draft_vocab if j else None)
        top, index = g.node("TopK", [logits, g.constant(f"k{k}", np.array([k], np.int64))],
                            [f"{tag}top", f"{tag}index"], axis=-1)                         # [1, 1, k]
        indices.append(index)
        top_logits.append(top)
        all_logits.append(logits)
        if sampled:
            noisy = g.node("Add", [top, f"draft_noise.{j}"], [f"{tag}noisy"])[0]
            choice = g.node("ArgMax", [noisy], [f"{tag}choice"], axis=-1, keepdims=1)[0]  # [1, 1, 1]
            choices.append(choice)
            drawn = g.node("GatherElements", [index, choice], [f"{tag}drawn"], axis=-1)[0]
            ids = g.node("Reshape", [drawn, g.constant("token_shape", np.array([1, 1], np.int64))], [f"{tag}token"])[0]
        else:
            ids = g.node("Gather", [index, g.constant("first", np.array(0, np.int64))], [f"{tag}token"], axis=-1)[0]
    if draft_vocab is None:
        g.node("Concat", indices, ["draft_tokens"], axis=1)
    else:   # positions in the draft vocabulary -> token ids
        g.node("Gather", [g.constant("draft_vocab", np.asarray(draft_vocab, np.int64)),
                          g.node("Concat", indices, [DRAFT_INDICES], axis=1)[0]], ["draft_tokens"], axis=0)
    g.node("Concat", top_logits, ["draft_logits"], axis=1)
    if sampled:
        g.node("Concat", choices, ["draft_choice"], axis=1)
    else:
        # sum(exp(logits - max)) = 1 / (the top token's probability), every step's at once.
        # ReduceLogSumExp would be one kernel, but ONNX Runtime's is about 10x slower than these.
        best = g.node("Gather", ["draft_logits", g.constant("first_kept", np.array([0], np.int64))], ["draft_best"],
                      axis=-1)[0]
        every = g.node("Concat", all_logits, [DRAFT_ALL_LOGITS], axis=1)[0]
        shifted = g.node("Exp", [g.node("Sub", [every, best], ["draft_shifted"])[0]], ["draft_exp"])[0]
        g.node("ReduceSum", [shifted, g.constant("last_axis", np.array([-1], np.int64))], ["draft_mass"], keepdims=1)
    outputs = [helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, [1, depth, k]),
               helper.make_tensor_value_info("draft_logits", TensorProto.FLOAT, [1, depth, k]),
               helper.make_tensor_value_info("draft_choice", TensorProto.INT64, [1, depth, 1]) if sampled else
               helper.make_tensor_value_info("draft_mass", TensorProto.FLOAT, [1, depth, 1])]
    outputs += _kv_values(c, [n for step in presents for n in step])
    inputs = [i for i in _step_inputs(c, with_bias=False) if i.name != "position_ids"]
    if sampled:
        inputs += [helper.make_tensor_value_info(f"draft_noise.{j}", TensorProto.FLOAT, [1, 1, k]) for j in range(depth)]
    return g.model_proto(inputs, outputs)


def save(model: "LlamaModel", out_dir, max_context: int, depth: int = DRAFT_DEPTH,
         draft_vocab: np.ndarray | None = None) -> dict[str, object]:
    """Write the lowered model and its drafters (scoring ``draft_vocab`` only, when given) into
    ``out_dir``, their shared weights once in one file; returns the manifest entries naming them."""
    import onnx
    from onnx import external_data_helper

    out_dir = Path(out_dir)
    (out_dir / WEIGHTS).unlink(missing_ok=True)
    main = lower(model, max_context)
    onnx.save(main, out_dir / ORT_ONNX, save_as_external_data=True, all_tensors_to_one_file=True,
              location=WEIGHTS, size_threshold=1024)
    stored = {t.name: t for t in onnx.load(out_dir / ORT_ONNX, load_external_data=False).graph.initializer}
    for sampled, name in ((False, DRAFT_ONNX), (True, SAMPLED_DRAFT_ONNX)):
        draft = lower_drafter(model, max_context, depth, sampled, draft_vocab)
        for tensor in draft.graph.initializer:  # the same weights under the same names: point at them
            if tensor.name in stored and stored[tensor.name].data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in stored[tensor.name].external_data}
                external_data_helper.set_external_data(tensor, WEIGHTS, int(info["offset"]), int(info["length"]))
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
        onnx.save(draft, out_dir / name)
    return {"ort_onnx": ORT_ONNX, "draft_onnx": DRAFT_ONNX, "sampled_draft_onnx": SAMPLED_DRAFT_ONNX,
            "draft_depth": depth, "draft_candidates": draft_candidates(model.config.vocab_size, draft_vocab),
            "ort_head_dim": lowered_head_dim(model.config.head_dim)}


# --- feeds: what the runtime binds each step, also used to validate the lowering -------------------
def attention_bias(parents_of_tree: np.ndarray, prefix: int, num_new: int) -> np.ndarray:
    """float32 [1, 1, T, prefix + N]: 0 where a new token sees a key, the lowest float elsewhere.

    ``parents_of_tree`` is the ancestor matrix (bool [N, N]) of the pending tree, whose last T rows
    are the new tokens; the ``prefix`` committed tokens are visible to all."""
    n = parents_of_tree.shape[0]
    bias = np.zeros((1, 1, num_new, prefix + n), dtype=np.float32)
    bias[0, 0, :, prefix:] = np.where(parents_of_tree[n - num_new:], 0.0, np.finfo(np.float32).min)
    return bias


def validate_lowering(model_bytes: bytes, flat_model, config, max_context: int, tolerance: float) -> dict[str, float]:
    """The lowered graph against the PyTorch model: a prefill, then a branching tree over it."""
    import torch

    from ..engines.onnxruntime import open_session

    from ..plugins.tree_attention import ancestor_matrix, tree_mask_from_parents

    session = open_session(model_bytes)
    rng = np.random.default_rng(3)
    c = config
    capacity = min(max_context, 64)
    buffers = {n: np.zeros((1, c.num_kv_heads, capacity, lowered_head_dim(c.head_dim)), np.float32)
               for n in input_names(c.num_layers)[5:]}
    cases = [("prefill", list(range(-1, 10)), 0), ("tree_step", [-1, 0, 0, 1, 1, 2, 5], 11)]
    diffs = {}
    for case, parents, past in cases:
        t = len(parents)
        tokens = rng.integers(0, c.vocab_size, t)
        anc = ancestor_matrix(parents)
        depth = anc.sum(1) - 1
        feeds = {"input_ids": tokens[None], "position_ids": (past + depth)[None].astype(np.int64),
                 "attention_bias": attention_bias(anc, past, t),
                 "seqlens_k": np.array([past + t - 1], np.int32),
                 "total_sequence_length": np.array(past + t, np.int32)} | buffers
        outputs = session.run(None, feeds)
        got = outputs[0]
        # PyTorch: the same tokens over the same committed prefix (the prefill's tokens).
        half, dp = c.head_dim // 2, lowered_head_dim(c.head_dim)
        unpadded = np.concatenate([np.arange(half), dp // 2 + np.arange(half)])
        past_kv = [torch.from_numpy(np.ascontiguousarray(buffers[n][:, :, :past][..., unpadded].transpose(0, 2, 1, 3)))
                   for n in input_names(c.num_layers)[5:]]
        with torch.no_grad():
            want = flat_model(torch.from_numpy(tokens[None]), torch.from_numpy(feeds["position_ids"]),
                              torch.from_numpy(tree_mask_from_parents(parents)[None]), *past_kv)[0].numpy()
        diffs[case] = float(np.abs(got - want).max())
        if case == "prefill":  # keep the prefill's KV as the next case's cache
            for name, present in zip(input_names(c.num_layers)[5:], outputs[1:]):
                buffers[name] = np.ascontiguousarray(present)
    worst = max(diffs.values())
    if not worst <= tolerance:
        from ..errors import SpecInferError

        raise SpecInferError(f"validation failed: the ONNX Runtime lowering and PyTorch differ by {worst:.3g} "
                             f"(tolerance {tolerance}): {diffs}")
    return diffs


# --- logits only where they are read --------------------------------------------------------------
LOGIT_ROWS = "logit_rows"


def select_logit_rows(model: "onnx.ModelProto") -> "onnx.ModelProto":
    """The lowered graph (:func:`lower`) with one more input, ``logit_rows`` int64 [R]: the new
    tokens whose logits it computes (``logits`` [1, R, V]). A prompt needs its last token's only,
    and the LM head is a quarter of the LLM's work a token (an SSM's most): the final norm and the
    head then run on the rows asked for. Rewritten at load time, so exports stay as they are."""
    from onnx import TensorProto, helper

    graph = model.graph
    nodes = list(graph.node)
    at = next(i for i, n in enumerate(nodes) if n.output[0] == "final_norm.out")
    final = nodes[at]
    gathers = []
    for i in (0, 1):   # the last residual and the last block's output, which the final norm adds
        rows = f"{final.input[i]}.rows"
        gathers.append(helper.make_node("Gather", [final.input[i], LOGIT_ROWS], [rows], name=rows, axis=1))
        final.input[i] = rows
    del graph.node[:]
    graph.node.extend(nodes[:at] + gathers + nodes[at:])
    graph.input.append(helper.make_tensor_value_info(LOGIT_ROWS, TensorProto.INT64, ["rows"]))
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].dim_param = "rows"
    return model


# --- a drafter that drafts fewer tokens ------------------------------------------------------------


def truncate_drafter(model: "onnx.ModelProto", depth: int) -> "onnx.ModelProto":
    """A drafter (:func:`lower_drafter`) cut to its first ``depth`` steps. Its steps are unrolled and
    each costs the same (~27 kernels at a few microseconds each), so a chain of 3 drafted by the
    8-step drafter pays for 8: each output keeps its first ``depth`` steps, and the nodes, inputs
    (later steps' noise) and weights nothing then reads are dropped. Steps kept run the same
    kernels on the same inputs, so their results are the full drafter's bit for bit. Rewritten at
    load time, so exports stay as they are."""
    import onnx

    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    graph = cut.graph
    full = next(o for o in graph.output if o.name == "draft_tokens").type.tensor_type.shape.dim[1].dim_value
    if not 1 <= depth <= full:
        raise ValueError(f"a drafter of {full} steps cannot be cut to {depth}")
    for node in graph.node:
        if node.op_type == "Concat" and node.output[0] in DRAFT_OUTPUTS + (DRAFT_INDICES, DRAFT_ALL_LOGITS):
            del node.input[depth:]
    later = tuple(f".step{j}" for j in range(depth, full))
    outputs = [o for o in graph.output if not o.name.endswith(later)]
    for o in outputs:
        if o.name in DRAFT_OUTPUTS:
            o.type.tensor_type.shape.dim[1].dim_value = depth
    del graph.output[:]
    graph.output.extend(outputs)
    keep_what_outputs_need(graph)
    return cut


def tokens_only(model: "onnx.ModelProto") -> "onnx.ModelProto":
    """A greedy drafter (:func:`lower_drafter`, maybe cut or batched, maybe one native node) that
    outputs its ``draft_tokens`` and caches only: greedy incremental decoding by the model's own
    drafter, which needs no probabilities. The top tokens' logits and the mass go, and with them
    the mass's Sub, Exp and ReduceSum over every step's logits (the embedded LLM's chain of 8 for
    16 sequences, 1.4 of 22.8 ms in ONNX Runtime's profiler; its runs 7-12% shorter without). The tokens are
    the full drafter's bit for bit (the same kernels on the same inputs)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    outputs = [o for o in graph.output if o.name not in DRAFT_OUTPUTS[1:]]
    del graph.output[:]
    graph.output.extend(outputs)
    keep_what_outputs_need(graph, inputs=False)   # every input stays: the caller binds them all
    return out


def keep_what_outputs_need(graph, inputs: bool = True) -> None:
    """Drop the nodes, weights, value infos and (``inputs``) inputs no output of ``graph`` needs,
    walking its (topologically sorted) nodes backwards."""
    needed, kept = {o.name for o in graph.output}, []
    for node in reversed(list(graph.node)):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    for field in (graph.input, graph.initializer, graph.value_info) if inputs else (graph.initializer, graph.value_info):
        live = [v for v in field if v.name in needed]
        del field[:]
        field.extend(live)


# --- many sequences in one run ------------------------------------------------------------------------
def slot_names(num_layers: int, slot: int) -> tuple[list[str], list[str]]:
    """A batched graph's per-sequence inputs and KV outputs for sequence ``slot``."""
    inputs = [f"attention_bias.{slot}", f"seqlens_k.{slot}", f"total_sequence_length.{slot}"]
    inputs += [f"{name}.{slot}" for name in input_names(num_layers)[5:]]
    return inputs, [f"{name}.{slot}" for name in output_names(num_layers)[1:]]


def batch_sequences(model: "onnx.ModelProto", slots: int) -> "onnx.ModelProto":
    """The lowered graph (:func:`lower`) rewritten to score the new tokens of ``slots`` sequences in
    one run, each over its own KV cache.

    GroupQueryAttention cannot batch trees over shared caches (batch must be 1 when more than one
    new token meets a past), and everything else in a decoder works token by token. So the
    sequences' new tokens go in as one row, ``input_ids``/``position_ids`` [1, T1 + ... + Tn], with
    ``slot_tokens`` int64 [n] = (T1, ..., Tn): every MatMul reads the weights once for all of them,
    and each layer splits its packed q|k|v by sequence, runs one attention per sequence on that
    sequence's cache (``past_key.<layer>.<slot>``, bound in place as its present too, with its own
    ``attention_bias.<slot>``, ``seqlens_k.<slot>``, ``total_sequence_length.<slot>``) and
    concatenates the results. Logits are [1, T, V] in the same order."""
    import onnx
    from onnx import TensorProto, helper

    graph = model.graph
    layers = sum(1 for n in graph.node if n.op_type == "GroupQueryAttention")
    known = {v.name: v for v in list(graph.input) + list(graph.output)}
    nodes = [helper.make_node("Split", ["position_ids", "slot_tokens"], [f"position_ids.{s}" for s in range(slots)],
                              name="position_ids.split", axis=1)]
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        layer = int(node.input[3].rsplit(".", 1)[1])
        qkv, attn = node.input[0], node.output[0]
        nodes.append(helper.make_node("Split", [qkv, "slot_tokens"], [f"{qkv}.{s}" for s in range(slots)],
                                      name=f"{qkv}.split", axis=1))
        for s in range(slots):
            inputs = list(node.input)
            inputs[0] = f"{qkv}.{s}"
            inputs[3:7] = [f"past_key.{layer}.{s}", f"past_value.{layer}.{s}", f"seqlens_k.{s}",
                           f"total_sequence_length.{s}"]
            inputs[9:11] = [f"position_ids.{s}", f"attention_bias.{s}"]
            outputs = [f"{attn}.{s}", f"{node.output[1]}.{s}", f"{node.output[2]}.{s}"]
            copy = helper.make_node(node.op_type, inputs, outputs, name=f"{node.name}.{s}", domain=node.domain)
            copy.attribute.extend(node.attribute)
            nodes.append(copy)
        nodes.append(helper.make_node("Concat", [f"{attn}.{s}" for s in range(slots)], [attn], name=f"{attn}.concat",
                                      axis=1))

    def renamed(value, name):
        """A value's info under its slot's name, its symbolic sizes the slot's own."""
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(value)
        copy.name = name
        for dim in copy.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = f"{dim.dim_param}.{name.rsplit('.', 1)[1]}"
        return copy

    inputs = [known["input_ids"], known["position_ids"],
              helper.make_tensor_value_info("slot_tokens", TensorProto.INT64, [slots])]
    inputs += [known[LOGIT_ROWS]] if LOGIT_ROWS in known else []   # rows of the whole batch's tokens
    outputs = [known["logits"]]
    for s in range(slots):
        slot_inputs, slot_outputs = slot_names(layers, s)
        inputs += [renamed(known[name.rsplit(".", 1)[0]], name) for name in slot_inputs]
        outputs += [renamed(known[name.rsplit(".", 1)[0]], name) for name in slot_outputs]
    batched = helper.make_graph(nodes, f"{graph.name}_x{slots}", inputs, outputs, list(graph.initializer))
    out = helper.make_model(batched, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                            producer_name=model.producer_name)
    return out


def batch_drafter(model: "onnx.ModelProto", slots: int) -> "onnx.ModelProto":
    """A drafter (:func:`lower_drafter`, cut or not) rewritten to draft a chain for each of
    ``slots`` sequences in one run, each over its own KV cache: the SSMs' drafts of many requests
    in one call, whose weights are read once for all of them and whose ~27 kernels a step are paid
    once, not once per request.

    As in :func:`batch_sequences`, the sequences' tokens go in as one row: ``input_ids`` [1, C1 +
    ... + Cn] (each sequence's tokens to score, its root last) with ``slot_tokens`` int64 [n] = (C1,
    ..., Cn) and ``last_rows`` int64 [n] (each one's last row, C1 - 1, C1 + C2 - 1, ...); every
    later step drafts one token per sequence. Each layer of each step splits its packed q|k|v by
    sequence and runs one attention per sequence on that sequence's cache (``past_key.<layer>.<slot>``,
    bound in place as its every step's present too) with its own ``seqlens_k.<slot>`` and
    ``total_sequence_length.<slot>``. Outputs are the drafter's with the sequences side by side:
    ``draft_tokens`` [1, depth x n, K] step-major (step j of sequence s at row j x n + s), and so
    ``draft_logits`` and ``draft_mass``/``draft_choice``; a sampled drafter's ``draft_noise.<j>`` is
    [1, n, K], a sampled decoding chain's temperature and uniforms [1, n]. Each sequence's rows are what the drafter computes for it alone: the same kernels
    on its own rows."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    per_slot = {"seqlens_k", "total_sequence_length"}   # values each sequence has its own of
    per_slot.update(i.name for i in graph.input if i.name.startswith("past_"))
    depth = next(o for o in graph.output if o.name == "draft_tokens").type.tensor_type.shape.dim[1].dim_value
    constants = [numpy_helper.from_array(np.ones(slots, np.int64), "slot_ones"),
                 numpy_helper.from_array(np.arange(slots, dtype=np.int64), "slot_rows"),
                 numpy_helper.from_array(np.array([1, slots], np.int64), "slot_token_shape")]
    nodes = []

    def slot(name: str, s: int) -> str:
        return f"{name}.{s}" if name in per_slot else name

    for node in graph.node:
        step0 = node.output[0].startswith("step0/")
        if node.op_type == "GroupQueryAttention":
            qkv, attn = node.input[0], node.output[0]
            nodes.append(helper.make_node("Split", [qkv, "slot_tokens" if step0 else "slot_ones"],
                                          [f"{qkv}.{s}" for s in range(slots)], name=f"{qkv}.split", axis=1))
            for s in range(slots):
                inputs = [f"{qkv}.{s}"] + [slot(name, s) for name in node.input[1:]]
                copy = helper.make_node(node.op_type, inputs, [f"{o}.{s}" for o in node.output],
                                        name=f"{node.name}.{s}", domain=node.domain)
                copy.attribute.extend(node.attribute)
                nodes.append(copy)
            nodes.append(helper.make_node("Concat", [f"{attn}.{s}" for s in range(slots)], [attn],
                                          name=f"{attn}.concat", axis=1))
        elif any(name in per_slot for name in node.input):   # a step's seqlens_k and total: per sequence
            for s in range(slots):
                copy = onnx.NodeProto()
                copy.CopyFrom(node)
                copy.name = f"{node.name}.{s}"
                copy.input[:] = [slot(name, s) for name in node.input]
                copy.output[:] = [f"{o}.{s}" for o in node.output]
                nodes.append(copy)
            per_slot.update(node.output)
        else:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            # The last token's row: of each sequence at step 0, and every row (one a sequence) after.
            copy.input[:] = [("last_rows" if step0 else "slot_rows") if name == "last_index" else
                             "slot_token_shape" if name == "token_shape" else name for name in node.input]
            nodes.append(copy)

    def renamed(value, name: str, dims: dict[int, object] | None = None):
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(value)
        copy.name = name
        for i, dim in enumerate(copy.type.tensor_type.shape.dim):
            if dims and i in dims:
                dim.Clear()
                if isinstance(dims[i], int):
                    dim.dim_value = dims[i]
                else:
                    dim.dim_param = dims[i]
            elif dim.dim_param:
                dim.dim_param = f"{dim.dim_param}.{name.rsplit('.', 1)[1]}"
        return copy

    inputs = [helper.make_tensor_value_info("slot_tokens", TensorProto.INT64, [slots]),
              helper.make_tensor_value_info("last_rows", TensorProto.INT64, [slots])]
    for value in graph.input:
        if value.name in per_slot:
            inputs += [renamed(value, f"{value.name}.{s}") for s in range(slots)]
        elif value.name.startswith(PER_SEQUENCE_ROWS):
            inputs.append(renamed(value, value.name, {1: slots}))
        else:
            inputs.append(value)
    outputs = []
    for value in graph.output:
        if value.name in DRAFT_OUTPUTS:
            outputs.append(renamed(value, value.name, {1: depth * slots}))
        else:
            outputs += [renamed(value, f"{value.name}.{s}") for s in range(slots)]
    used = {name for node in nodes for name in node.input}
    batched = helper.make_graph(nodes, f"{graph.name}_x{slots}", inputs, outputs,
                                [t for t in list(graph.initializer) + constants if t.name in used])
    return helper.make_model(batched, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                             producer_name=model.producer_name)
