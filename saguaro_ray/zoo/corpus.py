"""The zoo's training corpus: the Python standard library of this interpreter.

Files are the ``.py`` sources under ``sysconfig.get_paths()["stdlib"]`` in
sorted relative-path order, skipping ``site-packages`` (third-party code that
differs between environments), files that are not valid UTF-8 (a few encoding
test fixtures), a few very large data-like files, and exact duplicates of an
earlier file (so no held-out text also appears in training). A file belongs to the
*held-out* slice when a stable hash of its relative path falls in the lowest
``HELDOUT_PERCENT`` of 100 buckets, so the split never depends on which other
files exist, and is the same for every preset. Benchmarks take their prompts
from the held-out slice (:func:`heldout_texts`), never from training text.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HELDOUT_PERCENT = 5
MAX_FILE_BYTES = 400_000  # pydoc_data/topics.py (757 kB of doc text) and such
_TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX-style, relative to the stdlib root
    text: str

    @property
    def is_test(self) -> bool:
        return any(part in _TEST_DIR_NAMES for part in self.relpath.split("/")[:-1])


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Whether a file (by its relative path) is in the held-out slice."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


@lru_cache(maxsize=1)
def _all_files() -> tuple[SourceFile, ...]:
    root = stdlib_root()
    out, seen = [], set()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] == "site-packages" or "__pycache__" in rel:
            continue
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n")
        if text.strip() and text not in seen:  # exact duplicates: first path only
            seen.add(text)
            out.append(SourceFile(rel, text))
    return tuple(out)


def corpus_files(*, heldout: bool, include_tests: bool = True, max_bytes: int | None = None) -> list[SourceFile]:
    """Train (``heldout=False``) or held-out files, in sorted path order.

    ``include_tests=False`` drops test suites; ``max_bytes`` keeps an evenly
    spread, deterministic subset of about that many bytes (every n-th file).
    """
    files = [f for f in _all_files() if is_heldout(f.relpath) == heldout]
    if not include_tests:
        files = [f for f in files if not f.is_test]
    if max_bytes is not None:
        total = sum(len(f.text) for f in files)
        if total > max_bytes:
            stride = total / max_bytes
            picked, acc, next_at = [], 0.0, 0.0
            for f in files:
                if acc >= next_at:
                    picked.append(f)
                    next_at += stride * len(f.text)
                acc += len(f.text)
            files = picked
    return files


def corpus_fingerprint() -> str:
    """A short hash of every corpus file's path and content."""
    h = hashlib.sha256()
    for f in _all_files():
        h.update(f.relpath.encode())
        h.update(b"\0")
        h.update(f.text.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def heldout_texts(max_files: int | None = None) -> list[str]:
    """The held-out source files' texts, in sorted path order (deterministic).

    Benchmarks take prompts from here: no zoo model was trained on these files.
    """
    files = corpus_files(heldout=True)
    if max_files is not None:
        files = files[:max_files]
    return [f.text for f in files]
