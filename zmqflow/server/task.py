"""A task's server: one ROUTER at the task's address hosting its services, plus its client pool.

``AsyncServer`` lives on the caller's event loop; ``Server`` runs one on a background thread for
scripts and notebooks (as TF's ``tf.train.Server`` does), and its ``join()`` returns when the
server is stopped instead of never.

``keys`` (a key directory, else ``ZMQFLOW_KEYS``) puts CurveZMQ on every socket: the router admits
only the allow-list, and the task's own calls present its task key. Without keys a task refuses
to listen beyond loopback unless ``insecure=True`` (else ``ZMQFLOW_INSECURE=1``): a protected mode,
as Redis has, so a cluster is never open to its network by accident.

A task stops on request, not only by signal: the ``master.shutdown`` op (``zmqflow stop``) and, with
``exit_when_done``, the last training session's goodbye call :meth:`AsyncServer.request_stop`.
The server answers first, then stops itself, or hands the request to its ``stop_handler`` (the
``serve`` command's, which stops it as on SIGTERM and exits 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..cluster import ClusterSpec, TaskId, resolve, shard_tasks
from ..errors import ConfigError, NotFound
from ..loop import LoopThread
from ..observe import metrics as observe_metrics
from ..observe.endpoint import bind_address
from ..observe.metrics import MetricsHub, TaskMetrics
from ..rpc import DEFAULT_TIMEOUT, Counters, RpcClient, RpcServer, Service
from ..rpc.health import wait_for_tasks
from .bulk_listener import bulk_host
from .checkpoint_roots import CheckpointRoots
from .idle_trim import IdleTrim
from .services import MasterService, PsService, WorkerService
from .services.catalog import CatalogService
from .services.ring import RingService
from .limits import ServerLimits
from .observed import probe
from ..transport.base import Transport
from ..transport.registry import plain_zeromq
from ..transport.curve import Keys, is_loopback, keys_from
from ..transport.options import DEFAULT_OPTIONS, SocketOptions
from ..wire import Limits

__all__ = ["AsyncServer", "Server", "REPLY_FLUSH"]

log = logging.getLogger("zmqflow.server")
# How long a requested stop waits so the reply that asked for it leaves first (sockets close with
# LINGER 0): the caller learns the task heard it. A lost reply costs nothing: stop polls the task.
REPLY_FLUSH = 0.1


class AsyncServer:
    """The asyncio-native task server. ``async with AsyncServer(spec, "ps:0") as s: ...``"""

    def __init__(
        self,
        cluster: "ClusterSpec | Mapping[str, Any] | str | os.PathLike[str]",
        task: "TaskId | str",
        *,
        services: Mapping[str, Service] | None = None,
        limits: "ServerLimits | Limits | None" = None,
        options: SocketOptions = DEFAULT_OPTIONS,
        default_timeout: float = DEFAULT_TIMEOUT,
        allow_modules: list[str] | None = None,
        transport: Transport | None = None,
        debug: bool = False,
        keys: "Keys | str | os.PathLike[str] | None" = None,
        insecure: bool | None = None,
        checkpoint_roots: "Sequence[str | os.PathLike[str]] | str | None" = None,
        metrics_hub: MetricsHub | None = None,
        exit_when_done: bool = False,
        idle_trim: float | None = None,
    ):
        """``idle_trim``: once no big message came for that many seconds, hand the heap's free
        pages back to the OS (:mod:`.idle_trim`; ``zmqflow serve`` uses 1 s). Off by default: in a
        process that embeds a server, the heap is the rest of the process's too.
        ``exit_when_done``: stop once every chief and worker task finished training (a ps task
        under ``serve --exit-when-done``; see :mod:`.services.sessions`). ``checkpoint_roots``: the directories a ps shard here may write checkpoints under
        (None: ``ZMQFLOW_CHECKPOINT_ROOTS``, else none, and saves are refused; ``"*"``: anywhere).
        ``allow_modules``: modules whose public functions sessions may run here. ``metrics_hub``:
        record this task's metrics there (else on the process's hub once metrics are enabled)."""
        self.spec, tid = resolve(cluster, task, env={})
        self.transport = transport  # None: chosen per endpoint scheme (transport.registry)
        assert tid is not None
        self.task: TaskId = tid
        self.address = self.spec.address(self.task)
        # ``limits``: a ServerLimits, or the codec's Limits alone (the rest at their defaults)
        if limits is None:
            limits = ServerLimits()
        elif isinstance(limits, Limits):
            limits = ServerLimits.from_wire(limits)
        self.server_limits: ServerLimits = limits
        self.limits: Limits = limits.wire()
        self.debug = debug  # error replies carry tracebacks only then
        if options.router_max_msg_bytes == DEFAULT_OPTIONS.router_max_msg_bytes:  # not set by hand: follow the codec
            options = dataclasses.replace(options, router_max_msg_bytes=limits.router_max_msg_bytes)
        if options.max_msg_parts == DEFAULT_OPTIONS.max_msg_parts:  # likewise: one part over the codec's frames
            options = dataclasses.replace(options, max_msg_parts=limits.max_frames + 2)  # and the routing id
        self.options = options
        self.default_timeout = default_timeout
        self.counters = Counters()
        self.started_at = time.monotonic()
        self.keys = keys_from(keys, str(tid), require_task=True)
        if self.keys is not None:
            self.keys.learn(self.spec)
        self.insecure = os.environ.get("ZMQFLOW_INSECURE") == "1" if insecure is None else bool(insecure)
        if allow_modules is None:
            allow_modules = [m for m in os.environ.get("ZMQFLOW_ALLOW_MODULES", "").split(",") if m]
        self._services: dict[str, Service] = {
            "master": MasterService(self),
            "worker": WorkerService(allow_modules, limits.max_run_threads),
            "ring": RingService(),
        }
        # Every task hosts a shard, as every TF task can hold variables (``zf.device("/job:worker/task:0")``);
        # one that holds none costs an empty store. Default placement stays on the ps tasks (shard_tasks).
        replicas = [str(t) for t in self.spec.tasks if t.job in ("chief", "worker")]
        self._services["ps"] = PsService(replicas, reachable=self.client_reachable, limits=limits.state(),
                                         checkpoint_roots=CheckpointRoots.parse(checkpoint_roots))
        if self.task == shard_tasks(self.spec)[0]:
            self._services["catalog"] = CatalogService(self.spec, limits.state(), call=self.call)
        self._services.update(services or {})
        self._rpc: RpcServer | None = None
        self._client: RpcClient | None = None
        self._stopped: asyncio.Event | None = None
        self.metrics_hub = metrics_hub
        self.metrics: TaskMetrics | None = None  # while running with metrics on
        self.exit_when_done = bool(exit_when_done)
        self.stop_reason: str | None = None  # why a stop was requested (None: it was not)
        # who acts on a requested stop, called on the loop with the reason; None: stop this server
        self.stop_handler: Callable[[str], None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._idle_trim = None if idle_trim is None else IdleTrim(self.counters, idle_trim)

    # TaskRuntime ------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return self.address.endpoint

    @property
    def client(self) -> RpcClient:
        if self._client is None:
            raise RuntimeError(f"server {self.task} is not started")
        return self._client

    def client_reachable(self, identity: bytes) -> bool:
        """Whether a client (by routing id) still has a connection to this task."""
        return self._rpc is not None and self._rpc.reachable(identity)

    def service_names(self) -> list[str]:
        return list(self._services)

    def service_states(self) -> dict[str, str]:
        """What each service has to say about its state (a shard recovering, a ring's generation)."""
        return {name: s for name, svc in self._services.items() if (s := svc.state())}

    def progress_step(self) -> int | None:
        """The step this task's ps shard holds, if any (what its status shows when nothing here trains)."""
        ps = self._services.get("ps")
        return ps.progress_step() if isinstance(ps, PsService) else None

    def service(self, name: str) -> Service:
        try:
            return self._services[name]
        except KeyError:
            raise NotFound(f"task {self.task} hosts no service {name!r}") from None

    def register_function(self, name: str, fn: Callable[..., Any]) -> None:
        """Let sessions run ``fn`` here by ``name`` (``sess.run(name, task=...)``): the way to offer
        a function that is not a public top-level function of an allowed module."""
        worker = self._services["worker"]
        assert isinstance(worker, WorkerService)
        worker.register(name, fn)

    def add_service(self, service: Service) -> None:
        """Host another service (before or after start); its name is how callers address it."""
        self._services[service.name] = service
        if self._rpc is not None:
            self._rpc.services[service.name] = service

    # lifecycle --------------------------------------------------------------------------
    def _check_exposure(self, endpoint: str) -> None:
        """Protected mode: no keys means loopback only, unless the operator said ``insecure``."""
        if self.keys is None and not self.insecure and not is_loopback(endpoint):
            raise ConfigError(
                f"task {self.task} refuses to listen on {endpoint} without keys: anyone who reaches it could read and "
                "change the model. Make keys with `zmqflow keys generate DIR --cluster c.json` and start with --keys DIR "
                "(or ZMQFLOW_KEYS=DIR), or pass --insecure (insecure=True) to serve unauthenticated on a trusted network"
            )

    def bind_endpoint(self) -> str:
        """Where the router listens: the task's own address, or ZMQFLOW_BIND_HOST at its port
        (:func:`zmqflow.observe.endpoint.bind_address`, which the metrics endpoint follows too)."""
        return bind_address(self.address).bind_endpoint()

    async def start(self) -> "AsyncServer":
        loop = asyncio.get_running_loop()
        bind = self.bind_endpoint()
        self._check_exposure(bind)
        self._stopped = asyncio.Event()
        self.started_at = time.monotonic()
        self.metrics = observe_metrics.for_task(str(self.task), self.metrics_hub)
        if self.metrics is not None:
            self.metrics.probe = probe(self.counters, self._services)
        rpc = RpcServer(
            bind,
            self._services,
            name=str(self.task),
            loop=loop,
            limits=self.limits,
            options=self.options,
            counters=self.counters,
            transport=self.transport,
            max_deadline=self.server_limits.max_deadline,
            max_in_flight=self.server_limits.max_in_flight,
            max_kept_bytes=self.server_limits.max_kept_bytes,
            max_peer_kept_bytes=self.server_limits.max_peer_kept_bytes,
            debug=self.debug,
            keys=self.keys,
            metrics=self.metrics,
        )
        await self._start_bulk(bind)  # before the router: a session asking at once is offered a stream
        try:
            await rpc.start()
        except BaseException:
            await self._close_bulk()
            observe_metrics.release(self.metrics, self.metrics_hub)
            self.metrics = None
            raise
        self._rpc = rpc
        self._client = RpcClient(
            # with keys, an unguessable routing id: another key holder must not take over this task's
            # connection by connecting with its name (ROUTER_HANDOVER hands a routing id to the newest)
            identity=str(self.task) if self.keys is None else f"{self.task}-{uuid.uuid4().hex}",
            source=str(self.task),
            loop=loop,
            limits=self.limits,
            options=self.options,
            default_timeout=self.default_timeout,
            counters=self.counters,
            transport=self.transport,
            keys=self.keys,
        )
        try:
            for svc in self._services.values():
                await svc.start()
        except BaseException:  # nothing half-started stays open: the router, the listener, the client
            await self.stop()
            raise
        if self._idle_trim is not None:
            self._idle_trim.start()
        return self

    async def _start_bulk(self, bind: str) -> None:
        """The ps shard's bulk listener, where this task offers streams (:func:`bulk_host`)."""
        host = bulk_host(bind, self.keys, plain_zeromq(bind, self.transport))
        ps = self._services.get("ps")
        if host is None or not isinstance(ps, PsService):
            return
        try:
            await ps.open_bulk(host)
        except OSError as exc:  # no port to be had: pulls go over ZeroMQ
            log.warning("%s: no bulk listener on %s: %s", self.task, host, exc)

    async def _close_bulk(self) -> None:
        ps = self._services.get("ps")
        if isinstance(ps, PsService):
            await ps.close_bulk()

    @property
    def running(self) -> bool:
        return self._rpc is not None

    def request_stop(self, reason: str) -> None:
        """Stop soon, once the reply of the call that asked is on its way (on the server's loop;
        a second request changes nothing)."""
        if self._rpc is None or self.stop_reason is not None:
            return
        self.stop_reason = reason
        log.info("%s: %s", self.task, reason)
        asyncio.get_running_loop().call_later(REPLY_FLUSH, self._act_on_stop)

    def _act_on_stop(self) -> None:
        if self.stop_handler is not None:
            self.stop_handler(self.stop_reason or "stop requested")
        elif self._rpc is not None:
            self._stop_task = asyncio.get_running_loop().create_task(self.stop())

    async def stop(self) -> None:
        """Stop serving: services first, then the router and every outgoing connection."""
        if self._rpc is None:
            return
        rpc, self._rpc = self._rpc, None
        if self._idle_trim is not None:
            self._idle_trim.stop()
        await self._close_bulk()
        for svc in reversed(list(self._services.values())):
            await svc.stop()
        await rpc.close()
        if self._client is not None:
            self._client.close()
        observe_metrics.release(self.metrics, self.metrics_hub)
        self.metrics = None
        if self._stopped is not None:
            self._stopped.set()

    async def join(self) -> None:
        """Wait until the server is stopped."""
        if self._stopped is not None:
            await self._stopped.wait()

    async def __aenter__(self) -> "AsyncServer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # calls ------------------------------------------------------------------------------
    async def call(self, task: "TaskId | str", service: str, op: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """Call ``service.op`` on another task of the cluster (or this one)."""
        tid = TaskId.parse(task)
        return await self.client.call(self.spec.address(tid).endpoint, service, op, body, timeout=timeout, name=str(tid))

    async def wait_for_cluster(self, timeout: float = 30.0) -> None:
        """Return when every task answers; else raise ClusterNotReady naming those that did not."""
        await wait_for_tasks(self.client, self.spec, timeout)

    def __repr__(self) -> str:
        return f"AsyncServer({self.task} at {self.target}, {'running' if self.running else 'stopped'})"


class Server:
    """A task server on a background thread: ``.target``, ``.join()``, ``.stop()``, with-block."""

    def __init__(
        self,
        cluster: "ClusterSpec | Mapping[str, Any] | str | os.PathLike[str]",
        task: "TaskId | str",
        *,
        start: bool = True,
        **kwargs: Any,
    ):
        self._async = AsyncServer(cluster, task, **kwargs)
        self._async.stop_handler = self._stop_requested
        self._thread: LoopThread | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        if start:
            self.start()

    @classmethod
    def from_env(cls, **kwargs: Any) -> "Server":
        """The task named by ZMQFLOW_CLUSTER/ZMQFLOW_TASK (or TF_CONFIG)."""
        spec, task = resolve()
        assert task is not None
        return cls(spec, task, **kwargs)

    @property
    def spec(self) -> ClusterSpec:
        return self._async.spec

    @property
    def task(self) -> TaskId:
        return self._async.task

    @property
    def target(self) -> str:
        return self._async.target

    @property
    def async_server(self) -> AsyncServer:
        return self._async

    @property
    def loop_thread(self) -> LoopThread:
        if self._thread is None:
            raise RuntimeError(f"server {self.task} is not started")
        return self._thread

    def start(self) -> "Server":
        with self._lock:
            if self._thread is not None:
                return self
            thread = LoopThread(name=f"zmqflow-{self.task}")
            try:
                thread.call(self._async.start(), timeout=30)
            except BaseException:
                thread.stop()
                raise
            self._thread = thread
            self._done.clear()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            try:
                thread.call(self._async.stop(), timeout=timeout)
            finally:
                thread.stop(timeout)
                self._done.set()

    def join(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped (by ``stop()`` from another thread, a signal, or a
        stop request: ``zmqflow stop``, or the end of training under ``exit_when_done``)."""
        return self._done.wait(timeout)

    @property
    def stop_reason(self) -> str | None:
        """Why a stop was requested (None: it was not)."""
        return self._async.stop_reason

    def on_stop_request(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(reason)`` (on a thread of its own) once a stop request has stopped this server:
        how the process that embeds it notices (the bridge runtime shuts down, a training loop ends)."""
        self._listeners.append(fn)

    def _stop_requested(self, reason: str) -> None:
        """On the loop thread, which ``stop()`` joins: stop from another thread, then tell the listeners."""
        def stop_and_tell() -> None:
            self.stop()
            for fn in list(self._listeners):
                try:
                    fn(reason)
                except Exception:  # one listener's failure must not keep the others from hearing
                    log.exception("%s: a stop listener failed", self.task)

        threading.Thread(target=stop_and_tell, name=f"zmqflow-stop-{self.task}", daemon=True).start()

    def register_function(self, name: str, fn: Callable[..., Any]) -> None:
        """Let sessions run ``fn`` here by ``name``; see :meth:`AsyncServer.register_function`."""
        self._async.register_function(name, fn)

    def wait_for_cluster(self, timeout: float = 30.0) -> None:
        self.loop_thread.call(self._async.wait_for_cluster(timeout), timeout=timeout + 5)

    def call(self, task: "TaskId | str", service: str, op: str, body: Any = None, *, timeout: float | None = None) -> Any:
        t = self._async.default_timeout if timeout is None else timeout
        return self.loop_thread.call(self._async.call(task, service, op, body, timeout=t), timeout=t + 5)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server({self.task} at {self.target})"
