"""Weight-only quantised linear layers: the target's own weights as a self-draft.

A self-draft is the target with its linear weights rounded at load (see
:data:`SCHEMES`): ``int8`` per output channel everywhere, or ``int4`` in
groups of 32 inputs for the decoder's linears with the LM head in int8.
Activations stay floating point: quantising them too (torch's dynamic int8
fbgemm linear) was fast but agreed with the fp32 model's greedy tokens only
62% of the time. Greedy agreement on SmolLM2-135M-Instruct (4 chat + 4
HumanEval prompts × 64 tokens of the target's own greedy continuation, one
token per step) with the fp32 / the bf16 target: int8 0.973 / 0.959; int4
with an int8 head 0.979 / 0.975, with an int4 head only 0.881 / 0.908 (the
head, a tied embedding, is the sensitive part). The embedding lookup keeps
exact float rows; a tied head gets its own quantised copy of the embedding.

Kernels (SmolLM2-135M's 120 linears + its 49152×576 head, 1 thread, this
2-core AMD EPYC with avx512_bf16; ms per forward for M = 1/2/4/5/8/16 rows,
the least of 15 interleaved repetitions; the machine was shared):

=====================================  =====  =====  =====  =====  =====  =====
fp32 oneDNN packed (the float default)  17.1   18.2   19.0   19.8   24.9   32.8
bf16 oneDNN packed                       9.6    9.9   10.2   11.0   13.2   17.1
``_weight_int8pack_mm``, bf16 x          8.9    8.2    9.1   14.0   16.8   29.9
``_weight_int4pack_mm_for_cpu``, bf16 x  5.1    5.5    7.0   10.5   13.4   25.2
:class:`QuantizedLinear` int8, auto     10.1    9.3   10.3   13.0   15.5   20.2
:class:`QuantizedLinear` int4, auto      6.9    7.0    8.4   11.5   14.5   19.2
=====================================  =====  =====  =====  =====  =====  =====

The int kernels' cost grows in steps of a few rows: int8 beats bf16 oneDNN
up to 4 rows, int4 up to 8 (at 5–8 rows by ~1 ms, at 16 it is 1.5× slower),
so each :class:`QuantFormat` carries its crossover (``int_rows``) and the
``auto`` kernel runs the int kernel up to it and bf16 oneDNN on the
dequantised weights above (a wide tree step). The two compute in bf16 whatever
the runner's dtype and differ only by rounding; the auto rows above include
the runner's fp32↔bf16 casts (~1 ms). Left out because slower: the int
kernels with fp32 activations are scalar code (int8 85 ms at M = 1, 1764 at
16; int4 191 and 3116); dequantising per call (to bf16 then ``F.linear``:
94–127 ms; then oneDNN packing: 159–248); torchao 0.18's int8 weight-only
path, which is that dequantise-and-``mm`` (53–61). torchao's int4 CPU path is
the same ``_weight_int4pack_mm_for_cpu`` op, so torchao is not a dependency.
Other devices run ``F.linear`` on the dequantised weights (the reference; no
int kernel was measured there).

A quantised runner is simply another model: the logits it returns are the
law its tokens are drawn from, whichever kernel computed them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.linear import pack_weight, packed_linear, packing_available, plain_linears

if TYPE_CHECKING:
    from saguaro_ray.workers.decoder import Decoder


@dataclass(frozen=True)
class QuantFormat:
    """How a weight is rounded: ``bits`` per weight, one scale per output
    channel (``group_size`` None) or one scale and zero per ``group_size`` inputs.
    ``int_rows``: up to this many rows the format's int kernel beats bf16
    oneDNN on the CPU (measured; see the module docstring)."""

    bits: int
    group_size: int | None
    int_rows: int


INT8_PER_CHANNEL = QuantFormat(8, None, int_rows=4)  # symmetric
INT4_GROUP32 = QuantFormat(4, 32, int_rows=8)  # asymmetric


@dataclass(frozen=True)
class QuantScheme:
    """The format of the decoder's linears and that of its LM head."""

    linears: QuantFormat
    head: QuantFormat


# The one home of the scheme names (a model spec such as ``self:int8`` uses these keys).
# int4 keeps an int8 head: with the head in int4 too its greedy agreement was 0.88.
SCHEMES: dict[str, QuantScheme] = {
    "int8": QuantScheme(INT8_PER_CHANNEL, INT8_PER_CHANNEL),
    "int4": QuantScheme(INT4_GROUP32, INT8_PER_CHANNEL),
}

# What the int kernels compute in: their fp32 paths are scalar code.
COMPUTE_DTYPE = torch.bfloat16
# _convert_weight_to_int4pack_for_cpu wants a multiple of 16 output channels
_INT4_ROWS = 16


