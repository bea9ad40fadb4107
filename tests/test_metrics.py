"""Prometheus metrics: a real ``zmqflow serve`` scraped over HTTP, and in-process servers on a hub of their own."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import zmqflow as zf
from zmqflow.client.ring import AsyncRing
from zmqflow.errors import AddressInUse, ConfigError, DeadlineExceeded
from zmqflow.observe import metrics
from zmqflow.observe.endpoint import host_for, port_from_env, serve_metrics
from zmqflow.rpc import RpcClient
from zmqflow.testing import free_port, local_cluster, wait_until
from zmqflow.wire.requests.ps import Empty

from .conftest import ZMQFLOW, SizeReadCalls, arun

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "zmqflow.json"


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    """Summed over every series of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_a_served_task_counts_real_pushes_pulls_and_lookups(tmp_path, procs):
    ps_port, mport = free_port(), free_port()
    spec = zf.ClusterSpec({"ps": [f"127.0.0.1:{ps_port}"]})
    cfile = tmp_path / "cluster.json"
    cfile.write_text(spec.to_json())
    server = procs([*ZMQFLOW, "serve", "--cluster", str(cfile), "--task", "ps:0", "--metrics-port", str(mport),
                    "--checkpoint-root", str(tmp_path)], env={"ZMQFLOW_RESTART_COUNT": "2"})
    server.wait_for_line("serving ps:0", 30)
    assert f"metrics at http://127.0.0.1:{mport}/metrics" in server.output
    with zf.Session(cluster=spec, task="ps:0", name="trainer") as sess:
        w = sess.variable("w", np.zeros(8, np.float32), optimizer=zf.optim.SGD(0.1))
        emb = sess.embedding("emb", None, 4, capacity=16)
        before = scrape(mport)
        for _ in range(7):
            w.push(np.ones(8, np.float32))
        for _ in range(5):
            w.read()
        for batch in range(5):
            emb.lookup(np.arange(batch * 8, batch * 8 + 8))
        zf.checkpoint.save(sess, str(tmp_path / "ckpt"), step=1)
        after = scrape(mport)
    t = {"task": "ps:0"}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # every push applied once, every request timed under its op
    assert value(d, "zmqflow_pushes_applied_total", mode="async", **t) == 7
    assert value(d, "zmqflow_request_seconds_count", op="ps.push", **t) == 7
    assert value(d, "zmqflow_request_seconds_count", op="ps.pull", **t) == 5
    assert value(d, "zmqflow_request_seconds_count", op="ps.emb_lookup", **t) == 5
    assert value(after, "zmqflow_request_seconds_bucket", op="ps.push", le="+Inf", **t) == \
        value(after, "zmqflow_request_seconds_count", op="ps.push", **t)
    # the trainer's messages, per peer and direction: one request and one reply per call
    peers = {dict(ls)["peer"] for (n, ls), _ in after.items() if n == "zmqflow_messages_total"}
    trainer = [p for p in peers if p == "trainer"]
    assert len(trainer) == 1, peers
    calls = sum(v for (n, ls), v in d.items() if n == "zmqflow_request_seconds_count")
    assert value(d, "zmqflow_messages_total", peer=trainer[0], direction="in", **t) == calls
    assert value(d, "zmqflow_messages_total", peer=trainer[0], direction="out", **t) == calls
    assert value(d, "zmqflow_bytes_total", peer=trainer[0], direction="in", **t) >= 7 * 8 * 4
    # what the shard holds, as its own status says
    assert value(after, "zmqflow_variables", **t) == 1  # w; the table's rows are not a variable part
    assert value(after, "zmqflow_shard_bytes", kind="variables", **t) >= 8 * 4
    rows = value(after, "zmqflow_table_rows", table="emb", **t)
    evicted = value(after, "zmqflow_table_evictions_total", table="emb", **t)
    assert 0 < rows <= 16 and evicted > 0 and rows + evicted == 40
    assert value(d, "zmqflow_shard_save_seconds_count", **t) == 1
    assert value(after, "zmqflow_restarts", **t) == 2
    assert total(after, "zmqflow_build_info") == 1


