"""Distil a small draft for a target that has none: ``saguaro-ray draft distill``.

Most real targets ship without a small sibling sharing their tokenizer, and
an early exit of the target itself agrees too rarely to draft (below 0.2 for
every depth up to 20 of SmolLM2-135M's 30 layers), so a draft is made: a Llama
of the target's width with its first ``layers`` layers, its embeddings,
final norm and (tied or not) head, trained by KL to the target's top-k
distribution on text the target itself wrote (:mod:`.distill_data`; the
training itself: :mod:`.distill_train`). This module is the command: its
checks, its caches, and the draft directory it writes.

The embeddings and head are frozen by default: for a 49152-token vocabulary
they are most of a one-layer draft's parameters, the target's own head is
what the draft must imitate, and the optimizer then only carries the layers.

Everything is seeded and step-counted, so the same target and settings give
the same draft. ``minutes`` becomes a step count once the warm-up steps are
timed (the warm-up's learning rates do not depend on the total, so the run
equals one made with that step count; the count is written to
``distill.json``); ``max_steps`` caps it. On a shared machine the count
follows the load during the warm-up. Results are cached twice: the
target's text per (target, data settings) under the cache root, shared by
drafts of any depth, and the draft itself in ``out`` with a key of the target
checkpoint and every setting, so a second call with the same arguments
returns the finished directory without work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from saguaro_ray.errors import ConfigError, UnsupportedArchitectureError
from saguaro_ray.models.distill_data import DataSpec, TeacherData, generate_teacher_data
from saguaro_ray.models.distill_train import heldout_agreement, student, train
from saguaro_ray.models.resolve import resolve_model_path
from saguaro_ray.workers.checkpoint import Checkpoint, open_checkpoint
from saguaro_ray.workers.model_config import parse_dtype
from saguaro_ray.zoo.build import zoo_root
from saguaro_ray.zoo.model import TrainLlama
from saguaro_ray.zoo.train import round_weights

log = logging.getLogger(__name__)

# Bump when the procedure changes in a way that changes the data or the weights.
DISTILL_VERSION = 1
SUMMARY_FILE = "distill.json"
HELDOUT_FILE = "distill-heldout.safetensors"
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


@dataclass(frozen=True)
class DistillSpec:
    """Every setting of a distillation (all of them are part of the cache key)."""

    layers: int = 1
    minutes: float = 10.0  # training time budget
    max_steps: int | None = None  # cap on the steps the budget allows
    batch_size: int = 4  # sequences per step
    lr: float = 1e-3
    warmup_steps: int = 20
    train_embeddings: bool = False
    seed: int = 0
    data: DataSpec = field(default_factory=DataSpec)


@dataclass(frozen=True)
class DistillResult:
    path: Path
    summary: dict[str, Any]
    reused: bool  # True when ``path`` already held this exact draft


def cache_root() -> Path:
    """Where the target's text is cached: a sibling of the zoo's cache."""
    return zoo_root().parent / "distill"


def _sha(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def checkpoint_fingerprint(ckpt: Checkpoint) -> str:
    """A hash of a checkpoint's config and weight bytes (what makes it this model)."""
    h = hashlib.sha256((ckpt.path / "config.json").read_bytes())
    for f in ckpt.weight_files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:20]


def _validate(target: str | os.PathLike, out: str | os.PathLike, spec: DistillSpec) -> tuple[Checkpoint, Path]:
    ckpt = open_checkpoint(target)
    cfg = ckpt.config
    plain = not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm or cfg.rope_scaling or cfg.sliding_window)
    if not plain or cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise UnsupportedArchitectureError(
            f"{ckpt.path}: draft distill supports plain Llama targets (no biases, QK norm, RoPE scaling, "
            "sliding window; head_dim * heads = hidden)"
        )
    if not 1 <= spec.layers <= cfg.num_layers:
        raise ConfigError(f"--layers must be between 1 and the target's {cfg.num_layers} layers, got {spec.layers}")
    if not spec.minutes > 0:
        raise ConfigError(f"--minutes must be positive, got {spec.minutes}")
    if spec.warmup_steps < 2:
        raise ConfigError("warmup_steps must be at least 2 (the warm-up is timed for --minutes)")
    if spec.max_steps is not None and spec.max_steps < 1:
        raise ConfigError(f"--max-steps must be a positive integer, got {spec.max_steps}")
    if spec.batch_size < 1 or spec.data.batch_size < 1 or spec.data.top_k < 1 or spec.data.gen_tokens < 1:
        raise ConfigError("batch sizes, --top-k and --gen-tokens must be positive")
    if spec.data.samples_per_prompt < 1 or spec.data.heldout_every < 2:
        raise ConfigError("--samples-per-prompt must be >= 1 and the held-out stride >= 2")
    if not spec.data.sample_temperature > 0:
        raise ConfigError(f"--sample-temperature must be positive, got {spec.data.sample_temperature}")
    dest = Path(out).expanduser().absolute()
    if dest == ckpt.path.absolute():
        raise ConfigError("--out must differ from --target")
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / SUMMARY_FILE).is_file())):
        raise ConfigError(f"{dest} exists and is not a distilled draft directory; pass an empty or new directory")
    return ckpt, dest


