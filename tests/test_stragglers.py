"""The straggler report: the detector on synthetic rounds, and real runs that name a slow worker."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zmqflow.errors import InvalidArgument
from zmqflow.observe import metrics, stragglers
from zmqflow.observe.stragglers import Rounds, StragglerDetector

from .conftest import ZMQFLOW

jitter = st.floats(min_value=0.0, max_value=0.02, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(jitter, min_size=3, max_size=12), min_size=1, max_size=30), st.floats(0, 1e6))
def test_equals_with_jitter_below_the_floor_are_never_named(rounds, base):
    d = StragglerDetector("t", floor_s=0.05, hits=1)
    for times in rounds:
        assert d.observe({f"w{i}": base + t for i, t in enumerate(times)}) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(jitter, min_size=2, max_size=12), st.floats(0.2, 5.0), st.integers(0, 11), st.integers(1, 6))
@example([0.02, 0.0], 1.4827420935639664, 0, 1)  # the lag lands on the bound, plus a rounding of the sums
def test_one_member_well_behind_is_named_after_hits_rounds(times, lag, which, hits):
    which %= len(times)
    d = StragglerDetector("t", floor_s=0.1, hits=hits)
    arrivals = {f"w{i}": 100.0 + t + (lag if i == which else 0.0) for i, t in enumerate(times)}
    found = [d.observe(arrivals, at=100.0 + k) for k in range(hits)]
    assert found[:-1] == [None] * (hits - 1)
    last = found[-1]
    assert last is not None and last.task == f"w{which}" and last.members == len(times)
    # its lag is measured against the median (for two: against the other), so within the jitter of ``lag``
    # (arrivals are sums near 100 s: their rounding, ~1e-14 s, may carry the lag just past the jitter)
    assert lag - 0.02 - 1e-9 <= last.lag_s <= lag + 0.02 + 1e-9


def test_one_slow_round_names_no_one_and_old_rounds_expire():
    d = StragglerDetector("t", floor_s=0.1, hits=3, horizon_s=10.0)
    slow = {"a": 0.0, "b": 0.01, "c": 0.5}
    even = {"a": 0.0, "b": 0.01, "c": 0.02}
    assert d.observe(slow, at=0.0) is None
    for k in range(20):  # rounds in which no one is behind (later buckets of a step) do not dilute
        assert d.observe(even, at=1.0 + k * 0.01) is None
    assert d.observe(slow, at=2.0) is None
    assert d.observe(slow, at=3.0).task == "c"
    d2 = StragglerDetector("t", floor_s=0.1, hits=3, horizon_s=10.0)
    for at in (0.0, 20.0, 40.0):  # three slow rounds, but never three within the horizon
        assert d2.observe(slow, at=at) is None


def test_the_spread_raises_the_bar_and_thresholds_are_checked():
    d = StragglerDetector("t", factor=4.0, floor_s=0.01, hits=1)
    # noisy members (MAD 0.1 s): 0.3 s behind the median is not "well behind"
    assert d.observe({"a": 0.0, "b": 0.1, "c": 0.2, "d": 0.3, "e": 0.5}) is None
    assert d.observe({"a": 0.0, "b": 0.1, "c": 0.2, "d": 0.3, "e": 2.0}).task == "e"
    assert d.observe({"a": 0.0}) is None  # alone: nothing to compare with
    with pytest.raises(InvalidArgument, match="hits"):
        StragglerDetector("t", hits=0)
    with pytest.raises(InvalidArgument, match="floor_s=-1"):
        StragglerDetector("t", floor_s=-1)


def test_rounds_report_to_the_log_rate_limited_and_to_subscribers(caplog):
    clock = [0.0]
    rounds = Rounds(StragglerDetector("unit", floor_s=0.1, hits=2), clock=lambda: clock[0])
    got = []

    def record_straggler(source: str, task: str, lag_s: float) -> None:
        got.append((source, task, round(lag_s, 3)))

    stragglers.subscribe(record_straggler)
    try:
        with caplog.at_level(logging.WARNING, logger="zmqflow.observe.stragglers"):
            for step in range(4):
                for task, t in (("w0", 0.0), ("w1", 0.01), ("w2", 0.5)):
                    clock[0] = step * 10 + t
                    rounds.arrive(step, task)
                rounds.arrive(step - 1, "late")  # a closed round: ignored
                rounds.close(step)
    finally:
        stragglers.unsubscribe(record_straggler)
    assert got == [("unit", "w2", 0.49)] * 3  # from the second round on: every round it holds
    # and Prometheus: the metrics module subscribes the process's recorder
    assert metrics.HUB.registry.get_sample_value("zmqflow_straggler_total", {"source": "unit", "task": "w2"}) >= 3
    assert metrics.HUB.registry.get_sample_value("zmqflow_straggler_lag_seconds",
                                                 {"source": "unit", "task": "w2"}) == pytest.approx(0.49, abs=1e-6)
    lines = [r.getMessage() for r in caplog.records if "straggler in unit" in r.getMessage()]
    assert len(lines) == 1, lines  # the log says it once per REPORT_EVERY_S
    assert "w2 is 0.490 s behind the median of 3 members" in lines[0]


def _launch(procs, tmp_path, script: str, workers: int, ps: int):
    path = tmp_path / "train.py"
    path.write_text(script)
    return procs([*ZMQFLOW, "launch", "--workers", str(workers), "--ps", str(ps), "--", sys.executable, str(path)])


SYNC_PS = textwrap.dedent(
    """
    import os, time, numpy as np, zmqflow as zf
    slow = os.environ["ZMQFLOW_TASK"] == "worker:2"
    with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(sync=True), hooks=[zf.StopAtStep(16)],
                                     progress=False) as mon:
        mon.create({"w": np.zeros(4)}, optimizer=zf.optim.SGD(0.1))
        while not mon.should_stop():
            mon.params()
            if slow:
                time.sleep(0.3)
            mon.apply({"w": np.ones(4)})
    print("finished", flush=True)
    """
)


def test_sync_ps_names_the_worker_that_holds_every_step_up(tmp_path, procs):
    p = _launch(procs, tmp_path, SYNC_PS, workers=3, ps=1)
    line = p.wait_for_line("straggler in sync ps", 90)
    assert "worker:2 is" in line and "behind the median of 3 members" in line, line
    assert "[ps:0]" in line
    assert p.wait(90) == 0, p.output
    assert "straggler in sync ps: worker:0" not in p.output and "straggler in sync ps: worker:1" not in p.output


RING = textwrap.dedent(
    """
    import os, time, numpy as np
    from zmqflow.bridge import runtime
    rt = runtime.init(timeout=30)
    for step in range(14):
        if rt.rank == 1:
            time.sleep(0.3)
        rt.ring.allreduce(np.ones(256, np.float32))  # small: every rank hears every other directly
        rt.ring.allreduce(np.ones(400_000, np.float32))  # the ring: the right neighbour sees the wait
    print("finished", flush=True)
    runtime.shutdown()
    """
)


def test_the_ring_names_the_rank_that_holds_it_up(tmp_path, procs):
    p = _launch(procs, tmp_path, RING, workers=3, ps=0)
    line = p.wait_for_line("straggler in ring 'default'", 90)
    assert "worker:1 is" in line, line
    assert p.wait(90) == 0, p.output
    named = {w for w in ("worker:0", "worker:1", "worker:2") if f"straggler in ring 'default': {w} is" in p.output}
    assert named == {"worker:1"}, p.output
