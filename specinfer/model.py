"""The Llama family (Llama 2/3, Mistral, Qwen2) in plain PyTorch, with tree attention.

One forward scores a whole token tree: T new tokens with explicit positions, their packed ancestor
mask (see :mod:`specinfer.plugins.tree_attention`) and the KV cache of everything before them.
It returns the logits of every new token and the new tokens' keys and values; the caller (a
Runtime) decides where they live in the cache. Module and parameter names follow Hugging Face's,
so a checkpoint's state dict loads as it is.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.onnx.ops
from torch import nn
from torch.nn import functional as F

from .config import ModelConfig, load_config
from .errors import SpecInferError
from .plugins.tree_attention_torch import tree_attention


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with linear or llama3 scaling as transformers computes them."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """RoPE as in HF Llama (rotate-half, not interleaved) on [B, T, heads * D], cos/sin [B, T, D/2]:
    the ONNX ``RotaryEmbedding`` op, which PyTorch also runs eagerly."""
    return torch.onnx.ops.rotary_embedding(x, cos, sin, num_heads=num_heads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        # Qwen2 puts biases on q/k/v but never on o_proj.
        o_bias = c.attention_bias and c.model_type != "qwen2"
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=o_bias)

    def forward(self, x, cos, sin, tree_mask, past_k, past_v):
        b, t, _ = x.shape
        # One ONNX RotaryEmbedding node each (not ~7 elementwise nodes): on a CPU, small models
        # pay per node.
        q = rotary_embedding(self.q_proj(x), cos, sin, num_heads=self.num_heads).view(b, t, self.num_heads, self.head_dim)
        k = rotary_embedding(self.k_proj(x), cos, sin, num_heads=self.num_kv_heads).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        out = tree_attention(q, k, v, past_k, past_v, tree_mask,
                             self.num_heads, self.num_kv_heads, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.reshape(b, t, -1)), k, v


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, tree_mask, past_k, past_v):
        h, k, v = self.self_attn(self.input_layernorm(x), cos, sin, tree_mask, past_k, past_v)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaModel(nn.Module):
    """A causal LM of the Llama family whose attention is TreeAttention."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,         # int64 [B, T]
        position_ids: torch.Tensor,      # int64 [B, T]
        tree_mask: torch.Tensor,         # int32 [B, N, ceil(N/32)]
        past_keys: list[torch.Tensor],   # per layer [B, S, Hkv, D]
        past_values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Logits [B, T, V] (float32) and the new tokens' keys and values, per layer [B, T, Hkv, D]."""
        x = self.model.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, D/2], in float32 as HF
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        new_keys, new_values = [], []
        for layer, pk, pv in zip(self.model.layers, past_keys, past_values):
            x, k, v = layer(x, cos, sin, tree_mask, pk, pv)
            new_keys.append(k)
            new_values.append(v)
        logits = self.lm_head(self.model.norm(x)).float()
        return logits, new_keys, new_values


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        extra = " (pytorch_model.bin is not supported: save the model with safe_serialization)" \
            if (model_dir / "pytorch_model.bin").exists() else ""
        raise SpecInferError(f"no *.safetensors weights in {model_dir}{extra}")
    weights = {}
    for f in files:
        if not f.is_file():
            raise SpecInferError(f"weight shard missing: {f}")
        weights.update(load_file(f))
    return weights


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """Load a Hugging Face checkpoint folder into :class:`LlamaModel` (no network)."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    weights = _read_weights(model_dir)
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = set(model.state_dict().keys())
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - weights.keys())
    if missing:
        raise SpecInferError(f"checkpoint {model_dir} lacks weights: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(k for k in weights.keys() - expected if "rotary_emb" not in k)
    if unexpected:
        raise SpecInferError(f"checkpoint {model_dir} has weights this model does not use: "
                             f"{', '.join(unexpected[:5])} (an unsupported feature?)")
    model.load_state_dict({k: weights[k] for k in expected}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype).eval()
    model.inv_freq = rope_inv_freq(config)  # RoPE stays float32 whatever the weights' dtype, as in HF
    return model
