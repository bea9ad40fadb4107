"""Where the ring's same-host path may run and what it leaves on the host: whether shared memory
is on here, which processes share this kernel, whether a peer's pid still runs, the segments a
kill left behind, and a new segment's pages reserved up front (``client/ring_shm.py`` uses them).
"""

from __future__ import annotations

import os
import platform
import zlib

from ..state import shm_schedule as plan

__all__ = ["SHM_DIR", "ORDERED_STORES", "enabled", "host_id", "alive", "clean_stale", "socket_name", "reserve"]

SHM_DIR = "/dev/shm"


# A counter is published by a plain store after its piece's data, and read before the data: only
# a machine that keeps stores in order with stores and loads with loads (x86's TSO) makes that
# safe without fences, which Python cannot issue. Elsewhere (ARM, POWER) rings stay on TCP.
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def enabled() -> bool:
    return (ORDERED_STORES and os.environ.get("ZMQFLOW_RING_SHM", "1") not in ("0", "false", "no", "off")
            and os.access(SHM_DIR, os.W_OK))


def host_id() -> int:
    """Same value on every process of one kernel and pid namespace (pids are checked for liveness)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
    return (zlib.crc32(boot.encode()) << 31) ^ ns


def alive(pid: int) -> bool:
    """Running (a killed child its parent has not reaped yet is a zombie: dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def clean_stale(directory: str | None = None) -> list[str]:
    """Remove ring segments of this user whose creating process is gone (left by a kill during setup)."""
    directory = SHM_DIR if directory is None else directory
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = plan.NAME_RE.match(name)
        if m is None or alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    return removed


def socket_name(token: bytes) -> bytes:
    return b"\0zmqflow-ring-" + token.hex().encode()


def reserve(fd: int, size: int) -> None:
    """Give a new segment all its pages now. ``ftruncate`` alone makes a sparse file: on a tmpfs
    too small for it (a container's /dev/shm is 64 MiB by default) setup succeeds and the first
    write past the free space kills the process with SIGBUS; failing here leaves the ring on TCP."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot reserve {size} bytes in {SHM_DIR} for a ring segment ({exc.strerror}); "
                                 f"a container may need a larger /dev/shm (docker run --shm-size)") from exc
