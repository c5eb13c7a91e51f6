"""The Serve application's configuration (the ``args`` of a Serve config YAML).

``ServeAppConfig`` is what ``build_app`` takes, as a dict or the model itself::

    model_name: saguaro-zoo-tiny          # the id /v1/models lists and requests name
    target: zoo:tiny/target               # a model directory, zoo:<preset>/<role>, real:<name> or hf:<org>/<name>
    draft: zoo:tiny/draft                 # needed by sd / ssd / pyramid engines (also self:int8, self:int4)
    qualifier: zoo:tiny/qualifier         # needed by pyramid engines
    engines:                              # one engine per entry; the first is the default
      - {mode: ssd, k: 4, budget: 8}
      - {mode: ar}
      - {name: ssd-shared, mode: ssd, k: 4, connect: my-engine}  # attach to a named engine
    engine_options: {device: cpu, worker_cpus: 0.2, threads_per_worker: 1}
    api_keys: []                          # or api_keys_env: SAGUARO_API_KEYS
    num_replicas: 1

Every engine entry is a :class:`~saguaro_ray.config.SpeculationConfig` (its
fields, validated by it) plus ``name`` (default: the mode), ``connect`` (the
name of a detached engine started elsewhere with ``EngineConfig(name=...)``,
attached to instead of launched) and ``options`` (per-engine
:class:`~saguaro_ray.runtime.engine_config.EngineConfig` fields on top of
``engine_options``). A request picks an engine with the ``speculation``
extension object; see :meth:`ServeAppConfig.match`.

``target_tp`` (in ``engine_options``/``options``) shards each engine's target
over that many devices (tensor parallelism, see ``EngineConfig``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from saguaro_ray.config import MODES, SpeculationConfig
from saguaro_ray.errors import ConfigError

if TYPE_CHECKING:
    from saguaro_ray.models.spec import ModelRef

# SpeculationConfig fields an engine entry (and a request's `speculation` object) may set
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculationConfig))
# EngineConfig fields the serve config may not set: they come from the entry itself
_RESERVED = {"target", "draft", "qualifier", "spec", "name", "namespace"}


def engine_config_fields() -> set[str]:
    from saguaro_ray.runtime.engine_config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def _check_engine_options(options: dict[str, Any], where: str = "") -> dict[str, Any]:
    allowed = engine_config_fields() - _RESERVED
    unknown = sorted(set(options) - allowed)
    prefix = f"{where}: " if where else ""
    if unknown:
        raise ValueError(f"{prefix}unknown engine option(s) {unknown}; valid: {sorted(allowed)}")
    return options


class EngineEntry(BaseModel):
    """One engine the deployment holds: a speculation mode and its parameters."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    mode: str = "ar"
    k: int | None = None
    fanout: str | list[int] | None = None
    budget: int | None = None
    saguaro_c: float | None = None
    backup: str | None = None
    stage1: str | None = None
    stage2: str | None = None
    tau_q: float | None = None
    tau_t: float | None = None
    div: str | None = None
    lq: int | None = None
    ld: int | None = None
    allow_lossy: bool | None = None
    connect: str | None = None
    namespace: str = "saguaro-ray"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _validate(self) -> EngineEntry:
        if self.name is None:
            self.name = self.mode
        self.spec()  # raises ConfigError (a ValueError) with the field's message
        _check_engine_options(self.options, f"engine {self.name!r} options")
        return self

    def spec(self) -> SpeculationConfig:
        kwargs = {f: getattr(self, f) for f in SPEC_FIELDS if getattr(self, f) is not None}
        if isinstance(kwargs.get("fanout"), list):
            kwargs["fanout"] = tuple(kwargs["fanout"])
        return SpeculationConfig(**kwargs)

    def describe(self) -> str:
        spec = self.spec()
        if spec.mode == "ar":
            extra = ""
        elif spec.mode == "pyramid":
            extra = f" (lq={spec.lq}, ld={spec.ld}, stage1={spec.stage1}, stage2={spec.stage2})"
        else:
            extra = f" (k={spec.k}" + (f", budget={spec.budget}" if spec.mode == "ssd" else "") + ")"
        return f"{self.name}: {spec.mode}{extra}"


