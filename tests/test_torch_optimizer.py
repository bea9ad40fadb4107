"""DistributedOptimizer: ring buckets overlapped with backward, and dense parameters on ps shards.

The key check runs real processes under ``zmqflow launch``: two ranks, each on half of every
batch, must end bit-for-bit equal to each other and equal (to float32 rounding) to one process
training on the whole batch with the plain optimizer.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import zmqflow.torch as zt  # noqa: E402
from zmqflow.bridge import runtime  # noqa: E402
from zmqflow.errors import ConfigError, InvalidArgument, VariableConflict  # noqa: E402
from zmqflow.torch.buckets import GradientBuckets, plan_buckets  # noqa: E402

from .conftest import launch_script  # noqa: E402

# Shared by the launched script and the single-process reference: the same model, data and steps.
TRAIN = '''
import torch

STEPS, BATCH = 6, 32


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def train(model, opt, rank=0, size=1):
    for x, y in batches():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.chunk(size)[rank]), y.chunk(size)[rank])
        loss.backward()
        opt.step()
    return model
'''

SCRIPT = TRAIN + '''
import os, sys
import zmqflow.torch as zt

out = sys.argv[1]
zt.init()
for backend in ("ring", "ps"):
    for kind in ("sgd", "adam"):
        model = make_model()
        named = [(f"{kind}.{n}", p) for n, p in model.named_parameters()]  # ps variables: one set per run
        opt = zt.DistributedOptimizer(make_opt(kind, model.parameters()), named, backend=backend, bucket_mb=0.001)
        train(model, opt, zt.rank(), zt.size())
        torch.save(model.state_dict(), os.path.join(out, f"{backend}-{kind}-{zt.rank()}.pt"))
print("trained", zt.rank(), flush=True)
zt.shutdown()
'''


def _reference(kind: str) -> dict:
    ns: dict = {}
    exec(TRAIN, ns)
    model = ns["make_model"]()
    return ns["train"](model, ns["make_opt"](kind, model.parameters())).state_dict()


def _tolerance(backend: str, kind: str) -> dict:
    """torch.testing's float32 defaults, except for Adam on the ps shards: their Adam adds eps before
    the bias correction (TF's form), an eps in effect 32x torch's at step 1 (sqrt(1 - 0.999) = 1/32),
    which shrinks the first updates of gradients within ~100x of it by up to a few percent (2.3% of
    one step measured here). 5e-4 is 5% of one step at lr=0.01."""
    return {"atol": 5e-4, "rtol": 1e-4} if (backend, kind) == ("ps", "adam") else {}


def test_two_ranks_on_half_batches_match_one_process_on_whole_batches(procs, tmp_path):
    """Ring (buckets of 1 KB: several in flight) and sync ps, SGD with momentum and Adam."""
    p = launch_script(procs, tmp_path / "train.py", SCRIPT, tmp_path, workers=2, ps=1)
    assert p.wait(110) == 0, p.output
    for backend in ("ring", "ps"):
        for kind in ("sgd", "adam"):
            ranks = [torch.load(tmp_path / f"{backend}-{kind}-{r}.pt") for r in range(2)]
            for name, value in _reference(kind).items():
                # ring: every rank gets the same averaged bytes; ps: both pulled the shards' values
                assert torch.equal(ranks[0][name], ranks[1][name]), (backend, kind, name)
                torch.testing.assert_close(ranks[0][name], value, msg=lambda m: f"{backend} {kind} {name}: {m}",
                                           **_tolerance(backend, kind))


# in-process: one rank ---------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _step(model, opt, seed, closure=False):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)

    def loss_fn():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    if closure:
        return opt.step(loss_fn)
    loss_fn()
    opt.step()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_rank_ring_equals_the_plain_optimizer_bit_for_bit(local, kind):
    a, b = _model(), _model()
    make = (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) if kind == "sgd" else (lambda p: torch.optim.Adam(p, lr=0.01))
    plain = make(a.parameters())
    dist = zt.DistributedOptimizer(make(b.parameters()), b.named_parameters(), bucket_mb=0.0005)
    assert isinstance(dist, type(plain)) and len(dist.buckets.buckets) > 1
    for s in range(4):
        _step(a, plain, s)
        _step(b, dist, s, closure=s % 2 == 1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    for key, value in plain.state_dict()["state"][0].items():
        assert torch.equal(dist.state_dict()["state"][0][key], value), key
    sched = torch.optim.lr_scheduler.StepLR(dist, step_size=1, gamma=0.5)  # a scheduler accepts it
    _step(b, dist, 5)
    sched.step()
    assert dist.param_groups[0]["lr"] == (0.05 if kind == "sgd" else 0.005)


@pytest.mark.parametrize("backend", ["ring", "ps"])
def test_a_scheduler_made_before_wrapping_still_steps_the_distributed_optimizer(local, backend):
    """A scheduler made first patches the optimizer's own ``step``: wrapping must not copy that
    over the distributed one (which averaged nothing, and then refused the next zero_grad)."""
    a, b = _model(), _model()
    plain = torch.optim.SGD(a.parameters(), lr=0.1)
    inner = torch.optim.SGD(b.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    dist = zt.DistributedOptimizer(inner, b.named_parameters(), backend=backend)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    _step(a, plain, 0)
    _step(b, dist, 0)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{n}: {m}")
    plain_sched.step()
    with pytest.warns(UserWarning, match="overridden after learning rate scheduler initialization"):
        sched.step()  # said once: the step it counted was replaced by the distributed one
    for s in (1, 2):  # under ps, each push carries the scheduled rate to the shards
        _step(a, plain, s)
        _step(b, dist, s)
        plain_sched.step()
        sched.step()
    assert dist.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.0125
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{n}: {m}")
    inner.step()  # the optimizer wrapped, kept by the caller: steps the distributed one too


def test_averaged_gradients_keep_the_parameters_memory_layout(local):
    """A channels_last weight's gradient comes back in its strides, as autograd gives it: a fused
    optimizer reads a gradient's memory as the parameter's."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)

    a, b = model(), model()
    assert not b.weight.is_contiguous()
    plain = torch.optim.Adam(a.parameters(), lr=0.1, fused=True)
    dist = zt.DistributedOptimizer(torch.optim.Adam(b.parameters(), lr=0.1, fused=True), b.named_parameters())
    for s in range(3):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s)).to(memory_format=torch.channels_last)
        for m, opt in ((a, plain), (b, dist)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        assert b.weight.grad.stride() == b.weight.stride()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{n}: {m}")


def test_buckets_run_in_reverse_registration_order_by_size_and_dtype():
    params = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)), ("d", torch.zeros(10, dtype=torch.float64))]
    plan = plan_buckets(params, bucket_bytes=800)
    assert [b.names for b in plan] == [["d"], ["c"], ["b", "a"]]


