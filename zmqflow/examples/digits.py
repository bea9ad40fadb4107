"""Train a classifier on scikit-learn's bundled handwritten digits (8x8 images, no download)
with any strategy: the same script runs on one process, under ``zmqflow launch`` or on a real
cluster. Each worker trains on its own shard of the training split; the chief reports the
held-out accuracy, samples per second, and the time per step split into compute and
communication.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import zmqflow as zf

HIDDEN = 32
CLASSES = 10


def load(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("the digits demo needs scikit-learn: pip install 'zmqflow[demo]'")
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0, np.sqrt(2 / 64), (64, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": rng.normal(0, np.sqrt(2 / HIDDEN), (HIDDEN, CLASSES)),
        "b2": np.zeros(CLASSES),
    }


def forward(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ p["w1"] + p["b1"], 0.0)
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(1, keepdims=True)
    e = np.exp(logits)
    return h, e / e.sum(1, keepdims=True)


def loss_and_grads(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy over the batch and its gradients (a two-layer ReLU network)."""
    h, prob = forward(p, x)
    n = len(x)
    loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
    d = prob.copy()
    d[np.arange(n), y] -= 1.0
    d /= n
    dh = (d @ p["w2"].T) * (h > 0)
    return loss, {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ d, "b2": d.sum(0)}


def accuracy(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(p, x)[1].argmax(1) == y).mean())


STRATEGIES = {
    "ps": lambda: zf.ParameterServerStrategy(sync=False),
    "sync-ps": lambda: zf.ParameterServerStrategy(sync=True),
    "ring": lambda: zf.RingAllReduceStrategy(),
    "local": lambda: zf.LocalStrategy(),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="sync-ps")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32, help="examples per worker per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--result", help="write the chief's results (JSON) here")
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test = load()
    strategy = STRATEGIES[args.strategy]()
    with zf.MonitoredTrainingSession(strategy=strategy, hooks=[zf.StopAtStep(args.steps), zf.LoggingHook(100)]) as mon:
        mine = slice(mon.worker_index, None, mon.num_workers)
        x, y = x_train[mine], y_train[mine]
        rng = np.random.default_rng(mon.worker_index + 1)
        mon.create(init_params(), optimizer=zf.optim.Momentum(args.lr, momentum=0.9))
        while not mon.should_stop():
            idx = rng.integers(0, len(x), args.batch)
            loss, grads = loss_and_grads(mon.params(), x[idx], y[idx])
            mon.apply(grads, metrics={"loss": loss})
        if not mon.is_chief:
            return 0
        final = mon.params()
        t = mon.timings()
        acc = accuracy(final, x_test, y_test)
        steps = max(t["steps"], 1)
        samples = t["steps"] * args.batch * mon.num_workers
        result = {
            "strategy": strategy.name,
            "workers": mon.num_workers,
            "steps": mon.step,
            "test_accuracy": acc,
            "samples_per_s": samples / max(t["seconds"], 1e-9),
            "step_ms": 1e3 * t["seconds"] / steps,
            "compute_ms": 1e3 * t["compute_s"] / steps,
            "communication_ms": 1e3 * t["communication_s"] / steps,
        }
        print(
            f"{strategy.name} on {mon.num_workers} worker(s): test accuracy {acc:.3f} on {len(y_test)} held-out digits, "
            f"{result['samples_per_s']:.0f} samples/s, {result['step_ms']:.1f} ms/step "
            f"({result['compute_ms']:.1f} compute + {result['communication_ms']:.1f} communication)",
            flush=True,
        )
        if args.result:
            with open(args.result, "w") as fh:
                json.dump(result, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
