"""``python -m saguaro_ray.jobs.generate --input prompts.jsonl --output results.jsonl [...]``

Offline batch generation through the distributed engine, meant for ``ray job
submit``::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m saguaro_ray.jobs.generate --input prompts.jsonl --output /data/results.jsonl \\
        --target zoo:tiny/target --draft zoo:tiny/draft --mode ssd --k 4 --temperature 0 --max-tokens 64

Input: JSONL, one object a line with ``"prompt"`` (a string or a list of token
ids) and optionally per-prompt ``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``ignore_eos``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias`` (``{"token id": bias}``), ``logprobs``,
``logprobs_mode`` overriding the flags. Blank lines are skipped; a prompt's ``index`` is its position among the prompts (0-based).

Output: JSONL, one object per sample: ``index``, ``prompt``, and the fields
of ``saguaro-ray generate --json`` (``prompt_index`` = ``index``,
``sample_index``, ``mode``, ``token_ids``, ``text``, ``finish_reason``,
``prompt_tokens``, ``stats``). A prompt that cannot be served (too long for
the context, ...) gets one line ``{"index", "prompt", "error"}`` and the job
exits with status 1 after finishing the rest.

Resumable: lines are written (and flushed) as each prompt completes, in
completion order; a rerun reads the output first and skips every prompt whose
``n`` samples are all there (error lines do not count, so they are retried).
A torn last line from a killed run is cut off before appending. A prompt in
flight when the engine's coordinator dies is not lost: it resumes from what it
emitted once Ray has restarted the coordinator (the engine handle's
``agenerate``), within its deadline.

Paths are opened by the job's driver process: with ``ray job submit`` give
absolute paths on the head node (or a shared filesystem), or paths relative to
``--working-dir``, whose copy is the job's current directory (files written
there are discarded with it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from saguaro_ray.prompt_file import read_prompt_file

log = logging.getLogger("saguaro_ray.jobs.generate")

_WAIT_S = 600.0  # longest wait for one prompt's results before the job gives up


def build_parser() -> argparse.ArgumentParser:
    from saguaro_ray.cli_flags import MODEL_FORMS, SELF_FORMS, add_engine_args, add_sampling_args, add_speculation_args

    p = argparse.ArgumentParser(prog="python -m saguaro_ray.jobs.generate", description="batch generation from JSONL (resumable)")
    p.add_argument("--input", required=True, help="JSONL, one {\"prompt\": ...} object a line")
    p.add_argument("--output", required=True, help="JSONL results (appended to; existing results are skipped)")
    m = p.add_argument_group("models")
    m.add_argument("--target", help=f"target model: {MODEL_FORMS}")
    m.add_argument("--draft", default=None, help=f"the same forms, {SELF_FORMS}")
    m.add_argument("--qualifier", default=None, help=f"the same forms, {SELF_FORMS}")
    m.add_argument("--connect", default=None, help="use a running named engine (EngineConfig(name=...)) instead of launching one")
    m.add_argument("--namespace", default="saguaro-ray", help="namespace of the --connect engine")
    add_sampling_args(p.add_argument_group("sampling"))
    spec = p.add_argument_group("speculation (same flags as `saguaro-ray generate`)")
    add_speculation_args(spec)
    rt = p.add_argument_group("runtime")
    add_engine_args(rt)
    rt.add_argument("--placement-strategy", default="PACK", help="PACK | SPREAD | STRICT_PACK | STRICT_SPREAD")
    rt.add_argument("--target-placement-strategy", default="STRICT_PACK", help="placement of the target ranks (STRICT_PACK: one node)")
    rt.add_argument("--in-flight", type=int, default=32, help="prompts submitted to the engine at once")
    return p


# ------------------------------------------------------------------ files


def read_prompts(path: str) -> list[dict[str, Any]]:
    """The job's input: prompts with optional ``id`` and per-prompt sampling fields."""
    from saguaro_ray.cli_flags import SAMPLING_FLAGS

    return read_prompt_file(path, ("id", *SAMPLING_FLAGS))


