"""``zmqflow bench cluster``: the link-bound arithmetic and the namespace plan as data; the clean
refusal where namespaces are unavailable; a loopback run; and, as root where ``ip netns add``
works, real namespaces built, measured through and always taken down."""

from __future__ import annotations

import json
import secrets
import subprocess

import pytest

from zmqflow.bench.netns.calc import link_bound, payload_fraction, window_rate
from zmqflow.bench.netns.net import Network, check_netns, cleanup, list_namespaces, run_cmd
from zmqflow.bench.netns.plan import Topology, new_prefix, tbf_args
from zmqflow.bench.netns.run import format_table, run
from zmqflow.errors import InvalidArgument, Unavailable

from .conftest import ZMQFLOW

GBIT = 1e9
MB = 1e6


# -- the bound -----------------------------------------------------------------------------------
def test_one_shard_two_workers_bind_on_both_sides():
    b = link_bound(1 * GBIT, 2, [8 * MB])
    # each worker pulls then pushes: at most 125 MB/s each; the shard's link: 125 MB/s each way
    assert b.workers_bytes_per_s == pytest.approx(250e6)
    assert b.ps_bytes_per_s == pytest.approx(250e6)
    assert (b.bytes_per_s, b.binds) == (pytest.approx(250e6), "both")


def test_more_workers_than_one_shard_serves_bind_on_the_ps_link():
    b = link_bound(10 * GBIT, 4, [8 * MB])
    assert b.binds == "ps"
    assert b.bytes_per_s == pytest.approx(2 * 1.25e9)
    assert b.workers_bytes_per_s == pytest.approx(4 * 1.25e9)


def test_spread_shards_bind_on_the_worker_links():
    b = link_bound(1 * GBIT, 2, [2 * MB] * 4)
    assert (b.binds, b.bytes_per_s, b.ps_bytes_per_s) == ("workers", pytest.approx(250e6), pytest.approx(1e9))


def test_the_busiest_shard_sets_the_ps_bound():
    # 10 vars over 4 shards round-robin: 3, 3, 2, 2 -> the busiest holds 30%
    b = link_bound(1 * GBIT, 16, [3, 3, 2, 2])
    assert b.binds == "ps"
    assert b.bytes_per_s == pytest.approx(2 * 125e6 / 0.3)


@pytest.mark.parametrize("args", [(0, 2, [1]), (GBIT, 0, [1]), (GBIT, 2, []), (GBIT, 2, [0, 0]), (GBIT, 2, [-1, 3])])
def test_bound_refuses_nonsense(args):
    with pytest.raises(InvalidArgument):
        link_bound(*args)


def test_payload_fraction_counts_headers():
    assert payload_fraction(1500) == pytest.approx(1448 / 1514)
    assert 0.99 < payload_fraction(9000) < 1
    with pytest.raises(InvalidArgument):
        payload_fraction(40)


# -- the window ----------------------------------------------------------------------------------
def test_window_counts_phases_pro_rata_between_the_last_start_and_the_first_stop():
    a = [(0.0, 1.0, 2.0), (2.0, 3.0, 4.0)]  # worker a: 100 bytes a phase, one phase a second
    b = [(0.5, 1.5, 2.5), (2.5, 3.5, 4.5)]
    win = window_rate([a, b], 100, warm=0.5)
    # window [1.0, 4.0]: a pulls 1.0-1.0=0 of round 1, all of round 2 (1 s); b pulls 0.5 s of round 1, 1 s of round 2
    assert win.seconds == pytest.approx(3.0)
    pulled = 0 + 100 + 50 + 100
    pushed = 100 + 100 + 100 + 50
    assert win.pull_bytes_per_s == pytest.approx(pulled / 3)
    assert win.push_bytes_per_s == pytest.approx(pushed / 3)
    assert win.total_bytes_per_s == pytest.approx((pulled + pushed) / 3)
    assert win.rounds == 4


