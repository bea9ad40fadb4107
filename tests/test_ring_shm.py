"""The ring's shared-memory path between ranks on one host: exact results, dead ranks, cleanup."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client import ring_shm, ring_shm_host
from zmqflow.state import shm_schedule as plan
from zmqflow.state.reduce import Joined, reduce_in_order
from zmqflow.testing import wait_until

from .conftest import launch_script

pytestmark = pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
ROOT = str(Path(__file__).resolve().parent.parent)
SIZES = (0, 1, 7, 300_001, (1 << 20) // 4 * 3 + 5, (1 << 20) + 3)  # several 1 MiB slots, not a multiple; the last
# is past FOLD_STREAM_FROM for float32 too: its fold writes past the cache
LIST_SIZES = (300_001, 0, (1 << 20) // 4 * 3 + 5, 7)  # one call's arrays: several slots, pieces across their ends
DTYPES = ["float32", "float64"]
try:
    import ml_dtypes  # noqa: F401  (numpy's bfloat16)
    DTYPES.append("bfloat16")
except ImportError:
    pass


def rank_array(rank: int, size: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(100 * rank + size).uniform(-4, 4, size).astype(dtype)


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if plan.NAME_RE.match(n)}


WORKER = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    sys.path.insert(0, sys.argv[2])
    from tests.test_ring_shm import SIZES, DTYPES, LIST_SIZES, rank_array
    out = {}
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, timeout=20)
        for size in SIZES:
            for dtype in DTYPES:
                for op in ("sum", "mean"):
                    got = ring.allreduce(rank_array(ring.rank, size, dtype), op=op)
                    out[f"{size}-{dtype}-{op}"] = got.view(np.uint16) if dtype == "bfloat16" else got
        out["list"] = np.concatenate(ring.allreduce([rank_array(ring.rank, 5, "float32"), rank_array(ring.rank, 9, "float32")]))
        mixed = ring.allreduce([rank_array(ring.rank, 5, "float32"), rank_array(ring.rank, 7, "float64")])  # two buckets
        out["mixed-32"], out["mixed-64"] = mixed
        for op in ("sum", "mean"):  # pieces copied straight out of the arrays, across their ends
            out[f"long-list-{op}"] = np.concatenate(ring.allreduce([rank_array(ring.rank, m, "float32") for m in LIST_SIZES], op=op))
        print("SHM", ring.async_ring.shm_channel is not None, flush=True)
        ring.barrier()
        ring.leave()
        np.savez(f"{sys.argv[1]}/rank{ring.rank}.npz", **out)
    """
)


