"""Tensor parallelism for the decoder: which slice each rank holds, and the collectives.

A target too large for one device runs as T ranks (Megatron-style):

* q/k/v and gate/up projections are *column*-parallel: rank r holds its own
  heads and its own slice of the intermediate dimension, so attention and the
  SiLU·up product need no communication at all;
* o and down projections are *row*-parallel: each rank multiplies its slice
  of the inputs and one all-reduce sums the partial outputs (the bias, held
  whole by every rank, is added once, after the sum);
* the embedding and the LM head are split over the vocabulary: each rank
  looks up only the ids it owns (zeros elsewhere, then an all-reduce) and
  computes logits for its vocabulary range, gathered on rank 0 only, for
  only the rows the caller asked for;
* the KV cache is split by KV heads. With fewer KV heads than ranks, each KV
  head is replicated on T / num_kv_heads consecutive ranks — exactly the
  ranks whose query heads use it — so GQA grouping stays local.

:class:`ShardPlan` is pure arithmetic (no process group), so loading a rank's
slices needs no communication and validation runs before any actor starts.
:class:`TPContext` owns the process groups and every collective; a failed
collective means a peer is gone and the group is unusable, so the process
exits and the runtime restarts the whole group (see
``saguaro_ray.runtime.target_group``).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from saguaro_ray.errors import ConfigError
from saguaro_ray.workers.decoder import Decoder
from saguaro_ray.workers.model_config import DecoderConfig

log = logging.getLogger(__name__)

# Followers wait in a broadcast for the next command for as long as the engine
# is idle; a collective timeout would tear the group down. A week, not more:
# gloo keeps timeouts in 32-bit milliseconds.
IDLE_TIMEOUT = timedelta(days=7)
# exit status of a rank whose collective failed (a peer died)
COLLECTIVE_FAILURE_EXIT = 75

R = TypeVar("R")


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``world`` holds of a checkpoint (global indices)."""

    rank: int
    world: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # global index of the first local KV head
    intermediate: int  # local slice of the MLP's intermediate dimension
    vocab_start: int
    vocab_end: int  # exclusive; the last rank's range may be shorter
    vocab_shard: int  # rows every rank allocates (ceil(V / T)) so gathers are equal-sized

    @classmethod
    def for_rank(cls, cfg: DecoderConfig, rank: int, world: int) -> "ShardPlan":
        check_tensor_parallel(cfg, world)
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} outside a tensor-parallel group of {world}")
        h, hkv = cfg.num_heads // world, cfg.num_kv_heads
        if hkv >= world:
            local_kv, kv_start = hkv // world, rank * (hkv // world)
        else:  # replicate: ranks [j*T/hkv, (j+1)*T/hkv) share KV head j
            local_kv, kv_start = 1, rank // (world // hkv)
        shard = -(-cfg.vocab_size // world)
        start = min(rank * shard, cfg.vocab_size)
        return cls(
            rank=rank,
            world=world,
            num_heads=h,
            num_kv_heads=local_kv,
            kv_head_start=kv_start,
            intermediate=cfg.intermediate_size // world,
            vocab_start=start,
            vocab_end=min(start + shard, cfg.vocab_size),
            vocab_shard=shard,
        )

    def local_config(self, cfg: DecoderConfig) -> DecoderConfig:
        """The config of this rank's slice: the decoder modules are sized from it."""
        return replace(
            cfg,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_shard,
        )


def check_tensor_parallel(cfg: DecoderConfig, world: int, source: str = "") -> None:
    """Refuse a degree the model cannot be split into (before anything starts)."""
    where = f"{source}: " if source else ""
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"{where}target_tp must be a positive integer, got {world!r}")
    if cfg.num_heads % world:
        raise ConfigError(f"{where}num_attention_heads={cfg.num_heads} is not divisible by target_tp={world}")
    if cfg.intermediate_size % world:
        raise ConfigError(f"{where}intermediate_size={cfg.intermediate_size} is not divisible by target_tp={world}")
    hkv = cfg.num_kv_heads
    if hkv >= world and hkv % world:
        raise ConfigError(f"{where}num_key_value_heads={hkv} is not divisible by target_tp={world}")
    if hkv < world and world % hkv:
        raise ConfigError(
            f"{where}target_tp={world} exceeds num_key_value_heads={hkv} but is not a multiple of it, "
            "so KV heads cannot be replicated evenly"
        )