def test_overlapped_rounds_move_both_ways_over_the_whole_round_and_lift_the_workers_bound():
    win = window_rate([[(0.0, 0.0, 2.0), (2.0, 2.0, 4.0)]], 100, warm=1.0, overlapped=True)
    assert win.seconds == pytest.approx(3.0)  # [1, 4]: half of round 1, all of round 2, each way
    assert win.pull_bytes_per_s == win.push_bytes_per_s == pytest.approx(150 / 3)
    b = link_bound(1 * GBIT, 2, [2 * MB] * 4, overlapped=True)
    assert (b.binds, b.bytes_per_s) == ("workers", pytest.approx(500e6))  # each worker 125 MB/s each way


def test_window_refuses_runs_too_short_to_overlap():
    with pytest.raises(InvalidArgument, match="run longer"):
        window_rate([[(0.0, 1.0, 2.0)], [(1.5, 2.5, 3.5)]], 100, warm=1.0)
    with pytest.raises(InvalidArgument):
        window_rate([[(0.0, 1.0, 2.0)], []], 100, warm=0.0)


# -- the plan ------------------------------------------------------------------------------------
def test_plan_names_every_namespace_by_the_run_prefix_and_links_each_host_to_the_bridge():
    topo = Topology.make("zft-abc123", ps=2, workers=3)
    names = topo.namespaces()
    assert names[0] == "zft-abc123-br" and len(set(names)) == 6
    assert all(n.startswith("zft-abc123-") for n in names)
    assert len({h.ip for h in topo.hosts}) == 5
    cmds = [" ".join(c) for c in topo.setup_commands("/sbin/ip")]
    assert cmds[:6] == [f"/sbin/ip netns add {n}" for n in names]  # namespaces before anything in them
    for h in topo.hosts:
        assert len(h.label) <= 15  # an interface name
        assert f"/sbin/ip -n zft-abc123-br link add name {h.label} type veth peer name eth0 netns {h.ns}" in cmds
        assert f"/sbin/ip -n zft-abc123-br link set {h.label} master br0" in cmds
        assert f"/sbin/ip -n {h.ns} addr add {h.ip}/24 dev eth0" in cmds
    # nothing is ever made in the machine's own namespace
    assert all(c.split()[1] in ("netns", "-n") for c in cmds)


def test_rate_limits_both_ends_of_every_link():
    topo = Topology.make("zft-abc123", ps=1, workers=2)
    cmds = topo.rate_commands(10 * GBIT, tc="tc")
    assert len(cmds) == 2 * len(topo.hosts)
    for h in topo.hosts:
        assert ["tc", "-n", h.ns, "qdisc", "replace", "dev", "eth0", "root", *tbf_args(10 * GBIT)] in cmds
        assert ["tc", "-n", topo.bridge_ns, "qdisc", "replace", "dev", h.label, "root", *tbf_args(10 * GBIT)] in cmds


def test_token_bucket_holds_a_millisecond_and_at_least_a_gso_packet():
    assert tbf_args(10 * GBIT)[:4] == ["tbf", "rate", "10000000000bit", "burst"]
    assert int(tbf_args(10 * GBIT)[4]) == 1_250_000
    assert int(tbf_args(1 * GBIT)[4]) == 256 * 1024
    with pytest.raises(InvalidArgument):
        tbf_args(0)


def test_cluster_spec_and_prefix_checks():
    topo = Topology.make("zft-abc123", ps=4, workers=2)
    assert topo.cluster(2) == {"ps": ["10.213.0.10:7000", "10.213.0.11:7000"]}
    assert topo.exec_prefix(topo.workers[1], "ip") == ["ip", "netns", "exec", "zft-abc123-w1"]
    with pytest.raises(InvalidArgument):
        topo.cluster(5)
    with pytest.raises(InvalidArgument):
        Topology.make("zft-abc123", ps=0, workers=2)
    a, b = new_prefix("zft"), new_prefix("zft")
    assert a != b and a.startswith("zft-")
    for bad in ("", "Zft", "z-t", "zmqflowbench"):
        with pytest.raises(InvalidArgument):
            new_prefix(bad)


# -- refusing cleanly ----------------------------------------------------------------------------
def test_check_refuses_a_missing_ip_binary():
    with pytest.raises(Unavailable, match="/nonexistent/ip"):
        check_netns(ip="/nonexistent/ip")


