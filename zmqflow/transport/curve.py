"""CurveZMQ key material: the directory ``zmqflow keys generate`` writes, and what sockets need of it.

A key directory holds one keypair per task (or one shared task keypair), a client keypair, and
``allow.json``: every public key by role, which is what a server admits. Secret files are mode
0600 and never leave the directory; ``allow.json`` and the ``.key`` files are public, its folders
0700. A secret that does not match its public key, or a folder or ``allow.json`` that another user
could change, is refused at load. The
certificate files are pyzmq's (``zmq.auth.load_certificate`` reads them)::

    DIR/allow.json                 {"format": 1, "tasks": {name: z85}, "clients": {name: z85},
                                    "addresses": {task: "host:port"}}   (no secrets)
    DIR/tasks/<job>-<index>.key    a task's public certificate (with --cluster)
    DIR/tasks/<job>-<index>.key_secret   its secret (0600)
    DIR/tasks/task.key[_secret]    without a cluster: one key every task shares ("*" in allow.json)
    DIR/clients/client.key[_secret]      the client keypair

The ZAP handler (:mod:`.zap`) tells a router who sent each message as ``role/name`` ("task/ps:0",
"client/client"; "task/" for the shared task key, which proves the role but pins no name).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from ..cluster import Address, ClusterSpec
from ..errors import ConfigError

__all__ = [
    "TASK", "CLIENT", "ANY_TASK", "ALLOW_FILE", "KEYS_ENV", "CurveServer", "CurveClient", "Keys",
    "generate", "keys_from", "is_loopback", "task_file",
]

TASK, CLIENT = "task", "client"
ANY_TASK = "*"  # the allow-list's name for a task key every task shares (generated without a cluster)
ALLOW_FILE = "allow.json"
KEYS_ENV = "ZMQFLOW_KEYS"
_FORMAT = 1
_HOW = "make keys with `zmqflow keys generate DIR [--cluster c.json]`"


@dataclass(frozen=True)
class CurveServer:
    """What a router needs: its keypair, and the client public keys (raw 32 bytes) it admits, each
    with the user id its messages will carry (``role/name``)."""

    public: bytes
    secret: bytes
    allow: Mapping[bytes, str]


@dataclass(frozen=True)
class CurveClient:
    """What a dealer needs: its own keypair and the public key of the server it connects to."""

    public: bytes
    secret: bytes
    server: bytes


def task_file(task: str) -> str:
    """The certificate's base name for a task: ``worker:0`` -> ``worker-0`` (no colons in paths)."""
    return "task" if task == ANY_TASK else task.replace(":", "-")


