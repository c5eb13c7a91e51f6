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

from saguaro_ray.algorithms.tensors import host_to
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
        """Sequences with different query lengths run per distinct length, so
        the kernel's bottom-right causal alignment stays per sequence: each
        length's rows, lengths and tables are gathered here, once per step,
        not in every layer."""
        qlens = batch.query_lens
        tables = batch.block_tables.to(device=device, dtype=torch.int32)
        context = host_to(device, batch.context_lens, torch.int32)
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        groups = []
        for n in sorted(set(qlens)):
            idx = [b for b, m in enumerate(qlens) if m == n]
            if len(idx) == len(qlens):  # one length: every row, in order
                groups.append((n, None, context, tables))
                continue
            rows = host_to(device, [r for b in idx for r in range(starts[b], starts[b] + n)])
            sel = host_to(device, idx)
            groups.append((n, rows, context[sel], tables[sel]))
        return {"groups": groups, "window": (-1, -1) if window is None else (window - 1, 0)}

    def paged(self, plan: dict, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q) if len(plan["groups"]) > 1 else None
        for n, rows, context, tables in plan["groups"]:
            qb = (q if rows is None else q[rows]).view(-1, n, *q.shape[1:])
            o = self._with_kvcache(
                qb,
                k_cache,
                v_cache,
                cache_seqlens=context,
                block_table=tables,
                softmax_scale=scale,
                causal=True,
                window_size=plan["window"],
            ).reshape(-1, *q.shape[1:])
            if out is None:
                return o
            out[rows] = o
        return out


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn's kernels compute in


def select_backend(name: str | None, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Pick an attention backend by device *and* dtype: ``None``/``"auto"`` →
    flash-attn on CUDA in fp16/bf16 when importable, else torch (fp32 on CUDA
    runs torch's attention: flash-attn has no fp32 kernels);
    ``"torch"``/``"sdpa"`` or ``"flash_attn"`` force one."""
    if name in (None, "auto"):
        if device.type == "cuda" and dtype in FLASH_DTYPES:
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
        if dtype not in FLASH_DTYPES:
            raise ConfigError(f"attention backend 'flash_attn' runs in fp16 or bf16, not {dtype}; use dtype bf16 or attention backend 'torch'")
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
