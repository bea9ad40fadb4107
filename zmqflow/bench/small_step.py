"""A small model's training step through a ps shard process: a push and then a pull (two round
trips) beside ``push_pull``, whose pushes bring the rows back in their answers (one round trip).

For a model of a few KB the round trips are the step, not its bytes. Each row times both ways of
the same step of the same variables on the same shard in one run, alternating round by round:
a model of 4 float32 variables of the given size in all (``--vars N``: N of one size), through
``SyncReplicas(SGD)`` over one replica (``--async``: plain SGD; ``--optimizer``: another one with
its defaults at rate 0.01), one ``AsyncSession`` on this
process's loop, the shard a separate task server process on tcp loopback (or ipc).

    zmqflow bench step [--quick] [--kb 4,16,48,256,1000] [--vars N] [--transport tcp|ipc] [--async]
                       [--optimizer sgd|momentum|adagrad|adam] [--json FILE]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from .. import loop as zf_loop
from ..client.push_read import readable
from ..client.session import AsyncSession
from ..ports import free_port
from ..state import optim
from .procs import Child, plaintext, zf_keyed_task_process

__all__ = ["run", "format_table", "model_of", "SIZES_KB"]

SIZES_KB = (4, 16, 48, 256, 1000)  # every size reads back: under a shard's READ_BYTES (1 MiB)
OPTIMIZERS = {"sgd": optim.SGD, "momentum": optim.Momentum, "adagrad": optim.Adagrad, "adam": optim.Adam}


def model_of(kb: float, variables: int = 4) -> dict[str, np.ndarray]:
    """``variables`` float32 variables of ``kb`` KB in all (none empty: 160 bytes at least for 4,
    4 bytes a variable otherwise). Four are shaped as a small MLP's (two matrices, two biases);
    any other count are of one size, as the many layers of a deeper model, where what a step costs
    a variable counts more than its bytes."""
    n = max(40, int(kb * 1000 / 4))
    if variables != 4:
        return {f"v{i}": np.zeros((max(1, n // variables),), np.float32) for i in range(variables)}
    return {"w1": np.zeros((n * 6 // 10,), np.float32), "b1": np.zeros((n // 10,), np.float32),
            "w2": np.zeros((n * 2 // 10,), np.float32), "b2": np.zeros((n - n * 9 // 10,), np.float32)}


async def _us_per_step(step: Callable[[], Awaitable[Any]], steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        await step()
    return (time.perf_counter() - t0) / steps * 1e6


async def _row(sess: AsyncSession, kb: float, sync: bool, steps: int, rounds: int, variables: int,
               optimizer: str) -> dict[str, Any]:
    model = {f"{name}_{kb:g}": value for name, value in model_of(kb, variables).items()}
    base = OPTIMIZERS[optimizer](learning_rate=0.01)
    opt = optim.SyncReplicas(base, replicas_to_aggregate=1) if sync else base
    handles = [await sess.variable(name, value, optimizer=opt) for name, value in model.items()]
    grads = {name: np.full_like(value, 1e-3) for name, value in model.items()}
    read_back = readable({v.info: grads[v.name] for v in handles})  # else push_pull is a push, then a pull
    names = list(model)

    async def two() -> None:
        await sess.push(grads)
        await sess.pull(names)

    async def one() -> None:
        await sess.push_pull(grads)

    for _ in range(max(20, steps // 10)):  # warm-up: connections, caches
        await two()
        await one()
    times: dict[str, list[float]] = {"push_then_pull": [], "push_pull": []}
    for r in range(rounds):
        order = [("push_then_pull", two), ("push_pull", one)]
        for label, step in order if r % 2 == 0 else order[::-1]:
            times[label].append(await _us_per_step(step, steps))
    got, again = await sess.push_pull(grads), await sess.pull(names)
    if any(not np.array_equal(got[n], again[n]) for n in names):  # both ways measured the same step
        raise RuntimeError(f"push_pull of the {kb:g} KB model returned values a pull right after does not read")
    two_us, one_us = statistics.median(times["push_then_pull"]), statistics.median(times["push_pull"])
    return {"bench": "small_step", "model_kb": kb, "model_bytes": sum(v.nbytes for v in model.values()),
            "variables": len(model), "sync": sync, "optimizer": opt.spec(), "base_optimizer": optimizer,
            "read_back": read_back,
            "push_then_pull_us": two_us, "push_pull_us": one_us, "speedup": two_us / one_us,
            "rounds": rounds, "steps_per_round": steps}


async def _run(sizes: Sequence[float], sync: bool, steps: int, rounds: int, transport: str,
               variables: int, optimizer: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="zfstep-") as tmp:
        address = f"ipc://{tmp}/ps.sock" if transport == "ipc" else f"127.0.0.1:{free_port()}"
        spec = {"ps": [address]}
        with plaintext():
            child = Child(zf_keyed_task_process, (json.dumps(spec), "ps:0", ""), "ps shard")
            try:
                child.wait_ready()
                async with AsyncSession(cluster=spec, task="ps:0", timeout=30) as sess:
                    return [await _row(sess, kb, sync, steps, rounds, variables, optimizer)
                            | {"transport": transport} for kb in sizes]
            finally:
                child.stop()


def run(sizes: Sequence[float] = SIZES_KB, sync: bool = True, quick: bool = False, transport: str = "tcp",
        json_out: str | None = None, steps: int | None = None, rounds: int | None = None,
        variables: int = 4, optimizer: str = "sgd") -> list[dict[str, Any]]:
    """One row a model size (of ``variables`` variables, ``model_of``): microseconds a step each
    way (medians of ``rounds`` rounds of ``steps`` steps each way) and their ratio."""
    steps = steps or (200 if quick else 1000)
    rounds = rounds or (4 if quick else 8)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    rows = zf_loop.run(_run(sizes, sync, steps, rounds, transport, variables, optimizer))
    if json_out:
        with open(json_out, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| model | transport | optimizer | sync | read back in the push's answers | push, then pull (us) "
           "| push_pull (us) | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model_kb']:g} KB, {r['variables']} variables | {r['transport']} | {r['base_optimizer']} "
                   f"| {r['sync']} | "
                   f"{'yes' if r['read_back'] else 'no: too big'} | {r['push_then_pull_us']:.0f} | "
                   f"{r['push_pull_us']:.0f} | {r['speedup']:.2f}x |")
    return "\n".join(out)
