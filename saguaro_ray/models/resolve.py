"""Model specs → local checkpoint directories: the one place every engine,
frontend, job and benchmark resolves what a user named.

Resolution may do work — build the zoo family, convert a real model — so it
happens in the driver before any worker starts; loading a checkpoint
(:func:`saguaro_ray.workers.checkpoint.open_checkpoint`) only ever reads a
directory. See :mod:`saguaro_ray.models.spec` for the spec forms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from saguaro_ray.errors import ConfigError
from saguaro_ray.models.real import real_model_path
from saguaro_ray.models.spec import HF_PREFIX, REAL_PREFIX, ZOO_PREFIX, ModelRef, Spec, check_spec, quantized_spec, self_scheme


def _zoo_path(spec: str) -> Path:
    from saguaro_ray.zoo import PRESETS, ROLES, build_family, zoo_root

    preset, sep, role = spec[len(ZOO_PREFIX) :].partition("/")
    expected = (
        f"expected 'zoo:<preset>/<role>' with preset in {{{', '.join(sorted(PRESETS))}}} "
        f"and role in {{{', '.join(ROLES)}}}, e.g. 'zoo:tiny/draft'"
    )
    if not sep or not preset or role not in ROLES or "/" in role:
        raise ConfigError(f"malformed zoo model spec {spec!r}: {expected}")
    if preset not in PRESETS:
        raise ConfigError(f"unknown zoo preset {preset!r} in {spec!r}: {expected}")
    build_family(preset, progress=True)  # returns at once when built
    return zoo_root() / preset / role


def _hf_path(spec: str) -> Path:
    """A snapshot already in the local Hugging Face cache: nothing is downloaded."""
    repo, _, revision = spec[len(HF_PREFIX) :].partition("@")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo, revision=revision or None, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 — not cached, or the hub client missing: say what to do
        raise ConfigError(
            f"{spec}: not found in the local Hugging Face cache ({type(exc).__name__}); run "
            f"`huggingface-cli download {repo}` on every node that runs a worker, or give a local path"
        ) from None


def resolve_model_path(spec: Spec) -> Path:
    """``zoo:<preset>/<role>`` (built on first use), ``real:<name>`` (converted
    on first use), ``hf:<org>/<name>[@revision]`` (the local cache) → that
    directory; anything else is a path, returned as given."""
    if isinstance(spec, str):
        check_spec("target", spec)  # a self-draft names no directory of its own
        if spec.startswith(ZOO_PREFIX):
            return _zoo_path(spec)
        if spec.startswith(REAL_PREFIX):
            return real_model_path(spec[len(REAL_PREFIX) :])
        if spec.startswith(HF_PREFIX):
            return _hf_path(spec)
    return Path(spec)


def resolve_models(specs: Mapping[str, Spec | ModelRef]) -> dict[str, ModelRef]:
    """Role (``target``, ``draft``, ``qualifier``) → :class:`ModelRef`.

    ``self:<scheme>`` in a draft or qualifier role is the target's directory,
    quantised with that scheme at load. An already resolved :class:`ModelRef`
    is kept, so resolving twice (a frontend, then an engine) is harmless.
    """
    if "target" not in specs:
        raise ConfigError("a target model is required")
    for role, spec in specs.items():
        check_spec(role, spec)
    target = specs["target"]
    target_ref = target if isinstance(target, ModelRef) else ModelRef(str(resolve_model_path(target)))
    refs = {"target": target_ref}
    for role, spec in specs.items():
        if role == "target":
            continue
        if isinstance(spec, ModelRef):
            refs[role] = spec
        elif (scheme := self_scheme(spec)) is not None:
            refs[role] = ModelRef(target_ref.path, scheme)
        elif (quantized := quantized_spec(spec)) is not None:
            refs[role] = ModelRef(str(resolve_model_path(quantized[1])), quantized[0])
        else:
            refs[role] = ModelRef(str(resolve_model_path(spec)))
    return refs

