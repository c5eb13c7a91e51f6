"""What the bench machine costs: its identity, and the runner's basic step costs.

Measured once per report, apart from the runs, so a report says on what
machine and at what per-step prices its throughputs were obtained (the
costs that decide whether speculation can pay there at all).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from typing import Any


def step_costs(
    models: dict[str, str],
    threads: int = 1,
    context: int = 128,
    repeats: int = 30,
    branches: int = 8,
    device: str = "cpu",
    dtype: str | None = None,
    attention_backend: str | None = None,
    draft_vocab: int | None = None,
) -> dict[str, dict[str, float]]:
    """Median milliseconds of the runner's basic steps per model, on ``threads``
    torch threads: a 1-token decode, an 8-token verify, and one tree-decode
    step of ``branches`` branches — the costs that decide whether speculation
    pays (on CPU a draft step must cost ≲ 1/10 of a target verify).
    ``draft_vocab``: the draft's reduced-vocabulary head, as its engine runs it."""
    import torch

    from saguaro_ray.models.resolve import resolve_models
    from saguaro_ray.workers.runner import ModelRunner

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    try:
        for role, ref in resolve_models(models).items():
            head = {"head_vocab": draft_vocab} if role == "draft" else {}
            runner = ModelRunner(ref.path, device=device, dtype=dtype, attention_backend=attention_backend, quantize=ref.quantize, **head)
            runner.add_sequence(0)
            prompt = [(7 * i) % runner.vocab_size for i in range(context)]
            runner.forward([0], [prompt])

            def timed(fn: Any) -> float:
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    if device != "cpu":
                        torch.cuda.synchronize()
                    samples.append(time.perf_counter() - t0)
                return 1000 * statistics.median(samples)

            def decode(n: int) -> None:
                runner.forward([0], [prompt[:n]], num_logits=[n])
                runner.truncate(0, context)

            def tree() -> None:
                t = runner.tree_start([0] * branches, [context - (i % 4) for i in range(branches)], depth=4)
                runner.tree_forward(t, [[1]] * branches)

            out[role] = {"decode_1": timed(lambda: decode(1)), "verify_8": timed(lambda: decode(8)), f"tree_step_{branches}": timed(tree)}
    finally:
        torch.set_num_threads(old)
    return out


def machine_info(threads: int) -> dict[str, Any]:
    """Platform, CPU count, library versions and the commit: what a reader
    needs to compare two reports (``threads``: torch threads per worker)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "threads_per_worker": threads,
        "cuda": torch.cuda.is_available(),
        "git_commit": commit,
    }

