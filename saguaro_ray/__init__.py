"""saguaro-ray: exact LLM decoding with speculative speculative decoding on Ray."""

from saguaro_ray.errors import (
    CheckpointError,
    ConfigError,
    PromptTooLongError,
    SaguaroError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "PromptTooLongError",
    "SaguaroError",
    "UnsupportedArchitectureError",
    "__version__",
]
