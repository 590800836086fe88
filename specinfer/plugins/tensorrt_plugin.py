"""The TensorRT plugin that runs each ``specinfer::TreeAttention`` node: ``tensorrt.plugin``, ahead of time.

Why the Python plugin API with an ahead-of-time (AOT) implementation rather than a C++ IPluginV3:
the kernel is OpenAI Triton (the same source the PyTorch runtime and the tests run), and
``@trtp.aot_impl`` hands TensorRT that kernel compiled to PTX at build time, so the PTX is baked
into the engine and the engine runs without Python (``trtexec``, the Triton server's TensorRT
backend). An IPluginV3 would add a C++ library, its build (CUDA toolkit, TensorRT headers) and a
second kernel source to keep equal to the tested one. We register no JIT ``@trtp.impl``: with AOT
alone, TensorRT needs no preference flag to choose and no engine ever depends on Python.

How the ONNX node maps onto the plugin: op type ``TreeAttention`` is the plugin's name; the node's
``plugin_namespace`` attribute (``specinfer``, which also makes the parser take the plugin over the
model-local function) is its namespace; the other attributes ``num_heads``, ``num_kv_heads`` and
``scale`` are its fields. TensorRT does not serialize an AOT plugin's fields, so everything the kernel
needs from them (group size, KV heads, head dim, scale) is baked into the PTX as constexprs; the
shapes (T, S, N and the strides) are int32 extra arguments computed from symbolic shapes at run time.
Kernel parameters follow TensorRT's AOT convention: input pointers, int32 scalars, output pointer.

Untested here: TensorRT cannot be installed on our machines. What runs here: the PTX compile of the
exact kernel and signature (for sm_80 and sm_90, checked by ptxas), and the launch arithmetic.
This module imports without TensorRT; :func:`register_plugin` needs it.
"""
# No `from __future__ import annotations`: tensorrt.plugin inspects real annotation objects.
import re
from typing import List, Tuple, Union

from ..errors import SpecInferError
from . import onnx_function

PLUGIN_NAME = onnx_function.OP_TYPE          # "TreeAttention"
PLUGIN_NAMESPACE = onnx_function.DOMAIN      # "specinfer"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
FIELDS = ("num_heads", "num_kv_heads", "scale")
INPUTS = ("Q", "K", "V", "PK", "PV", "MASK")
SCALARS = ("T", "S", "N", "sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sp_b", "sp_t", "sp_h",
           "sm_b", "sm_n", "so_b", "so_t", "so_h")
OUTPUTS = ("OUT",)
CONSTEXPRS = ("HKV", "GROUP", "HEAD_DIM", "SCALE", "BLOCK_M", "BLOCK_N", "BLOCK_D", "IEEE")
TACTICS = {1: 16, 2: 64}  # tactic -> rows per program (BLOCK_M): small trees / decode, large trees / prefill
NUM_WARPS, NUM_STAGES = 4, 2


def kernel_signature(dtype: str) -> dict:
    """Triton signature of the plugin's kernel for ``dtype`` ('fp16' or 'bf16')."""
    ptr = f"*{dtype}"
    sig = {name: ptr for name in INPUTS[:5]}
    sig["MASK"] = "*i32"
    sig.update({name: "i32" for name in SCALARS})
    sig["OUT"] = ptr
    sig.update({name: "constexpr" for name in CONSTEXPRS})
    return sig


def constexprs(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_m: int) -> dict:
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return dict(HKV=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, SCALE=float(scale),
                BLOCK_M=block_m, BLOCK_N=64 if block_d <= 64 else 32, BLOCK_D=block_d, IEEE=False)