def test_a_metrics_port_in_use_or_zero_is_a_clear_error_exiting_2(tmp_path, procs):
    spec = {"ps": [f"127.0.0.1:{free_port()}"]}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        p = procs([*ZMQFLOW, "serve", "--cluster", json.dumps(spec), "--task", "ps:0", "--metrics-port", str(taken)])
        assert p.wait(30) == 2, p.output
    assert f"metrics port {taken} on 127.0.0.1 is in use" in p.output and "Traceback" not in p.output
    p = procs([*ZMQFLOW, "serve", "--cluster", json.dumps(spec), "--task", "ps:0", "--metrics-port", "0"])
    assert p.wait(30) == 2, p.output
    assert "metrics port must be 1..65535, got 0" in p.output


def test_metrics_bind_the_host_the_task_binds_when_the_spec_names_another(tmp_path, procs, monkeypatch):
    """A pod's spec address is a DNS name or service IP, not an interface: with ZMQFLOW_BIND_HOST the
    task binds that host, and so does its metrics endpoint (ZMQFLOW_METRICS_HOST still wins)."""
    spec = zf.ClusterSpec({"ps": [f"198.51.100.7:{free_port()}"]})  # TEST-NET-2: no interface of this host
    monkeypatch.setenv("ZMQFLOW_BIND_HOST", "127.0.0.1")
    monkeypatch.delenv("ZMQFLOW_METRICS_HOST", raising=False)
    assert host_for(spec, zf.TaskId("ps", 0)) == "127.0.0.1"
    monkeypatch.setenv("ZMQFLOW_METRICS_HOST", "0.0.0.0")
    assert host_for(spec, zf.TaskId("ps", 0)) == "0.0.0.0"
    monkeypatch.delenv("ZMQFLOW_METRICS_HOST")
    mport = free_port()
    p = procs([*ZMQFLOW, "serve", "--cluster", spec.to_json(), "--task", "ps:0", "--metrics-port", str(mport)],
              env={"ZMQFLOW_BIND_HOST": "127.0.0.1"})
    p.wait_for_line(f"metrics at http://127.0.0.1:{mport}/metrics", 30)
    p.wait_for_line("serving ps:0", 30)
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"zmqflow_build_info" in resp.read()
    p.signal(signal.SIGTERM)
    assert p.wait(10) == 0, p.output


def test_peer_labels_are_capped_and_the_rest_fold_into_other():
    hub = metrics.MetricsHub()
    extra = 10

    async def main() -> None:
        async with local_cluster({"ps": 1}, timeout=20, metrics_hub=hub) as servers:
            target = servers["ps:0"].target
            first = parse(generate_latest(hub.registry).decode())
            known = {dict(ls)["peer"] for (n, ls), _ in first.items() if n == "zmqflow_messages_total"} - {"other"}
            clients = [RpcClient(identity=f"peer-{i}") for i in range(metrics.MAX_LABELS + extra)]
            try:
                for c in clients:
                    await c.call(target, "master", "ping", Empty(), timeout=10)
            finally:
                for c in clients:
                    c.close()
            samples = parse(generate_latest(hub.registry).decode())
            peers = {dict(ls)["peer"] for (n, ls), _ in samples.items() if n == "zmqflow_messages_total"}
            assert len(peers) == metrics.MAX_LABELS + 1 and metrics.OTHER in peers
            # the first peers keep their names; the later ones are each counted once, as "other"
            named = sorted(p for p in peers if p.startswith("peer-"))
            assert len(named) == metrics.MAX_LABELS - len(known)
            assert value(samples, "zmqflow_messages_total", task="ps:0", peer="other", direction="in") == \
                extra + len(known)
            assert value(samples, "zmqflow_messages_total", task="ps:0", peer="other", direction="out") == \
                extra + len(known)
            # only ops that exist are labels
            ops = {dict(ls)["op"] for (n, ls), _ in samples.items() if n == "zmqflow_request_seconds_count"}
            assert "master.ping" in ops and all(re.fullmatch(r"[a-z_]+\.[a-z_]+", o) for o in ops)

    arun(main())


