"""DistributedOptimizer(average_in_backward=True): backward returns with the averaged gradients,
as DDP's does; by default (as Horovod) the average waits for step() or synchronize()."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import zmqflow.torch as zt  # noqa: E402
from zmqflow.errors import ConfigError, InvalidArgument  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def test_by_default_backward_leaves_the_average_to_step_as_horovod(local):
    model = _model()
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    assert opt.buckets.in_flight and not opt.buckets.averaged and opt.buckets.wait_s == 0
    opt.step()


def test_average_in_backward_returns_with_the_average_as_ddp(local):
    """Gradients read after backward are averaged, step() sends nothing more, a second backward
    before step() is refused, and zero_grad() (the optimizer's or the model's) starts the next step."""
    model = _model()
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=1e-4,  # several buckets
                                  average_in_backward=True)
    assert len(opt.buckets.buckets) > 1
    x = torch.randn(4, 6)
    model(x).pow(2).sum().backward()
    assert opt.buckets.averaged and not opt.buckets.in_flight and opt.buckets.wait_s > 0
    with pytest.raises(InvalidArgument, match="computed 2 times before step"):
        model(x).pow(2).sum().backward()
    opt.zero_grad()  # allowed: nothing is in flight; the averaged gradients go
    assert not opt.buckets.averaged and all(p.grad is None for p in model.parameters())
    model(x).pow(2).sum().backward()
    sent = zt.collectives.ring().async_ring.seq
    opt.step()
    assert zt.collectives.ring().async_ring.seq == sent  # the average was backward's: step() started no allreduce
    opt.step()  # a second step without backward averages what .grad holds again, bucket by bucket
    assert zt.collectives.ring().async_ring.seq == sent + len(opt.buckets.buckets)
    # a step GradScaler skipped (inf found: no opt.step()) then model.zero_grad(): the next backward starts afresh
    model(x).pow(2).sum().backward()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    assert opt.buckets.averaged
    with pytest.raises(InvalidArgument, match="computed 2 times before step"):
        model(x).pow(2).sum().backward()  # accumulated onto the average: refused as before
    with pytest.raises(ConfigError, match="average_in_backward is for backend='ring'"):
        zt.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), backend="ps", average_in_backward=True)
