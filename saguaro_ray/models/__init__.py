"""Models from outside the project: GGUF import, named real models (``real:``),
quantised self-drafts (``self:``), drafts distilled from a target, and the one
resolver of model specs.

Public API::

    resolve_model_path(spec)  -> Path                   (zoo:, real:, hf:, a directory)
    resolve_models({"target": ..., "draft": ...}) -> {role: ModelRef}   (also self:<scheme>)
    import_gguf(gguf_file, out, dtype="float32") -> Path
    real_model_path(name)     -> Path                   (converted once, cached)
    list_real_models()        -> list[dict]
    distill_draft(target, out, DistillSpec(...)) -> DistillResult   (saguaro_ray.models.distill)

Names are imported on first use (PEP 562): a worker that only loads a
checkpoint imports :mod:`saguaro_ray.models.spec` through this package, and
must not pull in the resolver, which can build (train) the zoo family.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "QUANT_SCHEMES": "spec",
    "ModelRef": "spec",
    "REAL_MODELS": "real",
    "list_real_models": "real",
    "models_root": "real",
    "real_model_path": "real",
    "import_gguf": "gguf_import",
    "read_gguf_info": "gguf_import",
    "resolve_model_path": "resolve",
    "resolve_models": "resolve",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'saguaro_ray.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"saguaro_ray.models.{_HOMES[name]}"), name)