def test_unknown_ops_get_no_latency_series_and_random_routing_ids_are_not_published():
    hub = metrics.MetricsHub()
    secret = "0123456789abcdef0123456789abcdef"

    async def main() -> None:
        async with local_cluster({"ps": 1}, timeout=20, metrics_hub=hub) as servers:
            target = servers["ps:0"].target
            clients = [RpcClient(identity=i) for i in ("prober", f"worker:7-{secret}", "twin-0123abcd", "twin-4567cdef")]
            try:
                for op in ("nope", "nope2"):
                    with pytest.raises(zf.errors.NotFound):
                        await clients[0].call(target, "master", op, Empty(), timeout=10)
                for c in clients[1:]:
                    await c.call(target, "master", "ping", Empty(), timeout=10)
            finally:
                for c in clients:
                    c.close()
            text = generate_latest(hub.registry).decode()
            samples = parse(text)
            ops = {dict(ls)["op"] for (n, ls), _ in samples.items() if n == "zmqflow_request_seconds_count"}
            assert not any("nope" in o for o in ops), ops
            # a keyed task's routing id is unguessable on purpose: only its name is shown
            assert secret not in text and "0123abcd" not in text
            assert value(samples, "zmqflow_messages_total", task="ps:0", peer="worker:7", direction="in") == 1
            assert value(samples, "zmqflow_messages_total", task="ps:0", peer="twin", direction="in") == 2
            assert value(samples, "zmqflow_messages_total", task="ps:0", peer="prober", direction="out") == 2

    arun(main())


def test_sync_rounds_missing_replicas_and_stale_gradients_are_counted():
    hub = metrics.MetricsHub()
    opt = zf.SyncReplicas(zf.optim.SGD(0.1), replicas_to_aggregate=2)

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 2}, timeout=20, metrics_hub=hub) as servers:
            spec = servers["ps:0"].spec
            w0 = zf.AsyncSession(cluster=spec, task="worker:0", name="worker:0", timeout=5)
            w1 = zf.AsyncSession(cluster=spec, task="worker:1", name="worker:1", timeout=5)
            try:
                await w0.variable("s", np.zeros(4, np.float32), optimizer=opt)
                await w1.get("s")
                with pytest.raises(DeadlineExceeded):  # worker:1 never pushes step 0 in time
                    await w0.push({"s": np.ones(4, np.float32)}, step=0, timeout=1.0)
                await w1.push({"s": np.ones(4, np.float32)}, step=0)  # completes step 0 with worker:0's
                reply = await w0.push({"s": np.ones(4, np.float32)}, step=0, timeout=2.0)  # older than step 1
            finally:
                await w0.close()
                await w1.close()
            assert reply is not None
            s = parse(generate_latest(hub.registry).decode())
            assert value(s, "zmqflow_sync_missing_total", source="ps:0", task="worker:1") == 1
            assert value(s, "zmqflow_sync_missing_total", source="ps:0", task="worker:0") == 0
            assert value(s, "zmqflow_sync_rounds_total", task="ps:0") == 1
            assert value(s, "zmqflow_pushes_applied_total", task="ps:0", mode="sync") == 1
            assert value(s, "zmqflow_stale_gradients_total", task="ps:0") == 1
            assert value(s, "zmqflow_global_step", task="ps:0") == 1

    arun(main())


def test_a_ring_allreduce_records_its_bytes_time_and_busbw():
    hub = metrics.MetricsHub()

    async def main() -> None:
        async with local_cluster({"worker": 2}, timeout=20, metrics_hub=hub) as servers:
            rings = [AsyncRing(servers[f"worker:{i}"]) for i in range(2)]
            data = [np.full(1 << 19, i + 1, np.float32) for i in range(2)]  # 2 MiB each: the ring path
            out = await asyncio.gather(*(r.allreduce(d) for r, d in zip(rings, data)))
            assert np.all(out[0] == 3)
            s = parse(generate_latest(hub.registry).decode())
            for i in range(2):
                t = f"worker:{i}"
                assert value(s, "zmqflow_ring_bytes_total", task=t) == data[0].nbytes
                assert value(s, "zmqflow_ring_allreduce_seconds_count", task=t) == 1
                assert value(s, "zmqflow_ring_busbw_bytes_per_second", task=t) > 0

    arun(main())


