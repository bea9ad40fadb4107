"""Slurm's job description read from its environment: node lists, tasks per node, this task's rank.

Slurm writes its layout in compressed forms (``gpu-[01-02],cpu7``; ``2(x3),1``); python-hostlist
expands them, and this module checks what it gives (names, duplicates, counts that agree).
It returns plain data (host, port, rank) and never builds a ClusterSpec itself: ``zmqflow.cluster``
imports it, so it must not import ``zmqflow.cluster`` back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

from .errors import ConfigError

__all__ = ["SlurmLayout", "SlurmTask", "expand_hostlist", "expand_tasks_per_node", "is_slurm", "layout"]

_MAX_HOSTS = hostlist.MAX_SIZE  # a count like 1(x999999999) would otherwise eat the memory before failing
_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-\._]*[A-Za-z0-9])?$")
_COUNT_RE = re.compile(r"^(?P<n>\d+)(\(x(?P<rep>\d+)\))?$", re.ASCII)

# srun sets the STEP_ forms for its own step, which may span fewer nodes than the allocation.
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NTASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@dataclass(frozen=True, slots=True)
class SlurmTask:
    """One rank: where it runs and the port it serves on (``base_port + local id``)."""

    rank: int
    host: str
    port: int
    local_id: int


@dataclass(frozen=True, slots=True)
class SlurmLayout:
    """Every rank of the step in rank order, and this process's rank."""

    tasks: tuple[SlurmTask, ...]
    rank: int


def expand_hostlist(text: str, var: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list, in order: ``gpu-[01-02],cpu7`` -> gpu-01, gpu-02, cpu7.

    python-hostlist expands it (within its cap on the number of hosts); duplicates are refused
    here: two ranks would then share a host and, by local id, a port."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{var}={text!r}: empty node list")
    if any(not item.strip() for item in _split_outside_brackets(text.strip())):
        raise ConfigError(f"{var}={text!r}: empty entry in the node list")
    try:
        hosts = hostlist.expand_hostlist(text.strip(), allow_duplicates=True)
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"{var}={text!r}: {exc}") from None
    for host in hosts:
        if not _NAME_RE.match(host):
            raise ConfigError(f"{var}={text!r}: malformed host name {host!r}")
    if len(set(hosts)) != len(hosts):
        dup = next(h for i, h in enumerate(hosts) if h in hosts[:i])
        raise ConfigError(f"{var}={text!r}: host {dup!r} listed twice")
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    """Top-level items (python-hostlist silently drops empty ones; a node list with one is malformed)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def expand_tasks_per_node(text: str, var: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]: each node's task count, in node-list order."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{var}={text!r}: empty tasks-per-node list")
    counts: list[int] = []
    for part in text.strip().split(","):
        m = _COUNT_RE.match(part.strip())
        if not m:
            raise ConfigError(f"{var}={text!r}: malformed entry {part!r}, expected 'N' or 'N(xM)'")
        rep = int(m["rep"]) if m["rep"] is not None else 1
        if rep < 1 or len(counts) + rep > _MAX_HOSTS:
            raise ConfigError(f"{var}={text!r}: bad repeat count in {part!r}")
        counts.extend(hostlist.parse_slurm_tasks_per_node(part.strip()))
    return counts


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value:
            return name, value
    return None


def is_slurm(env: Mapping[str, str]) -> bool:
    """Inside a Slurm task: a node list and a rank are both set."""
    return _first(env, _NODELIST_VARS) is not None and bool(env.get("SLURM_PROCID"))


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{name}={env.get(name)!r}: expected a non-negative integer")
    return int(text)


def layout(env: Mapping[str, str], base_port: int) -> SlurmLayout:
    """Every rank of the step, block-distributed over the nodes as Slurm's default places them:
    ranks 0..c0-1 on the first node, the next c1 on the second, and so on. This process's
    SLURM_LOCALID (and SLURMD_NODENAME when set) is checked against that placement, so a cyclic
    distribution fails here, naming the variable, rather than binding the wrong ports."""
    if isinstance(base_port, bool) or not isinstance(base_port, int) or not 1 <= base_port <= 65535:
        raise ConfigError(f"base_port {base_port!r}: expected a port 1..65535")
    found = _first(env, _NODELIST_VARS)
    if found is None:
        raise ConfigError("not in a Slurm job: SLURM_JOB_NODELIST is not set")
    nodes_var, nodes_text = found
    hosts = expand_hostlist(nodes_text, nodes_var)
    per_found = _first(env, _PER_NODE_VARS)
    if per_found is None:
        raise ConfigError("SLURM_TASKS_PER_NODE is not set")
    per_var, per_text = per_found
    counts = expand_tasks_per_node(per_text, per_var)
    if len(counts) != len(hosts):
        raise ConfigError(f"{per_var}={per_text!r} gives {len(counts)} nodes but {nodes_var}={nodes_text!r} "
                          f"lists {len(hosts)}")
    n_found = _first(env, _NTASKS_VARS)
    if n_found is None:
        raise ConfigError("SLURM_NTASKS is not set")
    ntasks = _int(env, n_found[0])
    if ntasks != sum(counts):
        raise ConfigError(f"{n_found[0]}={n_found[1]!r} but {per_var}={per_text!r} adds up to {sum(counts)}")
    if base_port + max(counts, default=1) - 1 > 65535:
        raise ConfigError(f"base_port {base_port} + {max(counts) - 1} local ids passes port 65535")
    tasks: list[SlurmTask] = []
    for host, count in zip(hosts, counts):
        for local in range(count):
            tasks.append(SlurmTask(len(tasks), host, base_port + local, local))
    rank = _int(env, "SLURM_PROCID")
    if rank >= ntasks:
        raise ConfigError(f"SLURM_PROCID={env.get('SLURM_PROCID')!r} out of range: the step has {ntasks} tasks")
    if env.get("SLURM_LOCALID"):
        local = _int(env, "SLURM_LOCALID")
        if local != tasks[rank].local_id:
            raise ConfigError(f"SLURM_LOCALID={env.get('SLURM_LOCALID')!r} but rank {rank} is local id "
                              f"{tasks[rank].local_id} in a block distribution: run with --distribution=block")
    node_name = env.get("SLURMD_NODENAME")
    if node_name and node_name != tasks[rank].host:
        raise ConfigError(f"SLURMD_NODENAME={node_name!r} but rank {rank} is on {tasks[rank].host!r} "
                          "in a block distribution: run with --distribution=block")
    return SlurmLayout(tuple(tasks), rank)
