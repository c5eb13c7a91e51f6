"""Distil a small draft for a target that has none: ``saguaro-ray draft distill``.

Most real targets ship without a small sibling sharing their tokenizer, and
an early exit of the target itself agrees too rarely to draft (below 0.2 for
every depth up to 20 of SmolLM2-135M's 30 layers), so a draft is made: a Llama
of the target's width with its first ``layers`` layers, its embeddings,
final norm and (tied or not) head, trained by KL to the target's top-k
distribution on text the target itself wrote (:mod:`.distill_data`).

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

from saguaro_ray.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from saguaro_ray.models.distill_data import DataSpec, TeacherData, generate_teacher_data
from saguaro_ray.workers.checkpoint import Checkpoint, open_checkpoint
from saguaro_ray.workers.model_config import parse_dtype
from saguaro_ray.zoo.build import zoo_root
from saguaro_ray.zoo.model import ModelShape, TrainLlama
from saguaro_ray.zoo.train import TrainSpec, bf16_autocast, optimizer_for, optimizer_step, progress_bar, round_weights

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
    """Distil (or find already distilled) a draft of ``target`` into ``out``."""
    ckpt, dest = _validate(target, out, spec)
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


def _student(ckpt: Checkpoint, layers: int, max_len: int, train_embeddings: bool, seed: int) -> TrainLlama:
    """A ``layers``-deep Llama of the target's shape holding the target's first layers, norm and head."""
    c = ckpt.config
    shape = ModelShape(
        hidden_size=c.hidden_size,
        num_layers=layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        intermediate_size=c.intermediate_size,
        tie_embeddings=c.tie_word_embeddings,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
    )
    torch.manual_seed(seed)
    model = TrainLlama(shape, c.vocab_size, max_len=max_len)
    wanted = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in wanted.items():
            if c.tie_word_embeddings and name == "lm_head.weight":
                continue  # the same tensor as the embedding
            file = ckpt.weight_map.get(name)
            if file is None:
                raise CheckpointError(f"{ckpt.path}: weight {name!r} is missing")
            with safe_open(ckpt.path / file, framework="pt") as f:
                param.copy_(f.get_tensor(name).float())
    if not train_embeddings:
        model.model.embed_tokens.weight.requires_grad_(False)
        model.lm_head.weight.requires_grad_(False)
    return model


def topk_kl(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Per-row KL(target || draft) over the target's top-k tokens plus one bucket for the rest.

    This is the exact KL between the two distributions coarsened to
    (top-k tokens, everything else), so the draft is pulled towards the
    target's probabilities where they are known and towards the right total
    mass elsewhere.
    """
    s_logp = torch.log_softmax(logits.float(), dim=-1)
    s_top = s_logp.gather(1, top_ids)
    p = top_logp.exp()
    p_tail = (1.0 - p.sum(-1)).clamp_min(0.0)
    s_top_mass = torch.logsumexp(s_top, dim=-1).clamp_max(-1e-7)
    log_q_tail = torch.log(-torch.expm1(s_top_mass))
    tail = p_tail * (torch.log(p_tail.clamp_min(1e-30)) - log_q_tail)
    return (p * (top_logp - s_top)).sum(-1) + tail


class _Batches:
    """Padded batches of whole training sequences, an epoch a seeded permutation."""

    def __init__(self, data: TeacherData, seqs: list[int], batch_size: int, seed: int) -> None:
        if not seqs:
            raise ConfigError("no training sequences: raise --chat-prompts / --code-prompts or --corpus-windows")
        self.data, self.seqs, self.batch_size = data, torch.tensor(seqs), batch_size
        self.tok_off, self.row_off = data.offsets()
        self.gen = torch.Generator().manual_seed(seed)
        self.order = torch.empty(0, dtype=torch.int64)
        self.next_i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        picked = []
        while len(picked) < self.batch_size:
            if self.next_i >= self.order.numel():
                self.order = self.seqs[torch.randperm(self.seqs.numel(), generator=self.gen)]
                self.next_i = 0
            picked.append(int(self.order[self.next_i]))
            self.next_i += 1
        return inputs_and_targets(self.data, picked, self.tok_off, self.row_off)