def test_a_blocking_allreduce_through_shared_memory_is_counted_too():
    """The blocking ring's fast path runs on the caller's thread, not the loop: it hands its count
    to the loop, and the metrics show it beside the loop's own (the first call sets the shared
    memory up on the loop; the second takes the fast path)."""
    hub = metrics.MetricsHub()
    spec = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
    servers = [zf.Server(spec, f"worker:{i}", metrics_hub=hub) for i in range(2)]
    data = [np.full(1 << 10, i + 1, np.float32) for i in range(2)]
    got: list[list] = [[], []]

    def rank(i: int) -> None:
        ring = zf.Ring(servers[i], timeout=20)
        got[i] = [ring.allreduce(data[i]), ring.async_ring.shm_channel is not None, ring.allreduce(data[i])]
        ring.barrier()

    try:
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [g[1] for g in got] == [True, True], "the shared-memory path was not set up"
        assert all(np.all(g[0] == 3) and np.all(g[2] == 3) for g in got)

        def counted() -> bool:
            s = parse(generate_latest(hub.registry).decode())
            return all(value(s, "zmqflow_ring_allreduce_seconds_count", task=f"worker:{i}") == 2 for i in range(2))

        wait_until(counted, 10, what="both allreduces counted on both tasks")
        s = parse(generate_latest(hub.registry).decode())
        assert value(s, "zmqflow_ring_bytes_total", task="worker:0") == 2 * data[0].nbytes
    finally:
        for server in servers:
            server.stop()


def test_straggler_and_eval_recordings_are_exported_with_capped_labels(monkeypatch):
    # a process record of its own: filling the cap would fold later tests' reports into "other"
    monkeypatch.setattr(metrics.HUB, "process", metrics.ProcessMetrics())
    metrics.record_straggler("worker:0", "worker:3", 1.5)
    metrics.record_straggler("worker:0", "worker:3", 0.25)
    metrics.set_eval_metric("accuracy", 0.875, step=120)
    metrics.set_eval_metric("loss", 0.5, step=120)
    for i in range(metrics.MAX_LABELS + 5):
        metrics.record_straggler("cap-test", f"w{i}", 0.1)
    s = parse(generate_latest(metrics.HUB.registry).decode())
    assert value(s, "zmqflow_straggler_total", source="worker:0", task="worker:3") == 2
    assert value(s, "zmqflow_straggler_lag_seconds", source="worker:0", task="worker:3") == 0.25
    assert value(s, "zmqflow_eval", metric="accuracy") == 0.875
    assert value(s, "zmqflow_eval_step") == 120
    pairs = {ls for (n, ls), _ in s.items() if n == "zmqflow_straggler_total"}
    assert len(pairs) <= metrics.MAX_LABELS + 1
    assert value(s, "zmqflow_straggler_total", source="other", task="other") >= 5


def test_the_bridge_runtime_serves_its_tasks_at_the_env_port(monkeypatch):
    from zmqflow.bridge import runtime

    port = free_port()
    monkeypatch.setenv("ZMQFLOW_METRICS_PORT", str(port))
    monkeypatch.setenv("ZMQFLOW_RESTART_COUNT", "3")
    runtime.shutdown()
    rt = runtime.init(timeout=20)
    try:
        assert rt.metrics is not None and rt.metrics.port == port
        v = rt.session.variable("bridge_v", np.zeros(3, np.float32), optimizer=zf.optim.SGD(1.0))
        v.push(np.ones(3, np.float32))
        s = scrape(port)  # the push returned once applied
        assert value(s, "zmqflow_pushes_applied_total", task="ps:0", mode="async") == 1
        tasks = {dict(ls).get("task") for (n, ls), _ in s.items() if n == "zmqflow_messages_total"}
        assert {"worker:0", "ps:0"} <= tasks
        assert value(s, "zmqflow_restarts", task="worker:0") == 3
        # a second process (or task) on the same port is refused, clearly
        with pytest.raises(AddressInUse, match=f"metrics port {port}"):
            serve_metrics(port, hub=metrics.MetricsHub())
    finally:
        runtime.shutdown()
    assert not metrics.enabled()
    with socket.socket() as again:  # the endpoint is closed with the runtime (scrapes may leave TIME_WAIT)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen(1)


