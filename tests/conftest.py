"""Shared pytest fixtures."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

# A shell starts a background job (`cmd &`, no job control) with SIGINT ignored,
# and an ignored signal stays ignored across exec: a server this suite starts
# would then never see the Ctrl-C its test sends, and would be killed instead
# of shutting down. Give the children the default disposition back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def private_costs_dir(tmp_path_factory: pytest.TempPathFactory):
    """Every engine this suite starts caches its workers' probed step costs
    (``engine/cost_probe.py``) in a directory of the session's own, not in the
    user's ``~/.cache/saguaro-ray/costs``: the suite's throwaway models (a
    tiny zoo, a test's own checkpoint) would otherwise leave tables there for
    good, and a user's real tables must not steer a test. Set before any
    engine or Ray instance starts, so Ray's workers inherit it."""
    path = tmp_path_factory.mktemp("costs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGUARO_COSTS_DIR", str(path))
        yield path


@pytest.fixture(scope="module", autouse=True)
def give_memory_back():
    """After each module, hand the memory its models freed back to the OS. The
    suite's two workers each live through every module they are given, and
    glibc keeps what a process frees: a worker that had loaded the coder pair
    and transformers' copies held 9 GB it no longer used when the next real
    model came, and in CI (stop 40) a worker died as the coder pair loaded, most likely
    killed for memory."""
    yield
    from saguaro_ray.runtime.process_memory import give_back

    give_back()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``), as each worker runs: the kernels
    and their summation order are the workers', and two cores are not
    oversubscribed by one test."""
    from saguaro_ray.torch_threads import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance for one test module (8 logical CPUs: the actors ask
    for fractions of the few real ones). Modules that need another define their own."""
    import ray

    started = not ray.is_initialized()
    if started:
        # address="local": never attach to some other `ray start` cluster on this machine
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def zoo_tiny() -> Path:
    """The ``tiny`` zoo family directory (target/, qualifier/, draft/, zoo.json).

    Built once under ``zoo_root()`` (``$SAGUARO_ZOO_DIR`` in CI, a cache dir)
    on first use — about 1.5 minutes on 2 cores — and reused afterwards.
    """
    from saguaro_ray.zoo import build_family, zoo_root

    build_family("tiny", progress=True)
    return zoo_root() / "tiny"
