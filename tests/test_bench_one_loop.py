"""The one-loop call-path benchmark runs and reports real times (the channel floor below the RPC)."""

from __future__ import annotations

import math

import pytest

from zmqflow.bench.transport.one_loop import channel_round_trip, main, ps_update, python_steps, rpc_costs
from zmqflow.loop import run

pytestmark = pytest.mark.timeout(60)


def test_rpc_costs_more_than_the_channels_alone() -> None:
    rt, call = run(rpc_costs(300))
    floor = run(channel_round_trip(300))
    assert all(math.isfinite(x) and x > 0 for x in (rt, call, floor))
    assert rt > floor  # the RPC round trip includes the channel's, plus codec and dispatch


def test_a_ps_update_costs_more_than_an_echo() -> None:
    """The scalar update adds the session, the op's declaration and the shard's write to the call."""
    update = run(ps_update(300))
    rt, _ = run(rpc_costs(300))
    assert math.isfinite(update) and update > 0
    assert update > rt * 0.8  # not less than most of a bare call: it is one, and more


def test_python_steps_are_counted_the_same_every_time() -> None:
    """The bytecode count is deterministic: two counts of the same path agree closely (the
    dedup ring and the deadline heap's rebuilds vary by a few bytecodes an op), and an update,
    which is an echo's path and more, executes more of them."""
    first, second = run(python_steps(200)), run(python_steps(200))
    for name in ("echo", "assign_add"):
        (ops1, calls1), (ops2, calls2) = first[name], second[name]
        assert ops1 > 100 and calls1 > 5
        assert abs(ops1 - ops2) <= 0.02 * ops1 and abs(calls1 - calls2) <= 0.05 * calls1
    assert first["assign_add"][0] > first["echo"][0]


def test_main_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--calls", "200"])
    main(["--calls", "200", "--channel-only"])
    main(["--calls", "200", "--ps"])
    main(["--calls", "200", "--opcodes"])
    out = capsys.readouterr().out
    assert "us per round trip" in out and "channel echo" in out and "us per update" in out
    assert "Python bytecodes" in out
