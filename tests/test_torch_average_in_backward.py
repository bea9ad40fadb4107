"""DistributedOptimizer(average_in_backward=True): backward returns with the averaged gradients,
as DDP's does; by default (as Horovod) the average waits for step() or synchronize()."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import zmqflow.torch as zt  # noqa: E402
from zmqflow.errors import ConfigError, InvalidArgument  # noqa: E402

from .conftest import launch_script  # noqa: E402


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


GPU_IN_BACKWARD = '''
import copy
import torch
import zmqflow.torch as zt

zt.init()
r = zt.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)).cuda()
alone = copy.deepcopy(model)  # the same weights, no hooks: each rank's own gradient
opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                              bucket_mb=1 / 1024, average_in_backward=True)
g = torch.Generator().manual_seed(10 + r)
x = torch.randn(5, 6, generator=g).cuda()
for step in range(2):
    opt.zero_grad()
    alone.zero_grad()
    model(x).pow(2).mean().backward()
    alone(x).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), alone.parameters()):
        mean = zt.allreduce(q.grad, zt.Sum) / 2
        assert p.grad.is_cuda and torch.allclose(p.grad, mean, rtol=1e-5, atol=1e-6), (step, name)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    with torch.no_grad():
        for p, q in zip(model.parameters(), alone.parameters()):
            q.copy_(p)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(zt.allreduce(flat, zt.Max), zt.allreduce(flat, zt.Min)), step
print(f"rank {r} gpu in backward done", flush=True)
zt.shutdown()
'''


def test_two_ranks_average_cuda_gradients_in_backward(procs, tmp_path):
    """On the GPU, the hook that starts the last bucket waits on autograd's device thread and sets
    the CUDA averages before backward returns; a clip right after acts on them on both ranks."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: averaging CUDA gradients in backward runs where torch.cuda.is_available()")
    pytest.importorskip("cupy", reason="cupy is needed to reduce CUDA tensors")
    p = launch_script(procs, tmp_path / "gpu_in_backward.py", GPU_IN_BACKWARD, workers=2)
    assert p.wait(100) == 0, p.output
    for r in (0, 1):
        p.wait_for_line(f"rank {r} gpu in backward done", 1)
