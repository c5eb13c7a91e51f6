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
"""

from saguaro_ray.models.gguf_import import import_gguf, read_gguf_info
from saguaro_ray.models.real import REAL_MODELS, list_real_models, models_root, real_model_path
from saguaro_ray.models.resolve import resolve_model_path, resolve_models
from saguaro_ray.models.spec import QUANT_SCHEMES, ModelRef

__all__ = [
    "QUANT_SCHEMES",
    "REAL_MODELS",
    "ModelRef",
    "import_gguf",
    "list_real_models",
    "models_root",
    "read_gguf_info",
    "real_model_path",
    "resolve_model_path",
    "resolve_models",
]
