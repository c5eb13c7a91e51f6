"""The decoder configuration, read from a Hugging Face ``config.json``.

One dataclass covers every supported Llama-family architecture; the
differences between them (biases, q/k norms, RoPE scaling, sliding window,
tied embeddings) are explicit fields so the decoder has no per-architecture
branches beyond reading them. Anything we would silently get wrong is refused
with :class:`UnsupportedArchitectureError` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from saguaro_ray.errors import ConfigError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map a dtype name (``"bf16"``, ``"float16"``, ...) to a torch dtype."""
    if value is None or value == "auto":
        return default
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {value!r}; choose one of {sorted(set(_DTYPES))}") from None


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    checkpoint_dtype: str | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "DecoderConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedArchitectureError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv:
            raise UnsupportedArchitectureError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
            )
        rope_theta, rope_scaling = _read_rope(cfg, source)
        sliding_window = _read_sliding_window(cfg, model_type, source)
        attention_bias = bool(cfg.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = attention_bias
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )


def _read_rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the classic (``rope_theta`` +
    ``rope_scaling``) or the newer ``rope_parameters`` layout."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params or None
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"{source}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            return theta, None
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": rope_type}
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError(f"{source}: partial_rotary_factor != 1 is not supported")
    return theta, scaling


def _read_sliding_window(cfg: dict[str, Any], model_type: str, source: str) -> int | None:
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        # Qwen only applies the window when use_sliding_window is set, and then
        # only to some layers; we refuse that rather than approximate it.
        if cfg.get("use_sliding_window"):
            raise UnsupportedArchitectureError(f"{source}: use_sliding_window=true is not supported for {model_type}")
        return None
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types) and model_type != "mistral":
        raise UnsupportedArchitectureError(f"{source}: per-layer attention types {set(layer_types)} are not supported")
    return int(window) if window else None