class ServeAppConfig(BaseModel):
    """Arguments of ``saguaro_ray.serve:build_app`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = "saguaro"
    aliases: list[str] = Field(default_factory=list)
    target: str
    draft: str | None = None
    qualifier: str | None = None
    engines: list[EngineEntry] = Field(default_factory=lambda: [EngineEntry(mode="ar")], min_length=1)
    engine_options: dict[str, Any] = Field(default_factory=dict)
    # requests
    default_max_tokens: int = Field(256, gt=0, description="chat completions without max_tokens (clipped to the context)")
    completion_default_max_tokens: int = Field(16, gt=0, description="completions without max_tokens (OpenAI's default)")
    max_n: int = Field(16, gt=0, description="samples one request may ask for (prompts x n)")
    max_stop_sequences: int = Field(4, gt=0)
    max_stop_length: int = Field(256, gt=0, description="characters of one stop sequence")
    max_body_bytes: int = Field(4 * 2**20, gt=0, description="request bodies beyond it get 413, unparsed")
    request_timeout_s: float = Field(600.0, gt=0, description="a request still running after it gets 504 and is abandoned")
    chat_template: str | None = None  # a Jinja template overriding the tokenizer's
    # security
    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None  # env var holding comma-separated keys (read in the replica)
    # deployment
    num_replicas: int = Field(1, gt=0)
    max_ongoing_requests: int = Field(64, gt=0, description="generation requests one replica runs or queues; past it 429")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    health_check_timeout_s: float = Field(30.0, gt=0)
    metrics_interval_s: float = Field(10.0, gt=0)

    @field_validator("engine_options")
    @classmethod
    def _options(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_engine_options(value)

    @model_validator(mode="after")
    def _validate(self) -> ServeAppConfig:
        names = [e.name for e in self.engines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engine names must be unique; repeated: {dupes} (give entries a `name`)")
        for entry in self.engines:
            self.engine_config(entry)  # validates models needed by the mode and every option
        return self

    # ----------------------------------------------------------------- engines
    def engine_options_for(self, entry: EngineEntry) -> dict[str, Any]:
        return {**self.engine_options, **entry.options}

    def engine_config(self, entry: EngineEntry) -> Any:
        """The :class:`EngineConfig` of ``entry`` (validated)."""
        from saguaro_ray.model_set import needed_specs
        from saguaro_ray.runtime.engine_config import EngineConfig

        spec = entry.spec()
        models = needed_specs([spec], self.target, self.draft, self.qualifier)  # only those its mode runs
        return EngineConfig(**models, spec=spec, namespace=entry.namespace, **self.engine_options_for(entry))

    def launch_config(self, entry: EngineEntry, models: dict[str, ModelRef] | None = None) -> Any:
        """``engine_config(entry)`` with ``models`` (role → resolved model, see
        :func:`saguaro_ray.models.resolve_models`) in place of the configured names."""
        config = self.engine_config(entry)
        if models:
            config = dataclasses.replace(
                config,
                target=models["target"].path if "target" in models else config.target,
                draft=models.get("draft", config.draft) if config.draft else None,
                qualifier=models.get("qualifier", config.qualifier) if config.qualifier else None,
            )
        return config

    def model_ids(self) -> list[str]:
        return [self.model_name, *[a for a in self.aliases if a != self.model_name]]

    def resolved_api_keys(self) -> list[str]:
        keys = list(self.api_keys)
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        return keys

    # ----------------------------------------------------------------- routing
    def match(self, request: dict[str, Any] | None) -> EngineEntry:
        """The engine a request's ``speculation`` object selects.

        ``None`` or ``{}``: the first engine. ``{"engine": NAME}`` picks by name;
        ``{"mode": M, "k": K, ...}`` picks the first engine whose mode is M and
        whose configured value equals every other field given (the deployment
        does not re-configure engines per request). Raises :class:`ConfigError`
        naming the available engines when nothing matches.
        """
        if not request:
            return self.engines[0]
        request = dict(request)
        name = request.pop("engine", None) or request.pop("name", None)
        unknown = sorted(set(request) - set(SPEC_FIELDS))
        if unknown:
            raise ConfigError(f"speculation has unknown field(s) {unknown}; valid: engine, {', '.join(SPEC_FIELDS)}")
        mode = request.get("mode")
        if mode is not None and mode not in MODES:
            raise ConfigError(f"speculation.mode must be one of {', '.join(MODES)}; got {mode!r}")
        for entry in self.engines:
            if name is not None and entry.name != name:
                continue
            spec = entry.spec()
            if all(_same(getattr(spec, f), v) for f, v in request.items()):
                return entry
        wanted = ", ".join(f"{k}={v!r}" for k, v in ([("engine", name)] if name else []) + sorted(request.items()))
        available = "; ".join(e.describe() for e in self.engines)
        raise ConfigError(f"no engine of this deployment matches speculation {{{wanted}}}; available: {available}")


def _same(configured: Any, requested: Any) -> bool:
    if isinstance(configured, tuple) and isinstance(requested, list):
        requested = tuple(requested)
    return configured == requested


def parse_config(config: dict[str, Any] | ServeAppConfig | None) -> ServeAppConfig:
    """A validated :class:`ServeAppConfig`; pydantic errors become :class:`ConfigError`."""
    from pydantic import ValidationError

    if isinstance(config, ServeAppConfig):
        return config
    try:
        return ServeAppConfig.model_validate(config or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}")
        raise ConfigError("invalid serve config: " + "; ".join(lines)) from None
