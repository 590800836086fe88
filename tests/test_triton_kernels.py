"""The OpenAI Triton kernels (tree attention, KV commit) against the float64 reference and Runtime._move.

On a CUDA GPU they run there; elsewhere in Triton's interpreter (TRITON_INTERPRET=1: the same kernel
code executed with numpy on CPU). Tolerances, max |kernel - reference| on outputs of magnitude ~1,
the reference fed the very inputs the kernel saw (rounded to its dtype): fp32 1e-5, fp16 2e-3,
bf16 2e-2 (GPU only: numpy, hence the interpreter, has no bfloat16).
"""
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first import of the kernels: @triton.jit reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="OpenAI Triton is not installed (pip install 'specinfer[kernels]')")

from specinfer.plugins import triton_kernels as tk  # noqa: E402
from specinfer.plugins.tree_attention import ancestor_matrix, pack_bits, tree_attention_reference  # noqa: E402
from specinfer.plugins.tree_attention_torch import tree_attention  # noqa: E402

INTERPRETED = type(tk.tree_attention_kernel).__name__ == "InterpretedFunction"
if not CUDA and not INTERPRETED:
    pytestmark = pytest.mark.skip(reason="the kernels were imported before TRITON_INTERPRET=1 was set (no GPU here)")
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none here)")

# (batch, new tokens T, earlier tree tokens N - T, committed prefix, query heads, KV heads, head dim)
SHAPES = [
    (1, 1, 0, 0, 4, 4, 16),      # first token
    (1, 1, 0, 37, 8, 2, 64),     # one decode step over a cache, GQA 4:1
    (2, 5, 0, 7, 4, 2, 16),      # batch 2
    (1, 40, 0, 3, 8, 2, 8),      # head dim below 16
    (1, 3, 6, 10, 6, 3, 32),     # N > T: an SSM growing its tree
    (2, 70, 0, 33, 4, 1, 16),    # multi-query, mask words > 2
    (1, 100, 30, 65, 4, 2, 32),  # N = 130
    (1, 256, 0, 100, 4, 2, 64),  # the largest tree
    (1, 64, 192, 50, 2, 1, 16),  # N = 256 with T = 64
    (1, 17, 0, 0, 12, 4, 80),    # prefill, head dim 80
    (1, 8, 0, 20, 8, 8, 128),    # head dim 128
]