def test_the_env_port_is_a_base_offset_by_the_tasks_place_on_its_host(monkeypatch):
    spec = zf.ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "10.0.0.2:2", "127.0.0.1:3"]})
    monkeypatch.setenv("ZMQFLOW_METRICS_PORT", "9100")
    assert [port_from_env(spec, t) for t in spec.tasks] == [9100, 9101, 9100, 9102]
    monkeypatch.setenv("ZMQFLOW_METRICS_PORT", "ninety")
    with pytest.raises(ConfigError, match="ZMQFLOW_METRICS_PORT"):
        port_from_env(spec, spec.tasks[0])
    with pytest.raises(ConfigError, match="1..65535"):
        serve_metrics(70000, hub=metrics.MetricsHub())


def test_every_metric_the_dashboard_queries_is_exported():
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    exported = set()
    for fam in text_string_to_metric_families(generate_latest(metrics.MetricsHub().registry).decode()):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(fam.type, [""])
        exported |= {fam.name + s for s in suffixes}
    assert exported == metrics.MetricsHub().sample_names()
    used = {name for e in exprs for name in re.findall(r"\bzmqflow_[a-z_]+", e)}
    assert used and used <= exported, used - exported
    by_kind = defaultdict(int)
    for p in board["panels"]:
        by_kind[p["type"]] += 1
    assert board["title"] and board["schemaVersion"] and by_kind["timeseries"] >= 6


LAUNCHED = """
import os, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
from zmqflow.bridge import runtime
rt = runtime.init(timeout=30)
base = int(os.environ["ZMQFLOW_METRICS_PORT"])
for port, task in ((base, "worker:0"), (base + 1, "ps:0")):  # the cluster's order on this host
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = [x for f in text_string_to_metric_families(text) for x in f.samples
           if x.name == "zmqflow_messages_total" and x.labels["task"] == task and x.value > 0]
    print("scraped", task, bool(got), "zmqflow_restarts" in text, flush=True)
runtime.shutdown()
"""


def test_launch_serves_every_task_at_the_env_base_port(tmp_path, procs):
    import sys

    base = free_port()
    while any(not _free(base + i) for i in range(2)):
        base = free_port()
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    p = procs([*ZMQFLOW, "launch", "--workers", "1", "--ps", "1", "--", sys.executable, str(script)],
              env={"ZMQFLOW_METRICS_PORT": str(base)})
    assert p.wait(90) == 0, p.output
    assert "scraped worker:0 True True" in p.output and "scraped ps:0 True True" in p.output, p.output


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True



def test_a_scrape_reads_the_shard_while_its_parts_and_slots_change():
    hub = metrics.MetricsHub()

    async def main() -> tuple[dict, int, int]:
        async with local_cluster({"ps": 1}, timeout=20, metrics_hub=hub) as servers:
            store = servers["ps:0"].service("ps").store
            for name in ("a", "b"):
                store.create(name, 0, [4], [0, 4], "float32")
            a, b = store.get("a"), store.get("b")
            added: list = []

            def add_part() -> None:
                added.append(("added", len(added)))
                store.parts[added[-1]] = b

            held, slot = np.zeros(4, np.float32).view(SizeReadCalls), np.zeros(4, np.float32).view(SizeReadCalls)
            a.value, a.slots["m"] = held, slot
            held.on_read = add_part  # reading the part's size adds a part to the shard...
            slot.on_read = lambda: a.slots.setdefault(f"s{len(a.slots)}", np.zeros(4, np.float32))  # ...and a slot
            endpoint = serve_metrics(free_port(), hub=hub)
            try:
                samples = await asyncio.to_thread(scrape, endpoint.port)
            finally:
                endpoint.close()
                held.on_read = slot.on_read = None
                for key in added:
                    del store.parts[key]
            return samples, len(added), len(a.slots)

    samples, parts_added, slots = arun(main())
    assert parts_added >= 1 and slots > 1  # the scrape did read while both changed
    assert value(samples, "zmqflow_variables", task="ps:0") == 2  # the parts as the scrape first saw them
    assert value(samples, "zmqflow_shard_bytes", task="ps:0", kind="variables") >= 2 * 16
