"""CPU cores of its own for each worker on a node (``EngineConfig.pin_cores``).

SSD's point is that the draft builds while the target verifies, on other
hardware. On a CPU node left to the scheduler, the two workers' threads
migrate between cores and share them with the coordinator's: measured on a
2-core VM (Qwen2.5-Coder-1.5B bf16 verifying 5 tokens beside the 0.5B int4
building 4-branch trees, two processes, 1 thread each; docs/performance.md),
verification took 607-868 ms unpinned against 262-273 ms alone, and 279 ms
with each process bound to a core of its own (the tree step 200-289 ms vs
92 ms). So each CPU worker claims cores before it loads its model.

A claim is an exclusive ``flock`` on ``<tmp>/saguaro-ray-cores/cpu<N>.lock``,
held by the process for its life: engines and Serve replicas on one node
never claim the same core, and a dead worker's cores are free again the
moment the kernel closes its files (a restarted worker claims afresh). A
worker that finds too few free cores runs unpinned, as before, and says so.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_held: list[int] = []  # this process's claim files (kept open: the claim lasts while they are)


def claims_dir() -> Path:
    """Where a node's claim files live (one per core, shared by every engine)."""
    return Path(os.environ.get("SAGUARO_CORES_DIR") or Path(tempfile.gettempdir()) / "saguaro-ray-cores")


def _try_claim(folder: Path, core: int) -> int | None:
    fd = os.open(folder / f"cpu{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def pin_threads(cores: set[int]) -> None:
    """Bind every thread of this process to ``cores`` (threads started later
    inherit their creator's binding)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def claim_cores(n: int) -> list[int] | None:
    """Claim ``n`` free cores of those this process may run on and bind all its
    threads to them; ``None`` (nothing claimed, nothing bound) when fewer than
    ``n`` are free or the platform cannot pin."""
    if not hasattr(os, "sched_setaffinity") or _held:
        return None
    folder = claims_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cores not pinned: %s (%s)", folder, exc)
        return None
    got: list[tuple[int, int]] = []
    for core in sorted(os.sched_getaffinity(0)):
        if len(got) == n:
            break
        fd = _try_claim(folder, core)
        if fd is not None:
            got.append((core, fd))
    if len(got) < n:
        for _, fd in got:
            os.close(fd)
        log.warning("cores not pinned: %d of the %d this worker wants are free (others held by workers on this node)", len(got), n)
        return None
    _held.extend(fd for _, fd in got)
    cores = [c for c, _ in got]
    pin_threads(set(cores))
    log.info("worker pinned to cores %s", cores)
    return cores


__all__ = ["claim_cores", "claims_dir", "pin_threads"]
