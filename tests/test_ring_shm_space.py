"""A /dev/shm too small for the ring's segments (a container's default is 64 MiB; a segment is
8 MiB per rank): the segment's pages are reserved when it is made, so the ring stays on TCP and
leaves no segment behind, instead of agreeing on shared memory and dying of SIGBUS at the first
big write."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from zmqflow.client import ring_shm_host
from zmqflow.client.ring import AsyncRing
from zmqflow.state import shm_schedule as plan
from zmqflow.testing import local_cluster

from .conftest import arun

pytestmark = pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
ROOT = str(Path(__file__).resolve().parent.parent)
NO_MOUNT = 77  # the child's exit code when it may not mount a tmpfs of its own

CHILD = textwrap.dedent(
    """
    import asyncio, numpy as np
    from zmqflow.client.ring import AsyncRing
    from zmqflow.testing import local_cluster

    async def main():
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            rings = [AsyncRing(servers[f"worker:{i}"], timeout=20) for i in range(2)]
            await asyncio.gather(*(r.allreduce(np.ones(2, np.float32)) for r in rings))
            print("SHM", [r.shm_channel is not None for r in rings], flush=True)
            outs = await asyncio.gather(*(r.allreduce(np.ones(2 << 20, np.float32)) for r in rings))  # 8 MiB
            print("SUM", sorted({float(v) for o in outs for v in (o.min(), o.max())}), flush=True)

    asyncio.run(main())
    """
)


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if plan.NAME_RE.match(n)}


def test_a_4_mib_dev_shm_keeps_the_ring_on_tcp(tmp_path):
    """The child gets a private mount namespace with a 4 MiB tmpfs over /dev/shm (needs root,
    else skipped); the namespace, and everything in it, goes when the child exits."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a small /dev/shm needs root and unshare")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    shell = f"mount -t tmpfs -o size=4m tmpfs /dev/shm || exit {NO_MOUNT}; exec {sys.executable} {script}"
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell], env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:  # run() killed it
        raise AssertionError(f"the child hung; its output:\n{exc.stdout}\n{exc.stderr}") from None
    if done.returncode == NO_MOUNT:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "SHM [False, False]" in done.stdout and "SUM [2.0]" in done.stdout, done.stdout
    assert "cannot reserve" in done.stderr and "its calls go over TCP" in done.stderr, done.stderr


def test_a_rank_that_cannot_reserve_its_segment_takes_every_rank_to_tcp_and_unlinks_it(monkeypatch):
    """Only rank 0's reservation fails (as on a /dev/shm with room for one segment): no rank may
    take shared memory, and the segment it made is gone."""
    made: list[str] = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, size: int) -> None:
        made.append(os.readlink(f"/proc/self/fd/{fd}"))
        if len(made) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, size)

    monkeypatch.setattr(ring_shm_host.os, "posix_fallocate", fallocate)
    before = segments()

    async def main() -> None:
        async with local_cluster({"worker": 2}, timeout=10, transport="tcp") as servers:
            rings = [AsyncRing(servers[f"worker:{i}"], timeout=10) for i in range(2)]
            await asyncio.gather(*(r.allreduce(np.ones(2, np.float32)) for r in rings))
            assert [r.shm_channel for r in rings] == [None, None]
            x = np.arange(1 << 20, dtype=np.float32)
            outs = await asyncio.gather(*(r.allreduce(x) for r in rings))
            for out in outs:
                np.testing.assert_array_equal(out, 2 * x)

    arun(main(), timeout=60)
    assert len(made) == 2 and not any(os.path.exists(p) for p in made)
    assert segments() <= before
