"""How a distilled draft learns: initialised from the target's first layers,
trained by top-k KL to the target's distribution on the target's own text,
and judged by greedy agreement on held-out target text.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from saguaro_ray.errors import CheckpointError, ConfigError
from saguaro_ray.models.distill_data import TeacherData
from saguaro_ray.workers.checkpoint import Checkpoint
from saguaro_ray.zoo.model import ModelShape, TrainLlama
from saguaro_ray.zoo.train import TrainSpec, bf16_autocast, optimizer_for, optimizer_step, progress_bar

if TYPE_CHECKING:  # distill.py imports this module: the spec is only named here
    from saguaro_ray.models.distill import DistillSpec


def student(ckpt: Checkpoint, layers: int, max_len: int, train_embeddings: bool, seed: int) -> TrainLlama:
    """A ``layers``-deep Llama of the target's shape holding the target's first layers, norm and head."""
    c = ckpt.config
    shape = ModelShape(
        hidden_size=c.hidden_size, num_layers=layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        intermediate_size=c.intermediate_size, tie_embeddings=c.tie_word_embeddings,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
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


def train(model: TrainLlama, data: TeacherData, spec: DistillSpec, progress: bool) -> dict[str, Any]:
    """Train ``model`` in place; returns its steps, tokens seen and final KL.

    ``spec.minutes`` becomes a step count once the warm-up steps are timed;
    the learning-rate schedule reads the total only after the warm-up, so the
    run equals one made with that count from the start.
    """
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