def _run(procs, tmp_path, n, env_off=False):
    if env_off:
        os.environ["ZMQFLOW_RING_SHM"] = "0"
    try:
        p = launch_script(procs, tmp_path / "worker.py", WORKER, tmp_path, ROOT, workers=n)
    finally:
        os.environ.pop("ZMQFLOW_RING_SHM", None)
    assert p.wait(100) == 0, p.output
    return p, [np.load(tmp_path / f"rank{r}.npz") for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_shm_allreduce_is_bit_identical_to_reduce_in_order(tmp_path, procs, n):
    before = segments()
    p, results = _run(procs, tmp_path, n)
    assert p.output.count("SHM True") == n, p.output
    for size in SIZES:
        for dtype in DTYPES:
            for op in ("sum", "mean"):
                key = f"{size}-{dtype}-{op}"
                ref = reduce_in_order([rank_array(r, size, dtype) for r in range(n)], op)
                ref = ref.view(np.uint16) if dtype == "bfloat16" else ref
                for r in range(n):
                    assert results[r][key].tobytes() == ref.tobytes(), f"{key} rank {r}"
    ref = np.concatenate([reduce_in_order([rank_array(r, m, "float32") for r in range(n)], "sum") for m in (5, 9)])
    np.testing.assert_array_equal(results[n - 1]["list"], ref)
    for key, m, dtype in (("mixed-32", 5, "float32"), ("mixed-64", 7, "float64")):
        ref = reduce_in_order([rank_array(r, m, dtype) for r in range(n)], "sum")
        assert all(results[r][key].tobytes() == ref.tobytes() for r in range(n)), key
    for op in ("sum", "mean"):
        ref = np.concatenate([reduce_in_order([rank_array(r, m, "float32") for r in range(n)], op) for m in LIST_SIZES])
        for r in range(n):
            assert results[r][f"long-list-{op}"].tobytes() == ref.tobytes(), f"long list {op} rank {r}"
    assert segments() <= before  # nothing left behind


def test_env_turns_shm_off(tmp_path, procs):
    p, results = _run(procs, tmp_path, 2, env_off=True)
    assert p.output.count("SHM False") == 2, p.output
    key = f"{SIZES[3]}-float32-sum"
    ref = reduce_in_order([rank_array(r, SIZES[3], "float32") for r in range(2)], "sum")
    np.testing.assert_array_equal(results[0][key], ref)


KILLED = textwrap.dedent(
    """
    import os, sys, time, numpy as np, zmqflow as zf
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, timeout=15)
        ring.allreduce(np.ones(10, np.float32))
        print("READY", ring.rank, os.getpid(), flush=True)
        if ring.rank == 1:
            time.sleep(60)  # killed here
        t = time.monotonic()
        try:
            ring.allreduce(np.ones(1 << 20, np.float32))
        except zf.errors.ZmqflowError as e:
            print("ERROR", type(e).__name__, e.details.get("task"), round(time.monotonic() - t, 1), flush=True); print("MSG", e, flush=True)
    """
)


def test_a_killed_rank_is_named_and_leaves_no_segments(tmp_path, procs):
    before = segments()
    p = launch_script(procs, tmp_path / "killed.py", KILLED, workers=3)
    line = p.wait_for_line("READY 1 ", 60)
    pid = int(line.split()[-1])
    assert segments() <= before  # unlinked as soon as every rank mapped them
    os.kill(pid, signal.SIGKILL)
    p.wait_for_line("ERROR", 30)
    try:
        wait_until(lambda: p.output.count("] ERROR ") == 2, 30)
    except TimeoutError:
        raise AssertionError(f"both survivors should name the dead rank; output:\n{p.output}") from None
    for row in [ln for ln in p.output.splitlines() if "ERROR" in ln]:
        kind, task, took = row.split("ERROR", 1)[1].split()
        assert kind in ("Unavailable", "DeadlineExceeded") and task == "worker:1" and float(took) < 15, row
    p.wait(60)
    assert segments() <= before


RANK = textwrap.dedent(
    """
    import sys, time, numpy as np
    from zmqflow.client.ring_shm import ShmChannel
    rank = int(sys.argv[1])
    ch = ShmChannel("t", rank, 2, ["worker:0", "worker:1"])
    print(" ".join(map(str, ch.blob())), ch.path, flush=True)
    blobs = np.array([[int(x) for x in sys.stdin.readline().split()] for _ in range(2)], np.int64)
    ch.attach(blobs)
    sys.stdin.readline()  # go
    src = np.full(1000, rank + 1, np.float32)
    out = ch.collective(src, "sum", 0, ["allreduce", "sum", "float32", 1, src.size, 0, None], time.monotonic() + 20)
    print("DONE", float(out.min()), float(out.max()), flush=True)
    ch.close()
    """
)


def test_a_peer_that_dies_after_its_last_piece_does_not_fail_the_call(tmp_path):
    """Rank 0 waits for rank 1's piece and is stopped (as a loaded machine deschedules it); rank 1
    publishes, finishes and exits; rank 0, resumed, has everything it needs and must complete rather
    than take rank 1's death for a failure of this call."""
    import mmap
    import subprocess

    (tmp_path / "rank.py").write_text(RANK)
    env = dict(os.environ, PYTHONPATH=ROOT)
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), str(r)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        hello = [p.stdout.readline().split() for p in ranks]
        for p in ranks:
            p.stdin.write("".join(" ".join(h[:4]) + "\n" for h in hello))
            p.stdin.flush()
        with open(hello[0][4], "rb") as f:
            seg0 = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        ranks[0].stdin.write("go\n")
        ranks[0].stdin.flush()
        wait_until(lambda: int(np.frombuffer(seg0, np.int64, plan.H_FIXED)[plan.H_WRITTEN]) == 1, 20, what="rank 0 published its piece")
        ranks[0].send_signal(signal.SIGSTOP)
        ranks[1].stdin.write("go\n")
        ranks[1].stdin.flush()
        assert ranks[1].stdout.readline().split() == ["DONE", "3.0", "3.0"]
        assert ranks[1].wait(20) == 0
        ranks[0].send_signal(signal.SIGCONT)
        assert ranks[0].stdout.readline().split() == ["DONE", "3.0", "3.0"]
        assert ranks[0].wait(20) == 0
        seg0.close()
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            p.stdin.close()
            p.stdout.close()


