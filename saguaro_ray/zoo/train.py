"""Training loops of the zoo: CE pre-training, distillation, held-out evaluation.

Everything is step-counted and seeded (never wall-clock budgeted), so a build
is reproducible: the same preset on the same machine and thread count gives
the same weights. Matmuls run under bfloat16 autocast (several times faster
than float32 on CPUs with AVX-512 BF16 / AMX) with float32 master weights;
evaluation runs in float32.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from saguaro_ray.zoo.model import TrainLlama


@dataclass(frozen=True)
class TrainSpec:
    """One training run: a fixed number of optimizer steps over random windows."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0


def token_stream(docs: Sequence[list[int]], eos_id: int) -> torch.Tensor:
    """All documents concatenated, each followed by ``eos_id`` (and one leading)."""
    total = 1 + sum(len(d) + 1 for d in docs)
    out = torch.empty(total, dtype=torch.int64)
    out[0] = eos_id
    pos = 1
    for d in docs:
        out[pos : pos + len(d)] = torch.as_tensor(d, dtype=torch.int64)
        out[pos + len(d)] = eos_id
        pos += len(d) + 1
    return out


class WindowSampler:
    """Deterministic batches of ``seq_len + 1`` token windows.

    Each epoch cuts the stream into non-overlapping windows at a random
    offset and visits them in a random order (seeded), so every token is seen
    once per epoch.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        if stream.numel() < (seq_len + 1) * 2:
            raise ValueError("token stream too short for the training window")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self._starts = torch.empty(0, dtype=torch.int64)
        self._next = 0
        self.epochs = 0

    def _new_epoch(self) -> None:
        w = self.seq_len + 1
        offset = int(torch.randint(0, self.seq_len, (1,), generator=self.gen))
        n = (self.stream.numel() - offset) // w
        starts = offset + torch.arange(n, dtype=torch.int64) * w
        self._starts = starts[torch.randperm(n, generator=self.gen)]
        self._next = 0
        self.epochs += 1

    def next(self) -> torch.Tensor:
        rows = []
        while len(rows) < self.batch_size:
            if self._next >= self._starts.numel():
                self._new_epoch()
            rows.append(self._starts[self._next])
            self._next += 1
        idx = torch.stack(rows)[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self.stream[idx]


def optimizer_for(model: TrainLlama, spec: TrainSpec) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: weight decay on matrices only."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    frac = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cos)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    # Into a log file (not a terminal) refresh rarely, so logs stay small.
    interactive = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=True,
        mininterval=0.1 if interactive else 30.0,
    )


def round_weights(model: TrainLlama, dtype: torch.dtype) -> None:
    """Round weights to the checkpoint dtype in place, so what is evaluated is what is saved."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype).float())


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def optimizer_step(model: TrainLlama, opt: torch.optim.Optimizer, loss: torch.Tensor, spec: TrainSpec, step: int) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
    for group in opt.param_groups:
        group["lr"] = _lr_at(step, spec)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_lm(
    model: TrainLlama,
    stream: torch.Tensor,
    spec: TrainSpec,
    *,
    progress: bool = True,
    desc: str = "train",
    log: Callable[[int, float], None] | None = None,
    monitor_batch: torch.Tensor | None = None,
    monitor_every: int = 100,
) -> float:
    """Pre-train ``model`` with next-token cross-entropy; returns the final smoothed loss.

    With ``monitor_batch`` (held-out windows), its loss is shown in the
    progress bar every ``monitor_every`` steps (no effect on training).
    """
    torch.manual_seed(spec.seed)
    sampler = WindowSampler(stream, spec.seq_len, spec.batch_size, spec.seed)
    opt = optimizer_for(model, spec)
    model.train()
    ema = None
    with progress_bar(spec.steps, desc, progress) as bar:
        for step in range(spec.steps):
            batch = sampler.next()
            with bf16_autocast():
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            optimizer_step(model, opt, loss, spec, step)
            value = float(loss.detach())
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            if log is not None:
                log(step, value)
            bar.update(1)
            if monitor_batch is not None and (step % monitor_every == 0 or step == spec.steps - 1):
                heldout_loss = _monitor({"m": model}, monitor_batch, "m")["m"]["heldout_loss"]
                model.train()
            if step % 10 == 0 or step == spec.steps - 1:
                post = {"loss": f"{ema:.3f}", "epoch": sampler.epochs}
                if monitor_batch is not None:
                    post["heldout"] = f"{heldout_loss:.3f}"
                bar.set_postfix(post, refresh=False)
    model.eval()
    return float(ema if ema is not None else float("nan"))


