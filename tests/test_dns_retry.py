"""A peer whose DNS name does not resolve yet (a pod not created yet): calls keep trying until
their deadline without blocking the loop, say so in the log at a bounded rate, and fail with an
``Unavailable`` naming the peer and the host. ``.invalid`` never resolves (RFC 2606)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from typing import Any

import pytest

from zmqflow.errors import ConfigError, Unavailable
from zmqflow.ports import free_port
from zmqflow.rpc import RpcClient
from zmqflow.server.task import AsyncServer
from zmqflow.transport import zeromq

LOGGER = "zmqflow.transport.zeromq"


def unresolvable() -> str:
    """A fresh name each test (the log's rate limit is per host and port)."""
    return f"zf-ps-{uuid.uuid4().hex[:8]}.zf.ns.svc.invalid"


def unreachable_call(host: str, name: str) -> Unavailable:
    """A 1 s ping of ``name`` at ``host``:2222, which must fail with ``Unavailable``."""

    async def main() -> Unavailable:
        client = RpcClient(identity="t", default_timeout=1.0)
        try:
            await client.call(f"tcp://{host}:2222", "master", "ping", name=name)
        except Unavailable as exc:
            return exc
        finally:
            client.close()
        raise AssertionError(f"the call to unreachable {name} at {host} succeeded")

    return asyncio.run(main())


def test_unresolvable_peer_fails_typed_naming_peer_and_host(caplog: pytest.LogCaptureFixture) -> None:
    """With the machine's real resolver."""
    host = unresolvable()

    caplog.set_level(logging.INFO, LOGGER)
    exc = unreachable_call(host, "ps:1")
    if "host" not in exc.details:  # the first lookup was still out when the call ended
        pytest.skip(f"this machine's resolver did not answer for {host} within the call's second")
    assert exc.details == {"task": "ps:1", "host": host}
    assert str(exc).startswith(f"ps:1 at tcp://{host}:2222 could not be reached within 1s: host {host} does not resolve")
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].startswith(f"ps:1 at {host}:2222 does not resolve yet; retrying")


class FakeResolver:
    """A stand-in for DNS: ``.invalid`` names fail at once (a real resolver may take seconds to say
    so), counted per host; a name in ``answer`` resolves to loopback once it has failed that often."""

    def __init__(self, real: Any):
        self.real = real
        self.lookups: dict[str, int] = {}
        self.answer: dict[str, int] = {}

    def __call__(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".invalid"):
            self.lookups[host] = self.lookups.get(host, 0) + 1
            if host in self.answer and self.lookups[host] > self.answer[host]:
                return self.real("127.0.0.1", port, *args, **kwargs)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.real(host, port, *args, **kwargs)


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> FakeResolver:
    fake = FakeResolver(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", fake)  # what asyncio's loop.getaddrinfo calls
    monkeypatch.setattr(zeromq, "RESOLVE_RETRY_S", 0.02)
    return fake


def test_log_line_once_per_interval_not_per_attempt(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
                                                    resolver: FakeResolver) -> None:
    monkeypatch.setattr(zeromq, "RESOLVE_LOG_S", 0.3)
    host = unresolvable()

    async def main() -> None:  # asyncio's own loop: its getaddrinfo is socket's, which the stand-in replaces
        client = RpcClient(identity="t", default_timeout=1.5)
        try:
            with pytest.raises(Unavailable, match="does not resolve"):
                await client.call(f"tcp://{host}:2222", "master", "ping", name="ps:0")
        finally:
            client.close()

    caplog.set_level(logging.INFO, LOGGER)
    asyncio.run(main())
    stamps = [r.created for r in caplog.records if r.name == LOGGER and "does not resolve yet" in r.getMessage()]
    assert resolver.lookups[host] >= 10  # it kept looking ...
    assert 2 <= len(stamps) <= 6  # ... and said so once per 0.3 s, not once per 0.02 s attempt
    assert all(b - a >= 0.29 for a, b in zip(stamps, stamps[1:]))


def test_a_name_that_comes_to_resolve_is_logged_and_cleared(caplog: pytest.LogCaptureFixture,
                                                           resolver: FakeResolver) -> None:
    host = unresolvable()
    resolver.answer[host] = 3

    caplog.set_level(logging.INFO, LOGGER)
    exc = unreachable_call(host, "ps:2")  # libzmq's own lookup still fails: the peer stays unreachable
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines[0].startswith(f"ps:2 at {host}:2222 does not resolve yet") and lines[-1] == f"ps:2 at {host}:2222 resolves now"
    assert "does not resolve" not in str(exc) and "host" not in exc.details  # no longer blamed on DNS


def test_server_answers_others_while_a_peer_does_not_resolve(monkeypatch: pytest.MonkeyPatch,
                                                             resolver: FakeResolver) -> None:
    """The lookups run off the loop: the task serves every other call meanwhile."""
    monkeypatch.delenv("ZMQFLOW_BIND_HOST", raising=False)
    port = free_port()
    spec = {"worker": [f"127.0.0.1:{port}"], "ps": [f"{unresolvable()}:2222"]}

    async def main() -> tuple[BaseException, list[float]]:
        async with AsyncServer(spec, "worker:0") as server:
            stuck = asyncio.ensure_future(server.call("ps:0", "master", "ping", timeout=2.0))
            client = RpcClient(identity="probe", default_timeout=5.0)
            times = []
            try:
                while not stuck.done():
                    t0 = time.monotonic()
                    await client.call(f"tcp://127.0.0.1:{port}", "master", "ping")
                    times.append(time.monotonic() - t0)
                    await asyncio.sleep(0.05)
            finally:
                client.close()
            return stuck.exception(), times

    exc, times = asyncio.run(main())
    assert isinstance(exc, Unavailable) and exc.details["task"] == "ps:0" and "does not resolve" in str(exc)
    assert len(times) >= 10 and max(times) < 1.0


def test_bind_host_lets_a_task_start_before_its_own_name_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's spec names it by a DNS name that may not resolve yet; ZMQFLOW_BIND_HOST (its pod IP)
    is where it listens, and peers reach it there."""
    port = free_port()
    spec = {"ps": [f"{unresolvable()}:{port}"]}
    monkeypatch.delenv("ZMQFLOW_BIND_HOST", raising=False)

    async def without() -> None:
        async with AsyncServer(spec, "ps:0"):
            pass

    with pytest.raises(ConfigError, match="cannot resolve host"):
        asyncio.run(without())
    monkeypatch.setenv("ZMQFLOW_BIND_HOST", "127.0.0.1")

    async def with_bind() -> object:
        async with AsyncServer(spec, "ps:0") as server:
            assert server.bind_endpoint() == f"tcp://127.0.0.1:{port}"
            client = RpcClient(identity="probe", default_timeout=5.0)
            try:
                return await client.call(f"tcp://127.0.0.1:{port}", "master", "ping")
            finally:
                client.close()

    assert asyncio.run(with_bind()) is not None
