"""User-facing configuration dataclasses, validated at construction.

Validation lives here, once, so the CLI, the Python API and the HTTP server
all reject the same bad values with the same message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from saguaro_ray.algorithms.backup import BackupPolicy
from saguaro_ray.algorithms.pyramid import validate_pyramid
from saguaro_ray.errors import ConfigError

# the largest integer a worker receives: the control plane's msgpack frames and
# the workers' int64 tensors carry no more (a larger top_k or seed would fail
# to encode *after* admission, failing the round of every sequence with it)
INT64_MAX = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


MAX_STOPS = 16  # stop strings per request: each is searched for after every token
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_DEADLINE_S = 86_400.0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence.

    ``temperature == 0`` is greedy decoding (ties go to the lowest token id).
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` makes a
    sample reproducible; ``None`` draws a fresh one. Generation stops at an
    end-of-sequence token unless ``ignore_eos``, or after ``max_tokens``, or
    as soon as the text contains one of the ``stop`` strings (cut before it,
    as OpenAI does) or a token of ``stop_token_ids`` is emitted (kept in the
    token ids, its text left out). The engine checks stops after every token,
    so decoding ends in the round that meets one. ``deadline_s``: seconds the
    request may take from its submission, queueing included; past it the
    engine aborts it (``DeadlineExceededError``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        # a single string or any sequence is accepted; kept as a tuple (hashable, and it rides the wire as one)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS or any(
            not isinstance(x, str) or not 0 < len(x) <= MAX_STOP_CHARS for x in stop
        ):
            raise ConfigError(f"stop must be at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters, got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or len(ids) > MAX_STOP_TOKEN_IDS or any(
            type(t) is not int or not 0 <= t < 2**31 for t in ids
        ):
            raise ConfigError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids, got {self.stop_token_ids!r}")
        d = self.deadline_s
        if d is not None and (not _is_number(d) or not math.isfinite(d) or not 0 < d <= MAX_DEADLINE_S):
            raise ConfigError(f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:g}] or None, got {d!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise ConfigError(f"top_k must be an integer in [0, {INT64_MAX}] (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= INT64_MAX:
            raise ConfigError(f"max_tokens must be a positive integer (at most {INT64_MAX}), got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= INT64_MAX):
            raise ConfigError(f"seed must be an integer in [0, {INT64_MAX}], got {self.seed!r}")

    def check_samples(self, n: int) -> None:
        """Refuse ``n`` samples of one prompt unless every sample's seed fits:
        sample i draws with seed ``seed + i`` (see ``Frontend.make_sequences``),
        and each of those seeds crosses the wire as a 64-bit integer."""
        if not _is_int(n) or n <= 0:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        if self.seed is not None and self.seed + n - 1 > INT64_MAX:
            raise ConfigError(f"seed must be at most {INT64_MAX - n + 1} with n={n} (sample i uses seed + i), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, seed: int | None) -> "SamplingParams":
        return replace(self, seed=seed)


MODES = ("ar", "sd", "ssd", "pyramid")


@dataclass(frozen=True)
class SpeculationConfig:
    """Which decoding mode runs and how it speculates.

    ``k``: draft tokens per round (SD/SSD). ``fanout``: ``"auto"`` (geometric
    allocation of ``budget`` fitted online) or an explicit tuple of K+1 counts.
    ``saguaro_c``: Saguaro sampling's down-weighting C in (0, 1] (1 = off).
    ``backup``: what serves an SSD cache miss. PyramidSD: the draft proposes
    ``ld`` tokens at a time until ``lq`` are qualified; stage rules and
    thresholds as in DESIGN §4 — any τ > 0 is lossy and needs ``allow_lossy``.
    """

    mode: str = "ar"
    k: int = 4
    fanout: str | tuple[int, ...] = "auto"
    budget: int = 8
    saguaro_c: float = 1.0
    backup: str = "neural"
    stage1: str = "exact"
    stage2: str = "exact"
    tau_q: float = 0.0
    tau_t: float = 0.0
    div: str = "reverse_kl"
    lq: int = 4
    ld: int = 2
    allow_lossy: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        BackupPolicy(self.backup)  # validates the name
        for name in ("k", "budget", "lq", "ld"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not 0 < self.saguaro_c <= 1:
            raise ConfigError(f"saguaro_c must be in (0, 1], got {self.saguaro_c!r}")
        if self.fanout != "auto":
            if not isinstance(self.fanout, tuple) or len(self.fanout) != self.k + 1 or any(
                not isinstance(f, int) or f < 0 for f in self.fanout
            ):
                raise ConfigError(f"fanout must be 'auto' or {self.k + 1} non-negative integers (one per k = 0..K), got {self.fanout!r}")
        lossy = validate_pyramid(self.stage1, self.stage2, self.tau_q, self.tau_t, self.div, self.allow_lossy)
        object.__setattr__(self, "_lossy", lossy and self.mode == "pyramid")

    @property
    def lossy(self) -> bool:
        """True only for PyramidSD with a fuzzy stage at τ > 0."""
        return self._lossy  # type: ignore[attr-defined]

    @property
    def needs_draft(self) -> bool:
        return self.mode in ("sd", "ssd", "pyramid")