def test_a_bucket_waits_for_the_buckets_before_it(local):
    model = _model()
    params = list(model.named_parameters())
    gb = GradientBuckets(params, zt.collectives.ring(), bucket_bytes=1, op="mean")  # one parameter per bucket
    try:
        for _, p in params:
            p.grad = torch.ones_like(p)
        order = [b.params[0] for b in gb.buckets]
        gb.grad_ready(order[2])
        gb.grad_ready(order[1])
        assert gb.start_order == []  # bucket 0 is not ready: 1 and 2 are held back
        gb.grad_ready(order[0])
        assert gb.start_order == [0, 1, 2]
        gb.synchronize()  # bucket 3 (never ready) starts here
        assert gb.start_order == [0, 1, 2, 3]
        assert all(torch.equal(p.grad, torch.ones_like(p)) for _, p in params)
    finally:
        gb.remove_hooks()


def test_unused_parameters_keep_no_gradient_and_used_ones_average(local):
    model = _model()
    extra = torch.nn.Linear(3, 3)  # registered with the optimizer, never used
    opt = zt.DistributedOptimizer(torch.optim.SGD([*model.parameters(), *extra.parameters()], lr=0.1))
    before = extra.weight.detach().clone()
    _step(model, opt, 0)
    assert extra.weight.grad is None and torch.equal(extra.weight, before)
    assert all(p.grad is not None for p in model.parameters())


def test_backward_passes_per_step_accumulates_then_averages(local):
    a, b = _model(), _model()
    plain = torch.optim.SGD(a.parameters(), lr=0.1)
    dist = zt.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), backward_passes_per_step=2)
    x = torch.randn(4, 6)
    for model in (a, b):
        model(x).sum().backward()
        model(2 * x).sum().backward()
    plain.step()
    dist.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    dist.zero_grad()
    for _ in range(2):
        b(x).sum().backward()
    with pytest.raises(InvalidArgument, match="computed 3 times"):
        b(x).sum().backward()


