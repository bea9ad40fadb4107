"""CurveZMQ keys: who gets in, what each key may do, whose name a call carries, protected mode.

Real sockets on loopback (tcp), real processes for the command line. Binds to a non-loopback
address are only ever attempted to see them refused: no traffic leaves loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import sys
import time

import numpy as np
import pytest
import zmq

import zmqflow as zf
from zmqflow import errors
from zmqflow.rpc import RpcClient
from zmqflow.testing import async_wait_until, free_port, local_cluster, make_spec
from zmqflow.transport.curve import ANY_TASK, CurveClient, Keys, generate, is_loopback
from zmqflow.transport.options import DEFAULT_OPTIONS
from zmqflow.transport.zeromq import ZmqTransport

from .conftest import BENCH_WIRING, ZMQFLOW, arun


def _spec(**jobs: int) -> zf.ClusterSpec:
    return make_spec(jobs, "tcp")


@pytest.fixture
def keyed(tmp_path):
    """A ps + 2 workers cluster spec on free loopback ports and its key directory."""
    spec = _spec(ps=1, worker=2)
    keys = tmp_path / "keys"
    generate(keys, spec)
    return spec, str(keys)


# keys generate ------------------------------------------------------------------------------
def test_keys_generate_writes_the_layout_with_private_secrets(tmp_path, procs):
    spec = _spec(ps=1, worker=1)
    cfile = tmp_path / "c.json"
    cfile.write_text(spec.to_json())
    p = procs([*ZMQFLOW, "keys", "generate", str(tmp_path / "k"), "--cluster", str(cfile)])
    assert p.wait(30) == 0, p.output
    root = tmp_path / "k"
    allow = json.loads((root / "allow.json").read_text())
    assert set(allow["tasks"]) == {"ps:0", "worker:0"} and set(allow["clients"]) == {"client"}
    assert allow["addresses"] == {str(t): str(spec.address(t)) for t in spec.tasks}
    for path in [root / "tasks" / "ps-0.key_secret", root / "tasks" / "worker-0.key_secret",
                 root / "clients" / "client.key_secret"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert "secret-key" in path.read_text()
    for path in [root / "tasks" / "ps-0.key", root / "clients" / "client.key", root / "allow.json"]:
        assert "secret-key" not in path.read_text()
    # a second run refuses to replace keys unless told to
    again = procs([*ZMQFLOW, "keys", "generate", str(root)])
    assert again.wait(30) == 2 and "--force" in again.output
    # without a cluster: one shared task key
    generate(tmp_path / "plain")
    shared = json.loads((tmp_path / "plain" / "allow.json").read_text())
    assert list(shared["tasks"]) == [ANY_TASK] and (tmp_path / "plain" / "tasks" / "task.key_secret").exists()
    k = Keys.load(tmp_path / "plain", "worker:3", require_task=True)
    assert (k.role, k.name, k.pinned) == ("task", "worker:3", False)


def test_a_secret_readable_by_others_is_refused(tmp_path):
    generate(tmp_path)
    os.chmod(tmp_path / "clients" / "client.key_secret", 0o644)
    with pytest.raises(errors.ConfigError, match="chmod 600"):
        Keys.load(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a key file a root or another owner")
def test_a_root_owned_secret_may_be_group_readable_as_a_kubernetes_secret_is(tmp_path):
    generate(tmp_path)
    secret = tmp_path / "clients" / "client.key_secret"
    os.chmod(secret, 0o440)  # what the kubelet makes of a Secret for a pod with an fsGroup
    assert Keys.load(tmp_path).role == "client"
    os.chown(secret, 1000, -1)  # the same mode on a file some user owns: refused
    with pytest.raises(errors.ConfigError, match="readable by others"):
        Keys.load(tmp_path)
    os.chown(secret, 0, -1)
    os.chmod(secret, 0o444)  # others may read it: refused whoever owns it
    with pytest.raises(errors.ConfigError, match=r"chmod 600 \(or 640 when owned by root\)"):
        Keys.load(tmp_path)


# a keyed cluster ------------------------------------------------------------------------------
def test_a_keyed_cluster_works_end_to_end_variables_push_and_ring(keyed):
    spec, keys = keyed

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys) as servers:
            async with zf.AsyncSession(cluster=spec, task="ps:0", keys=keys) as sess:
                assert sess.keys.role == "client" and sess.name == "client"
                w = await sess.variable("w", np.zeros(4, np.float32), optimizer=zf.optim.SGD(1.0))
                await sess.push({"w": np.ones(4, np.float32)})
                np.testing.assert_array_equal((await sess.pull(["w"]))["w"], -np.ones(4, np.float32))
                await w.assign(np.full(4, 7, np.float32))
                np.testing.assert_array_equal(await w.read(), np.full(4, 7, np.float32))
            rings = [zf.Ring(servers[f"worker:{i}"]) for i in range(2)]
            out = await asyncio.gather(*(r.allreduce(np.full(3, i + 1.0)) for i, r in enumerate(rings)))
            for o in out:
                np.testing.assert_array_equal(o, np.full(3, 3.0))
            # task keys may run admin ops on each other
            assert await servers["worker:0"].call("ps:0", "ps", "fence") >= 1
            assert await servers["worker:0"].call("ps:0", "ps", "unfence", {"epoch": 1}) is True

    arun(main())


def _session_value(spec, keys_dir, name="w"):
    async def main():
        async with zf.AsyncSession(cluster=spec, task="ps:0", keys=keys_dir) as sess:
            return (await sess.pull([name]))[name]
    return main()


@pytest.mark.parametrize("who", ["plaintext", "unlisted"])
def test_a_stranger_gets_unauthenticated_within_its_deadline_and_changes_nothing(keyed, tmp_path, who):
    spec, keys = keyed
    stranger = None
    if who == "unlisted":  # knows the cluster's public keys (they are public) but holds an unlisted keypair
        public, secret = zmq.curve_keypair()
        stranger = dataclasses.replace(Keys.load(keys), public=public, secret=secret)

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys) as servers:
            async with zf.AsyncSession(cluster=spec, task="ps:0", keys=keys) as sess:
                await sess.variable("w", np.arange(4, dtype=np.float32))
            ps = servers["ps:0"]
            before = ps.counters.msgs_in
            target = ps.target
            attacker = RpcClient(identity="intruder", default_timeout=5.0,
                                 keys=stranger)
            try:
                overwrite = {"mode": "set", "items": [["w", 0, 0, 4, np.full(4, 99, np.float32)]]}
                for op, body in [("assign", overwrite), ("pull", {"items": [["w", 0, 0, 4]]})]:
                    start = time.monotonic()
                    with pytest.raises(errors.Unauthenticated, match="authentication failed") as info:
                        await attacker.call(target, "ps", op, body, timeout=5.0)
                    assert time.monotonic() - start < 5.0
                    assert ("requires CurveZMQ keys" in str(info.value)) == (stranger is None)
            finally:
                attacker.close()
            assert ps.counters.msgs_in == before  # nothing reached the task
            np.testing.assert_array_equal(await _session_value(spec, keys), np.arange(4, dtype=np.float32))
            assert await servers["worker:0"].call("ps:0", "ps", "assign", overwrite) == 1  # the same request, keyed
            np.testing.assert_array_equal(await _session_value(spec, keys), np.full(4, 99, np.float32))

    arun(main())


def test_a_plaintext_session_fails_with_unauthenticated(keyed):
    spec, keys = keyed

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys) as servers:
            async with zf.AsyncSession(servers["ps:0"].target, timeout=3.0, keys=None) as sess:
                assert sess.keys is None
                with pytest.raises(errors.Unauthenticated):
                    await sess.status()

    os.environ.pop("ZMQFLOW_KEYS", None)
    arun(main())


def test_a_client_key_calling_admin_ops_is_denied(keyed):
    spec, keys = keyed

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys) as servers:
            async with zf.AsyncSession(cluster=spec, task="ps:0", keys=keys) as sess:
                await sess.variable("w", np.zeros(2, np.float32))
                for service, op, body, task in [("ps", "fence", None, "ps:0"), ("ps", "sweep", {"names": ["w"]}, "ps:0"),
                                                ("ring", "join", {"task": "worker:0", "generation": 0, "step": 0,
                                                                  "target": 0}, "worker:0")]:
                    with pytest.raises(errors.PermissionDenied, match=f"{service}.{op} needs a task key"):
                        await sess.call(service, op, body, task=task)
                assert not servers["ps:0"].service("ps").fenced
                assert (await sess.variables())[0]["name"] == "w"

    arun(main())


def test_identity_comes_from_the_key_not_from_the_header(keyed):
    spec, keys = keyed

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys) as servers:
            # a client claiming to be a sync replica is refused before anything runs
            liar = RpcClient(identity="liar", source="worker:0", keys=Keys.load(keys))
            liar.source = "worker:0"  # claims a replica's name in the header
            try:
                with pytest.raises(errors.PermissionDenied, match="claims to come from 'worker:0'"):
                    await liar.call(servers["ps:0"].target, "master", "status", timeout=5.0)
            finally:
                liar.close()
            # a task joining the ring as another task is refused
            with pytest.raises(errors.PermissionDenied, match="asked to join as worker:0"):
                await servers["worker:1"].call("worker:0", "ring", "join",
                                               {"task": "worker:0", "generation": 0, "step": 0, "target": 0}, timeout=5.0)
            # a task depositing a ring chunk as another rank is refused; as its own rank, taken
            zf.AsyncRing(servers["worker:0"], ["worker:0", "worker:1"], name="checked")
            chunk = {"ring": "checked", "seq": 0, "phase": "rs", "step": 0, "chunk": 0, "meta": [],
                     "data": np.zeros(2, np.float32)}
            with pytest.raises(errors.PermissionDenied, match="worker:1 may not deposit as rank 0"):
                await servers["worker:1"].call("worker:0", "ring", "deposit", {**chunk, "src": 0}, timeout=5.0)
            assert await servers["worker:1"].call("worker:0", "ring", "deposit", {**chunk, "src": 1}, timeout=5.0)
            # a session whose process is worker:1 pushes to a sync variable as worker:1, whatever it is called
            w1 = Keys.load(keys, "worker:1")
            async with zf.AsyncSession(cluster=spec, task="ps:0", keys=w1) as sess:
                assert sess.name == "worker:1"
                await sess.variable("s", np.zeros(2, np.float32),
                                    optimizer=zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1))
                await sess.push({"s": np.ones(2, np.float32)}, step=0)
                assert sess.replicas == ["worker:1"]
            with pytest.raises(errors.ConfigError, match="named by its key"):
                zf.AsyncSession(cluster=spec, task="ps:0", keys=w1, name="worker:0")

    arun(main())


def test_keys_from_the_environment_are_picked_up(keyed, monkeypatch):
    spec, keys = keyed
    monkeypatch.setenv("ZMQFLOW_KEYS", keys)
    monkeypatch.delenv("ZMQFLOW_TASK", raising=False)

    async def main():
        async with local_cluster(spec, timeout=10) as servers:
            assert servers["ps:0"].keys is not None and servers["ps:0"].keys.name == "ps:0"
            async with zf.AsyncSession(cluster=spec, task="ps:0") as sess:
                assert sess.keys is not None and sess.keys.role == "client"
                assert (await sess.status())["task"] == "ps:0"
            monkeypatch.setenv("ZMQFLOW_TASK", "worker:0")
            async with zf.AsyncSession(cluster=spec, task="ps:0") as sess:  # a task's own session: its task key
                assert (sess.keys.role, sess.name) == ("task", "worker:0")
                assert await sess.call("ps", "fence", task="ps:0") >= 1

    arun(main())


def test_a_blocking_server_and_session_take_keys(keyed):
    spec, keys = keyed
    with zf.Server(spec, "ps:0", keys=keys) as server:
        with zf.Session(server.target, keys=keys) as sess:
            assert sess.status()["task"] == "ps:0"


# protected mode ------------------------------------------------------------------------------
def test_without_keys_a_task_refuses_non_loopback_addresses_unless_insecure():
    assert is_loopback("tcp://127.0.0.1:1") and is_loopback("tcp://localhost:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:1") and not is_loopback("tcp://*:1")
    spec = zf.ClusterSpec({"worker": [f"0.0.0.0:{free_port()}"]})

    async def main():
        with pytest.raises(errors.ConfigError, match="zmqflow keys generate"):
            await zf.AsyncServer(spec, "worker:0", keys=None, insecure=False).start()
        server = await zf.AsyncServer(spec, "worker:0", keys=None, insecure=True).start()  # bind only, no traffic
        await server.stop()

    arun(main())


def test_serve_refuses_a_wildcard_address_without_keys_unless_insecure(tmp_path, procs):
    cfile = tmp_path / "c.json"
    cfile.write_text(json.dumps({"worker": [f"0.0.0.0:{free_port()}"]}))
    env = {"ZMQFLOW_KEYS": "", "ZMQFLOW_INSECURE": ""}
    refused = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "worker:0"], env=env)
    assert refused.wait(30) == 2
    assert "refuses to listen" in refused.output and "zmqflow keys generate" in refused.output
    allowed = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "worker:0", "--insecure"], env=env)
    allowed.wait_for_line("serving worker:0", 30)
    allowed.signal(15)
    assert allowed.wait(10) == 0


def test_serve_and_status_with_keys(tmp_path, procs):
    spec = _spec(worker=1)
    cfile = tmp_path / "c.json"
    cfile.write_text(spec.to_json())
    generate(tmp_path / "k", spec)
    p = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "worker:0", "--keys", str(tmp_path / "k")])
    p.wait_for_line("CurveZMQ keys from", 30)
    ok = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--json"], env={"ZMQFLOW_KEYS": str(tmp_path / "k")})
    assert ok.wait(30) == 0, ok.output
    assert json.loads(ok.output)["all_reachable"] is True
    plain = procs([*ZMQFLOW, "status", "--cluster", str(cfile), "--timeout", "1"], env={"ZMQFLOW_KEYS": ""})
    assert plain.wait(30) == 1
    p.signal(15)
    assert p.wait(10) == 0


def test_keys_of_another_cluster_fail_with_unauthenticated(keyed, tmp_path):
    """Its own key is unlisted and it expects other server keys: the server hangs up mid-handshake."""
    spec, keys = keyed
    generate(tmp_path / "other", spec)

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys):
            async with zf.AsyncSession(cluster=spec, task="ps:0", keys=str(tmp_path / "other"), timeout=5.0) as sess:
                start = time.monotonic()
                with pytest.raises(errors.Unauthenticated, match="refused this process's key"):
                    await sess.status()
                assert time.monotonic() - start < 5.0

    arun(main())


def test_the_transport_refuses_an_unlisted_key_at_the_handshake(tmp_path):
    """The seam itself: a CURVE listener hands over the authenticated name; a refused connection
    reports AUTH_FAILED and delivers nothing."""
    generate(tmp_path / "a")
    generate(tmp_path / "b")
    server_keys = Keys.load(tmp_path / "a", "worker:0", require_task=True)

    async def main():
        loop = asyncio.get_running_loop()
        got: list[tuple[list, str]] = []
        transport = ZmqTransport()
        listener = await transport.listen(f"tcp://127.0.0.1:{free_port()}", lambda f, user: got.append((f, user)),
                                          loop=loop, options=DEFAULT_OPTIONS, name="t",
                                          security=server_keys.server())
        states: dict[str, list[str]] = {"good": [], "bad": []}
        conns = {}
        try:
            for who, d in (("good", tmp_path / "a"), ("bad", tmp_path / "b")):
                k = Keys.load(d)
                conns[who] = transport.connect(listener.endpoint, who.encode(), lambda f: None, states[who].append,
                                               loop=loop, options=DEFAULT_OPTIONS, name=who,
                                               security=CurveClient(k.public, k.secret, server_keys.public))
            assert await conns["good"].send([b"hello"], loop.time() + 5)
            await async_wait_until(lambda: got and "auth-failed" in states["bad"], 5,
                                   what="the good message and the bad handshake's refusal")
            assert [(f[1:], user) for f, user in got] == [([b"hello"], "client/client")]
            assert "auth-failed" in states["bad"] and "up" in states["good"]
        finally:
            for c in conns.values():
                c.close()
            listener.close()

    arun(main())


LAUNCHED = """
import os, numpy as np, zmqflow as zf
server = zf.Server.from_env()
task = os.environ["ZMQFLOW_TASK"]
with zf.Session(cluster=server.spec, task="ps:0", timeout=20) as sess:
    assert server.async_server.keys is not None and sess.name == task, sess.name
    sess.wait_for_cluster(30)
    w = sess.variable("w", np.zeros(2), optimizer=zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2))
    w.push(np.ones(2))
    print("replicas", ",".join(sess.replicas), flush=True)
