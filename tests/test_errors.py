"""The one exception module: every project type lives in saguaro_ray.errors,
and a worker's exception of one of those types is raised again as itself."""

from __future__ import annotations

import pytest

from saguaro_ray import errors
from saguaro_ray.errors import BadFrame, ControlError, EncodeError, RemoteError, SaguaroError, local_error


def _project_types() -> list[type[SaguaroError]]:
    return [obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, SaguaroError)]


@pytest.mark.parametrize("cls", [c for c in _project_types() if not issubclass(c, (ControlError, BadFrame, EncodeError))], ids=lambda c: c.__name__)
def test_a_remote_project_error_is_raised_as_its_own_type(cls):
    remote = RemoteError(cls.__name__, "the message", "draft0", "Traceback ...")
    err = local_error(remote)
    assert type(err) is cls and str(err) == "the message"
    assert err.__cause__ is remote


@pytest.mark.parametrize("type_name", ["KeyError", "MethodNotAllowed", "ControlError", "WorkerTimeout", "EncodeError", "BadFrame", "RemoteError"])
def test_foreign_and_delivery_errors_stay_remote_errors(type_name):
    """A worker's KeyError, or its failure to deliver (an unencodable reply),
    is not something the caller did: it stays a RemoteError naming the type."""
    remote = RemoteError(type_name, "m", "target")
    assert local_error(remote) is remote


def test_a_type_that_needs_more_than_a_message_is_raised_as_its_nearest_base(monkeypatch):
    """A data-plane transfer loss (built from source, tag and reason) still
    reaches the round loop as the TransferLost it retries on; a type with no
    such base stays a RemoteError."""

    class LostInTransit(errors.TransferLost):
        def __init__(self, src: int, tag: int) -> None:
            super().__init__(f"from {src} tag {tag}")

    class NeedsTwo(SaguaroError):
        def __init__(self, a: str, b: str) -> None:
            super().__init__(a + b)

    monkeypatch.setitem(vars(errors), "LostInTransit", LostInTransit)
    monkeypatch.setitem(vars(errors), "NeedsTwo", NeedsTwo)
    errors._by_name.cache_clear()
    try:
        lost = RemoteError("LostInTransit", "from 1 tag 7", "draft0")
        err = local_error(lost)
        assert type(err) is errors.TransferLost and str(err) == "from 1 tag 7" and err.__cause__ is lost
        remote = RemoteError("NeedsTwo", "m", "target")
        assert local_error(remote) is remote
    finally:
        monkeypatch.undo()
        errors._by_name.cache_clear()


def test_the_old_import_paths_name_the_same_classes():
    from saguaro_ray.engine import transport
    from saguaro_ray.runtime import control, wire
    from saguaro_ray.serve import runner
    from saguaro_ray.workers import messages

    for module, names in [
        (transport, ["WorkerLost", "WorkerGone", "TransferLost"]),
        (wire, ["BadFrame", "EncodeError"]),
        (control, ["ControlError", "RemoteError", "WorkerTimeout", "ClientClosed", "SubscriberTimeout"]),
        (messages, ["NeedsPrefillError"]),
        (runner, ["ServeAlreadyElsewhere"]),
    ]:
        for name in names:
            assert getattr(module, name) is getattr(errors, name), (module.__name__, name)
