"""The process's ZAP handler: admits a CURVE client only when its public key is on the allow-list
of the router it connects to, and names it (``role/name``) on every message it sends.

libzmq asks one handler per context (``inproc://zeromq.zap.01``) about every CURVE handshake.
Several servers may share this process (and its context) on different loops and threads, so the
handler runs on its own thread and answers per ZAP domain: each CURVE router sets a domain of its
own and registers exactly that domain with its allow-list (a domain nobody registered, like the
empty one, is refused: without a handler anyone holding the server's public key would get in).
A refused client gets no answer; its socket monitor reports HANDSHAKE_FAILED_AUTH.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Mapping

import zmq

from ..errors import Unavailable
from .context import context

__all__ = ["register", "unregister", "ZAP_ENDPOINT"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_POLL_MS = 500

_lock = threading.Lock()
_domains: dict[bytes, Mapping[bytes, str]] = {}  # zap domain -> client public key (raw) -> user id
_counter = itertools.count(1)
_started: tuple[int, zmq.Context] | None = None  # (pid, context) the running handler is bound on


def _serve(sock: zmq.Socket) -> None:
    while True:
        try:
            if not sock.poll(_POLL_MS):
                continue
            frames = sock.recv_multipart()
        except zmq.ZMQError:  # the context was terminated: the process is ending
            sock.close(0)
            return
        try:
            sock.send_multipart(_answer(frames))
        except zmq.ZMQError:
            sock.close(0)
            return


def _answer(frames: list[bytes]) -> list[bytes]:
    """ZAP 1.0: [version, id, domain, address, identity, mechanism, *credentials] ->
    [version, id, status, text, user id, metadata]."""
    if len(frames) < 6:
        return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
    version, request_id, domain, address, _identity, mechanism, *creds = frames
    allow = _domains.get(domain)
    user = allow.get(creds[0]) if allow is not None and mechanism == b"CURVE" and creds else None
    if user is None:
        log.info("refused a %s connection from %s (domain %r): key not allowed", mechanism.decode(errors="replace"),
                 address.decode(errors="replace"), domain.decode(errors="replace"))
        return [version, request_id, b"400", b"key not allowed", b"", b""]
    return [version, request_id, b"200", b"OK", user.encode(), b""]


def _ensure_started() -> None:
    """Bind the handler on this process's context, once per context (again in a forked child, and
    on a new context once the previous one was closed: its handler ended with it)."""
    global _started
    ctx = context()
    if _started is not None and _started[0] == os.getpid() and _started[1] is ctx:
        return
    ready = threading.Event()
    failure: list[BaseException] = []

    def main() -> None:
        sock = ctx.socket(zmq.REP)
        sock.linger = 0
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(0)
            failure.append(exc)
            ready.set()
            return
        ready.set()
        _serve(sock)

    threading.Thread(target=main, name="zmqflow-zap", daemon=True).start()
    ready.wait(10)
    if failure or not ready.is_set():
        raise Unavailable(f"cannot start the ZAP handler at {ZAP_ENDPOINT}: {failure[0] if failure else 'timed out'} "
                          "(another authenticator on this process's ZeroMQ context?)")
    _started = (os.getpid(), ctx)


def register(allow: Mapping[bytes, str]) -> bytes:
    """A fresh ZAP domain admitting the keys of ``allow`` (raw public key -> user id); set it as the
    router's ``zap_domain`` before it binds."""
    with _lock:
        _ensure_started()
        domain = f"zmqflow-{os.getpid()}-{next(_counter)}".encode()
        _domains[domain] = dict(allow)
        return domain


def unregister(domain: bytes) -> None:
    with _lock:
        _domains.pop(domain, None)
