"""The worker service. For now: diagnostics that move tensors (echo, sink) for tests and benchmarks."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..rpc import CallContext, Service, op

__all__ = ["WorkerService"]


class WorkerService(Service):
    name = "worker"

    @op
    def echo(self, ctx: CallContext, **values: Any) -> dict[str, Any]:
        """Return the arguments as received; arrays go back zero-copy from the received frames."""
        return values

    @op
    def sink(self, ctx: CallContext, **values: Any) -> int:
        """Swallow the arguments and answer with the number of tensor bytes received."""
        return sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))
