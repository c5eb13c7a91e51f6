"""Host values as tensors on the device of the tensors they meet.

A hot path (a runner step, verification, a draft's tree build) turns Python
lists — token ids, lengths, per-row temperatures, row indices — into tensors
that then meet the model's tensors. Made without a device they land on the
*default* device (the CPU), and on CUDA the first operation that mixes them
with the model's tensors fails. Every such tensor is made here, beside the
tensor it will meet, so the device follows the data instead of being
repeated (or forgotten) at each call site.

On CUDA the values go up through pinned memory with a non-blocking copy: the
copy is queued on the current stream, so the host does not wait for the GPU
to drain before it can go on preparing the step (a pageable copy would).
"""

from __future__ import annotations

from typing import Any

import torch

_CPU = torch.device("cpu")


def host_to(device: torch.device, data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list, a number, or a CPU tensor) as a tensor on ``device``."""
    t = torch.as_tensor(data, dtype=dtype, device=_CPU)
    if device.type != "cuda":
        return t if device == _CPU else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, data: Any) -> torch.Tensor:
    """Copy host values into the existing tensor ``dst`` (a static buffer) — on
    CUDA straight from pinned memory, queued on the current stream."""
    t = torch.as_tensor(data, dtype=dst.dtype, device=_CPU)
    if dst.device.type == "cuda":
        return dst.copy_(t.pin_memory(), non_blocking=True)
    return dst.copy_(t)


def tensor_like(like: torch.Tensor, data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` as a tensor on ``like``'s device (``dtype``: as :func:`torch.as_tensor` infers)."""
    return host_to(like.device, data, dtype)
