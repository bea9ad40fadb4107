"""Key material a loader must refuse, the ZAP handler on a new context, and unguessable routing ids.

Real keys (``generate``), real sockets on loopback; the context test runs in a process of its own,
since it closes that process's ZeroMQ context."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap

import pytest

from zmqflow import errors
from zmqflow.client.session import AsyncSession
from zmqflow.rpc.roles import CLIENT_OPS
from zmqflow.testing import free_port, make_spec
from zmqflow.transport.curve import Keys, generate

from .conftest import arun


@pytest.fixture
def keyed(tmp_path):
    """A ps + worker cluster spec on free loopback ports and its key directory."""
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    generate(tmp_path / "keys", spec)
    return spec, str(tmp_path / "keys")


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_makes_private_directories_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        generate(tmp_path / "k")
    finally:
        os.umask(old)
    root = tmp_path / "k"
    assert [_mode(p) for p in (root, root / "tasks", root / "clients")] == [0o700] * 3
    assert _mode(root / "allow.json") == 0o644
    assert Keys.load(root).role == "client" and Keys.load(root, "worker:0", require_task=True).role == "task"


@pytest.mark.parametrize("where", ["allow.json", ".", "tasks", "clients"])
def test_an_allow_list_or_key_directory_others_may_write_is_refused(keyed, where):
    _, d = keyed
    path = os.path.join(d, where)
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o022)
    task = "worker:0" if where != "clients" else None
    with pytest.raises(errors.ConfigError, match="writable by others"):
        Keys.load(d, task)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a key directory another owner")
def test_keys_owned_by_another_user_are_refused_and_a_sticky_root_mount_is_not(keyed):
    _, d = keyed
    os.chmod(d, 0o1777)  # a Kubernetes Secret's mount point: root-owned, sticky, writable by all
    assert Keys.load(d, "ps:0", require_task=True).name == "ps:0"
    for where in ("allow.json", "tasks", "tasks/ps-0.key_secret"):
        path = os.path.join(d, where)
        os.chown(path, 1000, -1)
        with pytest.raises(errors.ConfigError, match="owned by another user"):
            Keys.load(d, "ps:0", require_task=True)
        os.chown(path, 0, -1)


def test_a_secret_key_that_is_not_its_public_keys_is_refused(keyed):
    _, d = keyed
    secret_of = lambda p: re.search(r'secret-key = "(.*)"', open(p).read()).group(1)  # noqa: E731
    mine = os.path.join(d, "tasks", "ps-0.key_secret")
    other = secret_of(os.path.join(d, "clients", "client.key_secret"))
    text = re.sub(r'secret-key = ".*"', f'secret-key = "{other}"', open(mine).read())
    with open(mine, "w") as fh:
        fh.write(text)
    with pytest.raises(errors.ConfigError, match=r"ps-0\.key_secret: its secret key does not belong to its public"):
        Keys.load(d, "ps:0", require_task=True)


CONTEXT_CHECK = textwrap.dedent("""
    import asyncio, sys
    from zmqflow.testing import async_wait_until, free_port
    from zmqflow.transport.context import context
    from zmqflow.transport.curve import CurveClient, Keys
    from zmqflow.transport.options import DEFAULT_OPTIONS
    from zmqflow.transport.zeromq import ZmqTransport

    good_dir, bad_dir = sys.argv[1:3]
    server = Keys.load(good_dir, "worker:0", require_task=True)

    async def check(tag):
        loop = asyncio.get_running_loop()
        got, states, conns = [], {"good": [], "bad": []}, {}
        t = ZmqTransport()
        lst = await t.listen(f"tcp://127.0.0.1:{free_port()}", lambda f, user: got.append((f[1:], user)),
                             loop=loop, options=DEFAULT_OPTIONS, name="t", security=server.server())
        try:
            for who, d in (("bad", bad_dir), ("good", good_dir)):
                k = Keys.load(d)
                conns[who] = t.connect(lst.endpoint, who.encode(), lambda f: None, states[who].append, loop=loop,
                                       options=DEFAULT_OPTIONS, name=who,
                                       security=CurveClient(k.public, k.secret, server.public))
            # never sendable: a connection that failed its handshake has no pipe to queue on
            assert not await conns["bad"].send([b"bad"], loop.time() + 0.3)
            assert await conns["good"].send([b"good"], loop.time() + 5)
            await async_wait_until(lambda: got and "auth-failed" in states["bad"], 10,
                                   what=f"{tag}: the good message and the bad handshake's refusal")
            assert got == [([b"good"], "client/client")], (tag, got)
        finally:
            for c in conns.values():
                c.close()
            lst.close()

    async def main():
        await check("first context")
        context().term()  # the next context() is a new one: the handler must be bound on it too
        await check("new context")
        print("ok", flush=True)

    asyncio.run(main())
""")


def test_a_new_context_gets_its_own_zap_handler_and_unlisted_keys_stay_out(tmp_path):
    generate(tmp_path / "good")
    generate(tmp_path / "bad")
    env = {k: v for k, v in os.environ.items() if k not in ("ZMQFLOW_KEYS", "ZMQFLOW_TASK")}
    p = subprocess.run([sys.executable, "-c", CONTEXT_CHECK, str(tmp_path / "good"), str(tmp_path / "bad")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_a_sessions_routing_id_has_a_128_bit_random_suffix():
    async def main():
        s = AsyncSession(f"tcp://127.0.0.1:{free_port()}", name="trainer")
        try:
            return s.client.identity
        finally:
            await s.close()

    ident = arun(main())
    assert re.fullmatch(rb"trainer-[0-9a-f]{32}", ident), ident


def test_security_md_lists_every_client_op_and_the_plain_bulk_streams():
    doc = open(os.path.join(os.path.dirname(__file__), "..", "SECURITY.md")).read()
    for service, ops in CLIENT_OPS.items():
        row = re.search(rf"^\| `{service}` \| (.*) \|$", doc, re.M)
        assert row is not None, service
        assert set(re.findall(r"`(\w+)`", row.group(1))) == set(ops), service
    assert "every socket runs CurveZMQ" not in doc.replace("\n  ", " ")
    assert "## Bulk streams" in doc and "**not encrypted**" in doc
