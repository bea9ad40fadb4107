"""The cluster benchmark: PS pull+push throughput as ps tasks go 1 -> 4 and workers 2 -> 4, each
task on its own simulated host (``--netns``: a network namespace whose link to one bridge is
rate-limited each way, e.g. to 1 or 10 Gbit/s), as a fraction of what the links allow
(:mod:`.calc`). Without ``--netns`` the same processes run on loopback with no link limit: the
machine's own ceiling, beside which the limited runs are read.

Per ps count, the ps tasks (``zmqflow serve``) and the most workers asked for start once; the
workers declare a model of ``nvars`` float32 variables (round-robin over the shards) and then, for
each rate, worker count and step, the first W workers run rounds for a few seconds, all started
together; throughput is taken over the window in which every one of them was busy. A step is
``pull-push`` (pull the model, then push a gradient: each link carries one way at a time) or
``push-pull`` (``Session.push_pull``: the two overlapped, both ways at once).

Run ``zmqflow bench cluster [--netns] [--quick] [--rate G ...] [--ps N ...] [--workers N ...]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from ...errors import InvalidArgument
from ...ports import free_port
from ..machine import OtherLoad
from ..report import align, cell, write_jsonl
from .calc import link_bound, payload_fraction, window_rate
from .net import Network, check_netns
from .plan import FAMILY, Topology, new_prefix

__all__ = ["format_table", "run"]

MB = 1e6
STEPS = ("pull-push", "push-pull")  # a worker's round: the two transfers in turn, or overlapped
_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding the zmqflow package
_SCRUB = ("ZMQFLOW_CLUSTER", "ZMQFLOW_TASK", "ZMQFLOW_KEYS", "TF_CONFIG")  # each task is told its own


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    return env


class _Proc:
    """One task's process; its stdout lines (JSON) arrive on a queue read with a deadline."""

    def __init__(self, argv: list[str], log_dir: str, name: str, talk: bool = False):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE if talk else subprocess.DEVNULL,
                                     stdin=subprocess.PIPE if talk else subprocess.DEVNULL, stderr=self._log, text=True,
                                     start_new_session=True)  # Ctrl-C reaches the runner, which stops them in order
        self.lines: queue.Queue[str | None] = queue.Queue()
        if talk:
            threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: TextIO) -> None:
        for line in out:
            self.lines.put(line)
        self.lines.put(None)

    def log_tail(self, n: int = 1500) -> str:
        with contextlib.suppress(OSError), open(self.log_path) as fh:
            return fh.read()[-n:].strip()
        return ""

    def send(self, record: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(record) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name} answered nothing within {timeout:g}s; its log: {self.log_tail()}") from None
        if line is None:
            self.proc.wait(5)
            raise RuntimeError(f"{self.name} exited (code {self.proc.returncode}); its log: {self.log_tail()}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # a worker's EOF: it ends by itself
        try:
            self.proc.wait(2 if self.proc.stdin is not None else 0.01)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # `zmqflow serve` stops on SIGTERM
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class _Layout:
    """Where the tasks run: addresses of the ps tasks and the command prefix of each host."""

    def __init__(self, topo: Topology | None, ip: str):
        self.topo, self.ip = topo, ip

    def spec(self, ps: int) -> dict[str, list[str]]:
        if self.topo is None:
            return {"ps": [f"127.0.0.1:{free_port()}" for _ in range(ps)]}
        return self.topo.cluster(ps)

    def prefix(self, job: str, index: int) -> list[str]:
        if self.topo is None:
            return []
        return self.topo.exec_prefix((self.topo.ps if job == "ps" else self.topo.workers)[index], self.ip)


def _row(rate: float | None, ps: int, workers: int, step: str, reports: list[dict[str, Any]],
         shard_bytes: dict[str, int], warm: float, other: float | None, netns: bool) -> dict[str, Any]:
    phase_bytes, overlapped = reports[0]["phase_bytes"], step == "push-pull"
    win = window_rate([[tuple(r) for r in rep["rounds"]] for rep in reports], phase_bytes, warm, overlapped)
    row: dict[str, Any] = {
        "netns": netns, "rate_gbit": rate, "ps": ps, "workers": workers, "step": step,
        "model_mb": round(phase_bytes / MB, 1),
        "pull_gbps": win.pull_bytes_per_s / 1e9, "push_gbps": win.push_bytes_per_s / 1e9,
        "total_gbps": win.total_bytes_per_s / 1e9, "window_s": round(win.seconds, 2), "rounds": win.rounds,
        "limit_gbps": None, "fraction": None, "binds": None, "workers_limit_gbps": None, "ps_limit_gbps": None,
        "other_cpus": None if other is None else round(other, 2),
    }
    if rate is not None:
        bound = link_bound(rate * 1e9, workers, [shard_bytes.get(f"ps:{i}", 0) for i in range(ps)], overlapped)
        row.update(limit_gbps=bound.bytes_per_s / 1e9, fraction=win.total_bytes_per_s / bound.bytes_per_s,
                   binds=bound.binds, workers_limit_gbps=bound.workers_bytes_per_s / 1e9,
                   ps_limit_gbps=bound.ps_bytes_per_s / 1e9)
    return row


def _group(layout: _Layout, ps: int, rates: Sequence[float | None], workers: Sequence[int], steps: Sequence[str],
           model_bytes: int, nvars: int, seconds: float, warm: float, set_rate: Callable[[float], None],
           log_dir: str, json_out: str | None, echo: Callable[[str], Any]) -> list[dict[str, Any]]:
    """Every (rate, worker count, step) row of one ps count, on one set of task processes."""
    spec_json = json.dumps(layout.spec(ps))
    if rates[0] is not None:
        set_rate(rates[0] * 1e9)  # the warm-up runs on limited links too
    servers: list[_Proc] = []
    clients: list[_Proc] = []
    rows = []
    try:
        for i in range(ps):
            servers.append(_Proc(layout.prefix("ps", i) + [
                sys.executable, "-m", "zmqflow", "serve", "--cluster", spec_json, "--task", f"ps:{i}",
                "--insecure", "--log-level", "warning"], log_dir, f"ps{i}"))
        for i in range(max(workers)):
            clients.append(_Proc(layout.prefix("worker", i) + [
                sys.executable, "-m", "zmqflow.bench.netns.worker", spec_json, f"w{i}", str(model_bytes), str(nvars)],
                log_dir, f"w{i}", talk=True))
        ready = [c.recv(timeout=120) for c in clients]
        shard_bytes = ready[0]["shard_bytes"]
        for rate in rates:
            if rate is not None:
                set_rate(rate * 1e9)
            for w, step in ((w, step) for w in workers for step in steps):
                load = OtherLoad()
                for c in clients[:w]:
                    c.send({"run": seconds + warm, "step": step})
                reports = [c.recv(timeout=seconds + warm + 120) for c in clients[:w]]
                row = _row(rate, ps, w, step, reports, shard_bytes, warm, load.cpus(), layout.topo is not None)
                echo(f"measured {_link(rate)}, {ps} ps, {w} workers, {step}: {row['total_gbps']:.3f} GB/s"
                     + ("" if row["fraction"] is None
                        else f" = {row['fraction']:.2f} of the {row['limit_gbps']:.3f} GB/s links allow"))
                rows.append(row)
                if json_out:
                    write_jsonl(json_out, [{"bench": "cluster", **row}])
    finally:
        for p in clients + servers:  # workers first: a ps that goes first makes them wait
            p.stop()
    return rows


def _link(rate: float | None) -> str:
    return "loopback" if rate is None else f"{rate:g} Gbit/s"


def run(quick: bool = False, netns: bool = False, rates: Sequence[float] = (), ps: Sequence[int] = (),
        workers: Sequence[int] = (), model_mb: float | None = None, seconds: float | None = None, nvars: int = 8,
        json_out: str | None = None, echo: Callable[[str], Any] = print, ip: str = "ip", tc: str = "tc",
        family: str = FAMILY, steps: Sequence[str] = STEPS) -> list[dict[str, Any]]:
    """One row per (link rate, ps count, worker count, step); each appended to ``json_out`` as
    measured. With ``netns``, Unavailable (saying why) where the machine does not allow namespaces."""
    ps = tuple(ps) or ((1, 4) if quick else (1, 2, 4))
    workers = tuple(workers) or (2, 4)
    steps = tuple(dict.fromkeys(steps)) or STEPS
    if set(steps) - set(STEPS):
        raise InvalidArgument(f"steps are {' and '.join(STEPS)}, got {', '.join(sorted(set(steps) - set(STEPS)))}")
    use_rates: tuple[float | None, ...] = (tuple(rates) or (1.0, 10.0)) if netns else (None,)
    model_bytes = int((model_mb or (8 if quick else 32)) * MB)
    seconds = seconds or (2.0 if quick else 4.0)
    warm = min(1.0, seconds / 4)
    if min(ps) < 1 or min(workers) < 1 or nvars < 1 or model_bytes < 4 * nvars or seconds <= 0:
        raise InvalidArgument(f"need ps, workers, nvars >= 1, a model of at least {4 * nvars} bytes and seconds > 0")
    if any(r is not None and r <= 0 for r in use_rates):
        raise InvalidArgument(f"link rates must be positive Gbit/s, got {list(rates)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zmqflow-cluster-") as log_dir:
        if not netns:
            for n in ps:
                rows += _group(_Layout(None, ip), n, use_rates, workers, steps, model_bytes, nvars, seconds, warm,
                               lambda _r: None, log_dir, json_out, echo)
            return rows
        check_netns(ip, tc, family)
        topo = Topology.make(new_prefix(family), max(ps), max(workers))
        echo(f"namespaces {topo.prefix}-*: {max(ps)} ps and {max(workers)} worker hosts on one bridge")
        with Network(topo, ip, tc) as net:
            for n in ps:
                rows += _group(_Layout(topo, ip), n, use_rates, workers, steps, model_bytes, nvars, seconds, warm,
                               net.set_rate, log_dir, json_out, echo)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ["link", "ps", "workers", "step", "model", "pull GB/s", "push GB/s", "total GB/s", "limit GB/s", "of limit",
            "binds", "rounds", "other CPUs"]
    lines = [head]
    for r in rows:
        lines.append([
            _link(r["rate_gbit"]), str(r["ps"]), str(r["workers"]), r.get("step", "pull-push"),
            f"{r['model_mb']:.0f} MB",
            f"{r['pull_gbps']:.3f}", f"{r['push_gbps']:.3f}", f"{r['total_gbps']:.3f}", cell(r["limit_gbps"], ".3f"),
            cell(r["fraction"], ".2f"), cell(r["binds"]), str(r["rounds"]), cell(r["other_cpus"], ".2f"),
        ])
    out = align(lines)
    out.append("limit: the most pull+push the links allow, each link full duplex at the rate: each worker moves at "
               "most the rate (it pulls, then pushes; twice the rate with push-pull, both at once); the busiest "
               "ps link at most twice the rate over its share "
               "of the model, reached only when workers' pulls and pushes interleave (workers pulling together "
               f"halve it). Headers leave {payload_fraction():.3f} of a link for payload (MTU 1500). Rows near "
               "what loopback moves (the command without --netns) are bound by CPU, not links. "
               "other CPUs: load from processes outside this run.")
    return "\n".join(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--netns", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(format_table(run(quick=args.quick, netns=args.netns, json_out=args.json)))
