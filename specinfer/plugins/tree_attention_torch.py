"""TreeAttention as a PyTorch custom op (``torch.ops.specinfer.tree_attention``): the model runs it
eagerly and the ONNX exporter sees one node it maps to ``specinfer::TreeAttention``.

Kept apart from :mod:`specinfer.plugins.tree_attention` (numpy: the mask layout and the reference)
so that the ONNX Runtime path, the server and the client never import torch.
"""
from __future__ import annotations

import torch

from .tree_attention import BITS_PER_WORD


def _visibility_torch(tree_mask: torch.Tensor, num_new: int, past_len: int) -> torch.Tensor:
    b, n, _ = tree_mask.shape
    j = torch.arange(n, device=tree_mask.device)
    words = tree_mask[:, n - num_new:].to(torch.int64) & 0xFFFFFFFF  # as unsigned 32-bit
    bits = (words[..., j // BITS_PER_WORD] >> (j % BITS_PER_WORD)) & 1
    prefix = torch.ones(b, num_new, past_len + num_new - n, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, bits.bool()], dim=-1)


@torch.library.custom_op("specinfer::tree_attention", mutates_args=())
def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    tree_mask: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """TreeAttention in PyTorch (SDPA with a dense bool mask built from the packed bits)."""
    t = q.shape[1]
    keys = torch.cat([past_k, k], dim=1).transpose(1, 2)  # [B, Hkv, S+T, D]
    values = torch.cat([past_v, v], dim=1).transpose(1, 2)
    mask = _visibility_torch(tree_mask, t, past_k.shape[1])[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.transpose(1, 2).contiguous()


@tree_attention.register_fake
def _(q, k, v, past_k, past_v, tree_mask, num_heads, num_kv_heads, scale):
    return torch.empty_like(q)
