"""User-facing configuration dataclasses, validated at construction.

Validation lives here, once, so the CLI, the Python API and the HTTP server
all reject the same bad values with the same message.
"""

from __future__ import annotations

import json
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
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
LOGPROBS_MODES = ("raw", "processed")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output for one request (OpenAI's ``response_format``).

    ``type``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid against ``schema``, kept as compact JSON
    text so the format is hashable and rides the wire as one string; the
    compiled grammar is cached by it).
    """

    type: str = "text"
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.type not in RESPONSE_FORMATS:
            raise ConfigError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {self.type!r}")
        if (self.type == "json_schema") != (self.schema is not None):
            raise ConfigError("response_format.json_schema.schema is required for type json_schema, and only there")
        if self.schema is not None:
            try:
                parsed = json.loads(self.schema)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"response_format.json_schema.schema must be JSON text: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ConfigError("response_format.json_schema.schema must be a JSON object")

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    @classmethod
    def of(cls, value: "ResponseFormat | dict | None") -> "ResponseFormat | None":
        """``value`` as a :class:`ResponseFormat`: OpenAI's dict shape
        (``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``),
        a ``{"type", "schema"}`` dict, or one already. ``text`` becomes None."""
        if value is None or isinstance(value, ResponseFormat):
            return None if value is None or not value.constrained else value
        if not isinstance(value, dict):
            raise ConfigError(f"response_format must be an object with a type, got {value!r}")
        kind = value.get("type", "text")
        schema = value.get("schema")
        if "json_schema" in value:
            js = value["json_schema"]
            if not isinstance(js, dict) or "schema" not in js:
                raise ConfigError("response_format.json_schema must be an object with a schema")
            schema = js["schema"]
        unknown = sorted(set(value) - {"type", "schema", "json_schema"})
        if unknown:
            raise ConfigError(f"response_format has unknown field(s) {unknown}; valid: type, json_schema")
        if schema is not None and not isinstance(schema, str):
            # key order kept: a grammar writes the properties in the order the schema lists them (as OpenAI does)
            schema = json.dumps(schema, separators=(",", ":"))
        fmt = cls(type=kind, schema=schema)
        return fmt if fmt.constrained else None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence.

    ``temperature == 0`` is greedy decoding (ties go to the lowest token id).
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` fixes the
    sample: the same tokens on every repeat, in every strategy and batch
    (speculation is checked by the drafter-invariant rule: each token is the
    race winner of the target's law under noise keyed by the seed and its
    output position, whatever was proposed); ``None`` draws a fresh seed.
    Generation stops at an end-of-sequence token unless ``ignore_eos``, or after ``max_tokens``, or
    as soon as the text contains one of the ``stop`` strings (cut before it,
    as OpenAI does) or a token of ``stop_token_ids`` is emitted (kept in the
    token ids, its text left out). The engine checks stops after every token,
    so decoding ends in the round that meets one. ``deadline_s``: seconds the
    request may take from its submission, queueing included; past it the
    engine aborts it (``DeadlineExceededError``). ``speculation``: this
    request's :class:`Strategy` (a mode name or a dict is accepted too);
    ``None`` leaves it to the engine's default (``auto`` unless configured
    otherwise). It changes speed, never the output.

    The OpenAI surface (issue 21), exact in every mode:
    ``logprobs``: return the target's log-probability of each emitted token and
    of its ``logprobs`` most likely alternatives (``0``: the token's alone;
    ``None``: off), from the distribution ``logprobs_mode`` names — ``raw``
    (the model's log-softmax, before any processing) or ``processed`` (after
    penalties, bias, grammar, temperature, top-k and top-p: the law sampled).
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI, over the generated
    tokens), ``repetition_penalty`` (Keskar et al., over prompt and generated
    tokens; 1 = off) and ``logit_bias`` (token id → added logit) change the
    target's law at every position, the proposed prefix counted as history.
    ``response_format``: structured output (:class:`ResponseFormat`).
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
    speculation: "Strategy | None" = None
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculation", Strategy.of(self.speculation))
        self._check_openai_fields()
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

    def _check_openai_fields(self) -> None:
        n = self.logprobs
        if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {n!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got {self.logprobs_mode!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ConfigError(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or not 0 < rp <= 10:
            raise ConfigError(f"repetition_penalty must be a number in (0, 10] (1 disables it), got {rp!r}")
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(int(t) if isinstance(t, str) and t.strip().isdigit() else t, b) for t, b in items]
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or len(pairs) > MAX_LOGIT_BIAS or any(
            not _is_int(t) or not 0 <= t < 2**31 or not _is_number(b) or not -100 <= b <= 100 for t, b in pairs
        ):
            raise ConfigError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100], got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in dict(pairs).items())))
        object.__setattr__(self, "response_format", ResponseFormat.of(self.response_format))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Do penalties depend on this sequence's history (the worker must know its tokens)?"""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Is the law changed before temperature (penalties, bias or a grammar)?"""
        return self.penalized or bool(self.logit_bias) or self.response_format is not None

    def with_seed(self, seed: int | None) -> "SamplingParams":
        return replace(self, seed=seed)


MODES = ("ar", "sd", "ssd", "pyramid")  # the fixed strategies
STRATEGY_MODES = ("auto", *MODES)  # what a request or an engine's default may name
DEFAULT_MAX_K = 8  # the largest K auto (and a request) may use unless configured


@dataclass(frozen=True)
class Strategy:
    """How one request's sequences speculate (DESIGN §5, strategy per sequence).

    ``mode``: ``auto`` (the engine picks K, SD or SSD for each sequence before
    every round, from a cost model it fits online) or a fixed ``ar`` / ``sd`` /
    ``ssd`` / ``pyramid``. ``k``: draft tokens per round for ``sd``/``ssd``,
    the largest K ``auto`` may pick for this request; ``None``: the engine's.
    Checked against what the engine allows when the request is submitted
    (:class:`~saguaro_ray.engine.strategy_menu.StrategyMenu`).
    """

    mode: str = "auto"
    k: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in STRATEGY_MODES:
            raise ConfigError(f"speculation.mode must be one of {', '.join(STRATEGY_MODES)}; got {self.mode!r}")
        if self.k is not None:
            if not _is_int(self.k) or self.k < 1:
                raise ConfigError(f"speculation.k must be a positive integer or null, got {self.k!r}")
            if self.mode in ("ar", "pyramid"):
                raise ConfigError(f"speculation.k does not apply to mode {self.mode!r} (ar drafts nothing; pyramid uses the engine's lq/ld)")

    @classmethod
    def of(cls, value: "Strategy | str | dict | None") -> "Strategy | None":
        """``value`` as a :class:`Strategy`: a mode name, a ``{"mode", "k"}`` dict, or one already."""
        if value is None or isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            return cls(mode=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"mode", "k"})
            if unknown:
                raise ConfigError(f"speculation has unknown field(s) {unknown}; valid: mode, k")
            return cls(**value)
        raise ConfigError(f"speculation must be a mode name or an object with mode and k, got {value!r}")


@dataclass(frozen=True)
class SpeculationConfig:
    """How an engine speculates: the strategies its requests may use and their parameters.

    ``mode``: the strategy of a request that names none — ``auto`` (the
    default: the engine picks per sequence and round) or a fixed mode.
    ``allow``: the strategies requests may name; empty: ``mode`` alone, or,
    for ``auto``, every mode the engine's models can run (see
    :func:`~saguaro_ray.model_set.allowed_modes`). One set of workers serves
    them all in one batch. ``k``: draft tokens per round of a fixed SD/SSD
    sequence that names no K; ``max_k`` (default: 8, or ``k`` with an
    explicit fan-out): the largest K a request or ``auto`` may use. ``fanout``: ``"auto"`` (geometric
    allocation of ``budget`` fitted online) or an explicit tuple of K+1 counts.
    ``backup``: what serves an SSD cache miss. PyramidSD: the draft proposes
    ``ld`` tokens at a time until ``lq`` are qualified; stage rules and
    thresholds as in DESIGN §4 — any τ > 0 is lossy and needs ``allow_lossy``.
    """

    mode: str = "auto"
    allow: tuple[str, ...] = ()
    k: int = 4
    max_k: int | None = None
    fanout: str | tuple[int, ...] = "auto"
    budget: int = 8
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
        if self.mode not in STRATEGY_MODES:
            raise ConfigError(f"mode must be one of {', '.join(STRATEGY_MODES)}; got {self.mode!r}")
        allow = (self.allow,) if isinstance(self.allow, str) else self.allow
        if not isinstance(allow, (list, tuple)) or any(m not in STRATEGY_MODES for m in allow):
            raise ConfigError(f"allow must list strategies among {', '.join(STRATEGY_MODES)}; got {self.allow!r}")
        object.__setattr__(self, "allow", tuple(dict.fromkeys(allow)))
        if self.allow and self.mode not in self.allow:
            raise ConfigError(f"the default mode {self.mode!r} must be one of allow {list(self.allow)}")
        BackupPolicy(self.backup)  # validates the name
        for name in ("k", "budget", "lq", "ld"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_k is not None and (not _is_int(self.max_k) or self.max_k < self.k):
            raise ConfigError(f"max_k must be an integer >= k ({self.k}), got {self.max_k!r}")
        if self.fanout != "auto":
            n = self.k_max + 1
            if not isinstance(self.fanout, tuple) or len(self.fanout) != n or any(not isinstance(f, int) or f < 0 for f in self.fanout):
                raise ConfigError(f"fanout must be 'auto' or {n} non-negative integers (one per k = 0..max_k), got {self.fanout!r}")
        lossy = validate_pyramid(self.stage1, self.stage2, self.tau_q, self.tau_t, self.div, self.allow_lossy)
        object.__setattr__(self, "_lossy", lossy and "pyramid" in self.named)

    @property
    def k_max(self) -> int:
        """The largest K any sequence of this engine speculates with."""
        if self.max_k is not None:
            return self.max_k
        return self.k if self.fanout != "auto" else max(self.k, DEFAULT_MAX_K)

    @property
    def named(self) -> tuple[str, ...]:
        """The strategies this config names (``allow``, else ``mode``)."""
        return self.allow or (self.mode,)

    @property
    def lossy(self) -> bool:
        """True only when PyramidSD with a fuzzy stage at τ > 0 is allowed (its requests are lossy)."""
        return self._lossy  # type: ignore[attr-defined]