class TPContext:
    """One rank's view of its tensor-parallel group: the plan and the collectives.

    Built before the group exists (weights load without communication);
    :meth:`connect` joins the group. ``group`` carries the tensors (NCCL on
    CUDA, gloo on CPU); ``control`` carries the per-step commands as pickled
    objects over gloo, on CPU, with a long timeout because followers block in
    it while the engine is idle. Every collective names its group explicitly,
    so other process groups in the same process (the workers' data plane)
    are unaffected.
    """

    def __init__(self, plan: ShardPlan, exit_on_failure: bool = True) -> None:
        self.plan = plan
        self.exit_on_failure = exit_on_failure
        self.group: Any = None
        self.control: Any = None

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def world(self) -> int:
        return self.plan.world

    def connect(self, store: dist.Store, device: torch.device) -> None:
        """Join the group through ``store``, a ``torch.distributed.Store`` every
        rank reaches. The runtime passes an authenticated one (see
        ``saguaro_ray.runtime.tp_actors.join_group``): torch's own TCPStore
        listens on every interface and lets any peer read or write the keys
        the ranks meet through."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a default process group")
        cuda = device.type == "cuda"
        if cuda and device.index is not None:  # Ray actors see their one GPU as the current device
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=store, rank=self.rank, world_size=self.world, timeout=IDLE_TIMEOUT
        )
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if cuda else self.group
        log.info("tensor-parallel rank %d/%d joined its group", self.rank, self.world)

    def close(self) -> None:
        """Leave the group and stop its backend's threads before returning.

        ``destroy_process_group`` only unregisters the groups: a gloo group's
        worker threads run until the last reference to its ``ProcessGroup``
        is dropped, and such a thread may still be releasing the tensors of
        the last collective after ``wait()`` returned. Releasing a tensor
        that has a Python object needs the GIL; if that happens while the
        interpreter is shutting down, CPython ends the thread in the middle
        of a ``noexcept`` destructor and the process aborts (SIGABRT,
        ``terminate called without an active exception``). So the groups
        must be freed here, while the interpreter is alive: this context
        must be their only holder (contexts that borrowed them drop theirs
        first), and a group still referenced afterwards is an error.
        """
        alive = [weakref.ref(g) for g in (self.group, self.control) if g is not None]
        self.group = self.control = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if any(r() is not None for r in alive):
            gc.collect()  # a reference cycle may be all that holds it
        if any(r() is not None for r in alive):
            raise RuntimeError(
                f"tensor-parallel rank {self.rank}: the process group is still referenced after close(); "
                "its backend threads keep running and can abort the process at exit"
            )

    # ----------------------------------------------------------- collectives
    def _run(self, what: str, fn: Callable[[], R]) -> R:
        if self.group is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} used before joining its group")
        try:
            return fn()
        except Exception:
            if not self.exit_on_failure:
                raise
            # a peer is gone mid-collective: this group cannot be used again
            log.exception("tensor-parallel %s failed on rank %d; exiting so the group restarts", what, self.rank)
            os._exit(COLLECTIVE_FAILURE_EXIT)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._run("all_reduce", lambda: dist.all_reduce(x, group=self.group))
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0 gets ``[n, vocab_size]`` from every rank's ``[n, vocab_shard]``;
        the other ranks get their own slice back (their logits are never used)."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        self._run("gather", lambda: dist.gather(local, parts, dst=0, group=self.group))
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0 sends ``obj`` (pickled, CPU tensors only); every rank returns it."""
        box = [obj if self.rank == 0 else None]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.control))
        return box[0]


# ------------------------------------------------------------- sharded layers


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_r @ W_r^T) + b``: the input dimension is split over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_end)`` of the embedding; ids elsewhere contribute zeros."""

    def __init__(self, plan: ShardPlan, hidden: int, tp: TPContext) -> None:
        super().__init__(plan.vocab_shard, hidden)
        self.start, self.end, self.tp = plan.vocab_start, plan.vocab_end, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        x = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))


class ShardedDecoder(Decoder):
    """The decoder sized for one rank's slice, with the collectives wired in.

    Everything else — norms, RoPE, attention over the local heads, the KV
    cache layout — is the ordinary :class:`Decoder` on the local config.
    """

    def __init__(self, cfg: DecoderConfig, tp: TPContext, device: torch.device) -> None:
        local = tp.plan.local_config(cfg)
        super().__init__(local, device)
        self.full_config = cfg
        self.tp = tp
        self.embed = VocabParallelEmbedding(tp.plan, cfg.hidden_size, tp)
        for layer in self.layers:
            attn, mlp = layer.attn, layer.mlp
            attn.o = RowParallelLinear(attn.o.in_features, cfg.hidden_size, cfg.o_bias, tp)
            mlp.down = RowParallelLinear(mlp.down.in_features, cfg.hidden_size, cfg.mlp_bias, tp)
        self.tie_head()  # the head is this rank's vocabulary shard of the new embedding

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_vocab(super().logits(hidden), self.full_config.vocab_size)
