"""Loading Hugging Face checkpoint directories into our decoder.

A checkpoint directory holds ``config.json``, the weights as one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``,
and tokenizer files. Everything is validated up front — a missing file or an
unsupported architecture raises a specific error naming it before any weight
is read. Weights are read tensor by tensor from memory-mapped safetensors and
copied straight into the (possibly fused) destination parameter, so the full
checkpoint is never materialised twice. A tensor-parallel rank reads only its
slice of each tensor (``get_slice``), so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from saguaro_ray.errors import CheckpointError
from saguaro_ray.models.spec import is_named_spec
from saguaro_ray.workers.decoder import Decoder
from saguaro_ray.workers.model_config import DecoderConfig
from saguaro_ray.workers.tensor_parallel import ShardPlan, ShardedDecoder, TPContext
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
    """Validate a checkpoint directory and read its config and weight index.

    Only a directory: model specs (``zoo:``, ``real:``, ...) are resolved
    before, by :mod:`saguaro_ray.models.resolve` — loading never builds or
    converts anything."""
    root = Path(path)
    if not root.is_dir() and is_named_spec(path):
        raise CheckpointError(
            f"{path!r} is a model name, not a directory: resolve it first (saguaro_ray.models.resolve_model_path)"
        )
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


class _Dest(NamedTuple):
    """Where one checkpoint tensor goes: ``param[rows]`` receives the source's
    ``src`` range along dimension ``dim`` (the whole tensor when ``src`` is None)."""

    param: str
    rows: slice | None = None
    dim: int = 0
    src: slice | None = None
    full: int = 0  # the source's expected size along ``dim`` when sliced


def _hf_to_ours(cfg: DecoderConfig, plan: ShardPlan) -> dict[str, _Dest]:
    """HF tensor name → where this rank's slice of it lands in our (fused) parameters.

    With one rank every source range is the whole tensor; with tensor
    parallelism the column-parallel weights (q/k/v, gate/up, vocabulary)
    take a row range and the row-parallel ones (o, down) a column range.
    """
    d, world = cfg.head_dim, plan.world
    h, hkv, inter = plan.num_heads, plan.num_kv_heads, plan.intermediate

    def part(start: int, size: int, full: int) -> tuple[slice | None, int]:
        return (None, 0) if world == 1 else (slice(start, start + size), full)

    q_src = part(plan.rank * h * d, h * d, cfg.num_heads * d)
    kv_src = part(plan.kv_head_start * d, hkv * d, cfg.num_kv_heads * d)
    inter_src = part(plan.rank * inter, inter, cfg.intermediate_size)
    fused_qkv = (
        ("q_proj", slice(0, h * d), q_src),
        ("k_proj", slice(h * d, (h + hkv) * d), kv_src),
        ("v_proj", slice((h + hkv) * d, (h + 2 * hkv) * d), kv_src),
    )
    fused_gate_up = (("gate_proj", slice(0, inter), inter_src), ("up_proj", slice(inter, 2 * inter), inter_src))
    vocab_rows = slice(0, plan.vocab_end - plan.vocab_start)
    vocab_src = part(plan.vocab_start, plan.vocab_end - plan.vocab_start, cfg.vocab_size)
    table: dict[str, _Dest] = {
        "model.embed_tokens.weight": _Dest("embed.weight", vocab_rows, 0, *vocab_src),
        "model.norm.weight": _Dest("norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = _Dest("lm_head.weight", vocab_rows, 0, *vocab_src)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        _fuse(table, f"{src}self_attn.", f"{dst}attn.qkv", fused_qkv, cfg.qkv_bias)
        table[f"{src}self_attn.o_proj.weight"] = _Dest(f"{dst}attn.o.weight", None, 1, *q_src)
        if cfg.o_bias:
            table[f"{src}self_attn.o_proj.bias"] = _Dest(f"{dst}attn.o.bias")
        if cfg.qk_norm:
            table[f"{src}self_attn.q_norm.weight"] = _Dest(f"{dst}attn.q_norm.weight")
            table[f"{src}self_attn.k_norm.weight"] = _Dest(f"{dst}attn.k_norm.weight")
        _fuse(table, f"{src}mlp.", f"{dst}mlp.gate_up", fused_gate_up, cfg.mlp_bias)
        table[f"{src}mlp.down_proj.weight"] = _Dest(f"{dst}mlp.down.weight", None, 1, *inter_src)
        if cfg.mlp_bias:
            table[f"{src}mlp.down_proj.bias"] = _Dest(f"{dst}mlp.down.bias")
        table[f"{src}input_layernorm.weight"] = _Dest(f"{dst}input_norm.weight")
        table[f"{src}post_attention_layernorm.weight"] = _Dest(f"{dst}post_norm.weight")
    return table


def _fuse(table: dict[str, _Dest], src: str, dst: str, parts: Any, bias: bool) -> None:
    """Map the checkpoint's separate projections ``src{proj}.weight`` (and
    ``.bias``) onto their row ranges of our fused ``dst.weight``."""
    for proj, rows, rng in parts:
        table[f"{src}{proj}.weight"] = _Dest(f"{dst}.weight", rows, 0, *rng)
        if bias:
            table[f"{src}{proj}.bias"] = _Dest(f"{dst}.bias", rows, 0, *rng)


def _read(f: Any, name: str, dest: _Dest, where: Path) -> torch.Tensor:
    """Read only ``dest.src`` of tensor ``name`` from the memory-mapped file."""
    if dest.src is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    full = sl.get_shape()
    if len(full) <= dest.dim or full[dest.dim] != dest.full:
        raise CheckpointError(f"{where}: tensor {name} has shape {tuple(full)}, config implies {dest.full} along dimension {dest.dim}")
    return sl[dest.src] if dest.dim == 0 else sl[:, dest.src]


def load_decoder(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, tp: TPContext | None = None) -> Decoder:
    """Build the decoder on ``device`` in ``dtype`` and fill it from the checkpoint.

    With ``tp`` (tensor parallelism) only this rank's slices are allocated and
    read, so no process ever holds the whole model.
    """
    cfg = ckpt.config
    plan = ShardPlan.for_rank(cfg, 0, 1) if tp is None else tp.plan
    with torch.device("meta"):
        model = Decoder(cfg, device=torch.device("meta")) if plan.world == 1 else ShardedDecoder(cfg, tp, torch.device("meta"))
    model = model.to(dtype).to_empty(device=device)  # allocates once, in the final dtype
    model.tie_head()  # to_empty gave the tied head its own storage
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    params = dict(model.named_parameters())
    if plan.vocab_end - plan.vocab_start < plan.vocab_shard:  # padding rows of the last vocabulary shard
        with torch.no_grad():
            for name in ("embed.weight", "lm_head.weight"):
                if name in params:
                    params[name].zero_()
    table = _hf_to_ours(cfg, plan)
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
                    dest = table[name]
                    dst = params[dest.param] if dest.rows is None else params[dest.param][dest.rows]
                    src = _read(f, name, dest, ckpt.path)
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
