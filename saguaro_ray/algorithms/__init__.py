"""Pure tensor algorithms: sampling, verification, speculation policies.

Nothing here imports Ray, ZeroMQ or does I/O; workers and engines call these
functions and own all state and transport.
"""
