"""Pre-packed fp32 and bf16 linear layers for CPU decoding, and the kernel choice.

At batch 1 a decoder step is a handful of matrix-vector products, so its time
is the time to stream the weights. PyTorch's default fp32 CPU ``linear`` goes
through MKL, which on the AMD EPYC machines we measure on reaches about half
the memory bandwidth oneDNN does and is slower still for 2–32 rows; oneDNN
with the weight reordered once into its blocked layout is 2–3× faster for
every row count a decoder sees (1-token decode, (K+1)-token verification,
N-branch tree steps). bf16 halves the bytes again: on SmolLM2-135M's linears
and LM head (1 thread, ms per forward for 1/5/8/16 rows) fp32 packed costs
17.5/19.1/23.6/31.9 and bf16 packed 10.2/11.2/13.3/17.6; bf16 ``F.linear``
was 1.2–2.4× slower than bf16 packed in every interleaved run, so bf16 is
packed as well. Results differ from ``torch.nn.functional.linear`` in the
same dtype only by summation order.

:func:`pack_linears` swaps every ``nn.Linear`` of a module (the decoder's LM
head included; a tied head keeps sharing the embedding's parameter) for a
:class:`PackedLinear` when the kernel choice, device and dtype allow it.

The kernel choice is the one documented override, the environment variable
``SAGUARO_LINEAR_KERNEL`` (read when a runner is built; see
:data:`LINEAR_KERNELS`); it reaches Ray workers too, which inherit the
driver's environment.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from saguaro_ray.errors import ConfigError

log = logging.getLogger(__name__)

KERNEL_ENV = "SAGUARO_LINEAR_KERNEL"
LINEAR_KERNELS: dict[str, str] = {
    "auto": "the measured fastest path for the device, dtype and row count (the default)",
    "packed": "oneDNN pre-packed weights for every row count (CPU fp32/bf16; quantised weights are dequantised to bf16)",
    "dense": "torch.nn.functional.linear on plain (dequantised) weights: the reference path",
    "int": "quantised models only: the int8/int4 weight-only kernel for every row count",
}


def linear_kernel() -> str:
    """The kernel choice from ``SAGUARO_LINEAR_KERNEL`` (``auto`` when unset)."""
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in LINEAR_KERNELS:
        raise ConfigError(f"{KERNEL_ENV}={choice!r} is not a linear kernel; expected one of {', '.join(LINEAR_KERNELS)}")
    return choice


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` can serve this device and dtype here."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        if ops is None or not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        # without native bf16 instructions oneDNN would emulate bf16, which is not what was measured
        return dtype == torch.float32 or bool(ops._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):  # an op namespace without the op raises on lookup in some versions
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered into oneDNN's blocked layout (an opaque copy in its dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


EXACT_ROWS = 16
"""Up to this many rows :func:`packed_linear` runs the row count it is given."""


def row_bucket(rows: int) -> int:
    """The row count :func:`packed_linear` runs for ``rows`` rows: ``rows`` up to
    :data:`EXACT_ROWS`, above it the next of eight steps per octave (17..32 in
    steps of 2, 33..64 in steps of 4, ...), so at most 1/8 more rows.

    Why: oneDNN builds (JIT-compiles) a primitive per input shape and keeps it in
    two caches of up to 1,024 entries each (its own and ideep's; a few hundred KB
apiece, judged from the soak's growth, not measured per entry);
    a server's prefills and ragged batches bring a new row count nearly every
    round, so a worker's memory kept growing for the 20 minutes of a soak (issue
    36: +6.9 MiB/min on SmolLM2-135M) and each new count paid a compilation.
    Bucketed, every weight sees at most 16 + 8 per octave shapes (72 up to 2,048
    rows), all kept. Padding is exact where a row's product does not depend on
    how many rows come with it: from two up in fp32, and in bf16, whose calls
    never exceed 32 rows (:data:`BF16_CALL_ROWS`; docs/models.md;
    tests/test_fast_paths.py)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


BF16_CALL_ROWS = 32
"""A bf16 call runs at most this many rows; :func:`packed_linear` splits larger inputs.

Why: from 33 rows up a oneDNN bf16 call sums a row in another order than 2-32
rows do, and which order depends on the call's row count (the 1.5B coder's
weights: first rows off by a bf16 step at 33-160 rows). A bf16 target would
then verify other bits than it decodes once batch x (K + 1) > 32, and a seeded
request's tokens would depend on its strategy and its neighbours. Calls of
2-32 rows share one order, so splitting keeps every row's bits whatever came
with it; it costs one more pass over the weights per 32 rows (the 1.5B's
forward: 1.7x at 40 rows, 2x at 72-160; docs/models.md). fp32 needs no cap
(2-160 rows measured invariant)."""


