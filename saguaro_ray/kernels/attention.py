"""Attention backends over a paged KV cache: the interface the model runner
calls, and the choice of backend.

Two kinds of attention calls exist in the engine:

* **paged** (:mod:`.paged_attention`) — a ragged batch of sequences, each
  bringing ``n_b >= 1`` new query tokens, attending causally to its own KV
  (prompt, earlier tokens and the new tokens, already written to the cache).
  Used by prefill, AR decode and (K+1)-token verification.
* **tree** (:mod:`.tree_attention`) — ``N`` branch rows that share one
  sequence's prefix KV (each up to its own key-length limit) and own a short
  per-branch suffix in a scratch buffer, so the prefix is never copied per
  branch.

A backend turns the batch description into a *plan* once per forward (masks,
gather indices) and every layer reuses it. ``TorchBackend`` runs anywhere
(CPU and CUDA, via ``scaled_dot_product_attention``); ``FlashAttnBackend`` is
chosen automatically on CUDA when ``flash_attn`` imports.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.paged_attention import PagedBatch, PagedPlan, attend_paged, plan_paged
from saguaro_ray.kernels.tree_attention import TreeBatch, TreePlan, attend_tree, plan_tree

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> object: ...

    def paged(self, plan: object, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor: ...

    def plan_tree(self, batch: TreeBatch, window: int | None, device: torch.device) -> object: ...

    def tree(
        self, plan: object, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k_scratch: torch.Tensor, v_scratch: torch.Tensor, scale: float,
    ) -> torch.Tensor: ...


class TorchBackend:
    """Portable backend: reads keys through the block table (a view when a
    sequence's blocks are consecutive), masks, and runs
    ``scaled_dot_product_attention``. Works on CPU and CUDA."""

    name = "torch"
    # the tree path attends to all of a group's suffix keys at once while
    # rows * suffix_total <= cascade_factor * prefix + cascade_slack, else cascades
    cascade_factor = 2
    cascade_slack = 256

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> PagedPlan:
        return plan_paged(batch, window, device)

    def paged(self, plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return attend_paged(plan, q, k_cache, v_cache, scale)

    def plan_tree(self, batch: TreeBatch, window: int | None, device: torch.device) -> TreePlan:
        return plan_tree(batch, window, device, self.cascade_factor, self.cascade_slack)

    def tree(
        self, plan: TreePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k_scratch: torch.Tensor, v_scratch: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        return attend_tree(plan, q, k_cache, v_cache, k_scratch, v_scratch, scale)


class FlashAttnBackend(TorchBackend):
    """flash-attn on CUDA for the paged path (block tables passed straight to
    the kernel, causal mask aligned bottom-right as verification needs). The
    tree path is inherited from ``TorchBackend`` (gather + explicit softmax
    with log-sum-exp), which runs unchanged on CUDA.

    flash-attn's paged kernels need a block size that is a multiple of 256;
    ``ModelRunner`` picks that block size when this backend is selected.
    """

    name = "flash_attn"
    required_block_size = 256

    def __init__(self) -> None:
        import flash_attn  # noqa: F401  (raises ImportError when absent)
        from flash_attn import flash_attn_with_kvcache

        self._with_kvcache = flash_attn_with_kvcache

    def plan_paged(self, batch: PagedBatch, window: int | None, device: torch.device) -> dict:
        return {
            "block_tables": batch.block_tables.to(device=device, dtype=torch.int32),
            "context_lens": torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
            "query_lens": batch.query_lens,
            "window": (-1, -1) if window is None else (window - 1, 0),
        }

    def paged(self, plan: dict, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        # Sequences with different query lengths are run per distinct length so
        # the kernel's bottom-right causal alignment stays per sequence.
        qlens = plan["query_lens"]
        out = torch.empty_like(q)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        for n in sorted(set(qlens)):
            idx = [b for b, m in enumerate(qlens) if m == n]
            rows = torch.cat([torch.arange(starts[b], starts[b] + n) for b in idx]).to(q.device)
            qb = q[rows].view(len(idx), n, *q.shape[1:])
            sel = torch.tensor(idx, device=q.device)
            o = self._with_kvcache(
                qb,
                k_cache,
                v_cache,
                cache_seqlens=plan["context_lens"][sel],
                block_table=plan["block_tables"][sel],
                softmax_scale=scale,
                causal=True,
                window_size=plan["window"],
            )
            out[rows] = o.reshape(-1, *q.shape[1:])
        return out


def select_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """Pick an attention backend: ``None``/``"auto"`` → flash-attn on CUDA when
    importable, else torch; ``"torch"``/``"sdpa"`` or ``"flash_attn"`` force one."""
    if name in (None, "auto"):
        if device.type == "cuda":
            try:
                return FlashAttnBackend()
            except ImportError:
                log.info("flash-attn not importable; using torch SDPA attention")
        return TorchBackend()
    if name in ("torch", "sdpa"):
        return TorchBackend()
    if name in ("flash_attn", "flash-attn"):
        if device.type != "cuda":
            raise ConfigError("attention backend 'flash_attn' needs a CUDA device; use 'torch' on CPU")
        return FlashAttnBackend()
    raise ConfigError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'flash_attn'")


__all__ = [
    "AttentionBackend",
    "FlashAttnBackend",
    "PagedBatch",
    "TorchBackend",
    "TreeBatch",
    "select_backend",
]
