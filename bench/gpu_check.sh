#!/usr/bin/env bash
# The GPU checks, in one call on a machine with an NVIDIA GPU, cupy and torch (CUDA) installed:
# the tests that skip without a GPU, the GPU allreduce beside gloo on CUDA tensors, and a training
# step beside DDP.
# Wheels the machine lacks (pyzmq, msgspec, python-hostlist) may wait in .whl/.
# CPU_TOO=1 adds the transport and PS benchmarks (quick) on that machine's cores.
# Usage: bash bench/gpu_check.sh [OUTDIR]   (results and logs go to OUTDIR, default $OUT or /tmp/gpu-check)
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
python3 -c "import cupy, torch, numpy, zmq; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__,
'pyzmq', zmq.__version__, 'gpus', cupy.cuda.runtime.getDeviceCount(), 'cpus', __import__('os').cpu_count())"
python3 -c "from zmqflow.transport import sockops; print('C socket calls:', sockops.compiled() or sockops.why_not())"
echo "== tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs --timeout 60 tests/test_ring_devices.py tests/test_torch_collectives.py \
    tests/test_torch_optimizer.py tests/test_torch_average_in_backward.py 2>&1 | tee "$out/tests.log" | tail -15
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs --timeout 60 tests/test_jax_bridge.py 2>&1 | tee "$out/tests_jax.log" | tail -8
echo "== allreduce on the GPU (one host: staged through shared memory) beside gloo on CUDA tensors"
timeout 120 python3 -m zmqflow bench allreduce --device cuda --vs gloo --ranks 2 --ranks 3 --sizes "${SIZES:-64K,1M,16M,64M}" \
    --json "$out/allreduce_cuda.jsonl" 2>&1 | tee "$out/allreduce_cuda.log" | tail -11
echo "== allreduce on the GPU over TCP (as between hosts: reduced on the GPU chunk by chunk)"
timeout 90 python3 -c "
from zmqflow.bench import allreduce as a
rows = a.run(ranks=(2, 3), sizes=(64 << 10, 1 << 20, 16 << 20, 64 << 20), gloo=False, device='cuda', ring_kwargs={'shm': False},
             echo=lambda *_: None, json_out='$out/allreduce_cuda_tcp.jsonl')
print(a.format_table(rows))" 2>&1 | tail -11
echo "== allreduce on the CPU, same sizes, beside gloo"
timeout 100 python3 -m zmqflow bench allreduce --vs gloo --ranks 2 --ranks 3 --sizes "${SIZES:-64K,1M,16M,64M}" --no-ps \
    --json "$out/allreduce_cpu.jsonl" 2>&1 | tail -11
echo "== where a GPU step's time goes, part by part"
timeout 100 python3 -m zmqflow launch --log-level warning --workers 2 -- python3 bench/gpu_step_parts.py \
    > "$out/parts.log" 2>&1; grep -v "^\[launch\]" "$out/parts.log" | head -14
echo "== a training step on the GPU: DistributedOptimizer (ring) beside DDP over gloo"
timeout 120 python3 -m zmqflow bench torch --only ddp --device cuda --json "$out/torch_ddp_cuda.jsonl" 2>&1 | tail -5
if [ -n "${CPU_TOO:-}" ]; then
    echo "== transport and PS on this machine's CPU cores (quick)"
    timeout 90 python3 -m zmqflow.bench.transport --quick --sizes 64,1M,16M,64M --json "$out/transport.jsonl" 2>&1 | tail -22
    timeout 120 python3 -m zmqflow bench ps --quick --json "$out/ps.jsonl" 2>&1 | tail -12
fi
