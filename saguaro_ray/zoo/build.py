"""Build a zoo family on disk: where it lives, when a build is complete and
current, and how a build is put in place (the build itself: :mod:`.recipe`).

Layout of a family directory ``DIR``::

    DIR/zoo.json            summary (what ``build_family`` returns)
    DIR/target/             Hugging Face checkpoint (config.json, model.safetensors,
    DIR/qualifier/          generation_config.json, tokenizer files): loadable by
    DIR/draft/              AutoModelForCausalLM / AutoTokenizer.from_pretrained

A build runs in a temporary sibling directory that is renamed into place only
when complete, so an interrupted build never looks finished; an ``fcntl``
lock next to ``DIR`` makes concurrent callers (processes, Ray actors) wait
for the one build and then reuse it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from saguaro_ray.errors import ConfigError
from saguaro_ray.zoo.presets import ROLES, Preset, get_preset
from saguaro_ray.zoo.recipe import BUILD_VERSION, build_into

logger = logging.getLogger(__name__)

SUMMARY_FILE = "zoo.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")


def zoo_root() -> Path:
    """``$SAGUARO_ZOO_DIR`` if set, else ``~/.cache/saguaro-ray/zoo``."""
    env = os.environ.get("SAGUARO_ZOO_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "saguaro-ray" / "zoo"


def _read_complete(dest: Path, preset: Preset) -> dict[str, Any] | None:
    """The summary of a complete, current build at ``dest``, else None."""
    try:
        summary = json.loads((dest / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(summary, dict)
        or summary.get("preset") != preset.name
        or summary.get("version") != BUILD_VERSION
        or summary.get("preset_hash") != preset.hash()
    ):
        return None
    for role in ROLES:
        if not all((dest / role / f).is_file() for f in _REQUIRED_FILES):
            return None
    return summary


class _Reporter:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        logger.info("%s", msg)
        if self.enabled:
            print(f"[zoo] {msg}", file=sys.stderr, flush=True)


def build_family(preset: str, out: str | os.PathLike | None = None, progress: bool = True) -> dict[str, Any]:
    """Build the ``preset`` family into ``out`` (default ``zoo_root()/<preset>``).

    Returns the summary dict (also written to ``DIR/zoo.json``). Returns at
    once when a complete build of the current preset definition is already
    there; concurrent callers wait on a file lock and then reuse the build.
    """
    p = get_preset(preset)
    dest = (Path(out).expanduser() if out is not None else zoo_root() / p.name).absolute()
    summary = _read_complete(dest, p)
    if summary is not None:
        return summary
    say = _Reporter(progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process building {dest} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            summary = _read_complete(dest, p)
            if summary is not None:
                return summary
            if dest.exists() and not (dest / SUMMARY_FILE).exists() and any(dest.iterdir()):
                raise ConfigError(f"{dest} exists and is not a zoo family directory; pass an empty or new directory")
            # Leftovers of interrupted builds (we hold the lock: nobody uses them).
            for stale in dest.parent.glob(f".{dest.name}.building-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            try:
                say(f"building zoo family {p.name!r} into {dest} ({p.description})")
                summary = build_into(tmp, p, say, progress)
                (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
                old = None
                if dest.exists():
                    old = dest.parent / f".{dest.name}.building-old-{os.getpid()}"
                    os.rename(dest, old)
                os.rename(tmp, dest)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            say(f"done in {summary['build_seconds']:.0f} s: {dest}")
            return summary
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)



def format_summary(summary: dict[str, Any]) -> str:
    """A small human-readable table of a family's ``zoo.json`` numbers."""
    c = summary.get("corpus", {})
    vocab = summary.get("tokenizer", {}).get("vocab_size", "?")
    lines = [
        (
            f"zoo family {summary.get('preset', '?')!r} (build v{summary.get('version', '?')}, "
            f"fingerprint {summary.get('fingerprint', '?')})"
        ),
        (
            f"corpus: {c.get('source', '?')} - {c.get('train_files', '?')} train files / "
            f"{c.get('train_tokens', 0):,} tokens; {c.get('heldout_files', '?')} held-out files / "
            f"{c.get('heldout_tokens', 0):,} tokens; vocab {vocab}"
        ),
        "",
        (
            f"{'model':<10} {'params':>9} {'layers':>6} {'hidden':>6} {'heads':>6} {'held-out loss':>13} "
            f"{'agreement':>9} {'build s':>8}"
        ),
    ]
    for role in ROLES:
        m = summary.get("models", {}).get(role)
        if m is None:
            continue
        agree = m.get("greedy_agreement")
        heads = f"{m.get('heads', '?')}/{m.get('kv_heads', '?')}"
        lines.append(
            f"{role:<10} {m['params'] / 1e6:>8.2f}M {m['layers']:>6} {m['hidden_size']:>6} {heads:>6} "
            f"{m['heldout_loss']:>13.3f} {'-' if agree is None else f'{agree:.3f}':>9} "
            f"{m.get('build_seconds', float('nan')):>8.0f}"
        )
    lines.append("")
    lines.append(
        f"agreement = fraction of held-out positions where the model's argmax equals the target's; "
        f"qualifier and draft are distilled together (shared build s); "
        f"total build {summary.get('build_seconds', float('nan')):.0f} s"
    )
    return "\n".join(lines)

