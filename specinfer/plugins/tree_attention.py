"""TreeAttention: the one attention op of specinfer, its semantics and reference implementations.

Semantics (written once; the ONNX function, the GPU kernel and the TensorRT plugin all follow it):

    query      [B, T, Hq, D]      the T new tokens (RoPE applied)
    key, value [B, T, Hkv, D]     their keys and values (RoPE applied to keys)
    past_key, past_value [B, S, Hkv, D]   every token already in the KV cache
    tree_mask  int32 [B, N, ceil(N / 32)], T <= N <= S + T
    out        [B, T, Hq, D]

The last N keys (of the S + T) are the *token tree* under construction; the S + T - N keys before
them are the committed prefix, which every new token sees. Row ``r`` of ``tree_mask`` is tree token
``r``'s ancestor set, packed as bits: bit ``j % 32`` of word ``j // 32`` is set iff tree token ``j``
is ``r`` itself or one of its ancestors. The T queries are the last T tree tokens, so query ``i``
uses row ``N - T + i``. New token i therefore attends to every committed token and, inside the tree,
only to itself and its ancestors.

N = T is the usual case (the LLM verifying a whole tree, one incremental step, a prefill).
N > T lets a speculative model grow its tree one depth per call: the frontier attends to its
ancestors scored by earlier calls, which are still in the cache but not committed.

Grouped-query attention: query head h reads KV head ``h // (Hq // Hkv)``. ``scale`` multiplies
``q . k`` (normally ``1 / sqrt(D)``). The bit layout is TensorRT-LLM's packed spec-decoding mask.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

BITS_PER_WORD = 32


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """Dense bool [N, N]: ``m[i, j]`` iff j is i or an ancestor of i. ``parents[i] < i`` or -1."""
    n = len(parents)
    if n == 1 and parents[0] == -1:   # an incremental step
        return np.array([[True]])
    if list(parents) == list(range(-1, n - 1)):   # a chain (a prompt): causal
        return np.tri(n, dtype=bool)
    parents = np.asarray(parents, dtype=np.int64)
    m = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: parents must come before children")
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """Pack a bool [..., N, N] ancestor matrix into int32 [..., N, ceil(N/32)] words (bit j of word
    w is column 32 w + j)."""
    n = mask.shape[-1]
    words = -(-n // BITS_PER_WORD)
    padded = np.zeros(mask.shape[:-1] + (words * BITS_PER_WORD,), dtype=bool)
    padded[..., :n] = mask
    packed = np.packbits(padded, axis=-1, bitorder="little")  # bytes, lowest column first
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32)


def unpack_bits(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: int32 [..., W] -> bool [..., n]."""
    j = np.arange(n)
    words = packed.view(np.uint32)[..., j // BITS_PER_WORD]
    return ((words >> (j % BITS_PER_WORD).astype(np.uint32)) & 1).astype(bool)


def tree_mask_from_parents(parents: Sequence[int]) -> np.ndarray:
    """The packed tree mask of one tree, int32 [N, ceil(N/32)]."""
    return pack_bits(ancestor_matrix(parents))


def visibility(tree_mask: np.ndarray, num_new: int, past_len: int) -> np.ndarray:
    """Dense bool [B, T, S + T] of which keys each new query sees (the semantics above)."""
    b, n, _ = tree_mask.shape
    total = past_len + num_new
    if not num_new <= n <= total:
        raise ValueError(f"tree_mask covers {n} tree tokens; need {num_new} <= N <= {total}")
    rows = unpack_bits(tree_mask[:, n - num_new:], n)  # [B, T, N]
    prefix = np.ones((b, num_new, total - n), dtype=bool)
    return np.concatenate([prefix, rows], axis=-1)


def tree_attention_reference(q, k, v, past_k, past_v, tree_mask, scale: float | None = None):
    """Plain numpy TreeAttention in float64: the oracle for every other implementation."""
    q, k, v, past_k, past_v = (np.asarray(x, dtype=np.float64) for x in (q, k, v, past_k, past_v))
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keys = np.concatenate([past_k, k], axis=1).repeat(hq // hkv, axis=2)  # [B, S+T, Hq, D]
    values = np.concatenate([past_v, v], axis=1).repeat(hq // hkv, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, keys) * scale
    seen = visibility(np.asarray(tree_mask), t, past_k.shape[1])[:, None]  # [B, 1, T, S+T]
    scores = np.where(seen, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", weights, values)
