"""The one-loop call-path benchmark runs and reports real times (the channel floor below the RPC)."""

from __future__ import annotations

import math

import pytest

from zmqflow.bench.transport.one_loop import channel_round_trip, main, rpc_costs
from zmqflow.loop import run

pytestmark = pytest.mark.timeout(60)


def test_rpc_costs_more_than_the_channels_alone() -> None:
    rt, call = run(rpc_costs(300))
    floor = run(channel_round_trip(300))
    assert all(math.isfinite(x) and x > 0 for x in (rt, call, floor))
    assert rt > floor  # the RPC round trip includes the channel's, plus codec and dispatch


def test_main_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--calls", "200"])
    main(["--calls", "200", "--channel-only"])
    out = capsys.readouterr().out
    assert "us per round trip" in out and "channel echo" in out