def test_a_peer_that_aborts_on_a_mismatch_and_exits_is_a_mismatch_not_a_death(monkeypatch):
    """Rank 1 finds the calls differ, sets its abort word, and its process exits, all while rank 0
    is between looking at it and judging it (as a loaded machine deschedules it). Rank 0 must
    report the mismatch rank 1 wrote, not merely that rank 1 is gone: whether a peer is gone is
    read first, its words after. Here the peer's liveness check itself plays the abort and exit."""
    ranks = [ring_shm.ShmChannel("mismatch-race", r, 2, ["worker:0", "worker:1"]) for r in range(2)]
    try:
        blobs = np.stack([ch.blob() for ch in ranks])
        for ch in ranks:
            ch.attach(blobs)

        def abort_then_exit(pid: int) -> bool:
            ranks[0].headers[1][plan.H_ABORT] = 1 + 1 + 2  # what rank 1's collective() writes for a mismatch
            return False

        monkeypatch.setattr(ring_shm_host, "alive", abort_then_exit)
        src = np.ones(8, np.float32)
        with pytest.raises(zf.errors.CollectiveMismatch, match="rank 1 .* made different calls"):
            ranks[0].collective(src, "sum", 0, ["allreduce", "sum", "float32", 1, src.size, 0, None],
                                time.monotonic() + 10)
    finally:
        for ch in ranks:
            ch.close()


