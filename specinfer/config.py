"""The model configuration we support, read from a Hugging Face ``config.json``.

One dataclass for the whole Llama family (Llama 2/3, Mistral, Qwen2). Anything outside what the
model implements gets a :class:`SpecInferError` that names the field, never a silent wrong answer.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .errors import SpecInferError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # the llama3 / linear parameters, None for plain RoPE
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token holds in the cache, over all layers, in float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _rope(raw: dict) -> tuple[float, dict | None]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise SpecInferError(
            f"unsupported RoPE scaling '{rope_type}' (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    return theta, params


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a ``config.json`` dict and turn it into a :class:`ModelConfig`."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecInferError(
            f"unsupported model_type '{model_type}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise SpecInferError(f"unsupported hidden_act '{act}' (only silu)")
    if raw.get("pretraining_tp", 1) != 1:
        raise SpecInferError("unsupported pretraining_tp != 1")
    num_heads = raw["num_attention_heads"]
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise SpecInferError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    theta, scaling = _rope(raw)
    # Qwen2 always has q/k/v biases; Llama and Mistral say so with `attention_bias`.
    attention_bias = True if model_type == "qwen2" else bool(raw.get("attention_bias", False))
    sliding = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        attention_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=sliding,
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``MODEL_DIR/config.json`` (and ``generation_config.json`` for EOS ids, if present)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SpecInferError(f"model folder not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise SpecInferError(f"no config.json in {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecInferError(f"{path} is not valid JSON: {e}") from None
    gen = model_dir / "generation_config.json"
    if gen.is_file() and raw.get("eos_token_id") is None:
        raw["eos_token_id"] = json.loads(gen.read_text()).get("eos_token_id")
    try:
        return parse_config(raw)
    except KeyError as e:
        raise SpecInferError(f"{path} lacks the field {e.args[0]}") from None


def check_context(config: ModelConfig, max_context: int) -> None:
    """Refuse a context that the model cannot attend over exactly."""
    if config.sliding_window is not None and max_context > config.sliding_window:
        raise SpecInferError(
            f"sliding-window attention is not supported: max context {max_context} exceeds the "
            f"model's sliding_window {config.sliding_window}; use --max-context {config.sliding_window} or less"
        )
