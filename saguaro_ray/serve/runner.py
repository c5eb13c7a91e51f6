"""``saguaro-ray serve --config FILE.yaml``: run a Serve config file.

The file is an ordinary Ray Serve config (``ServeDeploySchema``: ``http_options``,
``applications: [{name, route_prefix, import_path, args, runtime_env,
deployments}]``), so ``serve run FILE.yaml`` works on it just as well. This
command adds what a user of the engine expects: it joins only a cluster the
user meant (see :func:`intended_cluster`) or starts its own local Ray
instance with enough logical CPUs for the engines' fractional asks, deploys the applications the same way ``serve run`` does,
waits (bounded) until every application is RUNNING — or reports why one
failed — prints the URLs, and then blocks until Ctrl-C or SIGTERM (``--detach``: returns
at once and leaves the applications running on the cluster). On the stop it drains:
requests in flight finish before Serve shuts down (see :func:`_drain`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from saguaro_ray.errors import ConfigError, ServeAlreadyElsewhere

log = logging.getLogger(__name__)

OUR_BUILDERS = ("saguaro_ray.serve:build_app", "saguaro_ray.serve.app:build_app", "saguaro_ray.serve.build_app")


def load_serve_config(path: str | os.PathLike) -> Any:
    """Read and validate a Serve config YAML; returns a ``ServeDeploySchema``."""
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read serve config {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict) or "applications" not in raw:
        raise ConfigError(f"{path}: expected a Serve config with an `applications:` list")
    try:
        return ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: invalid Serve config at {loc}: {first['msg']}") from None


def validate_app_args(config: Any) -> None:
    """Build every application that uses our builder, so a bad ``args`` block
    fails here in milliseconds with the field named, not later in a replica."""
    from saguaro_ray.serve.config import parse_config

    for app in config.applications:
        if app.import_path in OUR_BUILDERS:
            try:
                parse_config(app.args or {})
            except ConfigError as exc:
                raise ConfigError(f"application {app.name!r}: {exc}") from None


def intended_cluster(address: str | None) -> tuple[str | None, str]:
    """The Ray cluster ``serve`` should join, and where that choice came from.

    Only a cluster the user meant: ``--address`` (``local``: none, start one;
    ``auto``: Ray's own search, as the user asked), else ``RAY_ADDRESS``, else
    the cluster ``ray start`` recorded in its address file
    (``$RAY_TMPDIR/ray/ray_current_cluster``, /tmp/ray/... by default; ``ray
    stop`` removes it) — exactly where ``ray.init()`` without an address
    looks. Never Ray's legacy ``auto`` fallback to *any* Ray process found on
    the machine: that joined the short-lived private instance of whatever
    script ran ``ray.init()`` here, and died with it. (None, why): start a
    local instance."""
    from ray._common.utils import get_ray_address_file

    if address is not None:
        return (None if address == "local" else address), "--address"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return env, "RAY_ADDRESS"
    path = get_ray_address_file(None)
    try:
        recorded = Path(path).read_text(encoding="utf-8").strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded, f"the cluster `ray start` recorded in {path}"
    return None, "no --address, RAY_ADDRESS or `ray start` cluster"


def _connect_or_start(address: str | None, detach: bool) -> bool:
    """Join the cluster the user meant (:func:`intended_cluster`), or start a
    local instance; True when we started it."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    if ray.is_initialized():
        return False
    target, source = intended_cluster(address)
    if target is not None:
        recorded = source.startswith("the cluster")
        try:
            # `ray start`'s cluster is joined as ray.init() joins it (address=None:
            # Ray reads the same file, and enables token auth as for a cluster it found)
            ray.init(address=None if recorded else target, namespace=SERVE_NAMESPACE, log_to_driver=False)
            return False
        except ConnectionError:
            if recorded and not detach:  # a stale file: `ray start`'s cluster died without `ray stop`
                log.warning("no Ray cluster at %s (%s); starting a local instance", target, source)
            else:
                hint = "--detach needs a running Ray cluster to leave the applications on" if detach else "no Ray cluster"
                raise ConfigError(f"{hint} at {target} (from {source}); start one with `ray start --head` or pass --address") from None
    elif detach:
        raise ConfigError(f"--detach needs a running Ray cluster to leave the applications on ({source}); start one with `ray start --head` or pass --address")
    # engines ask for fractional CPUs: give a small machine enough logical CPUs;
    # address="local": a new instance, whatever else runs on this machine
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 8), namespace=SERVE_NAMESPACE, include_dashboard=False)
    return True


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _check_http(running: Any, wanted: Any) -> None:
    """Refuse a config whose HTTP host or port differ from those of the Serve
    instance already running on the cluster: Serve keeps its proxies' address
    while it runs (it only logs that the new one is ignored), so the
    applications would be deployed where nothing listens at the URLs this
    command prints. Checked before anything is deployed."""
    if (running.host, running.port) != (wanted.host, wanted.port):
        raise ServeAlreadyElsewhere(
            f"Ray Serve already runs on this cluster with HTTP at {running.host}:{running.port}, and cannot move to "
            f"{wanted.host}:{wanted.port} (this config's http_options) while it runs: use {running.host}:{running.port} "
            "in the config, or stop Serve first (`serve shutdown`)"
        )


def run_config(
    path: str | os.PathLike,
    address: str | None = None,
    detach: bool = False,
    ready_timeout_s: float = 900.0,
    block: bool = True,
) -> dict[str, str]:
    """Deploy the Serve config at ``path``; returns ``{app name: URL}`` once
    every application is RUNNING. Blocks until Ctrl-C unless ``detach`` or
    ``block=False``."""
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api

    config = load_serve_config(path)
    validate_app_args(config)
    started = _connect_or_start(address, detach)
    try:
        # exactly what `serve run FILE.yaml` does
        client = serve_api.serve_start(
            http_options=config.http_options.model_dump(),
            proxy_location=config.proxy_location,
            grpc_options=_grpc_options(config),
        )
        _check_http(client.http_config, config.http_options)
        client.deploy_apps(config, _blocking=False)
        urls = _wait_running(config, ready_timeout_s)
        host, port = config.http_options.host, config.http_options.port
        for name, prefix in urls.items():
            print(f"saguaro-ray serve: application {name!r} is RUNNING at http://{host}:{port}{prefix}", flush=True)
        if detach or not block:
            return urls
        print("saguaro-ray serve: serving; press Ctrl-C to stop", flush=True)
        # a process manager's stop (SIGTERM: systemd, Kubernetes, `kill`) shuts down as Ctrl-C does
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
        try:
            while True:
                time.sleep(5)
        except KeyboardInterrupt:
            print("saguaro-ray serve: shutting down", flush=True)
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
        _drain(config)
        serve.shutdown()
        return urls
    except BaseException as exc:
        if not detach and not isinstance(exc, ServeAlreadyElsewhere):  # (that Serve is not ours to stop)
            try:
                serve.shutdown()
            except Exception:
                log.debug("serve shutdown failed", exc_info=True)
        raise
    finally:
        if started and block and not detach:
            ray.shutdown()


def _drain(config: Any) -> None:
    """Delete the applications before stopping Serve: ``serve.shutdown()``
    alone stops the HTTP proxies at once and resets every connection in
    flight, while deleting an application lets its replicas finish their
    requests in flight (Serve waits ``graceful_shutdown_timeout_s``, which
    ``build_app`` sets from ``request_timeout_s``) with the proxies still up.
    A second Ctrl-C stops waiting."""
    from ray import serve

    for app in config.applications:
        try:
            serve.delete(app.name, _blocking=True)
        except Exception as exc:  # noqa: BLE001 — serve.shutdown() below stops it anyway
            log.warning("application %r did not drain: %s", app.name, exc)


def cmd_serve(args: Any) -> int:
    """The ``saguaro-ray serve`` command (flags: config, address, detach, timeout)."""
    run_config(args.config, address=args.address, detach=args.detach, ready_timeout_s=args.timeout)
    return 0


def _grpc_options(config: Any) -> Any:
    from ray.serve.config import gRPCOptions

    return gRPCOptions(**config.grpc_options.model_dump())


def _wait_running(config: Any, timeout_s: float) -> dict[str, str]:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    names = {app.name: app.route_prefix or "/" for app in config.applications}
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        status = serve.status().applications
        states = {n: status[n].status if n in status else "NOT_STARTED" for n in names}
        failed = {n: status[n].message for n, s in states.items() if s in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)}
        if failed:
            name, message = next(iter(failed.items()))
            raise ConfigError(f"application {name!r} failed to deploy: {message.strip()[-2000:]}")
        if all(s == ApplicationStatus.RUNNING for s in states.values()):
            return names
        now = ", ".join(f"{n}: {s}" for n, s in states.items())
        if now != last:
            log.info("waiting for applications: %s", now)
            last = now
        if time.monotonic() > deadline:
            raise ConfigError(f"applications not RUNNING after {timeout_s:.0f} s ({now}); see `serve status`")
        time.sleep(1.0)
