"""Every chief/worker task runs this under ``zmqflow launch``: wait for the cluster, then the
coordinator (the chief, else worker 0) prints the cluster's status and moves a tensor to every
other task and back, checking each byte, while the others serve until it tells them it is done.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import zmqflow as zf
from zmqflow.cli.launch import COMMAND_JOBS
from zmqflow.cli.status import format_status
from zmqflow.rpc import CallContext, Service, op


class DemoService(Service):
    """Lets the coordinator tell a worker that the demo is over."""

    name = "demo"

    def __init__(self) -> None:
        super().__init__()
        self.finished = threading.Event()

    @op
    def done(self, ctx: CallContext) -> bool:
        self.finished.set()
        return True


def coordinator(spec: zf.ClusterSpec) -> zf.TaskId:
    return zf.TaskId("chief", 0) if "chief:0" in spec else zf.TaskId("worker", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    demo = DemoService()
    with zf.Server.from_env(services={"demo": demo}) as server:
        server.wait_for_cluster(args.timeout)
        if server.task != coordinator(server.spec):
            if not demo.finished.wait(args.timeout):
                print(f"{server.task}: the coordinator did not finish within {args.timeout:g}s")
                return 1
            return 0
        rows = [dict(server.call(t, "master", "status"), reachable=True) for t in server.spec.tasks]
        for row in rows:
            row["address"] = str(server.spec.address(row["task"]))
        print(f"cluster of {len(server.spec)} tasks is up:\n{format_status(rows)}")
        x = np.random.default_rng(0).standard_normal(args.mib * (1 << 20) // 4).astype(np.float32)
        others = [t for t in server.spec.tasks if t != server.task]
        for task in others:
            start = time.perf_counter()
            back = server.call(task, "worker", "echo", {"x": x})["x"]
            took = time.perf_counter() - start
            if not np.array_equal(back, x):
                print(f"{task}: the tensor came back changed")
                return 1
            print(f"moved {args.mib} MiB to {task} and back in {took * 1e3:.1f} ms ({2 * x.nbytes / took / 1e9:.2f} GB/s), bytes identical")
        for task in others:
            if task.job in COMMAND_JOBS:
                server.call(task, "demo", "done")
        print("demo finished")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
