"""The ps's ledger of training sessions past its cap on named sessions: never done under a live one."""

from __future__ import annotations

from zmqflow.server.services.sessions import MAX_OPEN, SessionLedger
from zmqflow.testing import make_spec


def test_sessions_past_the_cap_are_counted_so_the_task_stays_unfinished_while_one_is_open():
    """A hello past MAX_OPEN was not recorded: once the recorded sessions said goodbye the ledger
    said done, and a ps with --exit-when-done exited under the live one."""
    ledger = SessionLedger(make_spec({"ps": 1, "worker": 1}))
    for i in range(MAX_OPEN):
        ledger.hello("worker:0", f"old{i}")
    assert ledger.hello("worker:0", "live")
    for i in range(MAX_OPEN):
        ledger.goodbye("worker:0", f"old{i}", finished=True)
    assert not ledger.done and ledger.waiting() == ["worker:0"]
    assert ledger.describe() == {"worker:0": {"open": 1, "finished": False}}
    ledger.goodbye("worker:0", "live", finished=True)
    assert ledger.done and ledger.describe() == {"worker:0": {"open": 0, "finished": True}}