def _read_complete(dest: Path, key: str) -> dict[str, Any] | None:
    try:
        summary = json.loads((dest / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("key") != key:
        return None
    if not all((dest / f).is_file() for f in ("config.json", "model.safetensors", HELDOUT_FILE)):
        return None
    return summary


def distill_draft(target: str | os.PathLike, out: str | os.PathLike, spec: DistillSpec = DistillSpec(), progress: bool = True) -> DistillResult:
    """Distil (or find already distilled) a draft of ``target`` into ``out``.

    ``target`` is anything the model resolver takes (a directory, ``zoo:``,
    ``real:``, ``hf:``): the name is resolved here, before the checkpoint is
    opened, so loading it never builds anything."""
    ckpt, dest = _validate(resolve_model_path(target), out, spec)
    fingerprint = checkpoint_fingerprint(ckpt)
    key = _sha(DISTILL_VERSION, fingerprint, dataclasses.asdict(spec))
    summary = _read_complete(dest, key)
    if summary is not None:
        log.info("reusing the draft in %s (key %s)", dest, key)
        return DistillResult(dest, summary, reused=True)
    t_start = time.perf_counter()
    data, gen_seconds, data_reused = _teacher_data(ckpt, fingerprint, spec.data, progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        with torch.random.fork_rng(devices=[]):
            summary = _train_and_save(ckpt, data, spec, tmp, progress)
        summary.update(
            key=key,
            version=DISTILL_VERSION,
            target=str(ckpt.path),
            target_fingerprint=fingerprint,
            settings=dataclasses.asdict(spec),
        )
        summary["seconds"]["total"] = round(time.perf_counter() - t_start, 1)
        summary["data"]["reused"] = data_reused  # from the cache: generating it took generate_seconds once
        summary["data"]["generate_seconds"] = None if gen_seconds is None else round(gen_seconds, 1)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DistillResult(dest, summary, reused=False)


def _teacher_data(ckpt: Checkpoint, fingerprint: str, spec: DataSpec, progress: bool) -> tuple[TeacherData, float | None, bool]:
    """The target's text and top-k log-probs for ``spec``: from the cache, or generated once.

    Also returns the seconds generating it took (when it was made) and whether it was cached.
    """
    path = cache_root() / f"{_sha(DISTILL_VERSION, fingerprint, dataclasses.asdict(spec))}.safetensors"
    if path.is_file():
        try:
            with safe_open(path, framework="pt") as f:
                made_in = (f.metadata() or {}).get("generate_seconds")
            made_in = None if made_in is None else float(made_in)
            return TeacherData.from_tensors(load_file(path)), made_in, True
        except (OSError, KeyError, ValueError, SafetensorError) as exc:
            log.warning("ignoring an unreadable distillation cache %s (%s)", path, exc)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        data = generate_teacher_data(ckpt.path, spec, progress)
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    save_file(data.tensors(), str(part), metadata={"generate_seconds": f"{seconds:.1f}"})
    os.replace(part, path)
    return data, seconds, False



def _train_and_save(ckpt: Checkpoint, data: TeacherData, spec: DistillSpec, out: Path, progress: bool) -> dict[str, Any]:
    save_dtype = parse_dtype(ckpt.config.checkpoint_dtype or "float32")
    model = student(ckpt, spec.layers, int(data.lengths.max()), spec.train_embeddings, spec.seed)
    t0 = time.perf_counter()
    trained = train(model, data, spec, progress)
    t_train = time.perf_counter() - t0
    round_weights(model, save_dtype)
    t0 = time.perf_counter()
    metrics = heldout_agreement(model, data)
    t_eval = time.perf_counter() - t0
    _save_checkpoint(model, ckpt, out, save_dtype)
    save_file(data.heldout_only().tensors(), str(out / HELDOUT_FILE))
    held = data.sequences(heldout=True)
    return {
        "layers": spec.layers,
        "params": model.num_parameters(),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        **trained,
        "heldout": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()},
        "data": {
            "sequences": len(data.lengths),
            "heldout_sequences": len(held),
            "train_positions": int(data.top_ids.shape[0]) - int(sum(int(data.lengths[s]) - 1 for s in held)),
            "generated_tokens": int((data.lengths - data.prompt_lens).sum()),
        },
        "seconds": {"train": round(t_train, 1), "eval": round(t_eval, 1)},
    }


def _save_checkpoint(model: TrainLlama, ckpt: Checkpoint, out: Path, dtype: torch.dtype) -> None:
    """The target's config with fewer layers, the draft's weights, and the target's tokenizer files."""
    cfg = json.loads((ckpt.path / "config.json").read_text())
    cfg.pop("_model_name_or_path", None)
    cfg["num_hidden_layers"] = model.shape.num_layers
    cfg["architectures"] = ["LlamaForCausalLM"]
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = cfg["torch_dtype"] = name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.shape.tie_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in _TOKENIZER_FILES:
        if (ckpt.path / f).is_file():
            shutil.copyfile(ckpt.path / f, out / f)
