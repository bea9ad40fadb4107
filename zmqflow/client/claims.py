"""Creating the parts of a record this session holds the catalog's claim on, and giving it up.

The catalog hands the claim on a record that is not ready to one declarer at a time (the others
wait for the record to become ready). Its holder creates every part, then marks the record
ready. When a shard refuses a part (its own byte budget, a conflicting part: InvalidArgument,
ResourceExhausted, VariableConflict), the same declaration would fail every time: the holder
abandons the record, and the catalog drops the parts it made (only the catalog's task may), which
frees the name and what the record counted. When a shard is out (Unavailable, DeadlineExceeded), a retry may succeed: the record
and its parts stay, and the holder only gives the claim up, so the next declarer goes on at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ..errors import InvalidArgument, PermissionDenied, ProtocolError, ResourceExhausted, Unavailable, ZmqflowError
from ..wire.requests import cluster as crq
from .port import SessionPort

__all__ = ["REFUSALS", "MAX_HANDOVERS", "declare_claimed", "settle", "give_up"]

log = logging.getLogger(__name__)

# what a shard answers a create that would fail again as it is (VariableConflict is an InvalidArgument)
REFUSALS = (InvalidArgument, ResourceExhausted)
_BACKGROUND: set[asyncio.Task] = set()  # claims given up after their declaration was cancelled
# a declaration whose claim lapsed and passed on while it created parts declares again: this many times in all
MAX_HANDOVERS = 3
InfoT = TypeVar("InfoT")


async def declare_claimed(sess: SessionPort, what: str, name: str, request: crq.Declare,
                          info_of: Callable[[dict[str, Any]], InfoT],
                          create: Callable[[dict[str, Any], InfoT, str], Awaitable[bool]]) -> InfoT:
    """Declare ``request`` until its record is ready; its info (``info_of`` the record). While it
    is not, the catalog answers a declarer that holds the claim with the claim (the others wait
    there): ``create(record, info, claim)`` then makes the parts, as :func:`settle` does, and says
    whether the record became ready (else the claim passed on meanwhile: declare again). ``what``
    names the kind (variable, embedding) in errors."""
    for _ in range(MAX_HANDOVERS):
        record = await sess.call_catalog("declare", request)
        info = info_of(record)
        if record["ready"]:
            return info
        claim = record.get("claim")
        if not claim:
            raise ProtocolError(f"catalog.declare of {name!r} answered a record that is not ready without a claim")
        if await create(record, info, claim):
            return info
    raise Unavailable(f"{what} {name!r}: its claim passed to another declarer {MAX_HANDOVERS} times before it "
                      "became ready; declare it again", name=name)


async def settle(sess: SessionPort, name: str, claim: str, creates: Iterable[Awaitable[Any]],
                 then: Callable[[], Awaitable[Any]] | None = None) -> bool:
    """Run ``creates`` (every part of ``name``), then ``then`` (writing the value over parts a
    takeover found), and mark the record ready. True when it is; False when the claim passed to
    another declarer meanwhile (its lease lapsed): declare again to wait for that one. A failure
    is raised after the claim is given up: with the record dropped, and the parts this caller made
    with it, when every failure is a shard's refusal; else kept for a retry."""
    try:
        results = await asyncio.gather(*creates, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if not failed and then is not None:
            try:
                await then()
            except Exception as exc:  # classified below, as a create's failure is
                failed = [exc]
        if not failed:
            try:
                await sess.call_catalog("mark_ready", crq.MarkReady(name=name, claim=claim))
            except PermissionDenied:
                return False
            return True
    except asyncio.CancelledError:  # its caller stopped waiting: the next declarer need not wait for the lease
        _in_background(give_up(sess, name, claim, keep=True))
        raise
    interrupted = [f for f in failed if not isinstance(f, Exception)]
    if interrupted:  # a create cancelled: the record stays for a retry
        _in_background(give_up(sess, name, claim, keep=True))
        raise interrupted[0]
    refused = [f for f in failed if isinstance(f, REFUSALS)]
    if len(refused) == len(failed):
        await give_up(sess, name, claim, keep=False)
        raise refused[0]
    await give_up(sess, name, claim, keep=True)
    raise failed[0]


def _in_background(coro: Coroutine[Any, Any, Any]) -> None:
    """Run ``coro`` on the loop without waiting for it; kept referenced until it ends."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def give_up(sess: SessionPort, name: str, claim: str, *, keep: bool) -> None:
    """Abandon the claim (``keep``: the record stays); a catalog that does not answer lets the
    claim lapse with its lease instead, so this raises nothing of its own."""
    try:
        await sess.call_catalog("abandon", crq.Abandon(name=name, claim=claim, keep=keep))
    except ZmqflowError as exc:
        log.warning("could not give up the claim on %r (%s): it lapses with its lease", name, exc)

