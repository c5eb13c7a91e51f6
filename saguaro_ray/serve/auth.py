"""API keys: the one check every key-protected route makes before any work.

Keys come from the Serve config's ``api_keys`` and, read inside the replica,
the variable named by ``api_keys_env`` (so they need not sit in the YAML).
No keys configured means no check; ``/health`` never asks for one (load
balancers probe it).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from saguaro_ray.errors import ConfigError
from saguaro_ray.serve.config import ServeAppConfig
from saguaro_ray.serve.protocol import APIError


class APIKeys:
    """The keys one replica accepts, and the ``Authorization`` check against them."""

    def __init__(self, cfg: ServeAppConfig) -> None:
        keys = cfg.resolved_api_keys()
        if cfg.api_keys_env and not keys:
            # an empty variable would silently open the server: refuse to start instead
            raise ConfigError(
                f"api_keys_env={cfg.api_keys_env!r} is set but the variable is empty in the replica; "
                "set it through the Serve config's runtime_env.env_vars"
            )
        # compared as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500)
        self._keys = [k.encode("utf-8") for k in keys]

    def check(self, request: Request) -> None:
        """Raise a 401 :class:`APIError` unless ``request`` carries ``Authorization: Bearer <key>``."""
        if not self._keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        raw = token.strip().encode("latin-1")  # a header's str holds its raw bytes as latin-1
        if scheme.lower() != "bearer" or not raw or not any(hmac.compare_digest(raw, k) for k in self._keys):
            raise APIError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )
