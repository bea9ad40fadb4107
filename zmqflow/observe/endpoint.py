"""The HTTP endpoint Prometheus scrapes: prometheus-client's server over a hub's registry.

It is read-only and unauthenticated (SECURITY.md): it binds the host the task's router binds
(:func:`bind_address`: ``ZMQFLOW_BIND_HOST``, else the task's own) unless told otherwise.
``ZMQFLOW_METRICS_PORT`` is a base for every task of a launch: a task listens on it plus its
position among the cluster's tasks on the same host, so tasks sharing a machine do not collide,
and a task alone on its host gets the port itself.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..cluster import Address, ClusterSpec, TaskId
from ..errors import AddressInUse, ConfigError
from .metrics import HUB, MetricsHub, disable, enable

__all__ = ["Endpoint", "serve_metrics", "start_for", "port_from_env", "host_for", "bind_address", "PORT_ENV",
           "HOST_ENV", "BIND_HOST_ENV"]

PORT_ENV = "ZMQFLOW_METRICS_PORT"
HOST_ENV = "ZMQFLOW_METRICS_HOST"
BIND_HOST_ENV = "ZMQFLOW_BIND_HOST"


def bind_address(address: Address) -> Address:
    """Where a task with this spec address listens: ``ZMQFLOW_BIND_HOST`` at its port for tcp. A
    pod binds its IP (or ``0.0.0.0``) there, since its own DNS name may not resolve before it is
    ready, and the name a cluster spec gives it may be a service's, not an interface's. The task's
    router and its metrics endpoint both follow this one rule."""
    host = os.environ.get(BIND_HOST_ENV, "").strip()
    if not host or address.scheme != "tcp":
        return address
    return Address("tcp", host=host, port=address.port)


@dataclass
class Endpoint:
    host: str
    port: int
    _server: Any
    _thread: threading.Thread
    _global: bool = False  # it switched the process's recording on, and switches it off on close

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        if self._global:
            disable()


def serve_metrics(port: int, host: str = "127.0.0.1", *, hub: MetricsHub | None = None,
                  task: str | None = None) -> Endpoint:
    """Serve ``hub``'s registry (the process's, recording switched on) at ``http://host:port/metrics``.
    A port outside 1..65535 is a ``ConfigError`` (Prometheus must know where to look, so no port 0);
    a port taken is ``AddressInUse``."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"metrics port must be 1..65535, got {port!r}")
    hub = HUB if hub is None else hub
    try:
        from prometheus_client import start_http_server  # loaded only where an endpoint is asked for

        server, thread = start_http_server(port, addr=host, registry=hub.registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(f"metrics port {port} on {host} is in use: pick another --metrics-port "
                               f"(or {PORT_ENV})") from None
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    if hub is HUB:
        enable(task)
    return Endpoint(host, port, server, thread, hub is HUB)


def host_for(spec: ClusterSpec, task: TaskId) -> str:
    """``ZMQFLOW_METRICS_HOST``, else the host the task's router binds (loopback for in-process schemes)."""
    given = os.environ.get(HOST_ENV)
    if given:
        return given
    address = bind_address(spec.address(task))
    if address.scheme != "tcp" or not address.host:
        return "127.0.0.1"
    return "0.0.0.0" if address.host == "*" else address.host  # a task serving every interface


def port_from_env(spec: ClusterSpec, task: TaskId) -> int | None:
    """This task's port from ``ZMQFLOW_METRICS_PORT`` (a base: see the module), or None when unset."""
    text = os.environ.get(PORT_ENV, "").strip()
    if not text:
        return None
    try:
        base = int(text)
    except ValueError:
        raise ConfigError(f"{PORT_ENV} must be a port number, got {text!r}") from None
    if not 1 <= base <= 65535:
        raise ConfigError(f"{PORT_ENV} must be 1..65535, got {base}")
    host = spec.address(task).host
    same = [t for t in spec.tasks if spec.address(t).host == host]
    return base + same.index(task)



def start_for(spec: ClusterSpec, task: TaskId, port: int | None = None) -> Endpoint | None:
    """The endpoint of a task's process: at ``port`` when given, else at ``ZMQFLOW_METRICS_PORT``'s
    port for this task; None (metrics stay off) when neither names one."""
    if port is None:
        port = port_from_env(spec, task)
        if port is None:
            return None
    return serve_metrics(port, host_for(spec, task), task=str(task))
