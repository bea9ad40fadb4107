"""Restore time of a checkpoint of many small variables, on task servers in processes of their own:
``python bench/restore_many.py [N] [--window W]`` (N Adam variables of 64x16 float32 over 2 ps
shards; W records put back at once, ``RESTORE_WINDOW`` by default, 1 for one after another)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import zmqflow as zf
import zmqflow.client.checkpoint as ckpt
from zmqflow.ports import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("n", type=int, nargs="?", default=200)
    parser.add_argument("--window", type=int, default=ckpt.RESTORE_WINDOW)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    ckpt.RESTORE_WINDOW = args.window
    spec = {"ps": [f"127.0.0.1:{free_port()}" for _ in range(2)], "worker": [f"127.0.0.1:{free_port()}"]}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "cluster.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        procs = [subprocess.Popen([sys.executable, "-m", "zmqflow", "serve", "--cluster", path, "--task", t,
                                   "--checkpoint-root", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for t in ("ps:0", "ps:1", "worker:0")]
        try:
            with zf.Session("tcp://" + spec["worker"][0], timeout=30) as sess:
                sess.wait_for_cluster(30)
                for i in range(args.n):
                    sess.variable(f"v{i}", np.full((64, 16), i, np.float32), optimizer=zf.optim.Adam(0.01))
                saved = ckpt.save(sess, d, step=1)
                times = []
                for _ in range(args.reps):
                    began = time.perf_counter()
                    ckpt.restore(sess, saved)
                    times.append(time.perf_counter() - began)
            times.sort()
            print(f"{args.n} variables, window {args.window}: restore {times[len(times) // 2] * 1e3:.1f} ms median, "
                  f"{times[0] * 1e3:.1f} min, of {args.reps}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)


if __name__ == "__main__":
    main()
