"""Reading prompt files: JSONL, one ``{"prompt": ...}`` object a line.

One reader for the CLI (``generate --prompts-file``) and the batch job, so a
malformed line gets the same message (file, line number, what is wrong)
everywhere. A prompt is a string or a list of token ids.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from saguaro_ray.errors import ConfigError


def read_prompt_file(path: str, extra_fields: Iterable[str] = ("id",)) -> list[dict[str, Any]]:
    """Every non-blank line's object; ``extra_fields`` are the keys allowed
    besides ``prompt`` (anything else is refused, naming the line)."""
    allowed = {"prompt", *extra_fields}
    rows: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                prompt = obj.get("prompt") if isinstance(obj, dict) else None
                if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
                    raise ConfigError(f"{path}:{lineno}: expected an object with a \"prompt\" string (or list of token ids)")
                unknown = set(obj) - allowed
                if unknown:
                    raise ConfigError(f"{path}:{lineno}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}")
                rows.append(obj)
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc.strerror}") from None
    if not rows:
        raise ConfigError(f"{path}: no prompts")
    return rows
