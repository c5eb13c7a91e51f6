"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def zoo_tiny() -> Path:
    """The ``tiny`` zoo family directory (target/, qualifier/, draft/, zoo.json).

    Built once under ``zoo_root()`` (``$SAGUARO_ZOO_DIR`` in CI, a cache dir)
    on first use — about 1.5 minutes on 2 cores — and reused afterwards.
    """
    from saguaro_ray.zoo import build_family, zoo_root

    build_family("tiny", progress=True)
    return zoo_root() / "tiny"