def scheme(name: str) -> QuantScheme:
    """The scheme called ``name``; an unknown name is a one-line :class:`ConfigError`."""
    if name not in SCHEMES:
        raise ConfigError(f"unknown quantization {name!r}; expected one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


@dataclass
class QuantizedWeight:
    """``codes [N, K]`` with ``scales`` (and ``zeros``) in :data:`COMPUTE_DTYPE`.

    int8: ``w = codes · scales[n]``, codes in [-127, 127].
    int4: ``w = (codes − 8) · scales[n, g] + zeros[n, g]``, codes in [0, 15]
    (the convention of torch's int4 kernel), g = k // group_size.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the quantised model uses, ``[N, K]`` in ``dtype``."""
        if self.zeros is None:
            return (self.codes.float() * self.scales.float()[:, None]).to(dtype)
        n, k = self.codes.shape
        codes = self.codes.float().view(n, k // self.group_size, self.group_size) - 8
        return (codes * self.scales.float()[..., None] + self.zeros.float()[..., None]).view(n, k).to(dtype)


def quantize_weight(weight: torch.Tensor, qs: QuantFormat) -> QuantizedWeight:
    """Round ``weight [N, K]`` to format ``qs`` (round to nearest, deterministic)."""
    w = weight.detach().float()
    n, k = w.shape
    if qs.group_size is None:
        scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(COMPUTE_DTYPE)
        codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(codes, scales, None, None)
    g = qs.group_size
    levels = 2**qs.bits - 1
    groups = w.view(n, k // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny).to(COMPUTE_DTYPE)
    zeros = (lo + 2 ** (qs.bits - 1) * scales.float()).to(COMPUTE_DTYPE)
    # codes against the rounded scale and zero, so dequantize() is what the kernel computes
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 2 ** (qs.bits - 1)
    return QuantizedWeight(codes.clamp(0, levels).to(torch.uint8).view(n, k), scales, zeros, g)


class QuantizedLinear(nn.Module):
    """``y = x @ dequantize(W).T + b`` through the kernel ``kernel`` chose.

    ``kernel``: ``auto`` (CPU: the int kernel up to ``qs.int_rows``
    rows, bf16 oneDNN above; elsewhere ``dense``), ``int``, ``packed`` or
    ``dense`` (``F.linear`` on the dequantised weight in ``dtype``). Only the
    tensors the chosen paths read are kept; the float weight is dropped.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, qs: QuantFormat, kernel: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = qs.bits, qs.group_size
        device = weight.device
        if kernel == "int" and device.type != "cpu":
            raise ConfigError(f"the int linear kernel runs on the CPU only, not on {device.type}")
        packed = kernel in ("auto", "packed") and packing_available(device, COMPUTE_DTYPE)
        if kernel == "packed" and not packed:
            raise ConfigError(f"the packed linear kernel needs oneDNN bf16 on the CPU, not available on {device.type}")
        # the int kernel serves up to int_rows rows, oneDNN the rest
        if kernel == "int" or (kernel == "auto" and device.type == "cpu" and not packed):
            self.int_rows = sys.maxsize
        else:
            self.int_rows = qs.int_rows if kernel == "auto" and packed else 0
        q = quantize_weight(weight, qs)
        on_cpu_kernels = packed or self.int_rows > 0
        dense = q.dequantize(COMPUTE_DTYPE if on_cpu_kernels else dtype)
        kept_bias = None if bias is None else bias.detach().to(COMPUTE_DTYPE if on_cpu_kernels else dtype, copy=True)
        self.register_buffer("bias", kept_bias, persistent=False)
        self._packed = pack_weight(dense) if packed else None
        self._dense = None if on_cpu_kernels else dense
        self._codes, self._scales = self._int_kernel_operands(q) if self.int_rows else (None, None)

    def _int_kernel_operands(self, q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        if q.zeros is None:
            return q.codes, q.scales
        pad = -self.out_features % _INT4_ROWS  # zero rows, sliced off the output
        codes = F.pad(q.codes.to(torch.int32), (0, 0, 0, pad))
        sz = F.pad(torch.stack([q.scales, q.zeros], -1), (0, 0, 0, 0, 0, pad))
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz.transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return F.linear(x, self._dense, self.bias)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the decoder's activations are 2-D already
        xc = flat if flat.dtype == COMPUTE_DTYPE else flat.to(COMPUTE_DTYPE)
        if xc.shape[0] > self.int_rows:
            y = packed_linear(xc, self._packed, self.bias)
        else:
            if self.group_size is None:
                y = torch.ops.aten._weight_int8pack_mm(xc, self._codes, self._scales)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, self._codes, self.group_size, self._scales)
                if y.shape[1] != self.out_features:
                    y = y[:, : self.out_features]
            if self.bias is not None:
                y = y + self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        if self._dense is not None:
            path = "dense"
        else:
            path = "packed" if not self.int_rows else "int" if self._packed is None else f"int up to {self.int_rows} rows, packed above"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits}, group={self.group_size or 'channel'}, kernel={path}"
        )


def quantize_decoder(model: Decoder, name: str, dtype: torch.dtype, kernel: str = "auto") -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantizedLinear`:
    the LM head (tied or not; both linears of a reduced-vocabulary
    :class:`~saguaro_ray.kernels.subset_head.SubsetHead`) in the scheme's head
    format, the others in its linears format; returns how many.

    Groups must tile each input dimension: a model whose linears have an
    input size that is not a multiple of the group size is refused with a
    :class:`ConfigError` before anything is replaced.
    """
    qs = scheme(name)
    head = model.lm_head  # or a SubsetHead, whose linears (subset and full) are the head too

    def fmt_of(parent: nn.Module, child: nn.Linear) -> QuantFormat:
        return qs.head if child is head or parent is head else qs.linears

    swaps = [(parent, attr, child, fmt_of(parent, child)) for parent, attr, child in plain_linears(model)]
    for _, attr, child, fmt in swaps:
        if fmt.group_size is not None and child.in_features % fmt.group_size:
            raise ConfigError(
                f"{name} quantization needs linear input sizes divisible by {fmt.group_size}; {attr} has {child.in_features}"
            )
    for parent, attr, child, fmt in swaps:
        setattr(parent, attr, QuantizedLinear(child.weight, child.bias, fmt, kernel, dtype))
    return len(swaps)


__all__ = [
    "INT4_GROUP32",
    "INT8_PER_CHANNEL",
    "QuantFormat",
    "QuantScheme",
    "QuantizedLinear",
    "QuantizedWeight",
    "SCHEMES",
    "quantize_decoder",
    "quantize_weight",
    "scheme",
]
