"""Native CPU kernels that ONNX Runtime lacks, built from ``kernels/`` with the system's C compiler
on first use and loaded as one custom-op library (domain ``specinfer.native``).

* ``MatMulF16W`` (``kernels/f16w_matmul.c``) multiplies float32 activations by weights stored in
  float16 and widened in registers: the float32 MatMul of the same numbers, with half the weight
  traffic. It replaces a MatMul only where every weight is a float16 value already (a checkpoint
  saved in float16, as the embedded models are), so the model computes what it did before.
* ``MatMulBF16`` (same file), asked for by ``matmul_dtype="bfloat16"``: weights and activations
  rounded to bfloat16 and summed in float32 by AVX512-BF16, at twice the arithmetic rate (a
  bfloat16 model's products, as on a GPU); only on a CPU that has it (:func:`products_run`).
* ``MatMulI8`` (same file), asked for by ``matmul_dtype="int8"``: weights quantized to int8 per
  column, activations per row as the op runs, summed exactly in int32 by AVX512-VNNI, at twice the
  bfloat16 rate and half its weight bytes; without VNNI (AVX2) the same sums by VPMADDWD, and with
  AMX-INT8 the products of 6 rows or more by the tile unit (:func:`int8_by_tiles`): the same
  outputs bit for bit.
* ``TreeAttention`` (``kernels/tree_attention.c``) replaces the lowering's GroupQueryAttention:
  the same inputs (but the unused separate key and value) and outputs, the cache read and written
  in place, each query summed over its visible keys in slot order.
* ``TreeAttentionSlots`` (same file) is a batched graph's attention of many sequences, each on its
  own cache, in one node a layer, where the batch rewrites run a Split, a TreeAttention per
  sequence and a Concat (:func:`use_slot_attention`).
* ``DraftChain`` and ``DraftChainSampled`` (``kernels/draft_chain.c``) run a whole drafter
  (``ort_lowering.lower_drafter``, one sequence or a batch) as one node, where its graph runs ~27
  kernels a step (:func:`use_draft_chain`).
* ``specinfer_softmax`` (``kernels/shaping.c``, a plain C function called through ctypes) shapes
  sampled logits (:func:`softmax`).

The library is built for the CPU that runs it (``-march=native``): on AVX-512, or on AVX2 with FMA
and F16C (``kernels/simd.h``: the same kernels on 8-lane halves, every op but the bfloat16
products, which need AVX-512's instructions). Where it cannot be built (no C compiler, a CPU without
AVX2, FMA and F16C, not Linux x86-64) or ``SPECINFER_NATIVE=0``, the graphs keep ONNX Runtime's own
kernels.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from ..cache import cache_dir
from ..errors import SpecInferError

KERNELS = Path(__file__).parent / "kernels"
DOMAIN = "specinfer.native"
OP = "MatMulF16W"
SWIGLU_OP = "MatMulF16WSwiGLU"
NORMED_OPS = {OP: "SkipRMSNormMatMulF16W", SWIGLU_OP: "SkipRMSNormMatMulF16WSwiGLU"}   # by the product they lead
# The same products on bfloat16 or int8 weights and activations (kernels/f16w_matmul.c), by their
# float16 op; the int8 ops take the weight's scales and sums as an input after it.
BF16_OPS = {OP: "MatMulBF16", SWIGLU_OP: "MatMulBF16SwiGLU"}
I8_OPS = {OP: "MatMulI8", SWIGLU_OP: "MatMulI8SwiGLU"}
PRODUCT_OPS = {"float16": {OP: OP, SWIGLU_OP: SWIGLU_OP}, "bfloat16": BF16_OPS, "int8": I8_OPS}   # by weights' type
PRODUCTS_OF = {ops[OP]: products for products, ops in PRODUCT_OPS.items()}   # a product op's weights' type
K_GROUPS = {"float16": 1, "bfloat16": 2, "int8": 4}   # k a packed weight's lane holds (pack_group_panels)
NORMED_OPS |= {ops[op]: f"SkipRMSNorm{ops[op]}" for ops in (BF16_OPS, I8_OPS) for op in (OP, SWIGLU_OP)}
# The CPU flag each reduced product type's instructions need: VDPBF16PS and VCVTNEPS2BF16 (with
# AVX-512); int8, VPDPBUSD where the CPU has AVX512-VNNI, else AVX2's VPMADDWD, the same exact sums.
PRODUCT_CPU_FLAGS = {"bfloat16": "avx512_bf16", "int8": "avx2"}
PRODUCT_NAMES = {"bfloat16": "AVX512-BF16", "int8": "AVX2"}
WEIGHT_SUFFIXES = {"float16": ".f16w", "bfloat16": ".bf16w", "int8": ".i8w"}   # a packed weight's name: the weight's + this
SCALES = ".scales"   # an int8 weight's scales and sums: its packed name + this
ATTENTION_OP = "TreeAttention"
SLOTS_OP = "TreeAttentionSlots"
F16_KV_OPS = {ATTENTION_OP: "TreeAttentionF16KV", SLOTS_OP: "TreeAttentionSlotsF16KV"}   # over float16 caches
DRAFT_OPS = {"draft_mass": "DraftChain", "draft_choice": "DraftChainSampled"}   # by the drafter's last output
PANEL = 64                       # weight columns per packed panel (the kernel's PANEL)
CPU_FLAGS = ("avx2", "f16c", "fma")   # the least the library is built for (kernels/simd.h)
WIDE_FLAG = "avx512f"                  # with it, the library's AVX-512 build, the reduced products' too
# MatMuls with no more weights than this stay on ONNX Runtime's: for small ones the kernel's
# hand-out over the thread pool costs more than their weights' traffic (SSM 1's drafter, whose
# largest weight has 64 x 2048 values: 397 us a call native against 370, 300 calls each).
MIN_WEIGHT_VALUES = 1 << 17
# A drafter runs as one DraftChain node only if its matrices hold no more values than this: the node
# runs on one thread, ~4 MFLOP a token at this size, where a larger model's graph (an LLM drafting
# its own chain for incremental decoding) shares its MatMuls over the pool. The embedded LLM's own
# chain on the node took 2.6x as long.
DRAFT_CHAIN_MAX_WEIGHTS = 1 << 21


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.lru_cache(maxsize=None)
def library() -> Path | None:
    """The built library of the native ops, compiled into the specinfer cache once per source and
    CPU; None where it cannot run here (see the module docstring)."""
    if os.environ.get("SPECINFER_NATIVE", "1") == "0":
        return None
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    flags = cpu_flags()
    if not set(CPU_FLAGS) <= flags:
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    code = b"".join(path.read_bytes() for path in sorted(KERNELS.glob("*.[ch]")))
    # -march=native ties the build to this CPU: the key names the CPU's flags too.
    key = hashlib.sha256(code + " ".join(sorted(flags)).encode()).hexdigest()[:16]
    out = cache_dir() / "native" / f"specinfer_native-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes that start together (a server's models)
    # never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        compile_kernels(Path(tmp), compiler)
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"specinfer: could not build the native kernels ({detail.strip()[:300]}); "
                      f"using ONNX Runtime's own", RuntimeWarning, stacklevel=2)
        return None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def products_run(matmul_dtype: str) -> bool:
    """Whether the products in ``matmul_dtype`` (bfloat16: ``MatMulBF16`` and its siblings; int8:
    ``MatMulI8`` and its) run here; float32 always does."""
    flag = PRODUCT_CPU_FLAGS.get(matmul_dtype)
    needs = {flag, WIDE_FLAG} if matmul_dtype == "bfloat16" else {flag}
    return flag is None or (needs <= cpu_flags() and library() is not None)


def compile_kernels(out: Path, compiler: str, target: Sequence[str] = ("-march=native",)) -> None:
    """Build every ``kernels/*.c`` into the shared library ``out`` for ``target`` (compiler flags:
    this CPU by default; ``-mavx2 -mfma -mf16c`` for one without AVX-512); raises
    ``subprocess.CalledProcessError`` with the compiler's message."""
    subprocess.run([compiler, "-O3", *target, "-shared", "-fPIC", "-o", str(out), *map(str, sorted(KERNELS.glob("*.c")))],
                   check=True, capture_output=True, text=True, timeout=120)


def int8_by_tiles() -> bool:
    """Whether int8 products of several rows (a tree, a batch, a prompt) run on the CPU's tile unit
    here (AMX-INT8, where Linux grants this process its state and ``SPECINFER_AMX`` is not 0); the
    same outputs bit for bit as on VPDPBUSD (``kernels/f16w_matmul.c``)."""
    import ctypes

    path = library()
    return path is not None and bool(ctypes.CDLL(str(path)).specinfer_int8_tiles())


def require_products(matmul_dtype: str) -> None:
    """Refuse products in ``matmul_dtype`` where they cannot run, saying what they need."""
    if not products_run(matmul_dtype):
        raise SpecInferError(f"{matmul_dtype} matrix products need the native kernels on a CPU with "
                             f"{PRODUCT_NAMES[matmul_dtype]} ({PRODUCT_CPU_FLAGS[matmul_dtype]} in /proc/cpuinfo), "
                             f"a C compiler and SPECINFER_NATIVE not 0; use float32")


def pack_panels(weights: np.ndarray) -> np.ndarray:
    """A [K, N] weight as the native kernels read it: panels of 64 columns, [ceil(N / 64), K, 64],
    the last padded with zeros."""
    k, n = weights.shape
    padded = np.zeros((k, -(-n // PANEL) * PANEL), weights.dtype)
    padded[:, :n] = weights
    return np.ascontiguousarray(padded.reshape(k, -1, PANEL).transpose(1, 0, 2))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Float32 ``values`` rounded to bfloat16 (to nearest even, as the CPU's VCVTNEPS2BF16 rounds
    finite numbers), as their uint16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def pack_group_panels(values: np.ndarray, group: int) -> np.ndarray:
    """A [K, N] weight as the bfloat16 (``group`` 2, :func:`bf16_bits`) or int8 (4,
    :func:`quantize_columns`) kernels read it: panels of 64 columns by groups of rows,
    [ceil(N / 64), ceil(K / group), 64 x group], zero-padded."""
    k, n = values.shape
    padded = np.zeros((-(-k // group) * group, -(-n // PANEL) * PANEL), values.dtype)
    padded[:k, :n] = values
    groups = padded.reshape(-1, group, padded.shape[1] // PANEL, PANEL).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(groups).reshape(groups.shape[0], groups.shape[1], group * PANEL)


def pack_pair_panels(bits: np.ndarray) -> np.ndarray:
    """A [K, N] bfloat16 weight (:func:`bf16_bits`) as the bfloat16 kernels read it (pairs of rows)."""
    return pack_group_panels(bits, 2)


def unpack_panels(packed: np.ndarray, group: int = 1) -> np.ndarray:
    """The [K, N] weight of :func:`pack_panels` (``group`` 1) or :func:`pack_group_panels`, K's
    padding rows kept."""
    p, kg, _ = packed.shape
    return packed.reshape(p, kg, PANEL, group).transpose(1, 3, 0, 2).reshape(group * kg, p * PANEL)


def quantize_columns(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [K, N] float32 weight as the int8 kernels take it: ``q`` int8 [K, N] in [-127, 127] and each
    column's ``scale`` (float32 [N], its largest magnitude m / 127; 0 for a column of zeros), weights
    ~ scale * q, q = round(weights x (127 / m)) to nearest even, as the kernels quantize activations."""
    weights = np.asarray(weights, np.float32)
    largest = np.abs(weights).max(axis=0)
    inverse = np.divide(np.float32(127), largest, out=np.zeros_like(largest), where=largest > 0)
    return np.clip(np.rint(weights * inverse), -127, 127).astype(np.int8), largest / np.float32(127)


def i8_scales(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The int8 ops' input beside the weight ``q`` [K, N] (N a multiple of 64): [2, N] float32, each
    column's scale, then the sum of its int8 weights (the kernel takes 128 times it off, as it feeds
    each activation to VPDPBUSD as an unsigned q + 128)."""
    return np.stack([scale, q.sum(axis=0, dtype=np.int64)]).astype(np.float32)


def bf16_initializer(bits: np.ndarray, name: str):
    """An ONNX bfloat16 initializer holding ``bits`` (uint16 bit patterns)."""
    from onnx import TensorProto, helper

    return helper.make_tensor(name, TensorProto.BFLOAT16, bits.shape, bits.tobytes(), raw=True)


def f16_exact(weights: np.ndarray) -> np.ndarray | None:
    """``weights`` in float16 if every value is one (then widening them back is exact), else None."""
    half = weights.astype(np.float16)
    return half if np.array_equal(half.astype(weights.dtype), weights) else None


def use_f16_weights(model, weights_dir: Path, packed: dict[str, object], products: str = "float16"):
    """A copy of ``model`` whose MatMuls by a float16-exact float32 weight ([K, N], N a multiple of
    64) run ``MatMulF16W`` on the weight packed in float16, or ``model`` itself where none does.
    ``products`` "bfloat16" or "int8": every such MatMul by a float32 weight, float16-exact or not,
    runs ``MatMulBF16`` on the weight rounded to bfloat16 (and its activations rounded too: a
    bfloat16 model's products) or ``MatMulI8`` on it quantized per column (and its activations per
    row). ``packed``: weight name + its suffix (:data:`WEIGHT_SUFFIXES`) -> packed initializers (None:
    not rewritten), filled and reused across the sessions of one export."""
    import onnx
    from onnx import numpy_helper

    inits = {init.name: init for init in model.graph.initializer}
    suffix = WEIGHT_SUFFIXES[products]
    chosen = []   # indices of the MatMuls rewritten
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or node.domain or node.input[1] not in inits:
            continue
        name = node.input[1]
        if name + suffix not in packed:
            init = inits[name]
            packed[name + suffix] = None
            if (init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2 and init.dims[1] % PANEL == 0
                    and init.dims[0] * init.dims[1] > MIN_WEIGHT_VALUES):
                weights = numpy_helper.to_array(init, base_dir=str(weights_dir))
                packed[name + suffix] = packed_weight(weights, products, name + suffix)
        if packed[name + suffix] is not None:
            chosen.append(index)
    if not chosen:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    weights = sorted({model.graph.node[i].input[1] + suffix for i in chosen})
    for i in chosen:
        node = out.graph.node[i]
        node.op_type, node.domain = PRODUCT_OPS[products][OP], DOMAIN
        node.input[1] = node.input[1] + suffix
        if products == "int8":
            node.input.append(node.input[1] + SCALES)
    # The float32 weights no other node reads are dropped: their session never loads them.
    return _with_initializers(out, [init for w in weights for init in packed[w]])


def packed_weight(weights: np.ndarray, products: str, name: str) -> list | None:
    """The initializers of ``weights`` [K, N] packed for the ``products`` kernels under ``name`` (an
    int8 weight's scales beside it), or None where float16 products cannot take it exactly."""
    from onnx import numpy_helper

    if products == "bfloat16":
        return [_panels_initializer(pack_pair_panels(bf16_bits(weights)), products, name)]
    if products == "int8":
        q, scale = quantize_columns(weights)
        return [_panels_initializer(pack_group_panels(q, K_GROUPS[products]), products, name),
                numpy_helper.from_array(i8_scales(q, scale), name + SCALES)]
    half = f16_exact(weights)
    return None if half is None else [numpy_helper.from_array(pack_panels(half), name)]


def _panels_initializer(panels: np.ndarray, products: str, name: str):
    """Packed panels as an ONNX initializer of the ``products`` kernels' weight type (bfloat16 bits
    as BFLOAT16, which numpy has not)."""
    from onnx import numpy_helper

    return bf16_initializer(panels, name) if products == "bfloat16" else numpy_helper.from_array(panels, name)


def _panels_of(init, products: str) -> np.ndarray:
    """The packed panels an initializer of :func:`_panels_initializer` holds."""
    from onnx import numpy_helper

    if products == "bfloat16":
        return np.frombuffer(init.raw_data, np.uint16).reshape(init.dims)
    return numpy_helper.to_array(init)


def swiglu_columns(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[K, I] gate and up (I a multiple of 32) as one [K, 2 I], each 64 columns 32 of ``gate`` then
    the same 32 of ``up``: the columns of ``MatMulF16WSwiGLU``'s panels."""
    k, halves = gate.shape[0], PANEL // 2
    return np.stack([gate.reshape(k, -1, halves), up.reshape(k, -1, halves)], axis=2).reshape(k, -1)


def pack_swiglu(gate: np.ndarray, up: np.ndarray, pack=pack_panels) -> np.ndarray:
    """The weights ``MatMulF16WSwiGLU`` reads: [K, I] gate and up in :func:`swiglu_columns` packed
    as ``pack`` packs [K, 2 I] (:func:`pack_pair_panels` for ``MatMulBF16SwiGLU``)."""
    return pack(swiglu_columns(gate, up))


def use_swiglu(model, packed: dict[str, object]):
    """A copy of ``model`` whose MLP activations, a ``MatMulF16W`` by [Wg | Wu] whose product is
    Split in halves, then ``Mul(Mul(gate, Sigmoid(gate)), up)`` (the lowering's SwiGLU), run as one
    ``MatMulF16WSwiGLU`` on the weight repacked (each panel: 32 columns of Wg, then Wu's same 32),
    or ``model`` itself where there is none. ``packed`` as :func:`use_f16_weights` fills it (the
    repacked weights go there too)."""
    from onnx import helper, numpy_helper

    nodes, readers, outputs = _readers(model)

    def only_reader(name: str, op: str):
        """The index of the one node reading ``name``, if it is an ``op`` of the default domain."""
        at = readers.get(name, [])
        if name in outputs or len(at) != 1 or nodes[at[0]].op_type != op or nodes[at[0]].domain:
            return None
        return at[0]

    inits = {init.name: init for init in model.graph.initializer}
    fused = {}   # index of the MatMul -> (the fused node, the indices of the nodes it replaces)
    for index, node in enumerate(nodes):
        products = PRODUCTS_OF.get(node.op_type)
        if products is None or node.domain != DOMAIN or node.input[1] not in inits:
            continue
        split = only_reader(node.output[0], "Split")
        if split is None or len(nodes[split].output) != 2 or len(nodes[split].input) > 1:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in nodes[split].attribute}
        if attrs.get("axis") != -1 or attrs.get("num_outputs") != 2:   # (halves of N, a multiple of 64)
            continue
        gate, up = nodes[split].output
        at = {nodes[i].op_type: i for i in readers.get(gate, []) if not nodes[i].domain}
        if gate in outputs or len(readers.get(gate, [])) != 2 or set(at) != {"Sigmoid", "Mul"}:
            continue
        sigmoid, silu = at["Sigmoid"], at["Mul"]
        if (only_reader(nodes[sigmoid].output[0], "Mul") != silu
                or sorted(nodes[silu].input) != sorted([gate, nodes[sigmoid].output[0]])):
            continue
        act = only_reader(nodes[silu].output[0], "Mul")
        if act is None or sorted(nodes[act].input) != sorted([nodes[silu].output[0], up]) or len(readers.get(up, [])) != 1:
            continue
        name = f"{node.input[1]}.swiglu"
        if name not in packed:   # the same weights, their columns reordered
            group = K_GROUPS[products]
            w = unpack_panels(_panels_of(inits[node.input[1]], products), group)   # [Wg | Wu]
            packed[name] = [_panels_initializer(pack_group_panels(swiglu_columns(*np.split(w, 2, axis=1)), group),
                                                products, name)]
            if products == "int8":   # its scales and sums, their columns reordered alike
                scales = numpy_helper.to_array(inits[node.input[2]])
                packed[name].append(numpy_helper.from_array(swiglu_columns(*np.split(scales, 2, axis=1)), name + SCALES))
        inputs = [node.input[0], name] + ([name + SCALES] if products == "int8" else [])
        replaced = helper.make_node(PRODUCT_OPS[products][SWIGLU_OP], inputs, [nodes[act].output[0]],
                                    name=f"{node.name}.swiglu", domain=DOMAIN)
        fused[index] = (replaced, {split, sigmoid, silu, act})
    if not fused:
        return model
    dropped = set().union(*(r for _, r in fused.values()))
    return _with_nodes(model, [fused[i][0] if i in fused else n for i, n in enumerate(nodes) if i not in dropped],
                       [init for w in sorted({n.input[1] for n, _ in fused.values()}) for init in packed[w]])


def use_skip_norms(model):
    """A copy of ``model`` whose ``SkipSimplifiedLayerNormalization`` nodes (residual add and RMSNorm)
    run inside the one ``MatMulF16W`` or ``MatMulF16WSwiGLU`` reading their normalized output, as
    ``SkipRMSNormMatMulF16W`` or ``SkipRMSNormMatMulF16WSwiGLU`` (which also write the sum the norm
    gave the next residual), or ``model`` itself where none does. Why: such a norm is a few hundred
    additions a token, but a kernel of its own costs what ONNX Runtime spends on any kernel (12 of
    the embedded LLM's 47 a step; without them its step is 1-5% faster)."""
    from onnx import helper, numpy_helper

    nodes, readers, outputs = _readers(model)
    fused, dropped, epsilons = {}, set(), {}
    for index, node in enumerate(nodes):
        if (node.op_type != "SkipSimplifiedLayerNormalization" or node.domain != "com.microsoft"
                or len(node.input) != 3 or any(node.output[1:3]) or node.output[0] in outputs):
            continue
        at = readers.get(node.output[0], [])
        if len(at) != 1 or nodes[at[0]].domain != DOMAIN or nodes[at[0]].op_type not in NORMED_OPS:
            continue
        product = nodes[at[0]]
        if list(product.input).index(node.output[0]) != 0:
            continue
        eps = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5)
        eps_name = epsilons.setdefault(float(eps), f"skip_norm.epsilon.{len(epsilons)}")
        total = node.output[3] if len(node.output) > 3 and node.output[3] else f"{node.output[0]}.sum"
        fused[index] = helper.make_node(NORMED_OPS[product.op_type], [*node.input, eps_name, *product.input[1:]],
                                        [product.output[0], total], name=f"{product.name}.skip_norm", domain=DOMAIN)
        dropped.add(at[0])
    if not fused:
        return model
    # Each fused node stands where its norm stood: its inputs are ready there, and whatever reads its
    # product came after the product's old node, which came after the norm.
    return _with_nodes(model, [fused.get(i, n) for i, n in enumerate(nodes) if i not in dropped],
                       [numpy_helper.from_array(np.array([eps], np.float32), name) for eps, name in epsilons.items()])


# GroupQueryAttention as the lowering writes it, the only form TreeAttention implements.
_GQA_FORM = {"do_rotary": 1, "rotary_interleaved": 0, "local_window_size": -1}


def use_tree_attention(model):
    """A copy of ``model`` whose GroupQueryAttention nodes run ``TreeAttention``, or ``model``
    itself where none does (only the form the lowering writes: packed q|k|v, rotary inside)."""
    import onnx
    from onnx import helper, numpy_helper

    chosen = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * (11 - len(node.input))
        if (all(attrs.get(k) == v for k, v in _GQA_FORM.items()) and not attrs.get("softcap")
                and not inputs[1] and not inputs[2] and all(inputs[i] for i in (3, 4, 5, 6, 7, 8))):
            chosen.append((index, inputs, float(attrs["scale"])))
    if not chosen:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    scales = {}
    for index, inputs, scale in chosen:
        name = scales.setdefault(scale, f"tree_attention.scale.{len(scales)}")
        node = out.graph.node[index]
        replaced = helper.make_node(ATTENTION_OP, [inputs[0], *inputs[3:11], name], list(node.output),
                                    name=node.name, domain=DOMAIN)
        node.CopyFrom(replaced)
    out.graph.initializer.extend(numpy_helper.from_array(np.array(s, np.float32), n) for s, n in scales.items())
    return _import_domain(out)


def use_slot_attention(model):
    """A copy of ``model`` whose per-sequence attentions of a batched graph (a Split of q|k|v by
    sequence, one ``TreeAttention`` per sequence, a Concat: ``ort_lowering.batch_sequences`` and
    ``batch_drafter`` after :func:`use_tree_attention`) run as one ``TreeAttentionSlots`` a layer,
    or ``model`` itself where there are none."""
    import onnx
    from onnx import helper, numpy_helper

    graph_nodes = list(model.graph.node)
    made_by = {out: i for i, node in enumerate(graph_nodes) for out in node.output}   # value -> its node's index
    producer = lambda name: graph_nodes[made_by[name]] if name in made_by else None
    fused = {}   # index of a Concat -> (the fused node, the indices of the nodes it replaces)
    for index, node in enumerate(graph_nodes):
        if node.op_type != "Concat" or node.domain:
            continue
        parts = [producer(name) for name in node.input]
        if not parts or not all(p is not None and p.op_type == ATTENTION_OP and p.domain == DOMAIN for p in parts):
            continue
        split = producer(parts[0].input[0])
        if (split is None or split.op_type != "Split" or len(split.input) < 2
                or [p.input[0] for p in parts] != list(split.output)):
            continue
        sizes = split.input[1]
        positions = [p.input[7] if len(p.input) > 7 else "" for p in parts]
        packed = ""
        if any(positions):   # the sequences' positions are a Split of the packed ones by the same sizes
            by = producer(positions[0])
            if (by is None or by.op_type != "Split" or list(by.output) != positions
                    or len(by.input) < 2 or by.input[1] != sizes):
                continue
            packed = by.input[0]
        first = parts[0]
        inputs = [split.input[0], sizes, packed, first.input[5], first.input[6], first.input[9]]
        if any(p.input[5:7] != first.input[5:7] or p.input[9] != first.input[9] for p in parts):
            continue
        outputs = [node.output[0]]
        for p in parts:
            bias = p.input[8] if len(p.input) > 8 and p.input[8] else _NO_BIAS
            inputs += [p.input[1], p.input[2], p.input[3], p.input[4], bias]
            outputs += [p.output[1], p.output[2]]
        replaced = {made_by[split.output[0]]} | {made_by[p.output[0]] for p in parts}
        fused[index] = (helper.make_node(SLOTS_OP, inputs, outputs, name=f"{node.name}.slots", domain=DOMAIN), replaced)
    if not fused:
        return model
    dropped = set().union(*(r for _, r in fused.values())) | set(fused)
    nodes = [fused[i][0] if i in fused else n for i, n in enumerate(graph_nodes) if i in fused or i not in dropped]
    read = {name for n in nodes for name in n.input} | {o.name for o in model.graph.output}
    # A Split of the positions that no attention reads any more goes too.
    nodes = [n for n in nodes if n.op_type != "Split" or any(o in read for o in n.output)]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    if any(_NO_BIAS in n.input for n in nodes):
        out.graph.initializer.append(numpy_helper.from_array(np.zeros(0, np.float32), _NO_BIAS))
    return _import_domain(out)


_NO_BIAS = "tree_attention_slots.no_bias"   # an empty tensor: that sequence's attention is causal


def use_f16_kv(model):
    """A copy of ``model`` on float16 caches: its attention nodes run ``TreeAttentionF16KV`` and
    ``TreeAttentionSlotsF16KV``, and the pasts they read and presents they write are float16 in
    the graph; None where not every cache is read and written by those nodes alone (ONNX Runtime's
    GroupQueryAttention and the drafter node take float32 caches only)."""
    import onnx

    nodes, readers, _ = _readers(model)
    pasts, presents = set(), set()
    for node in nodes:
        if node.domain == DOMAIN and node.op_type == ATTENTION_OP:
            pasts |= {node.input[1], node.input[2]}
            presents |= {node.output[1], node.output[2]}
        elif node.domain == DOMAIN and node.op_type == SLOTS_OP:   # 6 inputs, then 5 a sequence: key, value, ...
            pasts |= {name for i, name in enumerate(node.input[6:]) if i % 5 < 2}
            presents |= set(node.output[1:])
        elif node.op_type == "GroupQueryAttention" or node.op_type in DRAFT_OPS.values():
            return None
    attention = lambda i: nodes[i].domain == DOMAIN and nodes[i].op_type in F16_KV_OPS
    graph_inputs = {i.name for i in model.graph.input}
    if not pasts or not pasts <= graph_inputs or not all(attention(i) for name in pasts for i in readers[name]):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.domain == DOMAIN and node.op_type in F16_KV_OPS:
            node.op_type = F16_KV_OPS[node.op_type]
    for value in list(out.graph.input) + list(out.graph.output):
        if value.name in pasts | presents:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    return out


def use_draft_chain(model, weights_dir: Path, packed: dict[str, object]):
    """A drafter (``ort_lowering.lower_drafter``, maybe cut by ``truncate_drafter``, for one sequence
    or several by ``batch_drafter``) as one ``DraftChain`` (greedy) or ``DraftChainSampled`` node on
    the same inputs, outputs and weights; ``model`` itself where it is no such drafter, is larger
    than :data:`DRAFT_CHAIN_MAX_WEIGHTS` or has biases the op lacks (only the q|k|v projection's
    is taken). Its draft is the graph's up to float rounding (the same sums in another order), and a
    sequence's is bit for bit the same alone and in a batch. ``packed``: weight name -> its
    panels (:func:`pack_panels`), filled and reused across the sessions of one export."""
    from onnx import helper, numpy_helper

    from ..export.ort_lowering import drafter_present_names

    g = model.graph
    inputs, outputs = [i.name for i in g.input], [o.name for o in g.output]
    op = DRAFT_OPS.get(outputs[2] if len(outputs) > 2 else "")
    if outputs[:1] != ["draft_tokens"] or op is None:
        return model
    batched = "slot_tokens" in inputs
    suffixes = [f".{s}" for s in range(sum(n.startswith("seqlens_k.") for n in inputs))] if batched else [""]
    layers = sum(name.startswith("past_key.") for name in inputs) // max(len(suffixes), 1)
    by_name = {init.name: init for init in g.initializer}
    attrs = {(n.op_type, a.name): helper.get_attribute_value(a) for n in g.node for a in n.attribute}
    eps, scale = attrs.get(("SimplifiedLayerNormalization", "epsilon")), attrs.get(("GroupQueryAttention", "scale"))
    vocab = "draft_vocab" if "draft_vocab" in by_name else ""
    rows = "embed_tokens.draft_vocab" if "embed_tokens.draft_vocab" in by_name else "embed_tokens"
    head = "lm_head.draft_vocab" if vocab else "lm_head"
    shared = ["cos_cache", "sin_cache", "embed_tokens", rows, head, "final_norm"]
    weights = [[f"layers.{i}.input_norm", f"layers.{i}.qkv.weight", f"layers.{i}.qkv.bias", f"layers.{i}.o_proj.weight",
                f"layers.{i}.post_norm", f"layers.{i}.gate_up.weight", f"layers.{i}.down.weight"] for i in range(layers)]
    per_sequence = [[f"seqlens_k{x}", f"total_sequence_length{x}"]
                    + [f"past_{kv}.{i}{x}" for i in range(layers) for kv in ("key", "value")] for x in suffixes]
    needed = set(shared) | {name for layer in weights for name in layer if not name.endswith(".bias")}
    biases = {name for name in by_name if name.endswith(".bias")}
    if (not layers or not suffixes or eps is None or scale is None or not needed <= by_name.keys()
            or not {name for seq in per_sequence for name in seq} <= set(inputs)
            or biases - {f"layers.{i}.qkv.bias" for i in range(layers)}):
        return model
    matrices = [head] + [name for layer in weights for name in layer if name.endswith(".weight")]
    if sum(int(np.prod(by_name[name].dims)) for name in matrices) > DRAFT_CHAIN_MAX_WEIGHTS:
        return model
    depth = g.output[0].type.tensor_type.shape.dim[1].dim_value // len(suffixes)
    width, ffn = by_name["layers.0.qkv.weight"].dims[1], by_name["layers.0.gate_up.weight"].dims[1] // 2
    k = g.output[0].type.tensor_type.shape.dim[2].dim_value
    if layers > 64 or depth > 64 or k > 256:   # draft_chain.c's MAX_LAYERS, MAX_DEPTH, MAX_CANDIDATES
        return model
    constants = {"draft_chain.config": np.array([layers, depth, k, by_name[head].dims[1], width, ffn], np.int64),
                 "draft_chain.numbers": np.array([eps, scale], np.float32),
                 "draft_chain.none": np.zeros(0, np.float32), "draft_chain.no_vocab": np.zeros(0, np.int64)}
    steps = drafter_present_names(layers, depth)
    if {name + x for x in suffixes for step in steps for name in step} != set(outputs[3:]):
        return model
    # The node writes each cache in place once, so its outputs are one present key and value per
    # sequence and layer, not one per step as the graph's (which a runtime binds to the same cache:
    # 32 outputs at depth 8, ~5 us each to bind for every sequence and drafter depth).
    presents = [name + x for x in suffixes for name in steps[0]]
    for name in matrices:
        if name not in packed:
            packed[name] = numpy_helper.from_array(
                pack_panels(numpy_helper.to_array(by_name[name], base_dir=str(weights_dir))), f"{name}.panels")
    panel = lambda name: f"{name}.panels" if name in matrices else name if name in by_name else "draft_chain.none"
    node = helper.make_node(
        op, ["input_ids", "slot_tokens" if batched else "", "draft_chain.config", "draft_chain.numbers",
             *map(panel, shared), vocab or "draft_chain.no_vocab", *[panel(n) for layer in weights for n in layer],
             *[name for seq in per_sequence for name in seq], *[n for n in inputs if n.startswith("draft_noise.")]],
        outputs[:3] + presents, name="draft_chain", domain=DOMAIN)
    read, kept = set(node.input), set(outputs[:3] + presents)
    out = _with_nodes(model, [node], [packed[name] for name in matrices]
                      + [numpy_helper.from_array(value, name) for name, value in constants.items() if name in read])
    del out.graph.value_info[:]   # the graph's intermediate values are gone
    outputs_kept = [o for o in out.graph.output if o.name in kept]
    del out.graph.output[:]
    out.graph.output.extend(outputs_kept)
    return out


SAMPLE_OP = "SampleSoftmax"


def sampled_decoding(model):
    """A greedy drafter (``ort_lowering.lower_drafter``, maybe cut by ``truncate_drafter``, not yet
    batched, scoring the whole vocabulary) rewritten for sampled incremental decoding: each step's
    token is drawn from softmax(logits / temperature) by a ``SampleSoftmax`` node (the draw of
    ``sampling.draw``, :func:`sample_softmax`'s code) at the uniform fed for it, where the graph
    took the argmax, and the next step scores that token. Inputs added: ``sampling_temperature``
    and ``sampling_uniform.<j>``, float64 [1, 1] (``batch_drafter`` makes them [1, n]); outputs the
    drawn tokens, ``draft_tokens`` int64 [1, depth, 1], and the caches. Why: sampled incremental
    decoding ran a Runtime call and a draw in Python a token, where greedy decoding takes a chain
    of tokens in one run of this graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ..export.ort_lowering import DRAFT_OUTPUTS, SAMPLING_TEMPERATURE, SAMPLING_UNIFORM, keep_what_outputs_need

    if any(init.name == "draft_vocab" for init in model.graph.initializer):
        raise ValueError("a drafter with a draft vocabulary cannot decode: its head scores part of the vocabulary")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    depth = next(o for o in graph.output if o.name == "draft_tokens").type.tensor_type.shape.dim[1].dim_value
    tops = {n.output[0]: n for n in graph.node if n.op_type == "TopK"}
    nodes, drawn = [], []
    for node in graph.node:
        if node.op_type == "Gather" and node.output[0].endswith("/token"):
            continue   # the argmax a later step read: the draw below takes its name
        if node.output[0] == "draft_tokens":
            node = helper.make_node("Concat", drawn, ["draft_tokens"], name="draft_tokens", axis=1)
        nodes.append(node)
        step = node.output[0][:-len("top")] if node.output[0] in tops else None
        if step is not None:
            j = int(step[len("step"):-1])
            token = f"{step}token"
            nodes.append(helper.make_node(SAMPLE_OP, [node.input[0], SAMPLING_TEMPERATURE, f"{SAMPLING_UNIFORM}.{j}"],
                                          [token], name=token, domain=DOMAIN))
            nodes.append(helper.make_node("Unsqueeze", [token, "sampling_row_axis"], [f"{step}drawn"],
                                          name=f"{step}drawn"))
            drawn.append(f"{step}drawn")
    if len(drawn) != depth:
        raise ValueError(f"not a drafter of {depth} steps")
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), "sampling_row_axis"))
    graph.input.extend([helper.make_tensor_value_info(SAMPLING_TEMPERATURE, TensorProto.DOUBLE, [1, 1])]
                       + [helper.make_tensor_value_info(f"{SAMPLING_UNIFORM}.{j}", TensorProto.DOUBLE, [1, 1])
                          for j in range(depth)])
    outputs = [o for o in graph.output if o.name not in DRAFT_OUTPUTS[1:]]
    outputs[0].type.tensor_type.shape.dim[2].dim_value = 1
    del graph.output[:]
    graph.output.extend(outputs)
    keep_what_outputs_need(graph, inputs=False)   # the TopKs and the mass go; every input stays
    return _import_domain(out)


@functools.lru_cache(maxsize=None)
def _shaping():
    """``kernels/shaping.c``'s functions through ctypes (``softmax``, ``sample_softmax``,
    ``sample_residual``), or None where the library does not run. Addresses go as plain integers:
    ndpointer's checks cost more than the shaping of a row."""
    import ctypes
    from types import SimpleNamespace

    path = library()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    c = SimpleNamespace(softmax=lib.specinfer_softmax, sample_softmax=lib.specinfer_sample_softmax,
                        sample_residual=lib.specinfer_sample_residual)
    c.softmax.restype = None
    c.softmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p]  # logits, rows, V, T, out
    c.sample_softmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_double]   # logits, V, T, u
    c.sample_residual.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double]  # p, q, V, u
    c.sample_softmax.restype = c.sample_residual.restype = ctypes.c_int64
    return c


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray | None:
    """softmax(logits / temperature) over the last axis of float32 ``logits``, in float64 (the
    shaping of ``sampling.probabilities`` with no top-k or top-p cut, in one call of
    ``kernels/shaping.c``: ~10 us for 8k tokens against ~29 in numpy); None where the native
    kernels do not run or the logits are not float32."""
    functions = _shaping()
    if functions is None or logits.dtype != np.float32 or logits.ndim == 0 or logits.shape[-1] == 0:
        return None
    logits = np.ascontiguousarray(logits)
    out = np.empty(logits.shape, np.float64)
    functions.softmax(logits.ctypes.data, logits.size // logits.shape[-1], logits.shape[-1], temperature, out.ctypes.data)
    return out


def can_sample(logits: np.ndarray) -> bool:
    """Whether :func:`sample_softmax` draws from these logits (a float32 row, the library loaded)."""
    return logits.dtype == np.float32 and logits.ndim == 1 and len(logits) > 0 and _shaping() is not None


def sample_softmax(logits: np.ndarray, temperature: float, u: float) -> int:
    """The token drawn with uniform ``u`` from softmax(logits / temperature), as
    ``sampling.sample`` draws it from ``sampling.probabilities`` with no top-k or top-p cut (the
    same inverse CDF, up to float rounding), without writing the distribution: ~10 us cold for 8k
    tokens against ~90; -1 where the logits have no mass. Only where :func:`can_sample`."""
    logits = np.ascontiguousarray(logits)
    return int(_shaping().sample_softmax(logits.ctypes.data, len(logits), temperature, u))


def sample_residual(p: np.ndarray, q: np.ndarray | None, u: float) -> int | None:
    """The token drawn with uniform ``u`` from normalize(max(0, p - q)) (float64 rows), as
    ``sample(residual(p, q))``, or with ``q`` None from normalize(p) (``sampling.inverse_cdf``);
    None where that has no mass or the library does not run (the caller then draws in numpy)."""
    functions = _shaping()
    if (functions is None or p.dtype != np.float64 or p.ndim != 1 or len(p) == 0
            or (q is not None and (q.dtype != np.float64 or q.shape != p.shape))):
        return None
    p = np.ascontiguousarray(p)
    q = None if q is None else np.ascontiguousarray(q)
    token = int(functions.sample_residual(p.ctypes.data, None if q is None else q.ctypes.data, len(p), u))
    return token if token >= 0 else None


def _readers(model) -> tuple[list, dict[str, list[int]], set[str]]:
    """``model``'s nodes, the indices of the nodes reading each value, and its graph outputs' names."""
    nodes = list(model.graph.node)
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(i)
    return nodes, readers, {o.name for o in model.graph.output}


def _with_nodes(model, nodes: list, added: list):
    """A copy of ``model`` running ``nodes`` (as :func:`_with_initializers` keeps its initializers)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return _with_initializers(out, added)


def _with_initializers(out, added: list):
    """``out`` (a rewrite's copy) keeping only the initializers its nodes read, then ``added``,
    and importing the native domain."""
    read = {name for node in out.graph.node for name in node.input}
    kept = [init for init in out.graph.initializer if init.name in read]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept + list(added))
    return _import_domain(out)


def _import_domain(model):
    """``model`` (a rewrite's copy) importing the native domain, which its new nodes use."""
    from onnx import helper

    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def native_ops(model) -> set[str]:
    """The ops of the native domain ``model`` has (its session needs :func:`library` if any)."""
    return {node.op_type for node in model.graph.node if node.domain == DOMAIN}