def test_zero_grad_before_step_refuses_and_skip_synchronize_lets_gradients_be_clipped(local):
    model = _model()
    extra = torch.nn.Linear(2, 2)  # unused: its bucket starts at synchronize, so backward leaves it in flight
    opt = zt.DistributedOptimizer(torch.optim.SGD([*model.parameters(), *extra.parameters()], lr=0.1))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    assert opt.buckets.in_flight and not opt.buckets.averaged
    with pytest.raises(InvalidArgument, match="before step"):
        opt.zero_grad()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    for p, b, g in zip(model.parameters(), before, clipped):
        assert torch.equal(p, b - 0.1 * g)
    opt.zero_grad()


def test_bad_arguments_are_refused_naming_them(local):
    model = _model()
    with pytest.raises(InvalidArgument, match="backend"):
        zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backend="nccl")
    with pytest.raises(ConfigError, match="synchronous"):
        zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync=False)
    with pytest.raises(InvalidArgument, match="'mean'"):
        zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="max")
    with pytest.raises(InvalidArgument, match="not 2 others"):
        zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters())[:2])
    with pytest.raises(InvalidArgument, match="torch.optim.Optimizer"):
        zt.DistributedOptimizer(model)


# in-process: the ps backend ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99)),
    lambda p: torch.optim.Adagrad(p, lr=0.1),
], ids=["sgd", "nesterov", "adam", "adagrad"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_ps_backend_matches_the_torch_optimizer(local, make, sync):
    a, b = _model(), _model()
    plain = make(a.parameters())
    dist = zt.DistributedOptimizer(make(b.parameters()), b.named_parameters(), backend="ps", sync=sync)
    for s in range(4):
        _step(a, plain, s)
        _step(b, dist, s)
    adam = isinstance(plain, torch.optim.Adam)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{n}: {m}", **_tolerance("ps", "adam" if adam else "other"))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
], ids=["momentum", "adam"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_ps_backend_leaves_a_parameter_without_a_gradient_as_torch_does(local, make, sync):
    """A parameter used at the first step only: torch's optimizer skips it afterwards (its
    momentum or Adam moments do not move it), and so must the shards."""
    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(3)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    dist = zt.DistributedOptimizer(make(ours), [("w", ours[0]), ("b", ours[1])], backend="ps", sync=sync)
    plain = make(ref)
    for s in range(3):
        for params, opt in ((ours, dist), (ref, plain)):
            params[0].grad = torch.full_like(params[0], 0.5) if s == 0 else None  # used at step 0 only
            params[1].grad = torch.full_like(params[1], float(s + 1))
            opt.step()
    moved_once = ref[0].detach().clone()
    assert not torch.equal(moved_once, start[0])
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), **_tolerance("ps", "other"))


def test_ps_backend_pulls_into_contiguous_parameters_and_copies_into_strided_ones(local):
    """A contiguous CPU parameter is the pull's out= (its own memory filled as replies land); a
    strided one gets the received values copied in. Both end as a plain torch SGD leaves them."""
    torch.manual_seed(0)
    dense, strided = torch.randn(6, 5), torch.randn(5, 6).t()  # the second is not contiguous
    assert not strided.is_contiguous()
    ours = [torch.nn.Parameter(dense.clone()), torch.nn.Parameter(strided.clone().t().contiguous().t())]
    ref = [torch.nn.Parameter(dense.clone()), torch.nn.Parameter(strided.clone())]
    assert ours[0].is_contiguous() and not ours[1].is_contiguous()
    memory = [p.data_ptr() for p in ours]
    dist = zt.DistributedOptimizer(torch.optim.SGD(ours, lr=0.1), [("a", ours[0]), ("b", ours[1])], backend="ps")
    plain = torch.optim.SGD(ref, lr=0.1)
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        grads = [torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)]
        for params, opt in ((ours, dist), (ref, plain)):
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()
    assert [p.data_ptr() for p in ours] == memory  # updated in place, never replaced
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach())


