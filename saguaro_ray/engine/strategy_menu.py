"""What strategies an engine offers its requests, and a request's strategy checked against them.

One engine serves every mode (DESIGN §5): each sequence carries its own
:class:`~saguaro_ray.config.Strategy`. The :class:`StrategyMenu` is the one
place a requested strategy is checked — a mode the deployment does not
allow, a K beyond the engine's ``max_k``, PyramidSD without a qualifier —
before anything of the request is queued, with a message naming the field
(the Serve app answers it as an OpenAI-shaped 400).
"""

from __future__ import annotations

from dataclasses import dataclass

from saguaro_ray.algorithms.strategy_views import AUTO_MODES
from saguaro_ray.config import SpeculationConfig, Strategy
from saguaro_ray.errors import ConfigError
from saguaro_ray.model_set import allowed_modes


@dataclass(frozen=True)
class StrategyMenu:
    """``default``: the strategy of a request naming none; ``allowed``: what
    requests may name; ``k``: a fixed SD/SSD request's K when it names none;
    ``max_k``: the largest K any sequence uses."""

    default: str
    allowed: tuple[str, ...]
    k: int
    max_k: int
    has_draft: bool
    has_qualifier: bool

    @classmethod
    def of(cls, spec: SpeculationConfig, has_draft: bool, has_qualifier: bool) -> "StrategyMenu":
        return cls(spec.mode, allowed_modes(spec, has_draft, has_qualifier), spec.k, spec.k_max, has_draft, has_qualifier)

    @property
    def auto_modes(self) -> tuple[str, ...]:
        """The fixed modes ``auto`` chooses among: AR, and SD/SSD with a draft."""
        return AUTO_MODES if self.has_draft else ("ar",)

    def resolve(self, requested: Strategy | None) -> Strategy:
        """``requested`` (None: the default) with its K filled in: the
        request's strategy as its sequences run it. Raises
        :class:`ConfigError` naming ``speculation.mode`` or ``speculation.k``."""
        s = requested or Strategy(self.default)
        if s.mode == "pyramid" and not self.has_qualifier:
            raise ConfigError("speculation.mode 'pyramid' needs a qualifier model, and this engine has none")
        if s.mode in ("sd", "ssd", "pyramid") and not self.has_draft:
            raise ConfigError(f"speculation.mode {s.mode!r} needs a draft model, and this engine has none")
        if s.mode not in self.allowed:
            raise ConfigError(f"speculation.mode {s.mode!r} is not allowed by this engine; allowed: {', '.join(self.allowed)}")
        if s.k is not None and s.k > self.max_k:
            raise ConfigError(f"speculation.k must be at most {self.max_k} (the engine's max_k), got {s.k}")
        return self.filled(s)

    def filled(self, s: Strategy) -> Strategy:
        """``s`` with the engine's K where it names none (no checks: see :meth:`resolve`)."""
        if s.mode in ("sd", "ssd"):
            return Strategy(s.mode, s.k or self.k)
        if s.mode == "auto":
            return Strategy("auto", s.k or self.max_k)
        return s