@pytest.mark.parametrize("mode", ["in-place", "new-array", "joined"])
def test_a_rank_folds_its_own_slot_before_writing_over_it(monkeypatch, mode):
    """A reduction reads a rank's own share back from its slot (hot in the cache; and in place,
    the result overwrites the input), so the rank must not write a later piece over that slot
    before folding it, even once its peers have consumed it. Rank 0 is held back from its first
    fold until the peers have consumed a whole round of its slots: it must still end with the
    very bits of ``reduce_in_order``."""
    import threading

    n, slots, slot_bytes = 3, 2, 4096
    members = [f"worker:{r}" for r in range(n)]
    ranks = [ring_shm.ShmChannel(f"own-slot-{mode}", r, n, members, slots=slots, slot_bytes=slot_bytes) for r in range(n)]
    size = slot_bytes // 4 * (2 * slots + 1) + 3  # more pieces than two rounds of slots
    inputs = [rank_array(r, size, "float32") for r in range(n)]
    expected = reduce_in_order(inputs, "sum")
    real_may_read, held = plan.may_read, threading.Event()

    def may_read(piece, written):
        if threading.current_thread().name == "rank0" and piece == 0 and not held.is_set():
            word = ranks[0].layout.read_word(0)
            wait_until(lambda: all(int(ranks[r].headers[r][word]) >= slots for r in (1, 2)), 20,
                       what="the peers consumed a round of rank 0's slots")
            held.set()
            return False
        return real_may_read(piece, written)

    monkeypatch.setattr(plan, "may_read", may_read)
    results: dict[int, object] = {}

    def run(r):
        src = inputs[r].copy()
        given = Joined([src[:size // 3], src[size // 3:]]) if mode == "joined" else src
        try:
            out = ranks[r].collective(given, "sum", 0, ["allreduce", "sum", "float32", 1, size, 0, None],
                                      time.monotonic() + 20, in_place=mode == "in-place")
            results[r] = (out, src)
        except Exception as exc:  # reported below, with the rank
            results[r] = exc

    try:
        blobs = np.stack([ch.blob() for ch in ranks])
        for ch in ranks:
            ch.attach(blobs)
        threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert held.is_set()
        for r in range(n):
            assert not isinstance(results[r], Exception), f"rank {r}: {results[r]!r}"
            out, src = results[r]
            np.testing.assert_array_equal(out, expected, err_msg=f"rank {r}")
            if mode == "in-place":
                assert np.shares_memory(out, src)  # written into the input itself
            else:
                assert not np.shares_memory(out, src) and np.array_equal(src, inputs[r])  # the input untouched
    finally:
        for ch in ranks:
            ch.close()


def test_joined_arrays_read_as_one_across_their_ends():
    parts = [np.arange(3, dtype=np.float32), np.zeros(0, np.float32), np.arange(10, 15, dtype=np.float32).reshape(5, 1)]
    joined = Joined(parts)
    whole = np.concatenate([p.reshape(-1) for p in parts])
    assert joined.size == whole.size == 8 and joined.dtype == np.float32
    for a in range(9):
        for b in range(a, 9):
            dst = np.full(b - a, -1, np.float32)
            joined.copy_to(a, b, dst)
            np.testing.assert_array_equal(dst, whole[a:b], err_msg=f"[{a}, {b})")
    with pytest.raises(zf.errors.InvalidArgument, match=r"range \[2, 9\) of 8"):
        joined.copy_to(2, 9, np.empty(7, np.float32))
    with pytest.raises(zf.errors.InvalidArgument, match="one dtype"):
        Joined([np.zeros(2, np.float32), np.zeros(2, np.float64)])


def test_only_a_reduction_runs_in_place(tmp_path):
    ch = ring_shm.ShmChannel("in-place-refused", 0, 2, ["worker:0", "worker:1"])
    try:
        src = np.ones(4, np.float32)
        meta = ["allgather", "none", "float32", 1, 4, 0, None]
        with pytest.raises(zf.errors.InvalidArgument, match="only a reduction"):
            ch.collective(src, "gather", 0, meta, time.monotonic() + 5, in_place=True)
        with pytest.raises(zf.errors.InvalidArgument, match="only a reduction"):
            ch.collective(np.ones(8, np.float32)[::2], "sum", 0, meta, time.monotonic() + 5, in_place=True)
        with pytest.raises(zf.errors.InvalidArgument, match="only a reduction reads joined arrays"):
            ch.collective(Joined([src, src]), "gather", 0, meta, time.monotonic() + 5)
        assert ch.broken is None  # refused before anything was written: the channel still serves
    finally:
        ch.close()


def test_stale_segments_of_dead_processes_are_removed(tmp_path):
    child = __import__("subprocess").Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    dead = int(child.communicate()[0])
    name = plan.segment_name(dead, os.urandom(16))
    Path("/dev/shm", name).write_bytes(b"x")
    mine = plan.segment_name(os.getpid(), os.urandom(16))
    Path("/dev/shm", mine).write_bytes(b"x")
    try:
        removed = ring_shm_host.clean_stale()
        assert name in removed and mine not in removed and not Path("/dev/shm", name).exists()
    finally:
        Path("/dev/shm", mine).unlink()


def test_names_from_messages_are_checked():
    token = os.urandom(16)
    assert plan.valid_name(plan.segment_name(42, token), 42)
    assert not plan.valid_name(plan.segment_name(42, token), 43)
    assert not plan.valid_name("../etc/passwd")
    assert not plan.valid_name("zmqflow-ring-1-" + "g" * 32)
    assert plan.pieces(0, 4, 1 << 20) == [] and plan.pieces(5, 4, 8) == [(0, 2), (2, 4), (4, 5)]
    assert plan.may_write(8, 8, [1, 1]) and not plan.may_write(8, 8, [0, 1]) and plan.may_read(3, [4, 5]) and not plan.may_read(3, [3, 5])


COLLECTIVES = textwrap.dedent(
    """
    import os, sys, time, numpy as np, zmqflow as zf
    sys.path.insert(0, sys.argv[2])
    from tests.test_ring_shm import rank_array
    tmp = sys.argv[1]
    out = {}
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, timeout=20)
        ring.barrier()  # the first call agrees on the shared-memory path
        ch = ring.async_ring.shm_channel
        me, n = ring.rank, ring.size
        base = ch.base
        if me == n - 1:
            time.sleep(0.3)  # the others reach the barrier first: they must wait for this rank
        open(f"{tmp}/entered{me}", "w").close()
        ring.barrier()
        out["entered"] = np.array([os.path.exists(f"{tmp}/entered{r}") for r in range(n)])
        out["barrier pieces"] = np.array([ch.base - base])
        out["gather"] = ring.allgather(rank_array(me, 300_001, "float64"))
        out["gather empty"] = ring.allgather(np.zeros((0, 3), np.float32))
        out["bcast"] = ring.broadcast(rank_array(me, 700_001, "float32").reshape(-1, 1), root=n - 1)
        out["async gather"] = ring.submit(ring.async_ring.allgather(rank_array(me, 5, "float32"))).result(30)
        out["async bcast"] = ring.submit(ring.async_ring.broadcast(rank_array(me, 5, "float32"), root=0)).result(30)
        before = ch.base
        ring.submit(ring.async_ring.barrier()).result(30)
        out["shm"] = np.array([ring.async_ring.shm_channel is ch, ch.base - before])
        ring.leave()
    np.savez(f"{tmp}/rank{me}.npz", **out)
    """
)


@pytest.mark.parametrize("n", [2, 3])
def test_barrier_allgather_broadcast_take_shared_memory(tmp_path, procs, n):
    before = segments()
    p = launch_script(procs, tmp_path / "collectives.py", COLLECTIVES, tmp_path, ROOT, workers=n)
    assert p.wait(100) == 0, p.output
    for r in range(n):
        got = np.load(tmp_path / f"rank{r}.npz")
        assert got["entered"].all(), f"rank {r} left the barrier before every rank entered it"
        assert got["barrier pieces"].tolist() == [1] and got["shm"].tolist() == [1, 1]  # one shared-memory piece each
        assert got["gather"].tobytes() == np.stack([rank_array(q, 300_001, "float64") for q in range(n)]).tobytes()
        assert got["gather empty"].shape == (n, 0, 3)
        assert got["bcast"].shape == (700_001, 1)
        assert got["bcast"].tobytes() == rank_array(n - 1, 700_001, "float32").tobytes()
        np.testing.assert_array_equal(got["async gather"], np.stack([rank_array(q, 5, "float32") for q in range(n)]))
        np.testing.assert_array_equal(got["async bcast"], rank_array(0, 5, "float32"))
    assert segments() <= before


FAILING = textwrap.dedent(
    """
    import os, sys, time, numpy as np, zmqflow as zf
    mode, kind = sys.argv[1], sys.argv[2]
    with zf.Server.from_env() as server:
        ring = zf.Ring(server, timeout=15)
        ring.barrier()
        me = ring.rank
        print("READY", me, os.getpid(), flush=True)
        calls = {"barrier": lambda **kw: ring.barrier(**kw),
                 "allgather": lambda **kw: ring.allgather(np.ones(1 << 18, np.float32), **kw),
                 "broadcast": lambda **kw: ring.broadcast(np.ones(1 << 18, np.float32), root=0, **kw)}
        if mode == "mismatch":  # rank 1 makes another call than the others
            kind = {"barrier": "allgather", "allgather": "broadcast", "broadcast": "barrier"}[kind] if me == 1 else kind
        elif mode == "root":
            calls["broadcast"] = lambda **kw: ring.broadcast(np.ones(4, np.float32), root=me % 2, **kw)
        elif me == 1:
            time.sleep(60)  # killed here ("killed"), or silent past the others' deadline ("late")
        t = time.monotonic()
        try:
            calls[kind](timeout=2.0 if mode == "late" else None)
            print("NO ERROR", flush=True)
        except zf.errors.ZmqflowError as e:
            print("ERROR", type(e).__name__, e.details.get("task") or ",".join(e.details.get("fields", [])).replace(" ", "_"),
                  round(time.monotonic() - t, 1), flush=True)
            print("MSG", e, flush=True)
    """
)


def _errors(p, count):
    try:
        wait_until(lambda: p.output.count("] ERROR ") >= count, 40)
    except TimeoutError:
        raise AssertionError(f"{count} ranks should fail; output:\n{p.output}") from None
    return [ln.split("ERROR", 1)[1].split() for ln in p.output.splitlines() if "] ERROR " in ln]


@pytest.mark.parametrize("kind", ["barrier", "allgather", "broadcast"])
def test_a_killed_rank_fails_every_collective_naming_it(tmp_path, procs, kind):
    before = segments()
    p = launch_script(procs, tmp_path / "failing.py", FAILING, "killed", kind, workers=3)
    pid = int(p.wait_for_line("READY 1 ", 60).split()[-1])
    p.wait_for_line("READY 0 ", 60)
    p.wait_for_line("READY 2 ", 60)
    os.kill(pid, signal.SIGKILL)
    for err, task, took in _errors(p, 2):
        assert err in ("Unavailable", "DeadlineExceeded") and task == "worker:1" and float(took) < 15, (err, task, took)
    assert "NO ERROR" not in p.output
    p.wait(60)
    assert segments() <= before


def test_a_silent_rank_is_a_deadline_naming_it(tmp_path, procs):
    p = launch_script(procs, tmp_path / "failing.py", FAILING, "late", "barrier", workers=2)
    pid = int(p.wait_for_line("READY 1 ", 60).split()[-1])
    [(err, task, took)] = _errors(p, 1)
    assert (err, task) == ("DeadlineExceeded", "worker:1") and 1.5 <= float(took) < 10, p.output
    os.kill(pid, signal.SIGKILL)
    p.wait(60)


@pytest.mark.parametrize("mode,kind,field", [("mismatch", "barrier", "collective"), ("mismatch", "broadcast", "collective"),
                                             ("root", "broadcast", "root")])
def test_different_calls_are_a_mismatch_on_every_rank(tmp_path, procs, mode, kind, field):
    n = 3 if mode == "mismatch" else 2
    p = launch_script(procs, tmp_path / "failing.py", FAILING, mode, kind, workers=n)
    for err, fields, _ in _errors(p, n):
        assert err == "CollectiveMismatch" and field in fields.split(","), p.output
    assert p.wait(60) == 0, p.output
