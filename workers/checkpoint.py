"""Loading Hugging Face checkpoint directories into our decoder.

A checkpoint directory holds ``config.json``, the weights as one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``,
and tokenizer files. Everything is validated up front — a missing file or an
unsupported architecture raises a specific error naming it before any weight
is read. Weights are read tensor by tensor from memory-mapped safetensors and
copied straight into the (possibly fused) destination parameter, so the full
checkpoint is never materialised twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from saguaro_ray.errors import CheckpointError
from saguaro_ray.workers.decoder import Decoder
from saguaro_ray.workers.model_config import DecoderConfig
from saguaro_ray.workers.rope import Rotary

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: DecoderConfig
    weight_map: dict[str, str]  # tensor name -> file name

    @property
    def weight_files(self) -> list[Path]:
        return [self.path / f for f in sorted(set(self.weight_map.values()))]


def open_checkpoint(path: str | os.PathLike, require_tokenizer: bool = True) -> Checkpoint:
    """Validate a checkpoint directory and read its config and weight index."""
    if isinstance(path, str) and path.startswith("zoo:"):
        from saguaro_ray.zoo import resolve_model_path  # builds the family on first use

        root = resolve_model_path(path)
    else:
        root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"model directory {str(root)!r} does not exist")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{root}: config.json is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_file}: unreadable config ({exc})") from exc
    config = DecoderConfig.from_hf(cfg, source=str(cfg_file))
    weight_map = _weight_map(root)
    if require_tokenizer and not any((root / f).is_file() for f in _TOKENIZER_FILES):
        raise CheckpointError(f"{root}: no tokenizer file (expected one of {', '.join(_TOKENIZER_FILES)})")
    return Checkpoint(path=root, config=config, weight_map=weight_map)


def _weight_map(root: Path) -> dict[str, str]:
    index = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc})") from exc
        missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if missing:
            raise CheckpointError(f"{root}: shard files listed in the index are missing: {', '.join(missing)}")
        return dict(weight_map)
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single.name for name in f.keys()}
    if any(root.glob("*.bin")) or any(root.glob("*.pt")):
        raise CheckpointError(f"{root}: only safetensors weights are supported (found pickle .bin/.pt files)")
    raise CheckpointError(f"{root}: no weights found (expected model.safetensors or model.safetensors.index.json)")


def _hf_to_ours(cfg: DecoderConfig) -> dict[str, tuple[str, Callable[[torch.Tensor], slice] | None]]:
    """HF tensor name → (our parameter name, where it lands in a fused parameter)."""
    h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q_rows = slice(0, h * d)
    k_rows = slice(h * d, (h + hkv) * d)
    v_rows = slice((h + hkv) * d, (h + 2 * hkv) * d)
    table: dict[str, tuple[str, slice | None]] = {
        "model.embed_tokens.weight": ("embed.weight", None),
        "model.norm.weight": ("norm.weight", None),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = ("lm_head.weight", None)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for proj, rows in (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", v_rows)):
            table[f"{src}self_attn.{proj}.weight"] = (f"{dst}attn.qkv.weight", rows)
            if cfg.qkv_bias:
                table[f"{src}self_attn.{proj}.bias"] = (f"{dst}attn.qkv.bias", rows)
        table[f"{src}self_attn.o_proj.weight"] = (f"{dst}attn.o.weight", None)
        if cfg.o_bias:
            table[f"{src}self_attn.o_proj.bias"] = (f"{dst}attn.o.bias", None)
        if cfg.qk_norm:
            table[f"{src}self_attn.q_norm.weight"] = (f"{dst}attn.q_norm.weight", None)
            table[f"{src}self_attn.k_norm.weight"] = (f"{dst}attn.k_norm.weight", None)
        for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            table[f"{src}mlp.{proj}.weight"] = (f"{dst}mlp.gate_up.weight", rows)
            if cfg.mlp_bias:
                table[f"{src}mlp.{proj}.bias"] = (f"{dst}mlp.gate_up.bias", rows)
        table[f"{src}mlp.down_proj.weight"] = (f"{dst}mlp.down.weight", None)
        if cfg.mlp_bias:
            table[f"{src}mlp.down_proj.bias"] = (f"{dst}mlp.down.bias", None)
        table[f"{src}input_layernorm.weight"] = (f"{dst}input_norm.weight", None)
        table[f"{src}post_attention_layernorm.weight"] = (f"{dst}post_norm.weight", None)
    return table  # type: ignore[return-value]


def load_decoder(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> Decoder:
    """Build the decoder on ``device`` in ``dtype`` and fill it from the checkpoint."""
    cfg = ckpt.config
    with torch.device("meta"):
        model = Decoder(cfg, device=torch.device("meta"))
    model = model.to(dtype).to_empty(device=device)  # allocates once, in the final dtype
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    params = dict(model.named_parameters())
    table = _hf_to_ours(cfg)
    missing = set(table)
    by_file: dict[str, list[str]] = {}
    for name, fname in ckpt.weight_map.items():
        by_file.setdefault(fname, []).append(name)
    with torch.no_grad():
        for fname, names in sorted(by_file.items()):
            with safe_open(ckpt.path / fname, framework="pt", device="cpu") as f:
                for name in names:
                    if name not in table:
                        continue  # e.g. rotary inv_freq buffers saved by old exporters
                    dst_name, rows = table[name]
                    dst = params[dst_name] if rows is None else params[dst_name][rows]
                    src = f.get_tensor(name)
                    if src.shape != dst.shape:
                        raise CheckpointError(
                            f"{ckpt.path}: tensor {name} has shape {tuple(src.shape)}, config implies {tuple(dst.shape)}"
                        )
                    dst.copy_(src)
                    missing.discard(name)
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise CheckpointError(f"{ckpt.path}: {len(missing)} tensors missing from the checkpoint (e.g. {shown})")
    model.eval()
    return model
