"""Recovery benchmark: how long training stops when a ps shard is killed with ``kill -9``.

A sync-PS job (2 workers, 2 shards, tcp loopback) runs under ``zmqflow launch --restart
on-failure``; the chief pauses at a step after a checkpoint, the benchmark kills a shard, and
measures from the kill to: the restarted shard serving again (the baseline: a bare process
restart, which no recovery can beat), then the chief, then every worker training again. The
ratio is the whole stop over the bare restart; the difference is what recovery itself costs
(fence, sweep, restore from the checkpoint, unfence, workers reattaching).

Run ``zmqflow bench recovery [--quick] [--json FILE]``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .report import align, script_main, write_jsonl

__all__ = ["format_table", "run"]

_TRAIN = """
import os, sys, time, numpy as np, zmqflow as zf
ckpt, pause = sys.argv[1], sys.argv[2]
with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(sync=True), checkpoint_dir=ckpt, save_checkpoint_steps=20,
                                 hooks=[zf.StopAtStep(60)], progress=False) as mon:
    mon.create({"w": np.zeros((512, 64)), "b": np.zeros(64)}, optimizer=zf.optim.Momentum(0.01, 0.9))
    while not mon.should_stop():
        p = mon.params()
        mon.apply({"w": np.full((512, 64), 0.1), "b": np.full(64, 0.1)})
        if mon.is_chief and mon.step == 30 and not os.path.exists(pause + ".done"):
            open(pause + ".done", "w").close()
            print("paused", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(pause):  # the benchmark kills a shard, then creates this file
                if time.monotonic() >= deadline:
                    raise TimeoutError("the kill not reached within 60s")
                time.sleep(0.01)
"""


class _Lines:
    """A child's merged output, each line with the time it arrived; waited on with a deadline."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.seen: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.seen.append((time.monotonic(), line.rstrip("\n")))
                self.cond.notify_all()

    def wait_for(self, text: str, timeout: float, after: float = 0.0) -> float:
        """When the first line containing ``text`` (arriving after ``after``) arrived."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = next((t for t, line in self.seen if t >= after and text in line), None)
                if found is not None:
                    return found
                if not self.cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise TimeoutError(f"no line with {text!r} within {timeout:g}s")


def _once(victim: str) -> dict[str, Any]:
    """One job, one kill of ``victim``: seconds from the kill to each milestone in the job's log."""
    zmqflow = [sys.executable, "-m", "zmqflow"]
    with tempfile.TemporaryDirectory() as d:
        script, cfile, pause = os.path.join(d, "train.py"), os.path.join(d, "c.json"), os.path.join(d, "killed")
        with open(script, "w") as fh:
            fh.write(_TRAIN)
        job = _Lines([*zmqflow, "launch", "--workers", "2", "--ps", "2", "--restart", "on-failure", "--cluster-out", cfile,
                      "--", sys.executable, script, os.path.join(d, "ckpt"), pause])
        try:
            job.wait_for("paused", 120)
            status = subprocess.run([*zmqflow, "status", "--cluster", cfile, "--json"], capture_output=True, text=True,
                                    timeout=60)
            pid = next((r.get("pid") for r in json.loads(status.stdout)["tasks"] if r["task"] == victim), None)
            if pid is None:
                raise RuntimeError(f"zmqflow status did not report {victim}: {status.stdout or status.stderr}")
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            open(pause, "w").close()
            serving = job.wait_for(f"serving {victim}", 60, after=killed)
            chief = job.wait_for("[worker:0] worker:0: recovered", 60, after=killed)
            other = job.wait_for("[worker:1] worker:1: recovered", 60, after=killed)
            if job.proc.wait(120) != 0:
                raise RuntimeError(f"the training job failed after {victim} was killed")
        finally:
            if job.proc.poll() is None:  # the launcher stops its tasks (their own sessions) on SIGTERM
                job.proc.terminate()
                try:
                    job.proc.wait(30)
                except subprocess.TimeoutExpired:
                    job.proc.kill()
                    job.proc.wait()
    return {"victim": victim, "restart_s": serving - killed, "chief_s": chief - killed,
            "all_s": max(chief, other) - killed}


def run(quick: bool = False, json_out: str | None = None) -> dict[str, Any]:
    """Medians over 5 runs (1 with ``quick``) of killing ps:1, then ps:0 (which holds the catalog)."""
    rows = []
    for victim in ("ps:1", "ps:0"):
        runs = [_once(victim) for _ in range(1 if quick else 5)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("restart_s", "chief_s", "all_s")}
        rows.append({"victim": victim, "runs": len(runs), **med, "stop_over_restart": med["all_s"] / med["restart_s"]})
    result = {"bench": "recovery", "rows": rows}
    if json_out:
        write_jsonl(json_out, [result])
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [["killed", "runs", "shard serving again", "chief training", "all training", "stop / bare restart"]]
    for r in result["rows"]:
        lines.append([r["victim"] + (" (catalog)" if r["victim"] == "ps:0" else ""), str(r["runs"]),
                      f"{r['restart_s']:.2f} s", f"{r['chief_s']:.2f} s", f"{r['all_s']:.2f} s",
                      f"{r['stop_over_restart']:.2f}x"])
    return "\n".join(align(lines))


if __name__ == "__main__":
    script_main(__doc__, run, format_table)
