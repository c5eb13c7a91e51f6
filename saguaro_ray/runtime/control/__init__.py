"""The control plane over ZeroMQ: worker commands and the outcome broadcast.

Every frame is a :class:`~saguaro_ray.runtime.wire.FrameCodec` frame
(HMAC-SHA256 ‖ stamp ‖ msgpack); a frame that fails authentication, is not
fresh (a replay, or for another recipient: :mod:`saguaro_ray.runtime.replay`)
or cannot be decoded is dropped and counted (``dropped_frames``,
``drop_reasons``), never acted on. Every receive polls with a timeout, so
every loop notices ``close()``.

Channels, one module each, each documenting its own freshness rules:
commands (ROUTER worker ⇄ DEALER coordinator, :mod:`.server` and
:mod:`.client`), forwarded calls (a worker's DEALER → another worker's
ROUTER, answered to the coordinator, :mod:`.forwarding`) and the broadcast
(XPUB coordinator → SUB workers, :mod:`.pubsub`). Endpoints and the engine
key are :mod:`.endpoints`.

What they share (socket factory, poll bound, drop counter, built-in call
names) is :mod:`.sockets`; :mod:`.clock` maps worker spans onto the
client's clock. The frame codec is
:mod:`saguaro_ray.runtime.wire`; the exceptions are in :mod:`saguaro_ray.errors`.
"""

from __future__ import annotations

from saguaro_ray.errors import ClientClosed, ControlError, RemoteError, SubscriberTimeout, WorkerTimeout
from saguaro_ray.runtime.control.client import CommandClient
from saguaro_ray.runtime.control.endpoints import EngineKey, bind_endpoint, release_endpoint
from saguaro_ray.runtime.control.forwarding import CallForwarder
from saguaro_ray.runtime.control.pubsub import Broadcaster, Subscriber
from saguaro_ray.runtime.control.server import CommandServer

__all__ = [
    "Broadcaster",
    "ClientClosed",
    "CommandClient",
    "CallForwarder",
    "CommandServer",
    "ControlError",
    "EngineKey",
    "RemoteError",
    "Subscriber",
    "SubscriberTimeout",
    "WorkerTimeout",
    "bind_endpoint",
    "release_endpoint",
]