@pytest.mark.parametrize("extra", [[], ["--cleanup"]])
def test_command_refuses_without_namespaces_with_a_message_not_a_traceback(extra):
    done = subprocess.run([*ZMQFLOW, "bench", "cluster", "--netns", "--ip", "/nonexistent/ip", *extra],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "Error: bench cluster: network namespaces need iproute2's `/nonexistent/ip`" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# -- runs ----------------------------------------------------------------------------------------
def test_loopback_run_measures_without_a_limit(tmp_path):
    out = tmp_path / "c.jsonl"
    rows = run(netns=False, ps=(1,), workers=(2,), model_mb=2, seconds=1.0, json_out=str(out), echo=lambda _m: None)
    assert [r["step"] for r in rows] == ["pull-push", "push-pull"]  # both, by default
    for row in rows:
        assert (row["ps"], row["workers"], row["rate_gbit"], row["fraction"]) == (1, 2, None, None)
        assert row["total_gbps"] == pytest.approx(row["pull_gbps"] + row["push_gbps"])
        assert row["pull_gbps"] > 0 and row["push_gbps"] > 0 and row["rounds"] >= 2
    assert rows[1]["pull_gbps"] == pytest.approx(rows[1]["push_gbps"])  # overlapped: every round moves both
    assert json.loads(out.read_text().splitlines()[0])["bench"] == "cluster"
    table = format_table(rows)
    assert "loopback" in table and "push-pull" in table
    with pytest.raises(InvalidArgument, match="steps are"):
        run(netns=False, steps=("pull-only",))


@pytest.fixture
def netns_family():
    """A namespace family of this test alone; skips where namespaces are unavailable."""
    family = f"zt{secrets.token_hex(3)}"
    try:
        check_netns(family=family)
    except Unavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    yield family
    left = [n for n in list_namespaces() if n.startswith(family + "-")]
    if left:  # take them down anyway, then fail
        cleanup(family)
    assert not left, f"namespaces left behind: {left}"


def test_real_namespaces_limit_the_links_and_are_removed(netns_family, tmp_path):
    said: list[str] = []
    rows = run(netns=True, rates=(1,), ps=(1,), workers=(2,), model_mb=4, seconds=1.5, family=netns_family,
               json_out=str(tmp_path / "c.jsonl"), echo=said.append)
    prefix = said[0].split()[1].rstrip("*")
    assert prefix.startswith(netns_family + "-")
    assert not [n for n in list_namespaces() if n.startswith(prefix)]
    sequential, overlapped = rows
    # one shard: its link binds both ways, and overlapping lifts only the workers' side
    assert (sequential["rate_gbit"], sequential["binds"], overlapped["binds"]) == (1, "both", "ps")
    for row in rows:
        assert row["limit_gbps"] == pytest.approx(0.25)
        # the limit is real: loopback moves this model many times faster than 0.25 GB/s; payload
        # can never exceed the link (headers take 4.4% of it)
        assert 0.2 < row["fraction"] <= payload_fraction() + 0.02, row


def test_a_failure_inside_the_network_still_removes_it(netns_family):
    topo = Topology.make(new_prefix(netns_family), ps=1, workers=1)
    with pytest.raises(Unavailable, match="/nonexistent/tc"), Network(topo, tc="/nonexistent/tc") as net:
        assert set(topo.namespaces()) <= set(list_namespaces())
        net.set_rate(GBIT)
    assert not set(topo.namespaces()) & set(list_namespaces())


def test_cleanup_removes_leftovers_and_their_processes(netns_family):
    prefix = new_prefix(netns_family)
    for ns in (f"{prefix}-br", f"{prefix}-w0"):
        run_cmd(["ip", "netns", "add", ns])
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-w0", "sleep", "60"])
    try:
        removed = cleanup(netns_family)
        assert sorted(removed) == sorted([f"{prefix}-br", f"{prefix}-w0"])
        assert sleeper.wait(10) != 0  # ended by cleanup, not by running out
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    assert not [n for n in list_namespaces() if n.startswith(prefix)]
