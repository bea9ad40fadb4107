"""Who may call what, with keys: the one table of the ops a client key may call.

With CurveZMQ keys every caller is a ``task`` (a key of the cluster's tasks) or a ``client`` (the
client key). Task keys may call every op. Client keys may read, write and train: the ops listed
here, per service; everything else (fencing, sweeping and restoring shards, saving checkpoints,
ring membership and deposits) answers ``PermissionDenied`` before any handler runs. An op not in
the table is task-only, so a new op is closed until someone decides otherwise here. A service
outside zmqflow opens ops to clients with a ``client_ops`` class attribute. Without keys every
caller counts as a task, as before.

Stopping a task (``master.shutdown``, what ``zmqflow stop`` calls) is open to every admitted key,
client keys included, by decision: every key in the allow-list belongs to an operator of this
cluster or to one of its tasks, and a client key may already overwrite or zero every variable,
which ruins a run as surely as stopping it; the operator's own tool uses the client key. A key not
in the allow-list never gets a message through (ZAP refuses the handshake), so it stops nothing.
The training sessions' ``master.hello``/``master.goodbye`` (which let a ps task exit when
training is over) stay task-only: they count for the caller's task, and a client is none.

The identity a call comes from (the sync replica that pushes, the ring member that joins) is the
authenticated key's name, not a field the caller fills in: :func:`authorize` puts it in the
``CallContext`` and refuses a request whose header claims another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import PermissionDenied
from ..transport.curve import CLIENT, TASK

__all__ = ["TASK", "CLIENT", "CLIENT_OPS", "client_ops", "authorize"]

_READ_STATUS = frozenset({"ping", "status"})

CLIENT_OPS: Mapping[str, frozenset[str]] = {
    "master": _READ_STATUS | {"cluster", "wait_for_cluster", "shutdown"},  # shutdown: any admitted key (above)
    "worker": frozenset({"ping", "echo", "sink", "run"}),  # run: within the task's own allow-list of functions
    "catalog": frozenset({"ping", "declare", "mark_ready", "abandon", "lookup", "uninitialized", "records"}),
    "ps": _READ_STATUS | {"global_step", "variables", "create", "pull", "assign", "scatter", "push",
                          "bulk_offer", "pull_bulk", "push_bulk",
                          "emb_create", "emb_lookup", "emb_push", "emb_lookup_many", "emb_push_many", "emb_stats",
                          "emb_export"},
    "ring": _READ_STATUS,
}
# Task-only, by decision (for the record; anything unlisted above is task-only anyway):
# ps.fence, ps.unfence, ps.sweep, ps.drop (the catalog's, for a declarer that abandons), ps.restore_part,
# ps.emb_restore, ps.emb_evict, ps.save, ps.emb_export_delta,
# ring.join, ring.deposit, ring.abort, ring.leave, master.hello, master.goodbye.


def client_ops(service: Any) -> frozenset[str]:
    """The ops of ``service`` a client key may call: its ``client_ops`` attribute, else the table."""
    own = getattr(service, "client_ops", None)
    if own is not None:
        return frozenset(own)
    return CLIENT_OPS.get(getattr(service, "name", ""), frozenset({"ping"}))


def authorize(ctx: Any, user: str, allowed: frozenset[str]) -> None:
    """Fill ``ctx`` from the ZAP handler's user id (``role/name``) and refuse what the key may not
    do: an op outside ``allowed`` for a client, or a header claiming another name than the key's.
    A shared task key (empty name) proves the role only; the header's source stands."""
    role, _, name = user.partition("/")
    if role not in (TASK, CLIENT):
        raise PermissionDenied(f"{ctx.service}.{ctx.op}: unknown role {role!r}")
    ctx.role = role
    if name:
        if ctx.source and ctx.source != name:
            raise PermissionDenied(f"{ctx.service}.{ctx.op}: the request claims to come from {ctx.source!r} "
                                   f"but its key is {role} {name!r}")
        ctx.source = name
        ctx.verified = True
    if role != TASK and ctx.op not in allowed:
        raise PermissionDenied(f"{ctx.service}.{ctx.op} needs a task key; the caller presented {role} key "
                               f"{name!r}", op=f"{ctx.service}.{ctx.op}")
