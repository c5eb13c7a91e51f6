"""saguaro-ray: exact LLM decoding with speculative speculative decoding on Ray."""

from saguaro_ray.errors import (
    CheckpointError,
    ConfigError,
    PromptTooLongError,
    SaguaroError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"


def __getattr__(name: str):  # Ray is imported only when the distributed engine is used
    if name in ("Engine", "EngineHandle", "connect"):
        from saguaro_ray.runtime import engine

        return getattr(engine, name)
    if name == "EngineConfig":
        from saguaro_ray.runtime.engine_config import EngineConfig

        return EngineConfig
    if name in ("SamplingParams", "SpeculationConfig", "Strategy"):
        from saguaro_ray import config

        return getattr(config, name)
    raise AttributeError(f"module 'saguaro_ray' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "SpeculationConfig",
    "Strategy",
    "connect",
    "ConfigError",
    "PromptTooLongError",
    "SaguaroError",
    "UnsupportedArchitectureError",
    "__version__",
]
