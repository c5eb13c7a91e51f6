"""The runtime's control plane: authenticated msgpack frames over ZeroMQ.

:mod:`saguaro_ray.runtime.wire` turns the worker protocol's messages into
HMAC-signed, stamped msgpack frames (never pickle);
:mod:`saguaro_ray.runtime.replay` decides which stamped frames are fresh;
:mod:`saguaro_ray.runtime.control` carries them between a coordinator and its workers over ZeroMQ sockets —
command calls with replies, and an outcome broadcast. Nothing here imports
Ray: the actors only hand endpoints and the per-engine key around.
"""
