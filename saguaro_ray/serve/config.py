"""The Serve application's configuration (the ``args`` of a Serve config YAML).

``ServeAppConfig`` is what ``build_app`` takes, as a dict or the model itself::

    model_name: saguaro-zoo-tiny          # the id /v1/models lists and requests name
    target: zoo:tiny/target               # a model directory, zoo:<preset>/<role>, real:<name> or hf:<org>/<name>
    draft: zoo:tiny/draft                 # needed by sd / ssd / pyramid (and used by auto; also self:int8, self:int4)
    qualifier: zoo:tiny/qualifier         # needed by pyramid
    speculation: {mode: auto, allow: [auto, ar, sd, ssd], k: 4, max_k: 8, budget: 8, backup: auto}
    engine_options: {device: cpu, worker_cpus: 0.2, threads_per_worker: 1}
    connect: my-engine                    # optional: attach to a named detached engine instead of launching
    api_keys: []                          # or api_keys_env: SAGUARO_API_KEYS
    num_replicas: 1

A replica runs ONE engine for the model: one target (and one set of drafts),
whatever strategies its requests name — each sequence carries its own
(DESIGN §5), so offering SSD with an AR fallback costs no second target copy.
``speculation`` takes :class:`~saguaro_ray.config.SpeculationConfig`'s fields
(validated by it): ``mode`` is the strategy of a request naming none,
``allow`` the strategies requests may name (empty: every one the given models
run, see :func:`~saguaro_ray.model_set.allowed_modes`), ``max_k`` the largest
K a request may ask for. A request names its strategy with the
``speculation`` extension (``{"mode": "sd", "k": 6}`` or ``"ssd"``), checked
by the engine's :class:`~saguaro_ray.engine.strategy_menu.StrategyMenu`.
``engine_options`` are :class:`~saguaro_ray.runtime.engine_config.EngineConfig`
fields; ``target_tp`` there shards the target over that many devices.
``connect`` names a detached engine started elsewhere with
``EngineConfig(name=...)`` (in ``namespace``): the replica attaches to it
instead of launching one, and never stops it; give ``speculation`` the
strategies that engine allows (the replica checks requests against it, the
engine then against its own).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from saguaro_ray.config import SpeculationConfig
from saguaro_ray.errors import ConfigError

if TYPE_CHECKING:
    from saguaro_ray.models.spec import ModelRef

# the fields of the `speculation` block
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculationConfig))
# EngineConfig fields engine_options may not set: they come from the config itself
_RESERVED = {"target", "draft", "qualifier", "spec", "name", "namespace"}
# what `engines:` (a list of engines, each its own target copy) became
_ENGINES_REPLACED = (
    "`engines` was replaced by `speculation` (one engine per model serves every strategy): "
    "write `speculation: {mode: auto, allow: [ar, sd, ssd], k: 4, ...}` with SpeculationConfig's fields, "
    "and `connect: <name>` at the top level to attach to a named engine"
)


def engine_config_fields() -> set[str]:
    from saguaro_ray.runtime.engine_config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def _check_engine_options(options: dict[str, Any]) -> dict[str, Any]:
    allowed = engine_config_fields() - _RESERVED
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; valid: {sorted(allowed)}")
    return options


def speculation_config(fields: dict[str, Any]) -> SpeculationConfig:
    """The ``speculation`` block as a :class:`SpeculationConfig` (YAML lists
    become its tuples); raises :class:`ConfigError` naming a bad field."""
    unknown = sorted(set(fields) - set(SPEC_FIELDS))
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}; valid: {', '.join(SPEC_FIELDS)}")
    kwargs = {f: tuple(v) if isinstance(v, list) else v for f, v in fields.items()}
    return SpeculationConfig(**kwargs)


class ServeAppConfig(BaseModel):
    """Arguments of ``saguaro_ray.serve:build_app`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = "saguaro"
    aliases: list[str] = Field(default_factory=list)
    target: str
    draft: str | None = None
    qualifier: str | None = None
    speculation: dict[str, Any] = Field(default_factory=dict, description="SpeculationConfig fields: the strategies requests may use")
    engine_options: dict[str, Any] = Field(default_factory=dict)
    connect: str | None = None  # a detached engine's name: attach to it instead of launching one
    namespace: str = "saguaro-ray"
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

    @model_validator(mode="before")
    @classmethod
    def _no_engines(cls, data: Any) -> Any:
        """A config written for the engine-per-mode deployment is refused with
        what replaced it, not half-read (no compatibility shim)."""
        if isinstance(data, dict) and "engines" in data:
            raise ValueError(_ENGINES_REPLACED)
        return data

    @field_validator("speculation")
    @classmethod
    def _speculation(cls, value: dict[str, Any]) -> dict[str, Any]:
        speculation_config(value)  # raises ConfigError (a ValueError) with the field's message
        return value

    @field_validator("engine_options")
    @classmethod
    def _options(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_engine_options(value)

    @model_validator(mode="after")
    def _validate(self) -> ServeAppConfig:
        self.engine_config()  # validates the models the allowed strategies need and every option
        return self

    # ----------------------------------------------------------------- the engine
    def spec(self) -> SpeculationConfig:
        return speculation_config(self.speculation)

    def engine_config(self) -> Any:
        """The :class:`EngineConfig` of the deployment's engine (validated)."""
        from saguaro_ray.model_set import needed_specs
        from saguaro_ray.runtime.engine_config import EngineConfig

        spec = self.spec()
        models = needed_specs([spec], self.target, self.draft, self.qualifier)  # only those its strategies run
        return EngineConfig(**models, spec=spec, namespace=self.namespace, **self.engine_options)

    def launch_config(self, models: dict[str, ModelRef] | None = None) -> Any:
        """``engine_config()`` with ``models`` (role → resolved model, see
        :func:`saguaro_ray.models.resolve_models`) in place of the configured names."""
        config = self.engine_config()
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
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}" if loc else msg)
        raise ConfigError("invalid serve config: " + "; ".join(lines)) from None
