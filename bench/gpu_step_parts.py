"""Where a CUDA DistributedOptimizer step goes, part by part (2 ranks on one GPU, the MLP of
``zmqflow bench torch``): ``zmqflow launch --workers 2 -- python bench/gpu_step_parts.py``.
Each part is the median of 15 timed runs, each begun after a barrier and ended when the GPU is done."""
import copy
import cProfile
import io
import os
import pstats
import statistics
import time

import cupy as cp
import numpy as np
import torch

import zmqflow.torch as zt
from zmqflow.torch import collectives as _C

zt.init(timeout=60)
r = zt.rank()
dev = "cuda"



def med(f, n=15):
    ts = []
    for _ in range(n):
        zt.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


torch.manual_seed(0)
sizes = (1024, 2048, 1024, 10)
layers = []
for a, b in zip(sizes, sizes[1:]):
    layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers[:-1]).to(dev)
params = list(model.parameters())
alone = copy.deepcopy(model)  # the same model without the distributed optimizer's hooks
opt = zt.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), model.named_parameters(), bucket_mb=25)
plain = torch.optim.SGD(alone.parameters(), lr=0.01)
x, y = torch.randn(64, 1024, device=dev), torch.randint(0, 10, (64,), device=dev)
loss_fn = torch.nn.CrossEntropyLoss()


def fwd_bwd_plain():
    plain.zero_grad()
    loss_fn(alone(x), y).backward()


def step_zf():
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


grads = [torch.randn(p.numel(), device=dev) for p in params] + [torch.ones(len(params), device=dev)]
arrs = [cp.from_dlpack(g) for g in grads]
flat = cp.from_dlpack(torch.cat(grads))
for f in (fwd_bwd_plain, step_zf, fwd_bwd_plain, step_zf):
    f()
out = {}
ring = _C.ring()
cases = {
    "fwd+bwd alone": fwd_bwd_plain,
    "zf step (fwd+bwd+allreduce+sgd)": step_zf,
    "bucket path: submit(async allreduce of 7)": lambda: ring.submit(ring.async_ring.allreduce(arrs, "mean")).result(),
    "blocking ring.allreduce one 16.8MB": lambda: ring.allreduce(flat, "mean"),
    "zt.allreduce of one 8 MB tensor": lambda: zt.allreduce(grads[0]),
    "cupy->torch dlpack x7": lambda: [torch.from_dlpack(a) for a in arrs],
    "D2H 16.8MB pinned": lambda: cp.asnumpy(flat, out=np.frombuffer(cp.cuda.alloc_pinned_memory(flat.nbytes), np.float32, flat.size)),
    "H2D 16.8MB from pinned": lambda: cp.asarray(np.frombuffer(cp.cuda.alloc_pinned_memory(flat.nbytes), np.float32, flat.size)),
}
spans: dict[str, list[float]] = {"  backward (hooks start the allreduce)": [], "  synchronize (wait, then .grad)": [],
                                  "  inner step after synchronize": []}


def split_step():
    """One step timed in its three spans, each ended when the GPU is done."""
    marks = []
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    opt.synchronize()
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    with opt.skip_synchronize():
        opt.step()
    torch.cuda.synchronize()
    marks.append(time.perf_counter())
    for key, a, b in zip(spans, marks, marks[1:]):
        spans[key].append((b - a) * 1e3)


cases["zf step, split:"] = split_step
for k, f in cases.items():
    try:
        f()
        out[k] = f"{med(f):8.2f} ms"
    except Exception as exc:
        out[k] = f"failed: {exc!r}"[:200]
for k, v in spans.items():
    out[k] = f"{statistics.median(v[-15:]):8.2f} ms" if v else "not run"
prof = cProfile.Profile()
zt.barrier()
prof.enable()
for _ in range(30):
    step_zf()
torch.cuda.synchronize()
prof.disable()
if r == 0:
    for k, v in out.items():
        print(f"{k:45s} {v}", flush=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print("cProfile of 30 steps on rank 0, by own time:", text.getvalue()[-6000:], sep="\n")
    if os.environ.get("OUT"):
        prof.dump_stats(os.path.join(os.environ["OUT"], "step.prof"))
zt.barrier()
zt.shutdown()
