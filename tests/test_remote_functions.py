"""Remote functions cannot escape: registered functions and public functions defined in allowed
modules run; every other name is refused with PermissionDenied, before it can do anything."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import errors
from zmqflow.server.services.worker import WorkerService
from zmqflow.testing import make_spec, wait_until

from .conftest import ZMQFLOW

ALLOWED = ["json", "tests.fixtures.escapes", "tests.fixtures.remote"]


@pytest.fixture
def remote():
    """A session on worker:0 of a tcp cluster whose worker:1 allows ``ALLOWED``."""
    spec = make_spec({"worker": 2}, "tcp")
    with zf.Server(spec, "worker:0") as w0, zf.Server(spec, "worker:1", allow_modules=ALLOWED) as w1:
        with zf.Session(w0.target) as sess:
            yield sess, w1


def escapes(path: str) -> list[tuple[str, list]]:
    """Each call would create ``path`` (or read a file) if it ran."""
    return [
        ("json:codecs.open", [path, "w"]),  # a module the allowed module imported, then its function
        ("json:__loader__.get_data", ["/etc/hostname"]),  # a dunder, then an object's method
        ("tests.fixtures.escapes:os.system", [f"touch {path}"]),  # a shell through an imported os
        ("tests.fixtures.escapes:os.mkdir", [path]),  # a dotted path
        ("tests.fixtures.escapes:_private", [path]),  # a private function
        ("tests.fixtures.escapes:Maker", [path]),  # a class: calling it runs __init__
        ("tests.fixtures.escapes:copyfile", [__file__, path]),  # a function it imported from shutil
        ("tests.fixtures.escapes:make_dir", [path]),  # a builtin under a public name
        ("tests.fixtures.escapes:open", [path, "w"]),  # a builtin it never defined
        ("tests.fixtures.escapes:__builtins__", []),
        ("os:system", [f"touch {path}"]),  # a module not on the allow-list
        ("json", [path]),  # no colon: a registered name, and none is
        ("tests.fixtures.escapes:", []),
        (":total", []),
        ("tests..fixtures.escapes:total", []),
    ]


def test_every_escape_is_refused_with_permission_denied_and_has_no_effect(remote, tmp_path):
    sess, _ = remote
    for i in range(len(escapes(""))):
        target = tmp_path / f"made-{i}"
        function, args = escapes(str(target))[i]
        with pytest.raises(errors.PermissionDenied) as caught:
            sess.run(function, *args, task="worker:1")
        assert repr(function) in str(caught.value), (function, str(caught.value))
        assert not target.exists(), f"{function} ran: it created {target}"
    assert list(tmp_path.iterdir()) == []


def test_a_refused_name_imports_nothing(remote):
    sess, w1 = remote
    w1.async_server.service("worker").allow_modules = ("tests.fixtures",)
    sys.modules.pop("tests.fixtures.import_bomb", None)
    for function in ("tests.fixtures.import_bomb:_fine", "tests.fixtures.import_bomb:fine.__code__",
                     "tests.fixtures.import_bomb.__main__:fine", "tests.fixtures._import_bomb:fine",
                     "tests.fixture:fine"):
        with pytest.raises(errors.PermissionDenied, match="may not run"):
            sess.run(function, task="worker:1")
        assert "tests.fixtures.import_bomb" not in sys.modules, function
    assert sess.run("tests.fixtures.import_bomb:fine", task="worker:1") == "imported"  # allowed: it runs


def test_public_functions_of_allowed_modules_run_sync_and_async(remote):
    sess, _ = remote
    out = sess.run("tests.fixtures.remote:scale", np.arange(3.0), task="worker:1", factor=3.0)
    np.testing.assert_array_equal(out["y"], np.arange(3.0) * 3)
    assert out["shape"] == [3]
    assert sess.run("tests.fixtures.remote:add_later", 2, 3, task="worker:1") == 5  # a coroutine function
    assert sess.run("tests.fixtures.escapes:total", 1, 2, 3, task="worker:1") == 6
    assert sess.run("json:dumps", [1, 2], task="worker:1") == "[1, 2]"  # defined in json itself
    with pytest.raises(errors.RemoteError, match="remote boom"):
        sess.run("tests.fixtures.remote:boom", task="worker:1")
    with pytest.raises(errors.PermissionDenied, match="not on this task's allow-list"):
        sess.run("tests.fixtures.remote:scale", 1, task="worker:0")  # worker:0 allows nothing
    with pytest.raises(errors.PermissionDenied, match="is nothing"):
        sess.run("tests.fixtures.remote:nope", task="worker:1")
    with pytest.raises(errors.NotFound, match="cannot import"):
        sess.run("json.nothing_here:dumps", task="worker:1")


def test_registered_functions_run_by_name_sync_and_async(remote):
    sess, w1 = remote
    seen: list[int] = []
    done = threading.Event()

    def record(x: int) -> int:
        seen.append(x)
        done.set()
        return x * 2

    async def later(a: float, b: float = 1.0) -> float:
        await asyncio.sleep(0)
        return a + b

    w1.register_function("record", record)
    w1.register_function("steps.later", later)
    w1.register_function("private_helper", lambda: "anything the task chose to offer")
    assert sess.run("record", 21, task="worker:1") == 42 and done.is_set() and seen == [21]
    assert sess.run("steps.later", 1.5, task="worker:1", b=2.0) == 3.5
    assert sess.run("private_helper", task="worker:1") == "anything the task chose to offer"
    with pytest.raises(errors.PermissionDenied, match="registered: private_helper, record, steps.later"):
        sess.run("recorded", task="worker:1")
    with pytest.raises(errors.PermissionDenied):
        sess.run("record", 1, task="worker:0")  # registered on worker:1 only
    assert seen == [21]


def test_register_refuses_a_module_style_name_and_a_non_callable():
    svc = WorkerService()
    with pytest.raises(errors.InvalidArgument, match="without ':'"):
        svc.register("json:dumps", json.dumps)
    with pytest.raises(errors.InvalidArgument, match="without ':'"):
        svc.register("", json.dumps)
    with pytest.raises(errors.InvalidArgument, match="needs a callable"):
        svc.register("x", 3)  # type: ignore[arg-type]
    assert svc.functions == {}


def test_serve_with_an_allowed_module_refuses_the_escapes(procs, tmp_path):
    cfile = tmp_path / "c.json"
    spec = make_spec({"worker": 1}, "tcp")
    cfile.write_text(spec.to_json())
    p = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "worker:0", "--allow-module", "json"])
    p.wait_for_line("serving worker:0", 30)
    target = tmp_path / "created"
    with zf.Session(spec.address("worker:0").endpoint) as sess:
        with pytest.raises(errors.PermissionDenied, match="json:codecs.open"):
            sess.run("json:codecs.open", str(target), "w", task="worker:0")
        with pytest.raises(errors.PermissionDenied, match="__loader__"):
            sess.run("json:__loader__.get_data", "/etc/hostname", task="worker:0")
        assert sess.run("json:loads", "[1]", task="worker:0") == [1]
    assert not target.exists()



SLOW = "import time\n\ndef slow(marker, seconds):\n    open(marker, 'w').close()\n    time.sleep(seconds)\n"


def test_serve_stops_at_sigterm_while_a_plain_function_still_runs(procs, tmp_path):
    """A plain function runs on a thread of its own: one that blocks does not keep a stopped
    task's process alive (the loop's default executor would be joined at exit)."""
    (tmp_path / "slowmod.py").write_text(SLOW)
    cfile, marker = tmp_path / "c.json", tmp_path / "started"
    spec = make_spec({"worker": 1}, "tcp")
    cfile.write_text(spec.to_json())
    p = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "worker:0", "--allow-module", "slowmod"],
              env={"PYTHONPATH": str(tmp_path)})
    p.wait_for_line("serving worker:0", 30)
    with zf.Session(spec.address("worker:0").endpoint) as sess:
        pending = sess.submit(sess.async_session.run("slowmod:slow", str(marker), 60, task="worker:0", timeout=90))
        wait_until(marker.exists, 20, what="the function running on the task")
        p.signal(signal.SIGTERM)
        assert p.wait(10) == 0, p.output
        pending.cancel()


def test_plain_functions_count_until_they_return_not_until_their_deadline():
    """A deadline cancels the call but not its thread: the threads still running are what
    ``max_run_threads`` caps, so short deadlines cannot start threads without end."""
    from zmqflow.server.limits import ServerLimits

    spec = make_spec({"worker": 1}, "tcp")
    release = threading.Event()
    with zf.Server(spec, "worker:0", limits=ServerLimits(max_run_threads=2)) as w0:
        w0.register_function("slow", lambda: release.wait(30))
        w0.register_function("quick", lambda: "quick")
        worker = w0.async_server.service("worker")
        try:
            with zf.Session(w0.target) as sess:
                for _ in range(2):
                    with pytest.raises(errors.DeadlineExceeded):
                        sess.run("slow", task="worker:0", timeout=0.3)
                assert worker.running == 2
                for name in ("quick", "slow"):
                    with pytest.raises(errors.ResourceExhausted, match=f"'{name}'.*its limit max_run_threads 2"):
                        sess.run(name, task="worker:0")
                assert worker.running == 2  # a refused call started no thread
                release.set()
                wait_until(lambda: worker.running == 0, 10, what="the cancelled calls' threads to return")
                assert [sess.run("quick", task="worker:0") for _ in range(3)] == ["quick"] * 3
                assert worker.running == 0
        finally:
            release.set()


def test_worker_service_refuses_a_thread_limit_that_is_no_count():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(errors.InvalidArgument, match="max_threads"):
            WorkerService(max_threads=bad)  # type: ignore[arg-type]
