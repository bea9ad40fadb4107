"""Both servers of one transport, started together and always cleaned up.

For ipc and tcp each runs in its own spawned process, so the client shares neither a process nor
a GIL with them. inproc only connects within one ZeroMQ context, so there both run in this
process: ``zmqflow.Server`` on its loop thread, the raw ROUTER on a plain thread.

With ``keys`` (a key directory holding a shared task key) both run CurveZMQ: the zmqflow task
server with those keys (its ZAP handler admitting the allow-list), the raw ROUTER as a CURVE
server with the same task keypair (no ZAP handler: handshakes are not what is measured).
inproc never runs a handshake, so it has no CURVE variant.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

from ...ports import free_port
from ...server.task import Server
from ...transport.curve import Keys
from ..procs import Child, zf_keyed_task_process
from . import raw_pyzmq

__all__ = ["servers"]

_TASK = "worker:0"


def _spec(address: str) -> str:
    return json.dumps({"worker": [address]})


@contextlib.contextmanager
def servers(transport: str, keys: Keys | None = None) -> Iterator[tuple[str, str]]:
    """Start the zmqflow and the raw server for ``transport``; yield their endpoints; clean up."""
    if keys is not None and transport == "inproc":
        raise ValueError("inproc runs no handshake: CURVE applies to ipc and tcp only")
    with contextlib.ExitStack() as stack:
        if transport == "inproc":
            tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            zf = Server({"worker": [f"inproc://zfbench-zf-{tag}"]}, _TASK)
            stack.callback(zf.stop)
            raw = raw_pyzmq.ServerThread(f"inproc://zfbench-raw-{tag}")
            stack.callback(raw.stop)
            yield zf.target, raw.endpoint
            return
        if transport == "ipc":
            tmpdir = tempfile.mkdtemp(prefix="zfbench-")
            stack.callback(shutil.rmtree, tmpdir, True)
            raw_bind = f"ipc://{tmpdir}/raw.sock"
        else:
            raw_bind = "tcp://127.0.0.1:*"
        curve = (keys.public, keys.secret) if keys is not None else None
        raw_child = Child(raw_pyzmq.server_process, (raw_bind, curve), f"raw {transport} server")
        stack.callback(raw_child.stop)
        zf_ep = None
        for attempt in range(5):  # a picked tcp port can be taken before the server binds it
            address = f"ipc://{tmpdir}/zf-{attempt}.sock" if transport == "ipc" else f"127.0.0.1:{free_port()}"
            key_dir = str(keys.directory) if keys is not None else ""
            zf_child = Child(zf_keyed_task_process, (_spec(address), _TASK, key_dir), f"zmqflow {transport} server")
            try:
                zf_ep = zf_child.wait_ready()
            except RuntimeError as exc:
                zf_child.stop()
                if "in use" not in str(exc) or attempt == 4:
                    raise
                continue
            stack.callback(zf_child.stop)
            break
        raw_ep = raw_child.wait_ready()
        assert zf_ep is not None
        yield zf_ep, raw_ep
