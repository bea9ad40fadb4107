"""Services hosted by every task (master, worker) and by ps tasks (ps)."""

from .master import MasterService, TaskRuntime
from .ps import PsService
from .worker import WorkerService

__all__ = ["MasterService", "PsService", "TaskRuntime", "WorkerService"]
