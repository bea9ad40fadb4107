"""A training task's hello and goodbye to the ps tasks, so a ps can exit once training is over.

The bridge runtime and ``MonitoredTrainingSession`` say hello when they open and goodbye when
they close; a ps task started with ``--exit-when-done`` stops once every chief and worker task
has said a ``finished`` goodbye (the rule is in ``zmqflow/server/services/sessions.py``). Both
are best effort: a ps that is down or slow costs at most ``timeout`` and a line in the debug
log, and a hello that never arrived only means that ps keeps serving (the safe side).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from typing import TYPE_CHECKING

from ..cluster import ClusterSpec, TaskId
from ..errors import ZmqflowError
from ..server.services.sessions import TRAINING_JOBS
from ..wire.requests import cluster as crq

if TYPE_CHECKING:
    from .blocking import Session

__all__ = ["Presence", "TRAINING_JOBS"]

log = logging.getLogger("zmqflow.client")

TIMEOUT = 5.0


class Presence:
    """One training session's presence on the cluster's ps tasks (none for other jobs)."""

    def __init__(self, session: "Session", spec: ClusterSpec, task: TaskId, timeout: float = TIMEOUT):
        self.session = session
        self.id = uuid.uuid4().hex[:16]
        self.timeout = timeout
        self.targets = [t for t in spec.tasks if t.job == "ps"] if task.job in TRAINING_JOBS else []
        self._hello: concurrent.futures.Future[None] | None = None
        self._gone = False

    async def _tell(self, op: str, body: object) -> None:
        calls = [self.session.async_session.call("master", op, body, task=t, timeout=self.timeout)
                 for t in self.targets]
        for task, result in zip(self.targets, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(result, ZmqflowError):
                log.debug("%s to %s: %s", op, task, result)
            elif isinstance(result, BaseException):
                raise result

    def hello(self) -> None:
        """Announce the session, without waiting (the first goodbye waits for it)."""
        if self.targets and self._hello is None:
            self._hello = self.session.submit(self._tell("hello", crq.Hello(session=self.id)))

    def goodbye(self, finished: bool) -> None:
        """Say the session closed (once); ``finished``: training ended cleanly, not by a failure."""
        if not self.targets or self._hello is None or self._gone:
            return
        self._gone = True
        try:
            self._hello.result(self.timeout + 1)
            self.session.run_on_loop(self._tell("goodbye", crq.Goodbye(session=self.id, finished=finished)),
                                     self.timeout + 1)
        except Exception as exc:  # best effort, often at exit: a goodbye never raises
            log.debug("goodbye to the ps tasks ended with %s", exc)
