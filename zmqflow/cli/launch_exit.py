"""ps tasks under ``zmqflow launch`` exit by themselves once training is over.

With a command, launch starts its ps tasks with ``ZMQFLOW_EXIT_WHEN_DONE=1`` (unless
``--no-ps-exit-when-done``): each exits 0 once every chief and worker said a finished goodbye
(the bridge runtime and ``MonitoredTrainingSession`` do). When the commands have ended, launch
asks each ps still running whether it is stopping: those that are get :data:`EXIT_GRACE` to
exit by themselves; the others (a command that never opened a training session) are stopped
with SIGTERM at once, as before.
"""

from __future__ import annotations

import asyncio
import subprocess

from ..cluster import ClusterSpec, TaskId
from ..errors import ConfigError
from ..loop import run
from ..rpc.health import probe
from ..transport.curve import Keys, keys_from
from .probe_client import probe_client

__all__ = ["ENV", "EXIT_GRACE", "exit_env", "stopping", "let_finish"]

ENV = "ZMQFLOW_EXIT_WHEN_DONE"
EXIT_GRACE = 10.0  # a ps that said it is stopping has this long to be gone
_ASK_TIMEOUT = 2.0


def exit_env(task: TaskId, serves: bool, on: bool) -> dict[str, str]:
    """What to add to a task's environment: the flag for a ps task that serves, when on."""
    return {ENV: "1"} if on and serves and task.job == "ps" else {}


def stopping(spec: ClusterSpec, tasks: list[TaskId], keys: str | None) -> set[TaskId]:
    """Those of ``tasks`` that are stopping by themselves now, or already gone."""
    if not tasks:
        return set()
    try:
        loaded = keys_from(keys, env={})
    except ConfigError:
        return set()
    replies = run(_ask(spec, tasks, loaded))
    # an answer that is no map (whatever serves at that address) is not a ps stopping: SIGTERM, as before
    return {t for t, reply in zip(tasks, replies)
            if reply is None or (isinstance(reply, dict) and reply.get("stopping"))}


async def _ask(spec: ClusterSpec, tasks: list[TaskId], keys: Keys | None) -> list[object]:
    if keys is not None:
        keys.learn(spec)
    client = probe_client("launch", _ASK_TIMEOUT, keys)  # a ping's answer is small: no 4 GiB frames
    try:
        return list(await asyncio.gather(*(probe(client, spec, t, _ASK_TIMEOUT) for t in tasks)))
    finally:
        client.close()


def let_finish(procs: dict[TaskId, subprocess.Popen], spec: ClusterSpec, keys: str | None) -> None:
    """Give each ps that is stopping by itself the time to exit; the caller stops what is left."""
    running = {t: p for t, p in procs.items() if t.job == "ps" and p.poll() is None}
    for task in stopping(spec, list(running), keys):
        try:
            running[task].wait(EXIT_GRACE)
        except subprocess.TimeoutExpired:
            pass