def distill(
    students: dict[str, TrainLlama],
    teacher: TrainLlama,
    stream: torch.Tensor,
    spec: TrainSpec,
    *,
    kl_weight: float = 0.8,
    progress: bool = True,
    desc: str = "distill",
    monitor_batch: torch.Tensor | None = None,
    monitor_every: int = 100,
) -> dict[str, float]:
    """Distil several students from one teacher on the same batches.

    Loss per student: ``kl_weight * KL(teacher || student) + (1 - kl_weight) * CE``
    (per token, mean), so one teacher forward per batch serves every student.
    Returns each student's final smoothed KL. With ``monitor_batch``
    (held-out windows), each student's greedy agreement with the teacher on
    it is shown in the progress bar every ``monitor_every`` steps.
    """
    torch.manual_seed(spec.seed)
    sampler = WindowSampler(stream, spec.seq_len, spec.batch_size, spec.seed)
    opts = {name: optimizer_for(m, spec) for name, m in students.items()}
    teacher.eval()
    for m in students.values():
        m.train()
    ema: dict[str, float] = {}
    with progress_bar(spec.steps, desc, progress) as bar:
        for step in range(spec.steps):
            batch = sampler.next()
            inputs, labels = batch[:, :-1], batch[:, 1:].flatten()
            with torch.no_grad(), bf16_autocast():
                t_logits = teacher(inputs)
            t_logp = F.log_softmax(t_logits.float().flatten(0, 1), dim=-1)
            t_p = t_logp.exp()
            for name, m in students.items():
                with bf16_autocast():
                    s_logits = m(inputs)
                s_logp = F.log_softmax(s_logits.float().flatten(0, 1), dim=-1)
                kl = (t_p * (t_logp - s_logp)).sum(-1).mean()
                ce = F.nll_loss(s_logp, labels)
                loss = kl_weight * kl + (1.0 - kl_weight) * ce
                optimizer_step(m, opts[name], loss, spec, step)
                v = float(kl.detach())
                ema[name] = v if name not in ema else 0.98 * ema[name] + 0.02 * v
            bar.update(1)
            if monitor_batch is not None and (step % monitor_every == 0 or step == spec.steps - 1):
                agreement = _monitor({"teacher": teacher, **students}, monitor_batch, "teacher")
                for m in students.values():
                    m.train()
            if step % 10 == 0 or step == spec.steps - 1:
                post = {f"kl_{k}": f"{v:.3f}" for k, v in ema.items()}
                if monitor_batch is not None:
                    post.update({f"agree_{k}": f"{agreement[k]['greedy_agreement']:.3f}" for k in students})
                bar.set_postfix(post, refresh=False)
    for m in students.values():
        m.eval()
    return ema


@torch.no_grad()
def _monitor(models: dict[str, TrainLlama], windows: torch.Tensor, reference: str) -> dict[str, dict[str, float]]:
    """Cheap progress metrics on a few held-out windows (bfloat16, like training)."""
    with bf16_autocast():
        return evaluate(models, windows.flatten(), windows.shape[1] - 1, windows.shape[0], reference)


@torch.no_grad()
def evaluate(
    models: dict[str, TrainLlama],
    stream: torch.Tensor,
    seq_len: int,
    max_windows: int,
    reference: str = "target",
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """Held-out mean CE per token of each model, and greedy agreement with ``reference``.

    Windows are consecutive, non-overlapping ``seq_len + 1`` slices from the
    start of ``stream`` (float32, no autocast). Agreement is the fraction of
    positions where a model's argmax equals the reference's.
    """
    w = seq_len + 1
    n = min(max_windows, stream.numel() // w)
    windows = stream[: n * w].view(n, w)
    loss_sum = {k: 0.0 for k in models}
    agree = {k: 0 for k in models}
    count = 0
    for i in range(0, n, batch_size):
        batch = windows[i : i + batch_size]
        labels = batch[:, 1:].flatten()
        argmax = {}
        for name, m in models.items():
            m.eval()
            logits = m(batch[:, :-1]).float().flatten(0, 1)
            loss_sum[name] += float(F.cross_entropy(logits, labels, reduction="sum"))
            argmax[name] = logits.argmax(-1)
        for name in models:
            agree[name] += int((argmax[name] == argmax[reference]).sum())
        count += labels.numel()
    out = {}
    for name in models:
        out[name] = {"heldout_loss": loss_sum[name] / count}
        if name != reference:
            out[name]["greedy_agreement"] = agree[name] / count
    out["_tokens"] = {"count": float(count)}
    return out
