"""Serving: an OpenAI-compatible Ray Serve application over the engine.

``saguaro_ray.serve:build_app`` is the Serve application builder named by the
configs in ``deploy/serve/`` (``serve run deploy/serve/zoo-cpu.yaml`` or
``saguaro-ray serve --config ...``); see :mod:`saguaro_ray.serve.app` for the
endpoints and :mod:`saguaro_ray.serve.config` for the ``args`` schema.

Ray Serve and FastAPI are imported on first use of ``build_app`` /
``SaguaroDeployment``, so the config schema stays cheap to import.
"""

from typing import Any

from saguaro_ray.serve.config import ServeAppConfig, parse_config


def __getattr__(name: str) -> Any:
    if name in ("build_app", "SaguaroDeployment"):
        from saguaro_ray.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'saguaro_ray.serve' has no attribute {name!r}")


__all__ = ["SaguaroDeployment", "ServeAppConfig", "build_app", "parse_config"]
