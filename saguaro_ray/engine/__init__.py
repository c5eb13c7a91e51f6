"""Engines: the round loop that drives the worker logic for each decoding mode."""

from saguaro_ray.engine.local import LocalEngine
from saguaro_ray.engine.sequence import GenerationResult, SequenceState

__all__ = ["GenerationResult", "LocalEngine", "SequenceState"]
