"""zmqflow.torch collectives: one rank in-process, two ranks as real processes, CUDA where present."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import zmqflow.torch as zt  # noqa: E402
from zmqflow.bridge import runtime  # noqa: E402
from zmqflow.errors import ConfigError, InvalidArgument  # noqa: E402
from zmqflow.torch.tensors import from_array, to_array  # noqa: E402

from .conftest import launch_script  # noqa: E402


def test_rank_before_init_is_a_clear_error():
    runtime.shutdown()
    with pytest.raises(ConfigError, match="not initialised"):
        zt.rank()


def test_cpu_tensors_are_numpy_views_both_ways():
    t = torch.arange(6, dtype=torch.float32)
    a = to_array(t)
    a[0] = 42.0
    assert t[0] == 42.0  # a view, not a copy
    back = from_array(a)
    assert back.data_ptr() == t.data_ptr()
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert str(to_array(bf).dtype) == "bfloat16" and torch.equal(from_array(to_array(bf)), bf)
    with pytest.raises(InvalidArgument, match="contiguous"):
        to_array(torch.zeros(3, 4).t())
    with pytest.raises(InvalidArgument, match="expected a torch.Tensor"):
        to_array(np.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_one_rank_collectives_keep_shape_dtype_and_values(local, dtype):
    x = (torch.arange(12) - 3).to(dtype).reshape(3, 4)
    for op in ("mean", "sum", "min", "max"):
        out = zt.allreduce(x, op=op)
        assert out.dtype == dtype and out.shape == x.shape and torch.equal(out, x)
        assert out.data_ptr() != x.data_ptr()  # a new tensor
    y = x.clone()
    assert zt.allreduce_(y, zt.Sum) is y and torch.equal(y, x)
    assert torch.equal(zt.allgather(x), x) and torch.equal(zt.broadcast(x, 0), x)
    assert torch.equal(zt.allreduce(x.t()), x.t())  # not contiguous: read through a copy


def test_one_rank_async_and_synchronize(local):
    x = torch.ones(5)
    h = zt.allreduce_async(x, zt.Sum)
    y = torch.full((3,), 2.0)
    h2 = zt.allreduce_async_(y)
    assert torch.equal(zt.synchronize(h), x)
    zt.synchronize()  # waits for h2 too
    assert h2.done() and torch.equal(y, torch.full((3,), 2.0))
    assert torch.equal(zt.allgather(torch.tensor(3.0)), torch.tensor([3.0]))  # 0-d counts as (1,)


def test_bad_arguments_are_refused_before_anything_moves(local):
    with pytest.raises(InvalidArgument, match="op must be one of"):
        zt.allreduce(torch.ones(2), op="prod")
    with pytest.raises(InvalidArgument, match="root must be a rank"):
        zt.broadcast(torch.ones(2), 3)
    with pytest.raises(InvalidArgument, match="cannot be sent"):
        zt.allreduce(torch.ones(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(InvalidArgument, match="'w' is a list"):
        zt.broadcast_parameters({"w": [1.0]})
    with pytest.raises(InvalidArgument, match="torch.optim.Optimizer"):
        zt.broadcast_optimizer_state(object())


def test_broadcast_parameters_and_optimizer_state_on_one_rank(local):
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    zt.broadcast_parameters(model.state_dict(), root_rank=0)
    zt.broadcast_parameters(model.named_parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    zt.broadcast_optimizer_state(opt)
    assert opt.state_dict()["state"][0]["step"] == 1
    assert zt.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}


def test_cuda_tensors_are_reduced_on_the_gpu(local):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU path (DLPack to cupy) runs where torch.cuda.is_available()")
    pytest.importorskip("cupy", reason="cupy is needed to reduce CUDA tensors")
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    out = zt.allreduce(x, zt.Sum)
    assert out.is_cuda and torch.equal(out, x)
    y = x.clone()
    zt.allreduce_(y)
    assert torch.equal(y, x)
    model = torch.nn.Linear(4, 2).cuda()
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(3, 4, device="cuda")).sum().backward()
    opt.step()
    assert all(p.grad.is_cuda for p in model.parameters())


TWO_RANKS = '''
import sys
import torch
import zmqflow.torch as zt
from zmqflow.errors import CollectiveMismatch

zt.init()
r, n = zt.rank(), zt.size()
assert n == 2 and zt.local_size() == 2 and zt.local_rank() == r
x = torch.full((3,), float(r + 1))
assert torch.equal(zt.allreduce(x, zt.Sum), torch.full((3,), 3.0))
assert torch.equal(zt.allreduce(x), torch.full((3,), 1.5))
assert torch.equal(zt.allreduce(x.to(torch.bfloat16), zt.Max), torch.full((3,), 2.0, dtype=torch.bfloat16))
assert torch.equal(zt.allreduce(torch.tensor([r * 5 + 1]), zt.Average), torch.tensor([3]))  # (1 + 6) / 2, truncated
y = x.clone(); zt.allreduce_(y, zt.Min); assert torch.equal(y, torch.ones(3))
h = zt.allreduce_async(torch.full((2, 2), float(r)), zt.Sum)
assert torch.equal(zt.synchronize(h), torch.ones(2, 2))
rows = torch.arange((r + 1) * 2, dtype=torch.float64).reshape(r + 1, 2) + 10 * r  # 1 row on rank 0, 2 on rank 1
g = zt.allgather(rows)
assert g.shape == (3, 2) and g.tolist() == [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]], g
assert torch.equal(zt.broadcast(torch.full((4,), float(r)), 1), torch.ones(4))

# differentiable, as Horovod's: every rank's loss reads the collective's result
x = torch.full((r + 1, 2), float(r + 1), requires_grad=True)  # 1 row on rank 0, 2 on rank 1
w = torch.arange(6, dtype=torch.float32).reshape(3, 2)
(zt.allgather(x) * w).sum().backward()  # each row's gradient: its w, from each of the 2 ranks
assert torch.equal(x.grad, 2 * w[:1] if r == 0 else 2 * w[1:]), x.grad
v = torch.tensor([float(r + 1)], requires_grad=True)
((r + 1) * zt.allreduce(v)).sum().backward()  # d/dv_r of (1 + 2) * mean(v): 3 / 2
assert torch.equal(v.grad, torch.tensor([1.5])), v.grad
b = torch.tensor([float(r)], requires_grad=True)
((r + 1) * zt.broadcast(b, 1)).sum().backward()  # all of it to the root, rank 1
assert torch.equal(b.grad, torch.tensor([3.0 if r == 1 else 0.0])), b.grad

torch.manual_seed(r)  # different initial values on each rank
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
zt.broadcast_parameters(model.state_dict(), root_rank=0)
total = torch.cat([v.double().reshape(-1) for v in model.state_dict().values()])
assert torch.equal(zt.allreduce(total, zt.Max), zt.allreduce(total, zt.Min))  # the same everywhere

opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
if r == 0:  # only rank 0 has state; rank 1 must get it, and its lr
    model.train(); model(torch.randn(5, 4)).sum().backward(); opt.step(); opt.step()
zt.broadcast_optimizer_state(opt, root_rank=0)
state = opt.state_dict()
assert state["param_groups"][0]["lr"] == 0.1 and float(state["state"][0]["step"]) == 2.0, state["param_groups"]
moments = torch.cat([s["exp_avg"].reshape(-1) for s in state["state"].values()]).double()
assert torch.equal(zt.allreduce(moments, zt.Max), zt.allreduce(moments, zt.Min))

for bad in (torch.ones(3 + r), torch.ones(3, dtype=torch.float32 if r else torch.float64)):
    try:
        zt.allreduce(bad)
    except CollectiveMismatch as exc:
        print(f"rank {r} mismatch: {exc}", flush=True)
    else:
        print(f"rank {r} no error", flush=True)
        sys.exit(1)
zt.barrier()
print(f"rank {r} done", flush=True)
zt.shutdown()
'''


def test_two_ranks_as_processes(procs, tmp_path):
    """Values, uneven allgather, parameter and optimizer-state broadcast, and tensors that differ
    across ranks (shape, dtype): CollectiveMismatch on both ranks, after which the ring still works."""
    p = launch_script(procs, tmp_path / "two.py", TWO_RANKS, workers=2)
    assert p.wait(100) == 0, p.output
    for r in (0, 1):
        mismatches = [line for line in p.output.splitlines() if f"rank {r} mismatch" in line]
        assert len(mismatches) == 2, p.output
        assert "element count" in mismatches[0] and "dtype" in mismatches[1], mismatches
        p.wait_for_line(f"rank {r} done", 1)


EXIT_WITHOUT_SHUTDOWN = '''
import torch
import zmqflow.torch as zt

zt.init()
zt.allreduce(torch.ones(3))
raise SystemExit(3)  # no zt.shutdown(): the exit hook stops the server before the interpreter goes
'''


def test_a_rank_that_exits_without_shutdown_exits_cleanly(procs, tmp_path):
    """Left serving into interpreter teardown, a rank whose peer had gone crashed (SIGSEGV, most runs)."""
    p = launch_script(procs, tmp_path / "bye.py", EXIT_WITHOUT_SHUTDOWN, workers=2)
    assert p.wait(100) in (1, 3), p.output
    for task in ("worker:0", "worker:1"):
        # 3: its own exit; 1: it was still waiting for the other's last acknowledgement (Unavailable),
        # the race zt.shutdown()'s barrier exists for
        line = p.wait_for_line(f"{task} exited with code", 1)
        assert line.endswith(("code 3", "code 1")), p.output


GPU_OPTIMIZER = '''
import torch
import zmqflow.torch as zt

zt.init()
r = zt.rank()
torch.manual_seed(0)  # the same start on both ranks
model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)).cuda()
extra = torch.nn.Linear(3, 2).cuda()  # used on rank 1 only: rank 0 contributes zeros
idle = torch.nn.Linear(2, 2).cuda()  # used on no rank: keeps no gradient and does not move
named = [*model.named_parameters(), *(("extra." + n, p) for n, p in extra.named_parameters()),
         *(("idle." + n, p) for n, p in idle.named_parameters())]
start = [p.detach().clone() for _, p in named]
# buckets of about 1 KB: several in flight from backward, each fused on the GPU with its flags
opt = zt.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.5), named, bucket_mb=1 / 1024)
g = torch.Generator().manual_seed(10 + r)
x, y = torch.randn(5, 6, generator=g).cuda(), torch.randn(5, 3, generator=g).cuda()
for step in range(2):
    out = model(x)
    loss = torch.nn.functional.mse_loss(out, y) + (extra(out).pow(2).sum() if r == 1 else 0)
    opt.zero_grad()
    loss.backward()
    local = [None if p.grad is None else p.grad.detach().clone() for _, p in named]
    opt.step()
    for (name, p), mine, before in zip(named, local, start):
        if name.startswith("idle."):
            assert p.grad is None and torch.equal(p, before), name
            continue
        mine = torch.zeros_like(p) if mine is None else mine
        mean = zt.allreduce(mine, zt.Sum) / 2  # each rank's own gradient, averaged here by hand
        assert p.grad.is_cuda and torch.allclose(p.grad, mean, rtol=1e-6, atol=1e-7), (step, name)
        assert torch.allclose(p, before - 0.5 * mean, rtol=1e-6, atol=1e-6), (step, name)
    start = [p.detach().clone() for _, p in named]
print(f"rank {r} gpu optimizer done", flush=True)
zt.shutdown()
'''


def test_two_ranks_average_cuda_gradients_in_several_buckets(procs, tmp_path):
    """The CUDA step across processes: gradients fused on the GPU bucket by bucket, flags that
    tell a gradient one rank lacks (zeros) from one no rank has (None), the step on the mean."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU optimizer across ranks runs where torch.cuda.is_available()")
    pytest.importorskip("cupy", reason="cupy is needed to reduce CUDA tensors")
    p = launch_script(procs, tmp_path / "gpu_opt.py", GPU_OPTIMIZER, workers=2)
    assert p.wait(100) == 0, p.output
    for r in (0, 1):
        p.wait_for_line(f"rank {r} gpu optimizer done", 1)


