"""OpenAI Triton kernels: TreeAttention over the KV cache in place, and the KV commit after verification.

``tree_attention`` follows :mod:`specinfer.plugins.tree_attention` exactly (packed ancestor bits over
the N tree tokens, query i uses mask row N - T + i, the S + T - N keys before the tree always seen,
grouped-query attention). One program owns one KV head of one sequence and a block of rows, each row
a (new token, query head of that KV head's group) pair, so a KV block read from memory serves the
whole group. The cached keys are read where they lie (strided views of the cache, no copy), then the
T new keys; softmax is computed online (flash-attention style) in float32, the two matmuls run on
the tensor cores in the inputs' dtype (fp16 or bf16; fp32 uses IEEE matmuls). The tree is at most
256 tokens here (8 mask words per row) but the kernel itself has no such limit.

``commit_kv`` moves the accepted nodes' K and V of every layer to their final slots
(``kv[:, :, dst[i]] = kv[:, :, src[i]]`` in order, as :meth:`Runtime._move`), one program per
(layer, K|V, chunk of a slot's row); nothing else of the cache is touched.

Both are PyTorch ops (``torch.ops.specinfer.tree_attention_triton`` and ``.commit_kv``);
:func:`use_for_cuda` makes the model's own ``specinfer::tree_attention`` op run the kernel on CUDA
tensors. The same kernel, compiled ahead of time to PTX, is the TensorRT plugin's
(:mod:`specinfer.plugins.tensorrt_plugin`): its arguments are ordered input pointers, int32 scalars,
output pointer, as TensorRT's AOT plugins launch kernels.

Tested here with ``TRITON_INTERPRET=1`` (the interpreter runs the kernels on CPU with numpy) against
the float64 reference; on a GPU only where a test run has one (no GPU on our machines).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional: `pip install specinfer[kernels]` or a GPU image
    triton = tl = None

try:
    import torch
except ImportError:
    torch = None

MAX_TREE_TOKENS = 256  # what the engines and tests are built and checked for
LOG2E = 1.4426950408889634


def available() -> bool:
    return triton is not None and torch is not None


if triton is not None:

    @triton.jit
    def _attend_block(q, K, V, stride_t, start, length, offset, prefix, mask_rows, row_ok, d, d_ok,
                      m_i, l_i, acc, SCALE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """One block of BLOCK_N keys (positions offset + start ... of the S + T) into the online softmax."""
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < length
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K + j[:, None] * stride_t + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V + j[:, None] * stride_t + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * (SCALE * 1.4426950408889634)  # log2(e): exp2 below
        # Visibility: keys before the tree always; tree key t iff bit t of the query's ancestor row.
        tree = j + offset - prefix
        in_tree = tree >= 0
        tree = tl.maximum(tree, 0)
        words = tl.load(mask_rows[:, None] + (tree // 32)[None, :],
                        mask=row_ok[:, None] & (in_tree & j_ok)[None, :], other=0)
        bit = (words >> (tree % 32)[None, :]) & 1
        seen = j_ok[None, :] & ((in_tree == 0)[None, :] | (bit != 0))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def tree_attention_kernel(
        Q, K, V, PK, PV, MASK,                    # inputs: q, k, v [B,T,H,D]; past [B,S,Hkv,D]; mask int32
        T, S, N,                                  # int32 scalars: new tokens, cached tokens, tree tokens
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sp_b, sp_t, sp_h, sm_b, sm_n, so_b, so_t, so_h,
        OUT,                                      # output [B, T, Hq, D]
        HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        b = tl.program_id(1) // HKV
        kvh = tl.program_id(1) % HKV
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = tok < T
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_ok = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sq_b + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=q_ok, other=0.0)
        mask_rows = MASK + b * sm_b + (N - T + tok) * sm_n
        prefix = S + T - N
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        pk = PK + b * sp_b + kvh * sp_h
        pv = PV + b * sp_b + kvh * sp_h
        for start in range(0, S, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, pk, pv, sp_t, start, S, 0, prefix, mask_rows, row_ok, d, d_ok,
                                          m_i, l_i, acc, SCALE, BLOCK_N, IEEE)
        k = K + b * sk_b + kvh * sk_h
        v = V + b * sk_b + kvh * sk_h
        for start in range(0, T, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, k, v, sk_t, start, T, S, prefix, mask_rows, row_ok, d, d_ok,
                                          m_i, l_i, acc, SCALE, BLOCK_N, IEEE)
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # rows past T see nothing and are not stored
        tl.store(OUT + b * so_b + tok[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=q_ok)

    @triton.jit
    def commit_kernel(KV, SRC, DST, P, stride_lk, stride_slot, ROW: tl.constexpr, BLOCK: tl.constexpr):
        """kv[lk, dst[i]] = kv[lk, src[i]] for i = 0 .. P-1 in order, over one chunk of the row."""
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = e < ROW
        base = KV + tl.program_id(0).to(tl.int64) * stride_lk
        for i in range(P):
            src = tl.load(SRC + i)
            dst = tl.load(DST + i)
            x = tl.load(base + src * stride_slot + e, mask=ok)
            tl.store(base + dst * stride_slot + e, x, mask=ok)
            # A later move may overwrite an earlier move's source: every thread finishes move i first.
            tl.debug_barrier()


def block_sizes(rows: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) for ``rows`` = T * group query rows per program column."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 16 if rows <= 16 else 64
    block_n = 64 if block_d <= 64 else 32
    return block_m, block_n, block_d


def tree_attention(q, k, v, past_k, past_v, tree_mask, scale: float):
    """TreeAttention by the Triton kernel. Shapes as :func:`tree_attention_reference`; any strides
    with a contiguous last dimension (the cache is read in place). Returns a new [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    hkv, s, n = k.shape[2], past_k.shape[1], tree_mask.shape[1]
    if hq % hkv or not t <= n <= s + t or tree_mask.shape[2] != -(-n // 32):
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, past {tuple(past_k.shape)}, "
                         f"mask {tuple(tree_mask.shape)}")
    q, k, v, past_k, past_v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, past_k, past_v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    if past_k.stride() != past_v.stride():
        past_k, past_v = past_k.contiguous(), past_v.contiguous()
    mask = tree_mask.to(torch.int32).contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group = hq // hkv
    block_m, block_n, block_d = block_sizes(t * group, d)
    grid = (triton.cdiv(t * group, block_m), b * hkv)
    tree_attention_kernel[grid](
        q, k, v, past_k, past_v, mask, t, s, n,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        past_k.stride(0), past_k.stride(1), past_k.stride(2), mask.stride(0), mask.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out,
        HKV=hkv, GROUP=group, HEAD_DIM=d, SCALE=float(scale),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
    )
    return out


def commit_kv(kv, src, dst) -> None:
    """In place: ``kv[:, :, dst[i]] = kv[:, :, src[i]]`` in order, for a contiguous
    kv [L, 2, capacity, Hkv, D]; ``src``/``dst`` int sequences or tensors, sources increasing and
    at or after their destinations (what :meth:`Runtime.commit` asks for)."""
    src = torch.as_tensor(src, dtype=torch.int64, device=kv.device)
    dst = torch.as_tensor(dst, dtype=torch.int64, device=kv.device)
    if len(src) == 0:
        return
    if not kv.is_contiguous():
        raise ValueError("commit_kv needs a contiguous KV buffer")
    row = kv.shape[3] * kv.shape[4]
    block = min(1024, triton.next_power_of_2(row))
    grid = (kv.shape[0] * kv.shape[1], triton.cdiv(row, block))
    commit_kernel[grid](kv, src, dst, len(src), kv.stride(1), kv.stride(2), ROW=row, BLOCK=block)


# --- PyTorch ops ----------------------------------------------------------------------------------
if available():

    @torch.library.custom_op("specinfer::tree_attention_triton", mutates_args=())
    def tree_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                          past_v: torch.Tensor, tree_mask: torch.Tensor, num_heads: int, num_kv_heads: int,
                          scale: float) -> torch.Tensor:
        """``specinfer::tree_attention`` (same signature) by the Triton kernel."""
        return tree_attention(q, k, v, past_k, past_v, tree_mask, scale)

    @tree_attention_op.register_fake
    def _(q, k, v, past_k, past_v, tree_mask, num_heads, num_kv_heads, scale):
        return torch.empty_like(q)

    @torch.library.custom_op("specinfer::commit_kv", mutates_args=("kv",))
    def commit_kv_op(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move accepted nodes' KV to their final slots, in place (see :func:`commit_kv`)."""
        commit_kv(kv, src, dst)

_CUDA_REGISTERED = False


def use_for_cuda() -> None:
    """Make ``specinfer::tree_attention`` (what the model calls) run the Triton kernel on CUDA
    tensors. CPU tensors keep the SDPA implementation. Idempotent."""
    global _CUDA_REGISTERED
    if not available():
        raise RuntimeError("the Triton kernels need `triton` and `torch` (pip install specinfer[kernels])")
    if not _CUDA_REGISTERED:
        from .tree_attention_torch import tree_attention as op

        op.register_kernel("cuda")(lambda q, k, v, pk, pv, m, hq, hkv, scale: tree_attention(q, k, v, pk, pv, m, scale))
        _CUDA_REGISTERED = True
