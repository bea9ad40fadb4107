"""The optimizers every optimizer test runs, and the tolerance their results are held to."""

from __future__ import annotations

from zmqflow.optim import SGD, Adagrad, Adam, Momentum

TOL = dict(rtol=1e-12, atol=1e-12)
STEPS = 10

OPTIMIZERS = {
    "sgd": SGD(learning_rate=0.1),
    "momentum": Momentum(learning_rate=0.05, momentum=0.9),
    "nesterov": Momentum(learning_rate=0.05, momentum=0.8, nesterov=True),
    "adagrad": Adagrad(learning_rate=0.1),
    "adagrad_acc": Adagrad(learning_rate=0.3, initial_accumulator_value=0.5),
    "adam": Adam(learning_rate=0.01),
    # a large epsilon tells sqrt(v) + eps apart from sqrt(v + eps)
    "adam_eps": Adam(learning_rate=0.02, beta1=0.8, beta2=0.95, epsilon=0.1),
}