CLIP_AFTER_BACKWARD = '''
import torch
import zmqflow.torch as zt
from zmqflow.errors import InvalidArgument

zt.init()
r = zt.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
plain = [p.detach().clone() for p in model.parameters()]
opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                              bucket_mb=0.02, average_in_backward=True)
g = torch.Generator().manual_seed(r)
x = torch.randn(16, 64, generator=g) * (1 + 10 * r)  # rank 1's gradients are far larger
for step in range(2):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    # as under DDP: backward returned with the averaged gradients, so this clips the average
    averaged = [p.grad.clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    scale = min(1.0, 0.1 / (float(norm) + 1e-6))
    opt.step()
    for p, before, avg in zip(model.parameters(), plain, averaged):
        assert torch.allclose(p, before - 0.5 * scale * avg, rtol=1e-5, atol=1e-6), step
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(zt.allreduce(mine, zt.Max), zt.allreduce(mine, zt.Min))  # the same on both ranks
    plain = [p.detach().clone() for p in model.parameters()]

# a parameter rank 1 leaves unused: its backward cannot average as rank 0's did, so its step refuses
aux = torch.nn.Linear(4, 1)
opt.remove_hooks()
opt = zt.DistributedOptimizer(torch.optim.SGD([*model.parameters(), *aux.parameters()], lr=0.5),
                              [*model.named_parameters(), *(("aux." + n, p) for n, p in aux.named_parameters())],
                              bucket_mb=0.02, average_in_backward=True)
out = model(x)
(out.pow(2).mean() + (aux(out).sum() if r == 0 else 0)).backward()
try:
    opt.step()
except InvalidArgument as exc:
    assert r == 1 and "'aux.bias', 'aux.weight' got no gradient in this step on this rank" in str(exc), exc
    print(f"rank {r} refused", flush=True)
else:
    assert r == 0
zt.barrier()
print(f"rank {r} clip done", flush=True)
zt.shutdown()
'''


def test_clipping_right_after_backward_clips_the_average_on_every_rank(procs, tmp_path):
    """DDP-style code (backward, clip_grad_norm_, step) under average_in_backward clips the averaged
    gradients: backward waits for its buckets, so the clip neither acts on a rank's own gradients
    nor races the ring reading them; a rank that leaves a parameter unused refuses at step()."""
    p = launch_script(procs, tmp_path / "clip.py", CLIP_AFTER_BACKWARD, workers=2)
    assert p.wait(100) == 0, p.output
    for r in (0, 1):
        p.wait_for_line(f"rank {r} clip done", 1)
    assert "rank 1 refused" in p.output and "rank 0 refused" not in p.output
