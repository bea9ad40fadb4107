"""The parameter-server shard service hosted by tasks of a ``ps`` job."""

from __future__ import annotations

from typing import Any

from ..rpc import CallContext, Service, op

__all__ = ["PsService"]


class PsService(Service):
    name = "ps"

    @op
    def status(self, ctx: CallContext) -> dict[str, Any]:
        return {"variables": 0, "bytes": 0}
