"""The channel's socket calls in C (``zsock_c`` through ``sockops``) on real sockets: whole
messages received with their leading parts as bytes and the rest as zero-copy buffers, an empty
socket answered with None (no exception), sends copied or shared, a refused first part reported
as nothing sent, an unroutable one raised, and the frames pyzmq must send handed back."""

from __future__ import annotations

import gc
import subprocess
import sys
import uuid

import numpy as np
import pytest
import zmq

from zmqflow.transport import sockops
from zmqflow.transport.context import context

pytestmark = pytest.mark.skipif(not sockops.compiled(), reason=f"C socket calls not available: {sockops.why_not()}")

THRESHOLD = 65536


@pytest.fixture
def ops():
    return sockops.ops() or pytest.fail("compiled but switched off")


@pytest.fixture
def pair():
    """A bound ROUTER and a DEALER connected to it over inproc (connected at once)."""
    name = f"inproc://sockops-{uuid.uuid4().hex[:8]}"
    router, dealer = context().socket(zmq.ROUTER), context().socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    dealer.setsockopt(zmq.IDENTITY, b"dealer-1")
    router.bind(name)
    dealer.connect(name)
    try:
        yield router, dealer
    finally:
        router.close(0)
        dealer.close(0)


def test_an_empty_socket_answers_none_and_its_events(ops, pair):
    router, dealer = pair
    assert ops.recv(router.underlying, 2, True) is None
    assert ops.events(router.underlying) == router.getsockopt(zmq.EVENTS) == zmq.POLLOUT
    assert ops.events(dealer.underlying) & zmq.POLLOUT


def test_a_message_arrives_whole_leading_parts_as_bytes_the_rest_as_writable_buffers(ops, pair):
    router, dealer = pair
    big = np.arange(THRESHOLD, dtype=np.float32)
    assert ops.send(dealer.underlying, THRESHOLD, [b"header", b"x" * 7, np.arange(4, dtype=np.int64)]) == 3
    dealer.send_multipart([b"second", big], copy=False)
    assert ops.events(router.underlying) & zmq.POLLIN
    frames = ops.recv(router.underlying, 2, True)
    assert frames[:2] == [b"dealer-1", b"header"]
    assert [type(f) for f in frames[2:]] == [sockops.MSG, sockops.MSG]
    assert frames[2].bytes == b"x" * 7 and len(frames[2]) == 7
    view = np.frombuffer(frames[3], dtype=np.int64)
    assert view.tolist() == [0, 1, 2, 3] and view.flags.writeable
    view[0] = 9  # libzmq's own memory, held by the Msg
    assert np.frombuffer(frames[3], dtype=np.int64)[0] == 9
    second = ops.recv(router.underlying, 1, True)
    assert second[0] == b"dealer-1" and type(second[1]) is sockops.MSG and second[2].bytes == big.tobytes()
    assert ops.recv(router.underlying, 2, True) is None


def test_a_received_buffer_outlives_its_socket(ops):
    name = f"inproc://sockops-life-{uuid.uuid4().hex[:8]}"
    a, b = context().socket(zmq.PAIR), context().socket(zmq.PAIR)
    a.bind(name)
    b.connect(name)
    small, big = np.arange(3, dtype=np.float64), np.arange(1 << 16, dtype=np.float64)
    a.send_multipart([small, big], copy=False)
    got = ops.recv(b.underlying, 0, True)
    a.close(0)
    b.close(0)
    gc.collect()
    assert np.array_equal(np.frombuffer(got[0]), small) and np.array_equal(np.frombuffer(got[1]), big)


def test_a_forwarded_buffer_is_shared_not_copied_and_others_go_back_to_pyzmq(ops, pair):
    router, dealer = pair
    big = np.arange(THRESHOLD, dtype=np.float32)
    dealer.send_multipart([b"h", big], copy=False)
    ident, _h, frame = ops.recv(router.underlying, 2, True)
    view = np.frombuffer(frame, dtype=np.float32).reshape(256, -1)
    # the view of a received buffer goes back zero-copy: over inproc the dealer sees the same memory
    assert ops.send(router.underlying, THRESHOLD, [ident, b"back", view]) == 3
    back = ops.recv(dealer.underlying, 1, True)
    assert np.frombuffer(back[1], dtype=np.float32).ctypes.data == view.ctypes.data
    # a large buffer that no received message owns is pyzmq's to pin: handed back at its index
    assert ops.send(dealer.underlying, THRESHOLD, [b"h", big[::-1]]) == 1
    dealer.send(big[::-1].copy(), copy=False)  # the caller finishes the message it started
    assert np.array_equal(np.frombuffer(ops.recv(router.underlying, 2, True)[2], dtype=np.float32), big[::-1])
    assert ops.send(dealer.underlying, THRESHOLD, [object()]) == 0  # not a buffer at all: pyzmq refuses it