@pytest.mark.parametrize("backend", ["ring", "ps"])
def test_cuda_parameters_train_as_the_torch_optimizer_trains_them(local, backend):
    """On a GPU, parameters and gradients stay CUDA tensors (reduced through cupy by the ring,
    copied to and from the shards by the ps backend) and end as torch's own SGD leaves them."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: CUDA parameters are trained where torch.cuda.is_available()")
    if backend == "ring":
        pytest.importorskip("cupy", reason="cupy is needed to reduce CUDA tensors")
    a, b = _model().cuda(), _model().cuda()
    plain = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    dist = zt.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9), b.named_parameters(),
                                   backend=backend)
    for s in range(3):
        for model, opt in ((a, plain), (b, dist)):
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(8, 6, generator=g).cuda(), torch.randn(8, 3, generator=g).cuda()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert q.is_cuda, n
        torch.testing.assert_close(q, p, msg=lambda m: f"{n}: {m}")


def test_ps_backend_refuses_what_the_shards_cannot_run(local):
    model = _model()
    with pytest.raises(ConfigError, match="RMSprop is not supported"):
        zt.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), backend="ps")
    with pytest.raises(ConfigError, match="amsgrad=True"):
        zt.DistributedOptimizer(torch.optim.Adam(model.parameters(), amsgrad=True), backend="ps")
    with pytest.raises(ConfigError, match="AdamW"):
        zt.DistributedOptimizer(torch.optim.AdamW(model.parameters()), backend="ps")
    with pytest.raises(ConfigError, match="weight_decay"):
        zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4), backend="ps")
    assert runtime.current().session.variables() == []  # nothing was created
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), backend="ps")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    _step(model, opt, 0)
    sched.step()
    _step(model, opt, 1)  # a new learning rate travels with the push
    opt.param_groups[0]["momentum"] = 0.5  # the shards' own: refused, not trained past
    with pytest.raises(ConfigError, match="optimizer's momentum changed after DistributedOptimizer was made"):
        _step(model, opt, 2)


def test_ps_backend_refuses_a_second_model_whose_parameter_names_are_taken(local):
    """Two Sequentials both have '0.weight': the second must not attach to the first's variables."""
    gen, disc = torch.nn.Sequential(torch.nn.Linear(3, 3)), torch.nn.Sequential(torch.nn.Linear(3, 3))
    first = zt.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), gen.named_parameters(), backend="ps")
    before = [p.detach().clone() for p in disc.parameters()]
    with pytest.raises(VariableConflict, match="'torch/0.weight' already holds a parameter of another"):
        zt.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1), disc.named_parameters(), backend="ps")
    assert all(torch.equal(p, b) for p, b in zip(disc.parameters(), before))  # not loaded from gen's
    named = [(f"disc.{n}", p) for n, p in disc.named_parameters()]
    zt.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1), named, backend="ps")
    assert first is not None


@pytest.mark.parametrize("backend", ["ring", "ps"])
def test_a_parameter_unfrozen_after_wrapping_is_refused_at_step_not_left_behind(local, backend):
    """A parameter frozen when the optimizer was wrapped has no hook, bucket or variable: once
    unfrozen its gradient would be neither averaged nor stepped, and ranks would drift apart."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    names = [(f"unfrozen-{backend}.{n}", p) for n, p in model.named_parameters()]
    opt = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), names, backend=backend)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()  # as planned: only the second layer trains
    opt.zero_grad()
    model[0].requires_grad_(True)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(InvalidArgument, match=r"shape \[3, 3\] has a gradient but was not trainable"):
        opt.step()


def test_a_scheduler_made_before_wrapping_goes_on_after_load_state_dict(local):
    """torch's load_state_dict puts new param_groups on the distributed optimizer; the scheduler,
    which kept the wrapped one, must still set the learning rate the steps use."""
    model = torch.nn.Linear(2, 1)
    base = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(base, 1, gamma=0.1)
    opt = zt.DistributedOptimizer(base, model.named_parameters())
    for i in range(2):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        if i == 0:
            with pytest.warns(UserWarning, match="overridden after learning rate scheduler initialization"):
                sched.step()  # said once: the step it counted was replaced by the distributed one
        else:
            sched.step()
        opt.load_state_dict(opt.state_dict())  # as a resume from a checkpoint would
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01) == sched.get_last_lr()[0]


def test_a_dropped_optimizer_averages_nothing_and_a_live_one_keeps_its_parameters(local):
    model, x = torch.nn.Linear(2, 1), torch.ones(1, 2)
    first = zt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), model.named_parameters())
    first.zero_grad()
    model(x).sum().backward()
    first.step()
    with pytest.raises(InvalidArgument, match="'weight' is already averaged by another live DistributedOptimizer"):
        zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    del first  # dropped: its hooks must go with it, whenever the collector gets to it
    second = zt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for _ in range(3):  # the first's hooks counted these gradients too, and failed the second step
        second.zero_grad()
        model(x).sum().backward()
        second.step()