def _call(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN call on :func:`row_bucket` rows (zero rows added, their outputs dropped)."""
    rows = flat.shape[0]
    bucket = row_bucket(rows)
    if bucket != rows:
        flat = torch.cat([flat, flat.new_zeros(bucket - rows, flat.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return y if bucket == rows else y[:rows]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight from :func:`pack_weight` (``x`` in the weight's
    dtype); bf16 inputs of more than :data:`BF16_CALL_ROWS` rows run as calls of
    near-equal size (16-32 rows each, never the lone row oneDNN sums otherwise)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if flat.dtype == torch.bfloat16 and rows > BF16_CALL_ROWS:
        calls = -(-rows // BF16_CALL_ROWS)
        y = torch.cat([_call(part, packed, bias) for part in flat.tensor_split(calls)])
    else:
        y = _call(flat, packed, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class PackedLinear(nn.Module):
    """A linear layer whose forward runs oneDNN on a pre-packed weight.

    ``weight`` and ``bias`` stay the original parameters (state dicts and
    parameter listings are unchanged, a tied head keeps its tie); the packed
    copy is derived from them when the module is built — call :meth:`repack`
    after changing them.

    Row invariance: oneDNN (fp32 and bf16) sums a lone row in another order
    than the same row among 2 or more (MKL's ``F.linear`` differs up to ~8
    rows), so a 1-token decode would not equal that position inside a
    verification; a single row is computed as two, which costs what one does
    (streaming the weight is the cost). From two rows up every row count
    gives the same bits in fp32 (2-160 rows measured), and in bf16 because no
    call exceeds 32 rows (:data:`BF16_CALL_ROWS`: past them oneDNN sums a row
    in another order, which depends on the row count).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.weight: nn.Parameter | None = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.repack()

    def release_dense(self) -> None:
        """Drop the dense weight and keep only the packed copy: a model served
        for inference needs one copy of its weights, not two (the 1.5B in bf16:
        3.1 GB saved). Afterwards the layer runs without autograd and cannot be
        repacked; a weight another module shares (a tied head) must stay."""
        self.weight = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def repack(self) -> None:
        if self.weight is None:
            raise RuntimeError("this PackedLinear released its dense weight; it cannot be repacked")
        self._packed = pack_weight(self.weight)
        self._bias = None if self.bias is None else self.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # autograd where it is wanted
        if x.numel() == self.in_features:  # one row: as two (see the class docstring)
            return packed_linear(x.reshape(1, -1).expand(2, -1), self._packed, self._bias)[:1].view(*x.shape[:-1], -1)
        return packed_linear(x, self._packed, self._bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"dtype={self.dtype}, packed=oneDNN{'' if self.weight is not None else ' (dense weight released)'}"
        )


def plain_linears(module: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every exact ``nn.Linear`` under ``module`` as ``(parent, attribute, linear)``
    (subclasses such as tensor-parallel row-parallel linears are left alone)."""
    return [(parent, name, child) for parent in module.modules() for name, child in parent.named_children() if type(child) is nn.Linear]


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype, kernel: str = "auto", release_dense: bool = False) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear`
    when ``kernel`` (see :data:`LINEAR_KERNELS`) allows packing and packing is
    available for ``device``/``dtype``; returns how many. ``release_dense``
    (a model served for inference): each packed layer whose weight no other
    module shares drops its dense copy (:meth:`PackedLinear.release_dense`)."""
    if kernel not in ("auto", "packed") or not packing_available(device, dtype):
        return 0
    swaps = plain_linears(module)
    try:
        packed = [PackedLinear.from_linear(child) for _, _, child in swaps]
    except RuntimeError as exc:  # a oneDNN build that refuses the shape: keep plain linears
        log.info("oneDNN linear packing unavailable (%s); using torch.nn.functional.linear", exc)
        return 0
    shared = {id(p) for m in module.modules() if type(m) is not nn.Linear for p in m.parameters(recurse=False)}
    for (parent, name, child), layer in zip(swaps, packed):
        setattr(parent, name, layer)
        if release_dense and id(child.weight) not in shared:
            layer.release_dense()
    return len(swaps)


__all__ = [
    "KERNEL_ENV",
    "LINEAR_KERNELS",
    "BF16_CALL_ROWS",
    "EXACT_ROWS",
    "PackedLinear",
    "linear_kernel",
    "pack_linears",
    "pack_weight",
    "packed_linear",
    "packing_available",
    "plain_linears",
    "row_bucket",
]
