"""A worker of the cluster benchmark: ``python -m zmqflow.bench.netns.worker SPEC NAME MODEL_BYTES NVARS``.

It declares the model's variables (get-or-create, so every worker may), warms up with one pull
and push, prints one JSON line ``{"ready": ..., "shard_bytes": {task: bytes}}`` and then obeys
JSON lines on stdin: ``{"run": SECONDS, "step": STEP}`` starts rounds at once until SECONDS have
passed, and answers ``{"rounds": [[t0, t1, t2], ...], "phase_bytes": N}`` (``time.monotonic`` is
one clock for every namespace of the machine, so the runner lines the workers up). A round of
STEP ``pull-push`` pulls every variable, then pushes a gradient for every variable (as ``zmqflow
bench ps`` does; t1 between the two); one of ``push-pull`` is one ``Session.push_pull``, the two
overlapped (t1 = t0). EOF on stdin ends it, so a worker
never outlives its runner.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

from ... import loop as zf_loop
from ...client.session import AsyncSession
from ...transport.memory import keep_big_blocks

__all__ = ["main"]


def _say(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def _work(spec_json: str, name: str, model_bytes: int, nvars: int) -> None:
    per_var = max(1, model_bytes // nvars // 4)
    names = [f"v{i}" for i in range(nvars)]
    grads = {n: np.ones(per_var, np.float32) for n in names}
    phase_bytes = per_var * 4 * nvars
    loop = asyncio.get_running_loop()
    async with AsyncSession(cluster=json.loads(spec_json), task="ps:0", timeout=120, name=name) as sess:
        await sess.wait_for_cluster(60)
        shard_bytes: dict[str, int] = {}
        for n in names:
            var = await sess.variable(n, shape=(per_var,))
            for task, first, end in var.info.parts:
                shard_bytes[str(task)] = shard_bytes.get(str(task), 0) + (end - first) * var.info.row_bytes
        await sess.pull(names)  # warm up connections and pages
        await sess.push(grads)
        _say({"ready": name, "shard_bytes": shard_bytes, "phase_bytes": phase_bytes})
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            order = json.loads(line)
            seconds, overlapped = float(order["run"]), order.get("step") == "push-pull"
            rounds = []
            stop = time.monotonic() + seconds
            while (t0 := time.monotonic()) < stop:
                if overlapped:
                    await sess.push_pull(grads)
                    rounds.append((t0, t0, time.monotonic()))
                    continue
                await sess.pull(names)
                t1 = time.monotonic()
                await sess.push(grads)
                rounds.append((t0, t1, time.monotonic()))
            _say({"rounds": rounds, "phase_bytes": phase_bytes})


def main(argv: list[str]) -> None:
    spec_json, name, model_bytes, nvars = argv
    keep_big_blocks()  # the allocator `zmqflow serve` uses
    zf_loop.run(_work(spec_json, name, int(model_bytes), int(nvars)))


if __name__ == "__main__":
    main(sys.argv[1:])
