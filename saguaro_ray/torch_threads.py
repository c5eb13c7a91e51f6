"""Torch's intra-op thread count for one block of work, restored after.

Work that fixes its thread count — a zoo build (the weights depend on it),
tests on shared cores — must not leave the process's count changed for
whatever runs next in the same process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, restoring the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