"""


@pytest.mark.parametrize("per_task", [True, False])
def test_launch_with_keys_runs_a_keyed_cluster_of_processes(tmp_path, procs, per_task):
    spec = _spec(ps=1, worker=2)
    cfile = tmp_path / "c.json"
    cfile.write_text(spec.to_json())
    generate(tmp_path / "k", spec if per_task else None)
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    p = procs([*ZMQFLOW, "launch", "--cluster", str(cfile), "--keys", str(tmp_path / "k"), "--", sys.executable,
               str(script)])
    assert p.wait(90) == 0, p.output
    assert p.output.count("replicas worker:0,worker:1") == 2, p.output


def test_launch_checks_keys_and_exposure_before_starting(tmp_path, procs):
    spec = _spec(ps=1, worker=1)
    cfile = tmp_path / "c.json"
    cfile.write_text(spec.to_json())
    generate(tmp_path / "k", _spec(worker=1))  # keys of another cluster: no key for ps:0
    p = procs([*ZMQFLOW, "launch", "--cluster", str(cfile), "--keys", str(tmp_path / "k")])
    assert p.wait(30) == 2 and "no secret key for task ps:0" in p.output
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps({"worker": [f"0.0.0.0:{free_port()}"]}))
    p = procs([*ZMQFLOW, "launch", "--cluster", str(wide)], env={"ZMQFLOW_KEYS": ""})
    assert p.wait(30) == 2 and "--insecure" in p.output


def test_bench_transport_measures_curve_beside_plaintext():
    from zmqflow.bench.transport import format_table, run
    from zmqflow.bench.transport.report import format_curve_table

    rows = run(quick=True, transports=("tcp",), sizes=[4096], curve=True, echo=None, plan=BENCH_WIRING)
    assert [(r["transport"], r["security"]) for r in rows] == [("tcp", "plain"), ("tcp", "curve")]
    assert all(r["zf_gbps"] > 0 and r["raw_gbps"] > 0 for r in rows)
    table = format_curve_table(rows)
    assert "zf GB/s on" in table and "tcp" in table.splitlines()[-1]
    assert "curve" in format_table(rows)


def test_a_keyed_session_with_several_streams_moves_large_requests_over_each(keyed, monkeypatch):
    """Every extra stream is a CURVE connection of its own under the same key: admitted, and the
    large pushes and pulls it carries land exactly."""
    from zmqflow.client.variables import SLICE_BYTES
    from zmqflow.rpc.streams import STREAMS_ENV

    spec, keys = keyed
    monkeypatch.setenv(STREAMS_ENV, "3")
    rows = 3 * SLICE_BYTES // (64 * 4) + 1

    async def main():
        async with local_cluster(spec, timeout=10, keys=keys):
            async with zf.AsyncSession(cluster=spec, task="ps:0", keys=keys) as sess:
                await sess.variable("big", shape=(rows, 64))
                await sess.push({"big": np.ones((rows, 64), np.float32)})
                got = (await sess.pull(["big"]))["big"]
                np.testing.assert_array_equal(got, np.ones((rows, 64), np.float32))

    arun(main())