def random_parents(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def make_case(shape, dtype, seed=0):
    b, t, extra, past, hq, hkv, d = shape
    rng = np.random.default_rng(seed)
    n, s = t + extra, past + extra  # the cache holds the committed prefix and the earlier tree tokens
    mask = np.broadcast_to(pack_bits(ancestor_matrix(random_parents(rng, n))), (b, n, -(-n // 32))).copy()
    f = lambda *sh: torch.from_numpy(rng.standard_normal(sh).astype(np.float32)).to(dtype)
    return [f(b, t, hq, d), f(b, t, hkv, d), f(b, t, hkv, d), f(b, s, hkv, d), f(b, s, hkv, d), torch.from_numpy(mask)]


def check(case, dtype, got):
    want = tree_attention_reference(*[x.float().numpy() for x in case[:5]], case[5].numpy())
    assert got.dtype == dtype and got.shape == case[0].shape
    assert np.abs(got.float().cpu().numpy() - want).max() < TOL[dtype]


bf16_gpu = pytest.mark.skipif(not CUDA, reason="bf16 needs a CUDA GPU: the interpreter computes with numpy, "
                                                "which has no bfloat16")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=bf16_gpu)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-N{}-S{}-H{}/{}-D{}".format(
    s[0], s[1], s[1] + s[2], s[3] + s[2], *s[4:]))
def test_tree_attention_kernel_matches_reference(shape, dtype):
    case = make_case(shape, dtype)
    d = shape[-1]
    got = tk.tree_attention(*(x.to(DEVICE) for x in case), d ** -0.5)
    check(case, dtype, got)


def test_reads_the_cache_in_place():
    """The past as strided views of a [L, 2, capacity, Hkv, D] buffer, as the runtimes pass it."""
    q, k, v, pk, pv, mask = make_case((1, 6, 0, 0, 4, 2, 16), torch.float32, seed=3)
    cache = torch.randn(2, 2, 50, 2, 16)
    past_k, past_v = cache[1, 0, :21][None], cache[1, 1, :21][None]
    assert past_k.data_ptr() == cache[1, 0].data_ptr()
    case = [q, k, v, past_k, past_v, mask]
    check(case, torch.float32, tk.tree_attention(*(x.to(DEVICE) for x in case), 0.25 * 1.0))


def test_torch_op_equals_the_sdpa_op():
    case = make_case((2, 9, 4, 11, 4, 2, 16), torch.float32, seed=5)
    args = [x.to(DEVICE) for x in case] + [4, 2, 0.25]
    got = torch.ops.specinfer.tree_attention_triton(*args)
    want = tree_attention(*[x.cpu() if isinstance(x, torch.Tensor) else x for x in args])
    assert (got.cpu() - want).abs().max() < 1e-5


def move_reference(kv, src, dst):
    """Runtime._move, verbatim: in order, one slot at a time."""
    kv = kv.copy()
    for s, d in zip(src, dst):
        kv[:, :, d] = kv[:, :, s]
    return kv


@pytest.mark.parametrize("layers, hkv, d, length, path, pending", [
    (3, 2, 8, 4, [0, 2, 3, 5], 8),             # a branch: 2 -> 5, 3 -> 6, 5 -> 7 overlapping
    (1, 1, 16, 0, [1], 3),                     # one move at the start of the cache
    (2, 4, 512, 10, [0, 3, 4, 9], 12),         # a slot's row spans 2 program chunks (2048 values)
    (2, 2, 16, 30, list(range(0, 200, 2)), 220),  # a long path with gaps
])
def test_commit_kernel_matches_runtime_move(layers, hkv, d, length, path, pending):
    rng = np.random.default_rng(len(path))
    kv = rng.standard_normal((layers, 2, length + pending + 3, hkv, d)).astype(np.float32)
    src = length + np.asarray(path)
    dst = length + np.arange(len(path))
    moved = src != dst
    want = move_reference(kv, src[moved], dst[moved])
    buffer = torch.from_numpy(kv).to(DEVICE)
    address = buffer.data_ptr()
    torch.ops.specinfer.commit_kv(buffer, torch.as_tensor(src[moved]), torch.as_tensor(dst[moved]))
    assert buffer.data_ptr() == address  # in place
    assert np.array_equal(buffer.cpu().numpy(), want)


def test_commit_nothing_and_errors():
    kv = torch.zeros(1, 2, 4, 2, 16, device=DEVICE)
    tk.commit_kv(kv, [], [])
    with pytest.raises(ValueError, match="contiguous"):
        tk.commit_kv(kv.transpose(3, 4), [2], [1])
    with pytest.raises(ValueError, match="bad shapes"):
        case = make_case((1, 4, 0, 2, 4, 2, 16), torch.float32)
        tk.tree_attention(*case[:5], case[5][:, :2], 0.25)  # mask of 2 tree tokens for 4 new ones


@gpu
@pytest.mark.gpu
def test_torch_gpu_runtime_matches_cpu(checkpoints):
    """The model on CUDA with both kernels (fp32, IEEE matmuls) against the CPU reference runtime."""
    from specinfer.engines.torch_gpu_runtime import TorchGpuRuntime
    from specinfer.engines.torch_runtime import TorchRuntime

    gpu_rt = TorchGpuRuntime(checkpoints["llama3"], max_context=256, dtype=torch.float32)
    cpu_rt = TorchRuntime(checkpoints["llama3"], max_context=256)
    prompt = [1, 50, 51, 52, 53, 54, 55, 56]
    for rt in (gpu_rt, cpu_rt):
        rt.start("s")
        rt.prefill("s", prompt)
    a = [rt.score("s", [10, 20, 30], [-1, 0, 0]) for rt in (gpu_rt, cpu_rt)]
    b = [rt.score("s", [40, 41, 42], [2, 2, 3]) for rt in (gpu_rt, cpu_rt)]
    for rt in (gpu_rt, cpu_rt):
        rt.commit("s", [0, 2, 3, 5])
    c = [rt.score("s", [7]) for rt in (gpu_rt, cpu_rt)]
    for got, want in (a, b, c):
        assert np.abs(got - want).max() < 1e-3


@gpu
@pytest.mark.gpu
def test_kernel_timing_smoke():
    """A 256-token tree over a 4k cache, fp16, Llama-8B-like heads: runs and stays finite."""
    case = make_case((1, 256, 0, 4096, 32, 8, 128), torch.float16)
    out = tk.tree_attention(*(x.cuda() for x in case), 128 ** -0.5)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
