"""Pre-packed fp32 linear layers for CPU decoding.

At batch 1 a decoder step is a handful of matrix-vector products, so its time
is the time to stream the weights. PyTorch's default fp32 CPU ``linear`` goes
through MKL, which on the AMD EPYC machines we measure on reaches about half
the memory bandwidth oneDNN does and is slower still for 2–32 rows; oneDNN
with the weight reordered once into its blocked layout is 2–3× faster for
every row count a decoder sees (1-token decode, (K+1)-token verification,
N-branch tree steps). Results differ from ``torch.nn.functional.linear``
only by fp32 summation order.

:func:`pack_linears` swaps every ``nn.Linear`` of a module for a
:class:`PackedLinear` (same ``weight``/``bias`` parameters, plus the packed
copy) when the op is available, the device is the CPU and the dtype fp32;
otherwise it leaves the module alone. ``SAGUARO_PACKED_LINEAR=0`` turns it
off.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` can serve this device and dtype here."""
    if os.environ.get("SAGUARO_PACKED_LINEAR", "1").lower() in ("0", "false", "no", "off"):
        return False
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return ops is not None and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
    except RuntimeError:  # an op namespace without the op raises on lookup in some versions
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered into oneDNN's blocked layout (an opaque copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A linear layer whose forward runs oneDNN on a pre-packed weight.

    ``weight`` and ``bias`` stay the original parameters (state dicts and
    parameter listings are unchanged); the packed copy is derived from them
    when the module is built — call :meth:`repack` after changing them.
    ``dense_single_row``: oneDNN costs ~10 µs more per call than MKL, which
    for one row of a cache-resident weight is most of the call, so such
    products go through ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_single_row: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.dense_single_row = dense_single_row
        self.repack()

    @classmethod
    def from_linear(cls, linear: nn.Linear, dense_single_row: bool = False) -> "PackedLinear":
        return cls(linear.weight, linear.bias, dense_single_row)

    def repack(self) -> None:
        self._packed = pack_weight(self.weight)
        self._bias = None if self.bias is None else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) or (
            self.dense_single_row and x.numel() == self.in_features
        ):
            return F.linear(x, self.weight, self.bias)  # autograd where it is wanted; see dense_single_row
        return packed_linear(x, self._packed, self._bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=oneDNN"


# Below this many bytes of linear weights a model stays cache-resident between
# steps, and single-row products are faster through plain MKL (see PackedLinear).
CACHE_RESIDENT_BYTES = 16 << 20


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear`
    when packing is available for ``device``/``dtype``; returns how many."""
    if not packing_available(device, dtype):
        return 0
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    total = sum(child.weight.numel() * child.weight.element_size() for _, _, child in swaps)
    try:
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear.from_linear(child, dense_single_row=total <= CACHE_RESIDENT_BYTES))
    except RuntimeError as exc:  # a oneDNN build that refuses the shape: keep plain linears
        log.info("oneDNN linear packing unavailable (%s); using torch.nn.functional.linear", exc)
        for parent, name, child in swaps:
            setattr(parent, name, child)
        return 0
    return len(swaps)


__all__ = ["PackedLinear", "pack_linears", "pack_weight", "packed_linear", "packing_available"]