def test_a_large_buffer_is_lent_to_libzmq_until_it_is_done_with_it(ops, pair):
    """A large array that no received message owns goes out zero-copy: its owner is held (the
    receiver over inproc sees the very memory) until libzmq frees the message, and then let go at
    the next call, with no collector thread."""
    router, dealer = pair
    lent = ops.collect()
    big = np.arange(THRESHOLD, dtype=np.float32)
    refs = sys.getrefcount(big)
    assert ops.send(dealer.underlying, THRESHOLD, [b"h", big]) == 2
    assert sys.getrefcount(big) == refs + 1 and ops.collect() == lent + 1
    ident, _h, frame = ops.recv(router.underlying, 2, True)
    got = np.frombuffer(frame, dtype=np.float32)
    assert got.ctypes.data == big.ctypes.data and np.array_equal(got, np.arange(THRESHOLD, dtype=np.float32))
    del got, frame  # the receiver is done: libzmq frees the message here, the buffer waits for a call
    assert ops.collect() == lent and sys.getrefcount(big) == refs
    # a message that never leaves (no peer: refused) lends nothing for long
    lone = context().socket(zmq.DEALER)
    try:
        assert ops.send(lone.underlying, THRESHOLD, [big]) == -1
    finally:
        lone.close(0)
    assert ops.collect() == lent and sys.getrefcount(big) == refs


def test_a_refused_first_part_sends_nothing_and_an_unroutable_one_raises(ops):
    dealer = context().socket(zmq.DEALER)
    router = context().socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        assert ops.send(dealer.underlying, THRESHOLD, [b"no peer", b"at all"]) == -1  # EAGAIN: nothing queued
        with pytest.raises(zmq.ZMQError) as err:
            ops.send(router.underlying, THRESHOLD, [b"nobody", b"hello"])
        assert err.value.errno == zmq.EHOSTUNREACH
    finally:
        dealer.close(0)
        router.close(0)


def test_parts_past_max_parts_are_read_and_dropped(ops, pair):
    """A message of very many parts: the first max_parts come back, the rest leave the socket
    without an object each, and the next message arrives whole."""
    router, dealer = pair
    dealer.send_multipart([b"many", *([b""] * 5000), b"last"])
    dealer.send_multipart([b"next", b"x"])
    frames = ops.recv(router.underlying, 2, True, 4)
    assert frames[:2] == [b"dealer-1", b"many"] and len(frames) == 4
    nxt = ops.recv(router.underlying, 2, True, 4)
    assert nxt[:2] == [b"dealer-1", b"next"] and len(nxt) == 3 and nxt[2].bytes == b"x"
    assert ops.recv(router.underlying, 2, True, 4) is None


def test_bad_arguments_raise_instead_of_touching_memory(ops):
    with pytest.raises(ValueError, match="NULL"):
        ops.recv(0, 1, True)
    with pytest.raises(TypeError):
        ops.recv(1, 1)
    with pytest.raises(TypeError):
        ops.recv(1, 1, True, 4, 5)
    with pytest.raises(ValueError, match="max_parts"):
        ops.recv(1, 1, True, 0)
    with pytest.raises(TypeError):
        ops.send(1, [b"x"])
    with pytest.raises(ValueError, match="NULL"):
        ops.events(0)
    with pytest.raises(TypeError):
        sockops.MSG()  # only a receive makes one


def test_switching_the_c_calls_off_gives_pyzmqs_path():
    before = sockops.use_compiled(False)
    try:
        assert sockops.ops() is None
    finally:
        sockops.use_compiled(before)
    assert sockops.ops() is not None


_FREE_MANY = """
import uuid, numpy as np, zmq
from zmqflow.transport import sockops
from zmqflow.transport.context import context
ops, n = sockops.ops(), 3000
a, b = context().socket(zmq.PAIR), context().socket(zmq.PAIR)
a.sndhwm = b.rcvhwm = 0  # all of them queued at once
name = f"inproc://sockops-free-{uuid.uuid4().hex[:8]}"
a.bind(name)
b.connect(name)
big = np.ones(65536 // 4, dtype=np.float32)  # at pyzmq's copy threshold: pinned, not copied
for _ in range(n):
    a.send(big, copy=False)
frames = [ops.recv(b.underlying, 0, True)[0] for _ in range(n)]
assert all(len(f) == big.nbytes for f in frames)
del frames  # every free function runs here, in this thread
a.close(0)
b.close(0)
print("freed", n)
"""


def test_buffers_pyzmq_sent_zero_copy_in_this_process_are_freed_without_a_deadlock():
    """Over inproc a received part may be a buffer pyzmq sent zero-copy: freeing it hands it to
    pyzmq's collector thread (a blocking send on its socket, which holds about a thousand), and
    that thread needs the GIL to take them. Thousands freed back to back, in one list's
    deallocation (no bytecode between them to hand the GIL over), must not wait on it with the
    GIL held. A child process runs it: a deadlock there holds the GIL, which no in-process
    timeout could take back."""
    done = subprocess.run([sys.executable, "-c", _FREE_MANY], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "freed 3000" in done.stdout, done.stderr
