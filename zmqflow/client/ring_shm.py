"""The same-host data path of the ring: allreduce, allgather, broadcast and barrier through shared
memory (as NCCL's SHM transport).

When every member of a ring runs on this kernel (the same boot id and pid namespace) and each can
map the others' segments, ranks stop sending chunks over loopback TCP: each rank copies its input,
piece by piece, into its own segment in ``/dev/shm`` and every rank folds all ranks' pieces, read
straight from the segments, into its own output in rank order, so every rank ends with the same
bits as ``reduce_in_order`` (an allgather places the pieces in rows, a broadcast copies the root's,
a barrier exchanges one empty piece). A float32 or float64 sum or mean folds a piece of every rank
in one C pass (``state/kernels.py`` ``fold_sum``), writing a result of 4 MiB or more past the
cache; numpy's fold, which the other dtypes and ops take, makes one pass per rank. A call is cut into at least 4 pieces (down to 128 KiB), so
writing piece k+1 overlaps folding piece k; a segment's slots are reused once every reader
consumed them (``state/shm_schedule.py`` is the plan).

Calls run one at a time per ring, in the order they are submitted: on the ring's own thread, or on
a blocking caller's thread when none is queued, so the blocking path hands off to no other thread. "Piece ready" and "slot free" are counters in
the segments; a rank that finds nothing to do blocks on its own datagram socket (abstract
namespace, woken by one byte from a peer that moved a counter), with a timeout so it checks that
its peers still live (their pids) and its deadline. A dead peer raises ``Unavailable`` naming it,
a silent one ``DeadlineExceeded``; either sets an abort word (why, the rank at fault, the call) that
the other ranks see at once. The call a rank gave up fails on every rank, with that rank's reason,
even on one that has all it needs; the channel is then broken everywhere: every later call takes
TCP on every rank, a call already queued here included (``ChannelClosed``), so no rank is left on
shared memory while another moved on.

Segments are created with O_EXCL, mode 0600, their pages reserved at once (a sparse file on a full
tmpfs would be a SIGBUS at the first write; a ring that cannot reserve them stays on TCP), under a
name holding the creator's pid and 128 random bits; the names are agreed over the ring's own
authenticated RPC (an allgather), a peer's name is mapped only if it is one this code makes for
that peer's pid, owned by this user, of the expected size, and whose header carries the announced
token and rank. Every segment is unlinked as soon as all ranks have mapped it, so a normal exit or
a ``kill -9`` after setup leaves nothing in ``/dev/shm``; a kill in the short window of setup can
leave one, which the next ring on this host removes (segments of dead pids owned by this user).
``ZMQFLOW_RING_SHM=0`` turns it off; on machines other than x86 it is off (see
``ring_shm_host.ORDERED_STORES``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import secrets
import select
import socket
import stat
import threading
import time
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CollectiveMismatch, DeadlineExceeded, InvalidArgument, Unavailable, ZmqflowError
from ..state import shm_schedule as plan
from ..state.kernels import FOLD_STREAM_FROM, fold_sum
from ..state.reduce import Joined, finish_mean, mean_dtype, mean_into
from . import ring_shm_host as host

__all__ = ["ShmChannel", "ChannelClosed", "negotiate"]

log = logging.getLogger("zmqflow.client.ring")
_UFUNC = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}
_POLL_S = 0.05  # how often a blocked rank checks its peers' pids and its deadline
_SPIN = 20


def _combine(op: str, views: list[np.ndarray], out: np.ndarray, a: int, b: int, root: int) -> bool:
    """Fold (or place) one piece of every rank, in rank order, into ``out[a:b]``: the bits of
    ``reduce_in_order``. Returns whether a mean's division is done; else the caller divides, as
    there. A float sum or mean is one C pass (:func:`fold_sum`), its result streamed past the
    cache when big; numpy makes one pass per rank, each writing the piece."""
    n = len(views)
    if op == "gather":
        rows = out.reshape(n, -1)
        for r, v in enumerate(views):
            rows[r, a:b] = v
        return False
    if op in ("broadcast", "barrier"):
        out[a:b] = views[root]
        return False
    ufunc, o = _UFUNC[op], out[a:b]  # a piece at a time (at most a slot, 1 MiB) stays in L2: no finer
    if ufunc is np.add and fold_sum(o, views, n if op == "mean" else 0, out.nbytes >= FOLD_STREAM_FROM):
        return op == "mean"
    if op == "mean" and mean_dtype(out.dtype) is not None:  # half precision: summed in float32
        mean_into(o, views)
        return True
    ufunc(views[0], views[1], out=o)
    for v in views[2:]:
        ufunc(o, v, out=o)
    return False


def _no_span(kind: str, name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class ChannelClosed(Exception):
    """Call ``seq`` reached the channel after it broke on an earlier call (here or on a peer): the
    ring runs it over TCP instead, as every rank does."""

    def __init__(self, seq: int):
        super().__init__(f"call {seq}: the shared-memory channel broke on an earlier call")
        self.seq = seq


class ShmChannel:
    """One rank's end of the shared-memory path of one ring: its segment, its peers' mappings,
    its wake-up socket and the thread that runs its calls in order."""

    def __init__(self, name: str, rank: int, size: int, members: list[str], slots: int = 8, slot_bytes: int = 1 << 20):
        self.name, self.rank, self.size, self.members = name, rank, size, members
        # whether the transport gave up on a rank (its heartbeats stopped): a frozen process is
        # alive by its pid, yet named as over TCP (the ring sets it; read from this channel's thread)
        self.unreachable: Callable[[int], bool] = lambda rank: False
        self.layout = plan.Layout(size, slots, slot_bytes)
        self.token = secrets.token_bytes(16)
        self.seg_name = plan.segment_name(os.getpid(), self.token)
        self.path = os.path.join(host.SHM_DIR, self.seg_name)
        host.clean_stale()
        self.maps: list[Any] = [None] * size
        self.sock: Any = None
        self.out: Any = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.ftruncate(fd, self.layout.total)
                host.reserve(fd, self.layout.total)
                self.maps[rank] = mmap.mmap(fd, self.layout.total)
            finally:
                os.close(fd)
            self._setup(name, rank, size)
        except BaseException:  # no segment outlives a channel that failed to start
            self.unlink()
            for sock in (self.sock, self.out):
                if sock is not None:
                    sock.close()
            raise

    def _setup(self, name: str, rank: int, size: int) -> None:
        """The rest of the constructor, once the segment exists (a failure here unlinks it)."""
        self.headers: list[Any] = [None] * size
        self.headers[rank] = hdr = self._header(rank)
        hdr[plan.H_MAGIC], hdr[plan.H_RANK], hdr[plan.H_PID] = plan.MAGIC, rank, os.getpid()
        hdr[plan.H_TOK_HI], hdr[plan.H_TOK_LO] = np.frombuffer(self.token, np.int64)
        self.pids = [0] * size
        self.pids[rank] = os.getpid()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(host.socket_name(self.token))
        self.sock.setblocking(False)  # waits are polls with a timeout; a timeout socket would also wait in send
        self.poller = select.poll()
        self.poller.register(self.sock, select.POLLIN)
        self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.out.setblocking(False)  # a peer's full queue means it has wake-ups pending: never wait for it
        self.peers: list[bytes] = [b""] * size
        self.base = 0  # pieces published by every rank before the current call
        self.broken: ZmqflowError | None = None  # why the channel broke (here or on a peer) ...
        self.broken_seq = -1  # ... and on which call: it fails there on every rank, later calls take TCP
        self.breaking = threading.Lock()  # the ring's loop (``usable``) and the calls' thread both record breaks
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ring-shm-{name}")
        self.turn = threading.Lock()  # held by the call running now (on the pool's thread or a caller's)
        self.lock = threading.Lock()  # guards ``queued``: calls submitted to the pool and not yet done
        self.queued = 0

    def _header(self, r: int) -> np.ndarray:
        return np.frombuffer(self.maps[r], np.int64, self.layout.words)

    def blob(self) -> np.ndarray:
        """What this rank tells the others (over the ring's RPC): host, pid, token."""
        return np.array([host.host_id(), os.getpid(), *np.frombuffer(self.token, np.int64)], np.int64)

    def attach(self, blobs: np.ndarray) -> None:
        """Map every peer's segment named by its blob, refusing anything this ring did not make."""
        for r in range(self.size):
            if r == self.rank:
                continue
            where, pid, hi, lo = (int(v) for v in blobs[r])
            token = np.array([hi, lo], np.int64).tobytes()
            name = plan.segment_name(pid, token)
            if where != host.host_id() or not plan.valid_name(name, pid):
                raise Unavailable(f"ring {self.name!r}: rank {r} is not on this host", task=self.members[r])
            fd = os.open(os.path.join(host.SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size != self.layout.total:
                    raise Unavailable(f"ring {self.name!r}: rank {r}'s segment is not one this ring made", task=self.members[r])
                self.maps[r] = mmap.mmap(fd, self.layout.total)
            finally:
                os.close(fd)
            h = self.headers[r] = self._header(r)
            if (int(h[plan.H_MAGIC]), int(h[plan.H_RANK]), int(h[plan.H_PID]), int(h[plan.H_TOK_HI]), int(h[plan.H_TOK_LO])) != (plan.MAGIC, r, pid, hi, lo):
                raise Unavailable(f"ring {self.name!r}: rank {r}'s segment header does not match", task=self.members[r])
            self.pids[r] = pid
            self.peers[r] = host.socket_name(token)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()
        self.out.close()

    def usable(self, seq: int) -> bool:
        """Whether the ring's next call, ``seq``, comes here: not once the channel broke on an
        earlier call, here or on a peer (its abort word), so that every rank moves to TCP for the
        same call. The call it broke on still comes, to fail at once as it did on that peer."""
        self._adopt(seq)
        return self.broken is None or seq <= self.broken_seq

    def _broke(self, seq: int, exc: ZmqflowError) -> None:
        with self.breaking:  # the earliest break wins: that call failed, every later one takes TCP
            if self.broken is None or seq < self.broken_seq:
                self.broken_seq, self.broken = seq, exc

    def _adopt(self, seq: int, meta: Any = None) -> None:
        """Take in the calls the peers gave up (their abort words) before ``seq``, and with
        ``meta`` (call ``seq``'s description, to name what differs) ``seq`` itself."""
        for r in range(self.size):
            word = int(self.headers[r][plan.H_ABORT]) if r != self.rank else 0
            if word:  # the call's number was written before the word: x86 keeps stores in order
                aborted = int(self.headers[r][plan.H_ABORT_SEQ])
                if aborted < seq or (meta is not None and aborted == seq):
                    self._broke(aborted, self._abort_error(r, aborted, word, meta))

    def _check(self, seq: int, meta: Any) -> None:
        """Raise when call ``seq`` may not run here: ``ChannelClosed`` past the call the channel
        broke on, that call's own error on it."""
        self._adopt(seq, meta)
        if self.broken is not None and self.broken_seq <= seq:
            if self.broken_seq < seq:
                raise ChannelClosed(seq)
            raise self.broken

    def _abort_error(self, r: int, seq: int, word: int, meta: Any) -> ZmqflowError:
        """What rank ``r``'s abort word of call ``seq`` means here."""
        kind, culprit = plan.abort_reason(word, self.size)
        if kind == plan.MISMATCH and meta is None:  # an earlier call: only marks where the channel broke
            return CollectiveMismatch(f"ring {self.name!r} call {seq}: rank {r} ({self.members[r]}) found that the "
                                      f"ranks made different calls", ranks=[r, self.rank])
        if kind == plan.MISMATCH:  # name a rank whose description differs from this one's, if one wrote it
            lay, words = self.layout, plan.meta_words(meta)
            odd = [q for q in range(self.size)
                   if q != self.rank and [int(v) for v in self.headers[q][lay.meta_word:lay.words]] != words]
            return self._mismatch(seq, words, odd[0] if odd else r)
        task = self.members[culprit]
        who = f"rank {culprit} ({task})"
        if kind == plan.DEADLINE:
            return DeadlineExceeded(f"ring {self.name!r} call {seq} (shared memory) did not complete in time; rank {r} "
                                    f"({self.members[r]}) gave up waiting for {who}", task=task, rank=culprit)
        return Unavailable(f"ring {self.name!r} call {seq}: member {who} is gone", task=task, rank=culprit)

    def _fail(self, seq: int, exc: ZmqflowError) -> None:
        """This rank gave call ``seq`` up itself: its abort word says why, naming the rank at fault."""
        self._broke(seq, exc)
        mine = self.headers[self.rank]
        if not int(mine[plan.H_ABORT]):
            kind = (plan.MISMATCH if isinstance(exc, CollectiveMismatch) else
                    plan.DEADLINE if isinstance(exc, DeadlineExceeded) else plan.GONE)
            mine[plan.H_ABORT_SEQ] = seq  # before the word: a reader that sees the word sees the call
            mine[plan.H_ABORT] = plan.abort_word(kind, int(exc.details.get("rank", self.rank)), self.size)
        self._notify()

    # calls -----------------------------------------------------------------------------
    def submit(self, src: np.ndarray, op: str, seq: int, meta: Any, timeout: float,
               seen: Any = None, root: int = 0, in_place: bool = False) -> "concurrent.futures.Future[np.ndarray]":
        """Start a collective on the flat host array ``src`` (only read; a reduction also takes a
        :class:`~zmqflow.state.reduce.Joined` of several) after every call submitted before.
        ``op``: a reduction (``sum``, ``mean``, ``min``, ``max``), ``gather`` (every rank's
        ``src``, row by row), ``broadcast`` (``root``'s) or ``barrier`` (nothing). ``seen``: the
        ring's ``RingWatch`` (its timeline span, and who this call waited for). ``in_place``: a
        reduction's result goes into ``src`` itself (a contiguous array) instead of a new one."""
        with self.lock:
            self.queued += 1
        return self.pool.submit(self._queued_call, src, op, seq, meta, time.monotonic() + timeout, seen, root, in_place)

    def run(self, src: np.ndarray, op: str, seq: int, meta: Any, timeout: float, seen: Any = None,
            root: int = 0, in_place: bool = False) -> np.ndarray:
        """``submit(...).result()``, but on the caller's thread when no call is queued: a blocking
        caller saves the two thread wake-ups of a hand-off (about 0.1 ms, half a small call)."""
        with self.lock:
            inline = self.queued == 0 and self.turn.acquire(blocking=False)
        if not inline:
            return self.submit(src, op, seq, meta, timeout, seen, root, in_place).result(timeout + 5.0)
        try:
            return self.collective(src, op, seq, meta, time.monotonic() + timeout, seen, root, in_place)
        finally:
            self.turn.release()

    def _queued_call(self, *args: Any) -> np.ndarray:
        try:
            with self.turn:
                return self.collective(*args)
        finally:
            with self.lock:
                self.queued -= 1

    def collective(self, src: np.ndarray, op: str, seq: int, meta: Any, deadline: float, seen: Any = None,
                   root: int = 0, in_place: bool = False) -> np.ndarray:
        """Run one call (``submit`` says what it takes); ``ChannelClosed``: run it over TCP instead."""
        joined = isinstance(src, Joined)
        if in_place and (op not in _UFUNC or joined or not src.flags.c_contiguous or not src.flags.writeable):
            raise InvalidArgument(f"only a reduction writes in place, into a contiguous writeable array (op {op!r})")
        if joined and op not in _UFUNC:
            raise InvalidArgument(f"only a reduction reads joined arrays (op {op!r})")
        try:
            self._check(seq, meta)  # a peer gave this call (or an earlier one) up before it started here
            flat = src if joined else np.ascontiguousarray(src).reshape(-1)
            if seen is None:
                out = self._collective(flat, op, seq, meta, deadline, root, in_place=in_place)
            else:
                probe = seen.call()
                with seen.span("ring", "allreduce" if op in _UFUNC else op):
                    out = self._collective(flat, op, seq, meta, deadline, root, probe, seen.span, in_place)
                probe.done()
            self._adopt(seq, meta)  # a peer that gave this very call up after it was done here: it fails here too
            if self.broken is not None and self.broken_seq == seq:
                raise self.broken
            return out
        except ZmqflowError as exc:
            if exc is not self.broken:  # this rank's own finding (a peer's is in that peer's word already)
                self._fail(seq, exc)
            raise

    def _collective(self, src: Any, op: str, seq: int, meta: Any, deadline: float, root: int = 0,
                    probe: Any = None, span: Any = _no_span, in_place: bool = False) -> np.ndarray:
        """``probe`` hears when each peer's data first showed up; ``span(kind, name)`` times the
        waits and folds on the timeline (the ring's ``ring wait``, ``ring reduce`` tracks).
        A reduction folds this rank's share of a piece from its own slot, just written and still in
        the cache, so it writes no later piece over a slot it has not folded yet. ``in_place``: the
        result goes into ``src`` (no view aliases it, as this rank's share is read from the slot).
        A :class:`Joined` ``src`` (reductions only) has its pieces copied out of its parts."""
        lay, n, me = self.layout, self.size, self.rank
        joined = isinstance(src, Joined)
        from_slot = op in _UFUNC  # ``collective`` lets only reductions run in place or on joined arrays
        tag, words = plan.call_tag(seq, meta), plan.meta_words(meta)
        out = src if in_place else np.empty(src.size * n if op == "gather" else src.size, src.dtype)
        parts = plan.pieces(src.size, src.itemsize, lay.slot_bytes) or [(0, 0)]  # one, empty, to meet the peers
        copy = op != "broadcast" or me == root  # a broadcast needs the root's data only
        mine, hdrs = self.headers[me], self.headers
        base, wrote, folded, idle = self.base, 0, 0, 0
        others = [r for r in range(n) if r != me]
        late = list(others) if probe is not None else []  # peers whose first piece of this call is not in yet
        while folded < len(parts) or wrote < len(parts):  # a reduction folds its own pieces from its slot
            moved = False
            while wrote < len(parts) and plan.may_write(base + wrote, lay.slots, [int(hdrs[r][lay.read_word(me)]) for r in others]
                                                        + ([base + folded] if from_slot else [])):  # this rank reads its slot too
                a, b = parts[wrote]
                g = base + wrote
                if wrote == 0:
                    mine[lay.meta_word:lay.words] = words
                if joined:
                    src.copy_to(a, b, self._view(me, g, src.dtype, b - a))
                elif copy:
                    self._view(me, g, src.dtype, b - a)[...] = src[a:b]
                mine[lay.tag_word(g % lay.slots)] = tag
                wrote += 1
                mine[plan.H_WRITTEN] = base + wrote  # after the data: x86 keeps stores in order
                moved = True
            if moved:
                self._notify()
            if late:  # straggler report: when each peer's data first showed up
                for r in [r for r in late if int(hdrs[r][plan.H_WRITTEN]) > base]:
                    probe.arrived(self.members[r])
                    late.remove(r)
            g = base + folded
            ready = folded < len(parts) and (folded < wrote or not from_slot)
            if ready and plan.may_read(g, [int(hdrs[r][plan.H_WRITTEN]) for r in others]):
                a, b = parts[folded]
                for r in others:
                    if int(hdrs[r][lay.tag_word(g % lay.slots)]) != tag:
                        raise self._mismatch(seq, words, r)
                views = [src[a:b] if r == me and not from_slot else self._view(r, g, src.dtype, b - a) for r in range(n)]
                with span("ring reduce", "reduce" if op in _UFUNC else "place"):
                    divided = _combine(op, views, out, a, b, root)
                if op == "mean" and not divided:
                    with span("ring reduce", "mean"):
                        finish_mean(out[a:b], n)
                folded += 1
                for r in others:
                    mine[lay.read_word(r)] = g + 1
                self._notify()
                continue
            if not moved:
                idle += 1
                if idle > _SPIN:
                    def owing() -> list[int]:
                        return self._owing(base, wrote, folded, len(parts), others)
                    with span("ring wait", "wait"):
                        self._wait(deadline, seq, owing, meta)
        self.base = base + len(parts)
        return out.reshape(n, -1) if op == "gather" else out

    def _mismatch(self, seq: int, words: list[int], r: int) -> CollectiveMismatch:
        lay, me = self.layout, self.rank
        fields = plan.differing(words, self.headers[r][lay.meta_word:lay.words])
        return CollectiveMismatch(f"ring {self.name!r} call {seq}: rank {r} ({self.members[r]}) and rank {me} "
                                  f"({self.members[me]}) made different calls; {' and '.join(fields)} differ",
                                  ranks=[r, me], fields=fields)

    def _view(self, r: int, piece: int, dtype: Any, count: int) -> np.ndarray:
        off = self.layout.slot_offset(piece)
        return np.frombuffer(self.maps[r], np.uint8, count * dtype.itemsize, off).view(dtype)

    def _notify(self) -> None:
        for r, addr in enumerate(self.peers):
            if r != self.rank:
                try:
                    self.out.sendto(b"1", addr)
                except OSError:  # full (it will wake anyway) or gone (its pid check says so)
                    pass

    def _owing(self, base: int, wrote: int, folded: int, count: int, others: list[int]) -> list[int]:
        """The peers this rank is blocked on right now: one whose next piece it must fold is not
        published, or one that has not consumed the piece whose slot it must reuse. A peer that
        owes nothing (it published every piece of the call and freed the slots needed) may die
        without failing the call: its data stays mapped here."""
        lay, hdrs, me = self.layout, self.headers, self.rank
        g_read, g_write = base + folded, base + wrote
        return [r for r in others
                if (folded < count and int(hdrs[r][plan.H_WRITTEN]) < g_read + 1)
                or (wrote < count and int(hdrs[r][lay.read_word(me)]) < g_write - lay.slots + 1)]

    def _wait(self, deadline: float, seq: int, owing: Any, meta: Any) -> None:
        """Sleep until a peer moves a counter (or ``_POLL_S``), then judge only the peers this rank
        still waits on (``owing()``): checking every peer would fail a call that a peer dying right
        after its last piece cannot stop, as when the kill lands while this rank sat unscheduled."""
        left = deadline - time.monotonic()
        if self.poller.poll(max(1, int(1000 * min(_POLL_S, left)))):
            try:  # drain: one wake-up is enough, the counters say what changed
                while True:
                    self.sock.recv(64)
            except BlockingIOError:
                pass
        others = owing()
        if not others:
            return  # the counters moved: the caller makes progress
        for r in others:
            # Whether it is gone first, its words after: a peer that wrote them and then exited (an
            # abort, or the pieces this rank waited for) is judged by what it wrote. Read the other
            # way round, a peer that aborted on a mismatch and exited between the two reads looked
            # merely gone.
            dead = not host.alive(self.pids[r]) or self.unreachable(r)
            if int(self.headers[r][plan.H_ABORT]):
                self._check(seq, meta)  # it gave this call up, or left for TCP after an earlier one
            if dead and r not in owing():
                continue  # it published what this rank needs before it went: the call goes on
            if dead:
                raise Unavailable(f"ring {self.name!r} call {seq}: member rank {r} ({self.members[r]}) is gone",
                                  task=self.members[r], rank=r)
        if time.monotonic() > deadline:
            late = min(others, key=lambda r: int(self.headers[r][plan.H_WRITTEN]))  # the one furthest behind
            raise DeadlineExceeded(f"ring {self.name!r} call {seq} (shared memory) did not complete in time; "
                                   f"rank {self.rank} was waiting for rank {late} ({self.members[late]})",
                                   task=self.members[late], rank=late)


async def negotiate(ring: Any, wanted: bool, timeout: float) -> "ShmChannel | None":
    """Agree over the ring's RPC whether every rank takes the shared-memory path; every rank must
    call it at the same point (it runs two allgathers). None: stay on TCP."""
    channel = None
    if wanted and host.enabled():
        try:
            channel = ShmChannel(ring.name, ring.rank, ring.size, [str(m) for m in ring.members])
            channel.unreachable = ring.peer_down
        except OSError as exc:
            log.warning("ring %r: no shared-memory path here (%s); its calls go over TCP", ring.name, exc)
            channel = None
    blob = channel.blob() if channel is not None else np.zeros(4, np.int64)
    try:
        blobs = await ring.allgather(blob, timeout=timeout, shm=False)
    except BaseException:
        if channel is not None:
            channel.close()
        raise
    ok = channel is not None and all(int(b[1]) != 0 for b in blobs)
    if ok:
        try:
            channel.attach(blobs)
        except (OSError, ZmqflowError):
            ok = False
    try:
        oks = await ring.allgather(np.array([1 if ok else 0], np.int8), timeout=timeout, shm=False)
    except BaseException:
        if channel is not None:
            channel.close()
        raise
    if channel is not None:
        channel.unlink()  # every rank has mapped it (or given up): the name is no longer needed
        if not all(int(v[0]) for v in oks):
            channel.close()
            channel = None
    return channel
