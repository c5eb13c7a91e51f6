"""GGUF file → Hugging Face checkpoint directory that our runner loads.

The conversion is transformers' own GGUF support end to end (the ``gguf``
package reads and dequantises the blocks, transformers maps the tensor names
and un-permutes llama.cpp's q/k layout and builds the tokenizer and chat
template from the metadata): no dequantiser of ours, so what we write is what
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` computes. Loading
with ``GgufConfig(dequantize=True)`` gives a plain dense model that
``save_pretrained`` writes as ordinary safetensors (a model loaded with its
blocks kept packed is marked quantised and refuses to be saved).

The file is checked before transformers sees it — that it parses as GGUF (a
truncated or corrupt file fails here, in one line) and that its architecture
is one our runner runs — and the written directory is opened with our own
checkpoint reader before it is published. It is written into a temporary
sibling and renamed into place, so a crash or a second process importing to
the same place never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from saguaro_ray.errors import CheckpointError, ConfigError, UnsupportedArchitectureError

log = logging.getLogger(__name__)

# Bump when a change here changes what an import writes: cached conversions
# (``real:`` models) with an older stamp are converted again.
CONVERTER_VERSION = 1
STAMP_FILE = "saguaro-import.json"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class GGUFInfo:
    """What the file's metadata says, read without loading any tensor."""

    path: Path
    architecture: str
    name: str | None
    tensor_types: dict[str, int]  # GGML type name → how many tensors have it


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_gguf_info(gguf_file: str | os.PathLike) -> GGUFInfo:
    """Parse the GGUF header (every tensor's extent included, so a truncated
    file is caught here); raises :class:`CheckpointError` in one line."""
    from gguf import GGUFReader

    path = Path(gguf_file).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file, corrupt or truncated ({_one_line(exc)})") from None

    def text(key: str) -> str | None:
        field = reader.get_field(key)
        value = None if field is None else field.contents()
        return value if isinstance(value, str) else None

    arch = text("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: the GGUF metadata has no general.architecture")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return GGUFInfo(path=path, architecture=arch, name=text("general.name"), tensor_types=dict(types))


def supported_architectures() -> tuple[str, ...]:
    """GGUF architectures we import: the ones transformers' GGUF loader reads
    whose model type our runner runs."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from saguaro_ray.workers.model_config import SUPPORTED_MODEL_TYPES

    return tuple(a for a in SUPPORTED_MODEL_TYPES if a in GGUF_SUPPORTED_ARCHITECTURES)


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def _convert(info: GGUFInfo, into: Path, dtype: str) -> None:
    """transformers reads the file (dequantising to ``dtype``) and saves it into ``into``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, name = str(info.path.parent), info.path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=_torch_dtype(dtype), quantization_config=GgufConfig(dequantize=True)
        )
    except (ValueError, KeyError, IndexError, TypeError, OSError, RuntimeError, NotImplementedError) as exc:
        log.debug("transformers could not load %s", info.path, exc_info=True)
        raise CheckpointError(f"{info.path}: transformers could not read this GGUF ({_one_line(exc)})") from None
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)


def import_gguf(
    gguf_file: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "float32",
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint directory ``out`` (new, or an empty directory) from
    ``gguf_file`` with weights in ``dtype``; returns ``out``.

    ``out/saguaro-import.json`` records the converter version, the source and
    ``provenance`` (what a cache needs to tell a current conversion from a
    stale one).
    """
    from saguaro_ray.workers.checkpoint import open_checkpoint

    _torch_dtype(dtype)
    info = read_gguf_info(gguf_file)
    supported = supported_architectures()
    if info.architecture not in supported:
        raise UnsupportedArchitectureError(
            f"{info.path}: GGUF architecture {info.architecture!r} is not supported; supported: {', '.join(supported)}"
        )
    dest = Path(out).expanduser().absolute()
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise CheckpointError(f"{dest} already exists and is not an empty directory; remove it or choose another output")
    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.importing-", dir=dest.parent))  # (real.py clears leftovers)
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        _convert(info, tmp, dtype)
        open_checkpoint(tmp)  # our reader accepts it: config, weights and tokenizer
        stat = info.path.stat()
        stamp = {
            "converter_version": CONVERTER_VERSION,
            "source": str(info.path.absolute()),
            "source_bytes": stat.st_size,
            "architecture": info.architecture,
            "name": info.name,
            "tensor_types": info.tensor_types,
            "dtype": dtype,
            "seconds": round(time.perf_counter() - t0, 3),
            "provenance": dict(provenance or {}),
        }
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=1) + "\n")
        try:
            os.rename(tmp, dest)  # atomic; refuses if another import filled ``dest`` meanwhile
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise CheckpointError(f"{dest} was written by another process meanwhile; remove it or choose another output") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("imported %s (%s) into %s in %.1f s", info.path, info.architecture, dest, time.perf_counter() - t0)
    return dest


def read_stamp(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The import stamp of a checkpoint directory, or ``None`` (none, unreadable)."""
    try:
        stamp = json.loads((Path(checkpoint) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None
