"""What a bench command compares: its mode labels as request strategies, and its temperature settings.

One engine serves every strategy per request (DESIGN §5), so a benched mode
is a :class:`~saguaro_ray.config.Strategy` its requests carry, named by a
label of ``--modes``: ``ar``, ``sd``, ``ssd``, ``pyramid``, ``auto``, and
``sd:K`` / ``ssd:K`` for a K sweep (``sd`` alone: the engine's ``--k``);
``hf-ar`` and ``hf-assisted`` are the transformers peers, which no engine
runs. A temperature setting is one temperature for every request of a run,
or a mix (``--mixed``): request j of a run at the mix's temperature j mod n,
so each batch of a run holds every temperature at once — traffic no single
fixed mode serves best. A sampling setting (``--sampling``, repeatable) is
the other request fields a run's requests carry (penalties, ``logit_bias``,
...): several of them run interleaved like the modes, so a feature's cost is
its tokens/s against the plain setting's in the same run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from saguaro_ray.config import STRATEGY_MODES, SamplingParams, Strategy
from saguaro_ray.errors import ConfigError

PEER_MODES = ("hf-ar", "hf-assisted")  # run by saguaro_ray.bench.peers
SWEEP_MODES = ("sd", "ssd")  # the modes a label may give a K (``sd:K``)


@dataclass(frozen=True)
class BenchMode:
    """One label of ``--modes``: the strategy its requests carry (None for a peer)."""

    label: str
    strategy: Strategy | None

    @property
    def mode(self) -> str:
        """The strategy's mode (a peer: its name)."""
        return self.strategy.mode if self.strategy else self.label


def base_mode(label: str) -> str:
    """``sd:2`` → ``sd``: the mode a report row's label runs."""
    return label.split(":", 1)[0]


def in_turn(items: list[Any], turn: int) -> list[Any]:
    """``items`` rotated to start at ``turn`` (mod their number): the order in
    which the compared modes generate their ``turn``-th batch, so none always
    goes first or last (the bench's cells and the demo)."""
    start = turn % len(items) if items else 0
    return items[start:] + items[:start]


def parse_mode(label: str) -> BenchMode:
    """A ``--modes`` label as a :class:`BenchMode`; :class:`ConfigError` names the bad label."""
    if label in PEER_MODES:
        return BenchMode(label, None)
    mode, sep, k = label.partition(":")
    if mode not in STRATEGY_MODES:
        raise ConfigError(f"--modes: unknown mode {label!r}; choose from {', '.join(STRATEGY_MODES + PEER_MODES)}, or sd:K / ssd:K")
    if not sep:
        return BenchMode(label, Strategy(mode))
    if mode not in SWEEP_MODES:
        raise ConfigError(f"--modes: only {' and '.join(SWEEP_MODES)} take a K (sd:K, ssd:K), got {label!r}")
    if not k.isdigit() or int(k) < 1:
        raise ConfigError(f"--modes: K must be a positive integer (sd:K, ssd:K), got {label!r}")
    return BenchMode(label, Strategy(mode, int(k)))


def parse_modes(labels: list[str]) -> list[BenchMode]:
    """Every label of ``--modes``, each once."""
    if not labels:
        raise ConfigError("--modes: name at least one mode")
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError(f"--modes names {', '.join(twice)} more than once")
    return [parse_mode(x) for x in labels]


@dataclass(frozen=True)
class TemperatureSetting:
    """The temperatures of one run's requests: one value, or a mix."""

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values or any(not isinstance(t, (int, float)) or t < 0 for t in self.values):
            raise ConfigError(f"temperatures must be numbers >= 0, got {list(self.values)}")

    @property
    def label(self) -> float | str:
        """The report's ``temperature``: the value, or ``mix:0,0.7`` for a mix."""
        if len(self.values) == 1:
            return float(self.values[0])
        return "mix:" + ",".join(f"{t:g}" for t in self.values)

    def for_request(self, j: int) -> float:
        """Request j of a run (in submission order) runs at the mix's temperature j mod n."""
        return float(self.values[j % len(self.values)])


def temperature_settings(temperatures: list[float], mixed: list[float] | None) -> list[TemperatureSetting]:
    """Every temperature of ``--temperatures`` alone, then the ``--mixed`` mix if asked for."""
    settings = [TemperatureSetting((t,)) for t in temperatures]
    if mixed is not None:
        if len(set(mixed)) < 2:
            raise ConfigError(f"--mixed needs at least two different temperatures, got {mixed}")
        settings.append(TemperatureSetting(tuple(mixed)))
    return settings


BENCH_FIELDS = ("temperature", "max_tokens", "seed", "ignore_eos", "speculation")  # what the bench's own flags set


@dataclass(frozen=True)
class SamplingSetting:
    """The :class:`SamplingParams` fields a run's requests carry besides the
    bench's own (``--sampling '{"presence_penalty": 0.5}'``, ``'{"logprobs": 5}'``,
    ``'{"response_format": {"type": "json_object"}}'``); empty: plain sampling."""

    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        owned = sorted(set(self.params) & set(BENCH_FIELDS))
        if owned:
            raise ConfigError(f"--sampling sets {', '.join(owned)}: the bench's own flags set {', '.join(BENCH_FIELDS)}")
        unknown = sorted(set(self.params) - {f.name for f in fields(SamplingParams)})
        if unknown:
            raise ConfigError(f"--sampling has unknown field(s) {unknown}; it takes SamplingParams fields")
        SamplingParams(**self.params)  # its values are checked as every request's are

    @property
    def label(self) -> str | None:
        """The report's ``sampling``: the fields as canonical JSON, None when plain."""
        return json.dumps(self.params, sort_keys=True, separators=(",", ":")) if self.params else None


def sampling_settings(values: list[dict[str, Any]] | None) -> list[SamplingSetting]:
    """Every ``--sampling`` object, each once (none given: plain sampling alone)."""
    settings = [SamplingSetting(v) for v in values or [{}]]
    labels = [s.label for s in settings]
    if len(set(labels)) < len(labels):
        raise ConfigError("--sampling names one setting more than once")
    return settings