def launch_args(q_shape, past_shape, mask_shape, num_heads: int, num_kv_heads: int, block_m: int):
    """(grid, scalar args) for contiguous tensors, from shapes that are ints or TensorRT symbolic
    expressions alike (both support +, * and //)."""
    b, t, _, d = q_shape
    s, n, w = past_shape[1], mask_shape[1], mask_shape[2]
    q_row, kv_row = d * num_heads, d * num_kv_heads  # symbolic operand first: expressions have no __rmul__
    scalars = [t, s, n,
               t * q_row, q_row, d,      # query
               t * kv_row, kv_row, d,    # new key/value
               s * kv_row, kv_row, d,    # past key/value
               n * w, w,                 # mask
               t * q_row, q_row, d]      # output
    grid = ((t * (num_heads // num_kv_heads) + (block_m - 1)) // block_m, b * num_kv_heads)
    return grid, scalars


def drop_unused_params(ptx: str, name: str, keep: int) -> str:
    """Remove the entry's parameters after the first ``keep``. Triton >= 3.3 appends scratch pointers
    (global, profile) that its own launcher passes as null; TensorRT passes exactly inputs, extra
    args and outputs, so they must go, and may only if the kernel never reads them."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise SpecInferError(f"no .entry {name} in the PTX")
    params = [p.strip() for p in m.group(1).split(",") if p.strip()]
    if len(params) < keep:
        raise SpecInferError(f"kernel {name} has {len(params)} parameters, expected at least {keep}")
    body = ptx[m.end():]
    for i in range(keep, len(params)):
        if f"[{name}_param_{i}]" in body:
            raise SpecInferError(f"kernel {name} uses its parameter {i} (scratch memory): cannot launch from TensorRT")
    return ptx[:m.start(1)] + "\n\t" + ",\n\t".join(params[:keep]) + "\n" + ptx[m.end(1):]


def driver_ptx_version() -> Union[int, None]:
    """The newest PTX ISA the installed CUDA driver JIT-compiles (Triton's numbering, 85 = 8.5), or None.
    TensorRT hands our PTX to the driver, so the PTX must not be newer than the driver; Triton would
    otherwise write the ISA of the ptxas it bundles. ``SPECINFER_PTX_VERSION`` overrides."""
    import ctypes
    import os

    if os.environ.get("SPECINFER_PTX_VERSION"):
        return int(os.environ["SPECINFER_PTX_VERSION"])
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except OSError:
        return None
    from triton.backends.nvidia.compiler import ptx_get_version

    return ptx_get_version(f"{version.value // 1000}.{version.value % 1000 // 10}")


def compile_ptx(dtype: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_m: int,
                target=None, ptx_version: Union[int, None] = None) -> Tuple[str, str, object]:
    """Compile the tree-attention kernel to PTX: (kernel name, PTX, Triton metadata). ``target`` is a
    ``triton.backends.compiler.GPUTarget`` (default: the current GPU); ``ptx_version`` the PTX ISA
    (default: Triton's)."""
    import triton
    from triton.compiler import ASTSource

    from . import triton_kernels

    if not hasattr(triton_kernels.tree_attention_kernel, "arg_names") or \
            type(triton_kernels.tree_attention_kernel).__name__ == "InterpretedFunction":
        raise SpecInferError("the kernel was loaded under TRITON_INTERPRET=1: it cannot be compiled to PTX")
    src = ASTSource(fn=triton_kernels.tree_attention_kernel, signature=kernel_signature(dtype),
                    constexprs=constexprs(num_heads, num_kv_heads, head_dim, scale, block_m))
    target = target or triton.runtime.driver.active.get_current_target()
    options = {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    if ptx_version:
        options["ptx_version"] = ptx_version
    kernel = triton.compile(src, target=target, options=options)
    meta = kernel.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise SpecInferError("the tree-attention kernel needs scratch memory: TensorRT's AOT plugins cannot pass it")
    keep = len(INPUTS) + len(SCALARS) + len(OUTPUTS)
    return meta.name, drop_unused_params(kernel.asm["ptx"], meta.name, keep), meta


_REGISTERED = False


def register_plugin() -> None:
    """Register ``specinfer::TreeAttention`` with TensorRT's plugin registry (idempotent). Must run in
    the building process before the ONNX parser sees the model; an engine built with it needs nothing
    at run time."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise SpecInferError(f"TensorRT's Python plugin API is not available ({e}): install TensorRT 11 "
                             "(pip install 'specinfer[tensorrt]') on a machine with an NVIDIA GPU") from None
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SpecInferError("the TreeAttention plugin's kernel is compiled by OpenAI Triton, which is not installed: "
                             "pip install 'specinfer[kernels]' (or build with --attention native)") from None
    dtypes = {trt.float16: "fp16", trt.bfloat16: "bf16"}

    @trtp.register(PLUGIN_ID)
    def tree_attention_desc(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                            past_key: trtp.TensorDesc, past_value: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                            num_heads: int, num_kv_heads: int, scale: float) -> trtp.TensorDesc:
        return query.like()

    @trtp.autotune(PLUGIN_ID)
    def tree_attention_autotune(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                                past_key: trtp.TensorDesc, past_value: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                                outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        act = "FP16|BF16"
        return [trtp.AutoTuneCombination(", ".join([act] * 5 + ["INT32", act]), "LINEAR", list(TACTICS))]

    @trtp.aot_impl(PLUGIN_ID)
    def tree_attention_aot(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                           past_key: trtp.TensorDesc, past_value: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                           num_heads: int, num_kv_heads: int, scale: float, outputs: Tuple[trtp.TensorDesc],
                           tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                                 trtp.SymExprs]:
        if query.dtype not in dtypes:
            raise ValueError(f"TreeAttention plugin runs fp16 or bf16, not {query.dtype}")
        head_dim = query.shape_expr[3]
        if not head_dim.is_constant:
            raise ValueError("TreeAttention plugin needs a static head dimension")
        block_m = TACTICS.get(tactic, TACTICS[2])
        name, ptx, meta = compile_ptx(dtypes[query.dtype], num_heads, num_kv_heads, head_dim.constant_value(),
                                      scale, block_m, ptx_version=driver_ptx_version())
        grid, scalars = launch_args(query.shape_expr, past_key.shape_expr, tree_mask.shape_expr,
                                    num_heads, num_kv_heads, block_m)
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y = grid
        params.block_x = meta.num_warps * 32
        params.shared_mem = meta.shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(x) for x in scalars])
        return name.encode(), ptx.encode(), params, extra

    _REGISTERED = True