def inputs_and_targets(
    data: TeacherData, seqs: list[int], tok_off: torch.Tensor, row_off: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs ``[B, T]``, the mask of positions with a target row, and those rows.

    Padding only follows real tokens, so causal attention keeps it out of
    every real position.
    """
    n = [int(data.lengths[s]) - 1 for s in seqs]
    inputs = torch.zeros(len(seqs), max(n), dtype=torch.int64)
    valid = torch.zeros(len(seqs), max(n), dtype=torch.bool)
    rows = []
    for b, (s, m) in enumerate(zip(seqs, n)):
        inputs[b, :m] = data.tokens[tok_off[s] : tok_off[s] + m]
        valid[b, :m] = True
        rows.append(torch.arange(int(row_off[s]), int(row_off[s]) + m))
    idx = torch.cat(rows)
    return inputs, valid, data.top_ids[idx], data.top_logp[idx]


def _train(model: TrainLlama, data: TeacherData, spec: DistillSpec, progress: bool) -> dict[str, Any]:
    torch.manual_seed(spec.seed)
    batches = _Batches(data, data.sequences(heldout=False), spec.batch_size, spec.seed)
    steps = spec.max_steps
    tspec = TrainSpec(steps=steps or 1, batch_size=spec.batch_size, seq_len=0, lr=spec.lr, warmup_steps=spec.warmup_steps, seed=spec.seed)
    opt = optimizer_for(model, tspec)
    model.train()
    ema, tokens, step, t_probe = None, 0, 0, 0.0
    budget = spec.minutes * 60.0
    with progress_bar(steps, "distill draft", progress) as bar:
        while steps is None or step < steps:
            if step == 1:
                t_probe = time.perf_counter()
            elif step == spec.warmup_steps and (steps is None or steps > step):
                per_step = (time.perf_counter() - t_probe) / (step - 1)
                affordable = max(step, int(budget / per_step))
                steps = affordable if steps is None else min(steps, affordable)
                bar.total = steps
                bar.refresh()
                if step >= steps:
                    break
            if steps is not None and tspec.steps != steps:
                # Only the decay after warm-up reads the total: set once it is known.
                tspec = dataclasses.replace(tspec, steps=steps)
            inputs, valid, top_ids, top_logp = batches.next()
            with bf16_autocast():
                logits = model(inputs)
            loss = topk_kl(logits[valid], top_ids, top_logp).mean()
            optimizer_step(model, opt, loss, tspec, step)
            value = float(loss.detach())
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            tokens += int(valid.sum())
            step += 1
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix({"kl": f"{ema:.3f}"}, refresh=False)
    model.eval()
    return {"steps": step, "tokens_seen": tokens, "final_train_kl": round(float(ema), 4)}


@torch.no_grad()
def heldout_agreement(model: TrainLlama, data: TeacherData, batch_size: int = 8) -> dict[str, float]:
    """Greedy top-1 agreement with the target and mean top-k KL on held-out target text.

    Only positions that predict a token the target wrote are counted (not
    the prompt); the target's top-1 there is its greedy choice.
    """
    seqs = data.sequences(heldout=True)
    if not seqs:
        raise ConfigError("no held-out sequences: raise --chat-prompts / --code-prompts")
    tok_off, row_off = data.offsets()
    agree, count, kl_sum = 0, 0, 0.0
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        inputs, valid, top_ids, top_logp = inputs_and_targets(data, chunk, tok_off, row_off)
        pos = torch.arange(valid.shape[1])[None, :]
        generated = (pos >= data.prompt_lens[chunk][:, None] - 1)[valid]
        logits = model(inputs)[valid][generated]
        agree += int((logits.argmax(-1) == top_ids[generated, 0]).sum())
        kl_sum += float(topk_kl(logits, top_ids[generated], top_logp[generated]).sum())
        count += int(generated.sum())
    return {"greedy_agreement": agree / count, "topk_kl": kl_sum / count, "positions": count}


def heldout_subset(data: TeacherData) -> TeacherData:
    """Only the held-out sequences (what ``distill-heldout.safetensors`` holds)."""
    seqs = data.sequences(heldout=True)
    tok_off, row_off = data.offsets()
    tok = torch.cat([torch.arange(int(tok_off[s]), int(tok_off[s] + data.lengths[s])) for s in seqs])
    rows = torch.cat([torch.arange(int(row_off[s]), int(row_off[s] + data.lengths[s] - 1)) for s in seqs])
    return TeacherData(
        tokens=data.tokens[tok],
        lengths=data.lengths[seqs],
        prompt_lens=data.prompt_lens[seqs],
        heldout=data.heldout[seqs],
        top_ids=data.top_ids[rows],
        top_logp=data.top_logp[rows],
    )


def _train_and_save(ckpt: Checkpoint, data: TeacherData, spec: DistillSpec, out: Path, progress: bool) -> dict[str, Any]:
    save_dtype = parse_dtype(ckpt.config.checkpoint_dtype or "float32")
    model = _student(ckpt, spec.layers, int(data.lengths.max()), spec.train_embeddings, spec.seed)
    t0 = time.perf_counter()
    trained = _train(model, data, spec, progress)
    t_train = time.perf_counter() - t0
    round_weights(model, save_dtype)
    t0 = time.perf_counter()
    metrics = heldout_agreement(model, data)
    t_eval = time.perf_counter() - t0
    _save_checkpoint(model, ckpt, out, save_dtype)
    save_file(heldout_subset(data).tensors(), str(out / HELDOUT_FILE))
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