def completed(path: str, n: int) -> set[int]:
    """Indices of prompts whose ``n`` samples are all in ``path``; trims a torn
    (unterminated) last line left by a killed run so appending stays valid JSONL."""
    p = Path(path)
    if not p.exists():
        return set()
    data = p.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        log.warning("%s: dropping a torn last line (%d bytes) from an interrupted run", path, len(data) - cut)
        with open(p, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    samples: dict[int, set[int]] = {}
    for line in data.decode("utf-8").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "error" not in obj and isinstance(obj.get("index"), int):
            samples.setdefault(obj["index"], set()).add(int(obj.get("sample_index", 0)))
    return {i for i, s in samples.items() if len(s) >= n}


# ------------------------------------------------------------------ engine


def _engine(args: argparse.Namespace) -> tuple[Any, bool, Any]:
    """(handle, owned, the models) — launched, or attached by name."""
    from saguaro_ray.cli_flags import engine_options_from_args, speculation_from_args
    from saguaro_ray.errors import ConfigError
    from saguaro_ray.model_set import ModelSet
    from saguaro_ray.runtime.engine import Engine, connect
    from saguaro_ray.runtime.engine_config import EngineConfig

    if not args.target:
        raise ConfigError("--target is required (the tokenizer and context length come from it, also with --connect)")
    spec = speculation_from_args(args)
    models = ModelSet.open(args.target, args.draft, args.qualifier, modes=[spec])
    if args.connect:
        return connect(args.connect, address=args.address or "auto", namespace=args.namespace), False, models
    refs = models.refs
    config = EngineConfig(
        target=refs["target"].path,
        draft=refs.get("draft"),
        qualifier=refs.get("qualifier"),
        spec=spec,
        **engine_options_from_args(args),
        placement_strategy=args.placement_strategy,
        target_placement_strategy=args.target_placement_strategy,
    )
    return Engine.launch(config), True, models


def _params(args: argparse.Namespace, row: dict[str, Any]) -> Any:
    from saguaro_ray.cli_flags import SAMPLING_FLAGS, sampling_from_args

    return sampling_from_args(args, {k: row[k] for k in SAMPLING_FLAGS if k in row})


def run(args: argparse.Namespace) -> int:
    from saguaro_ray.cli_flags import speculation_from_args
    from saguaro_ray.engine.frontend import Frontend
    from saguaro_ray.errors import ConfigError

    if args.n <= 0 or args.in_flight <= 0:
        raise ConfigError("--n and --in-flight must be positive")
    rows = read_prompts(args.input)
    done = completed(args.output, args.n)
    todo = [i for i in range(len(rows)) if i not in done]
    print(f"generate: {len(rows)} prompts, {len(done)} already in {args.output}, {len(todo)} to run", flush=True)
    if not todo:
        return 0
    # validate every remaining prompt up front, per prompt (one bad line must not sink the job)
    params = {i: _params(args, rows[i]) for i in todo}
    handle, owned, models = _engine(args)
    frontend = Frontend.for_models(models, speculation_from_args(args))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    try:
        with open(args.output, "a", encoding="utf-8") as out:

            def write(obj: dict[str, Any]) -> None:
                out.write(json.dumps(obj) + "\n")
                out.flush()

            failures = asyncio.run(_generate(handle, frontend, rows, params, todo, args, write))
    finally:
        if owned:
            handle.shutdown()
    print(f"generate: wrote {args.output}; {failures} prompt(s) failed", flush=True)
    return 1 if failures else 0


async def _generate(
    handle: Any, frontend: Any, rows: list[dict[str, Any]], params: dict[int, Any], todo: list[int], args: argparse.Namespace, write: Callable[[dict[str, Any]], None]
) -> int:
    """Run every prompt of ``todo``, ``--in-flight`` at a time, through the
    handle's ``agenerate`` — so a prompt in flight when the engine's
    coordinator is lost resumes from what it emitted once Ray has restarted it
    (saguaro_ray.runtime.resumable), instead of failing; writes each prompt's
    lines as it completes and returns how many prompts failed."""
    from saguaro_ray.errors import SaguaroError

    failures = finished = 0
    t0 = time.perf_counter()
    queue = list(todo)
    pending: dict[asyncio.Future[Any], int] = {}
    while queue or pending:
        while queue and len(pending) < args.in_flight:
            i = queue.pop(0)
            try:
                frontend.make_sequences([rows[i]["prompt"]], params[i], args.n)
            except SaguaroError as exc:
                write({"index": i, "prompt": rows[i]["prompt"], "error": str(exc)})
                failures += 1
                continue
            pending[asyncio.ensure_future(handle.agenerate([rows[i]["prompt"]], params[i], args.n))] = i
        if not pending:
            continue
        ready, _ = await asyncio.wait(pending, timeout=_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        if not ready:
            for task in pending:
                task.cancel()  # aborts its request
            raise TimeoutError(f"no prompt finished within {_WAIT_S:.0f} s; {len(pending)} in flight")
        for task in ready:
            i = pending.pop(task)
            try:
                results = task.result()
            except SaguaroError as exc:  # the prompt's own error, or an engine that could not resume it
                write({"index": i, "prompt": rows[i]["prompt"], "error": str(exc)})
                failures += 1
                continue
            for r in results:
                obj = r.to_json()
                obj["prompt_index"] = i
                write({"index": i, "prompt": rows[i]["prompt"], **obj})
            finished += 1
            if finished % 10 == 0 or not (queue or pending):
                print(f"generate: {finished}/{len(todo)} prompts done ({time.perf_counter() - t0:.1f} s)", flush=True)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    from saguaro_ray.cli_flags import run_command

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return run_command("saguaro_ray.jobs.generate", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
