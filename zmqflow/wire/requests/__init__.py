"""Every op's request, declared once: the server validates a body against it at its edge, the
client builds its requests from it, and ``protocol/SPEC.md`` documents it (checked by a test).

``SERVICES[service][op]`` is the declaration of ``service.op``; ``OPEN`` marks the two ops that
take any map (``worker.echo``, ``worker.sink``). A request class is sent as the map of its fields
(defaults left off); see :mod:`.base` for the field types and limits.
"""

from . import cluster, ps
from .base import ArraySpec, Item, Request, Validator, compile_validator
from .cluster import OPEN

__all__ = ["SERVICES", "OPEN", "ArraySpec", "Item", "Request", "Validator", "compile_validator",
           "cluster", "ps", "declaration"]

SERVICES: dict[str, dict[str, type[Request]]] = {
    "master": cluster.MASTER,
    "worker": cluster.WORKER,
    "ps": ps.OPS,
    "catalog": cluster.CATALOG,
    "ring": cluster.RING,
}


def declaration(service: str, op: str) -> type[Request] | None:
    """The declaration of ``service.op``, or None for an op no built-in service has."""
    return SERVICES.get(service, {}).get(op)