def _write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    """A pyzmq-format certificate; a secret one is created 0600 (never readable by others, not
    even for a moment), and an existing file is never overwritten."""
    lines = [f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by zmqflow  ****",
             "#   ZeroMQ CURVE " + ("**Secret** Certificate" if secret else "Public Certificate"),
             "#   " + ("DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions." if secret
                      else "Exchange securely, or use a secure mechanism to verify the contents of this file."),
             "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def generate(directory: str | os.PathLike[str], spec: ClusterSpec | None = None, *, force: bool = False) -> dict[str, Any]:
    """Write a key directory: a keypair per task of ``spec`` (or one shared task keypair), the
    client keypair and the allow-list. Refuses to touch a directory that already has one unless
    ``force`` (then its keys are replaced). Returns the allow-list."""
    root = Path(directory)
    if (root / ALLOW_FILE).exists() and not force:
        raise ConfigError(f"{root} already holds keys ({ALLOW_FILE}); pass --force to replace them")
    _private_dir(root)
    allow: dict[str, Any] = {"format": _FORMAT, "tasks": {}, "clients": {}, "addresses": {}}
    names = [str(t) for t in spec.tasks] if spec is not None else [ANY_TASK]
    for role, sub, entries in ((TASK, "tasks", names), (CLIENT, "clients", ["client"])):
        folder = root / sub
        _private_dir(folder)
        for name in entries:
            public, secret = zmq.curve_keypair()
            base = folder / (task_file(name) if role == TASK else name)
            for path in (base.with_suffix(".key"), base.with_suffix(".key_secret")):
                if force:
                    path.unlink(missing_ok=True)
            _write_cert(base.with_suffix(".key"), public, None)
            _write_cert(base.with_suffix(".key_secret"), public, secret)
            allow["tasks" if role == TASK else "clients"][name] = public.decode()
    if spec is not None:
        allow["addresses"] = {str(t): str(spec.address(t)) for t in spec.tasks}
    tmp = root / (ALLOW_FILE + ".tmp")
    tmp.write_text(json.dumps(allow, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, root / ALLOW_FILE)
    return allow


def _private_dir(path: Path) -> None:
    """Make ``path`` mode 0700 (its parents as the umask allows), or check the one already there."""
    if path.is_dir():
        _check_owned(path)
        return
    path.mkdir(mode=0o700, parents=True)
    os.chmod(path, 0o700)  # whatever the umask


def _check_owned(path: Path) -> None:
    """Refuse, as ssh's StrictModes does, a key directory or allow-list that another user could
    change: owned by someone other than this user or root, or writable by group or others. A
    root-owned directory with the sticky bit (a Kubernetes Secret's mount point) may be writable
    by all: others cannot replace what is in it, and what they add is theirs, which is refused."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(f"{path} is owned by another user (uid {st.st_uid}): keys must be this user's or root's")
    sticky_root = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o022 and not sticky_root:
        raise ConfigError(f"{path} is writable by others (mode {oct(st.st_mode & 0o777)}): "
                          f"chmod go-w it (700 for a directory, 644 for {ALLOW_FILE})")


def _z85(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or len(value) != 40:
        raise ConfigError(f"{where}: expected a 40-character Z85 public key, got {value!r}")
    try:
        z85.decode(value)
    except Exception:
        raise ConfigError(f"{where}: {value!r} is not a Z85 key") from None
    return value.encode()


@dataclass
class Keys:
    """A loaded key directory: who this process is (``name``, ``role``: its keypair) and who
    may connect (the allow-list). A task presents its task key everywhere, in its server's
    outgoing calls and in sessions it opens; other processes present the client key."""

    directory: Path
    name: str
    role: str
    public: bytes
    secret: bytes
    pinned: bool  # the key names exactly this process (False for the shared task key)
    tasks: dict[str, bytes]
    clients: dict[str, bytes]
    endpoints: dict[str, str] = field(default_factory=dict)  # connect endpoint -> task name

    @classmethod
    def load(cls, directory: str | os.PathLike[str], task: str | None = None, *, require_task: bool = False) -> "Keys":
        """Read ``directory``; this process is ``task`` when its task key (or the shared one) is
        there, else the client. ``require_task``: a server must hold a task key."""
        root = Path(directory)
        _check_owned(root)
        _check_owned(root / ALLOW_FILE)
        try:
            allow = json.loads((root / ALLOW_FILE).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{root} holds no {ALLOW_FILE}: {_HOW}") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {root / ALLOW_FILE}: {exc}") from None
        if not isinstance(allow, dict) or allow.get("format") != _FORMAT:
            raise ConfigError(f"{root / ALLOW_FILE}: not a zmqflow allow-list (format {_FORMAT})")
        tasks = {str(n): _z85(k, f"{ALLOW_FILE} task {n}") for n, k in dict(allow.get("tasks") or {}).items()}
        clients = {str(n): _z85(k, f"{ALLOW_FILE} client {n}") for n, k in dict(allow.get("clients") or {}).items()}
        endpoints = {}
        for n, addr in dict(allow.get("addresses") or {}).items():
            endpoints[Address.parse(addr, f"{ALLOW_FILE} address of {n}").endpoint] = str(n)
        candidates: list[tuple[str, str, Path, bool]] = []
        if task is not None:
            candidates += [(task, TASK, root / "tasks" / f"{task_file(task)}.key_secret", True),
                           (task, TASK, root / "tasks" / f"{task_file(ANY_TASK)}.key_secret", False)]
        if not require_task:
            candidates.append(("client", CLIENT, root / "clients" / "client.key_secret", True))
        for name, role, path, pinned in candidates:
            if not path.exists():
                continue
            listed = (tasks.get(name if pinned else ANY_TASK) if role == TASK else clients.get(name))
            _check_owned(path.parent)
            public, secret = _load_secret(path)
            if listed != public:
                raise ConfigError(f"{path}: its public key is not the one {ALLOW_FILE} lists for {role} {name!r}")
            return cls(root, name, role, public, secret, pinned, tasks, clients, endpoints)
        who = f"task {task}" if task is not None else "a client"
        raise ConfigError(f"{root} holds no secret key for {who}: {_HOW} and copy the key to this host")

    def learn(self, spec: ClusterSpec) -> None:
        """Know which task serves each endpoint of ``spec`` (to pick the server key to expect)."""
        for t in spec.tasks:
            self.endpoints.setdefault(spec.address(t).endpoint, str(t))

    def server_key(self, endpoint: str, name: str | None = None) -> bytes:
        """The public key the task at ``endpoint`` (``name``, when known) must present."""
        for who in (name, self.endpoints.get(endpoint)):
            if who is not None and who in self.tasks:
                return self.tasks[who]
        if ANY_TASK in self.tasks:
            return self.tasks[ANY_TASK]
        raise ConfigError(f"no key in {self.directory} for the task at {endpoint}: give the session cluster= and "
                          f"task=, or generate the keys with --cluster so {ALLOW_FILE} lists the task's address")

    def client(self, endpoint: str, name: str | None = None) -> CurveClient:
        return CurveClient(self.public, self.secret, self.server_key(endpoint, name))

    def server(self) -> CurveServer:
        """A router's security: this task's keypair, admitting every listed key."""
        if self.role != TASK:
            raise ConfigError(f"a server needs a task key; {self.directory} gave this process the client key")
        allow = {z85.decode(k): f"{TASK}/{'' if n == ANY_TASK else n}" for n, k in self.tasks.items()}
        allow.update({z85.decode(k): f"{CLIENT}/{n}" for n, k in self.clients.items()})
        return CurveServer(self.public, self.secret, allow)

    def __repr__(self) -> str:
        return f"Keys({str(self.directory)!r}, {self.role} {self.name!r})"


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    """A secret key file, refused if others may read it. As PostgreSQL does for its key, a file
    owned by root may also be readable by its group: a Kubernetes Secret mounted for a pod with an
    fsGroup is root-owned, mode 0440, group fsGroup, and only so can a non-root process read it."""
    st = path.stat()
    loose = st.st_mode & (0o037 if st.st_uid == 0 else 0o077)
    if loose:
        allowed = "600 (or 640 when owned by root)" if st.st_uid == 0 else "600"
        raise ConfigError(f"{path} is readable by others (mode {oct(st.st_mode & 0o777)}): chmod {allowed} it")
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(f"{path} is owned by another user (uid {st.st_uid}): keys must be this user's or root's")
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ConfigError(f"{path} holds no secret key")
    try:
        matches = zmq.curve_public(secret) == public
    except zmq.ZMQError:
        matches = False
    if not matches:
        raise ConfigError(f"{path}: its secret key does not belong to its public key (a damaged or edited file?)")
    return public, secret


def keys_from(keys: "Keys | str | os.PathLike[str] | None", task: str | None = None, *,
              require_task: bool = False, env: Mapping[str, str] | None = None) -> Keys | None:
    """``keys=`` as given (a directory or loaded ``Keys``), else ``ZMQFLOW_KEYS``, else None."""
    if isinstance(keys, Keys):
        return keys
    if keys is None:
        keys = (os.environ if env is None else env).get(KEYS_ENV) or None
    if keys is None:
        return None
    return Keys.load(keys, task, require_task=require_task)


def is_loopback(endpoint: str) -> bool:
    """Whether binding ``endpoint`` exposes nothing beyond this host (ipc, inproc, loopback tcp)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host in ("*", "", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
