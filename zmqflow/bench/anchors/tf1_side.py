"""The TensorFlow side of the tf1 anchor: ps tasks and the worker that measures, each a spawned
process that imports tensorflow itself (the parent never does: a heavy import, threads, and an
optional extra).

TF1 between-graph replication as it was deployed: every task runs a ``tf.distribute.Server``
(gRPC); variables are placed on ``/job:ps/task:i`` by ``replica_device_setter`` (round robin, as
zmqflow's default placement); the worker's ``tf.compat.v1.Session`` talks to its own server, which
runs each step's ops on the ps tasks. Every measurement mirrors one of zmqflow's in
:mod:`.tf1`: same shapes, dtypes, ids, gradients and learning rates, and the same rows on the
wire (an embedding step moves a batch's unique ids' rows, as zmqflow's client does), so each is
the strongest TF1 program for the same work.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..embedding import BATCH, DIM, zipf_ids

__all__ = ["DENSE_LR", "EMB_LR", "TABLES", "TABLE_BATCH", "TABLE_DIM", "id_batches", "table_batches",
           "tf_ps_process", "tf_worker_process"]

DENSE_LR = 0.01
EMB_LR = 0.1
# a model's many small tables (``zmqflow bench tables``'s shape): ids a table a batch, and the width
TABLES, TABLE_BATCH, TABLE_DIM = 8, 512, 16


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Native stderr to /dev/null meanwhile: TF's C++ start-up notices (oneDNN, absl) ignore
    TF_CPP_MIN_LOG_LEVEL and would bury the table; Python errors still surface as exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _import_tf() -> Any:
    """tensorflow in graph mode (TF1 semantics: ref variables, sessions), its logs quiet."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with _quiet_stderr():
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        tf.compat.v1.disable_v2_behavior()
    return tf


def tf_ps_process(spec_json: str, index: int, conn: Any) -> None:
    """Process entry (see :mod:`zmqflow.bench.procs`): ps task ``index`` of the TF cluster."""
    try:
        tf = _import_tf()
        with _quiet_stderr():
            server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(spec_json)), job_name="ps", task_index=index)
    except Exception as exc:  # an import or bind failure is reported to the parent, not lost
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", server.target))
    conn.poll(None)  # a stop message or EOF (parent gone)
    # a gRPC server has no clean stop in TF; its threads would hold the exit: leave at once
    os._exit(0)


def _dense_block(tf: Any, graph: Any, n_ps: int, mb: float, nvars: int) -> tuple[list, Any, dict]:
    """``nvars`` float32 variables of ``mb`` MB in all on the ps tasks, and an SGD push of fed gradients."""
    per_var = int(mb * 1e6) // nvars // 4
    with graph.device(tf.compat.v1.train.replica_device_setter(ps_tasks=n_ps, worker_device="/job:worker/task:0")):
        vs = [tf.compat.v1.get_variable(f"d{mb:g}_{i}", shape=(per_var,), initializer=tf.compat.v1.zeros_initializer())
              for i in range(nvars)]
        feeds = [tf.compat.v1.placeholder(tf.float32, (per_var,)) for _ in vs]
        push = tf.compat.v1.train.GradientDescentOptimizer(DENSE_LR).apply_gradients(list(zip(feeds, vs)))
    grads = {f: np.full(per_var, 1e-3, np.float32) for f in feeds}
    return vs, push, grads


def _embedding_block(tf: Any, graph: Any, n_ps: int, rows: int) -> tuple[Any, Any, Any, Any]:
    """A ``rows`` x DIM table in ``n_ps`` partitions; a ``mod`` lookup and its sparse SGD push,
    each moving a batch's unique rows only, as zmqflow's client does: the lookup takes
    ``tf.unique`` of the ids, looks those up and gathers them back by the inverse index; the push
    sums the gradients of repeated ids (``unsorted_segment_sum`` over that index) and applies the
    sums with ``scatter_sub`` on each partition's ps (the unique lookup's gradient per partition)."""
    with graph.device(tf.compat.v1.train.replica_device_setter(ps_tasks=n_ps, worker_device="/job:worker/task:0")):
        table = tf.compat.v1.get_variable("emb", shape=(rows, DIM),
                                          initializer=tf.compat.v1.random_normal_initializer(stddev=0.01),
                                          partitioner=tf.compat.v1.fixed_size_partitioner(n_ps))
        ids = tf.compat.v1.placeholder(tf.int64, (BATCH,))
        uniq, inverse = tf.unique(ids)
        rows_u = tf.compat.v1.nn.embedding_lookup(table, uniq, partition_strategy="mod")
        looked = tf.gather(rows_u, inverse)
        upstream = tf.compat.v1.placeholder(tf.float32, (BATCH, DIM))
        summed = tf.math.unsorted_segment_sum(upstream, inverse, tf.size(uniq))
        parts = list(table)
        grads = tf.gradients(rows_u, parts, grad_ys=summed)
        push = tf.group(*[tf.compat.v1.scatter_sub(p, g.indices, EMB_LR * g.values) for p, g in zip(parts, grads)])
    return ids, upstream, looked, push


def _tables_block(tf: Any, graph: Any, n_ps: int, tables: int, rows: int) -> tuple[list, list, list, Any]:
    """``tables`` tables as :func:`_embedding_block` makes one (``rows`` x TABLE_DIM, a partition a
    ps): each batch's lookups of every table in one ``sess.run``, and their pushes in another, as
    one graph step moves them."""
    ids, ups, looked, pushes = [], [], [], []
    with graph.device(tf.compat.v1.train.replica_device_setter(ps_tasks=n_ps, worker_device="/job:worker/task:0")):
        for k in range(tables):
            table = tf.compat.v1.get_variable(f"table{k}", shape=(rows, TABLE_DIM),
                                              initializer=tf.compat.v1.random_normal_initializer(stddev=0.01),
                                              partitioner=tf.compat.v1.fixed_size_partitioner(n_ps))
            ids.append(tf.compat.v1.placeholder(tf.int64, (TABLE_BATCH,)))
            uniq, inverse = tf.unique(ids[-1])
            rows_u = tf.compat.v1.nn.embedding_lookup(table, uniq, partition_strategy="mod")
            looked.append(tf.gather(rows_u, inverse))
            ups.append(tf.compat.v1.placeholder(tf.float32, (TABLE_BATCH, TABLE_DIM)))
            summed = tf.math.unsorted_segment_sum(ups[-1], inverse, tf.size(uniq))
            parts = list(table)
            grads = tf.gradients(rows_u, parts, grad_ys=summed)
            pushes += [tf.compat.v1.scatter_sub(p, g.indices, EMB_LR * g.values) for p, g in zip(parts, grads)]
    return ids, ups, looked, tf.group(*pushes)


def _timed(call: Any) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def tf_worker_process(spec_json: str, plan: dict[str, Any], conn: Any) -> None:
    """Process entry (see :mod:`zmqflow.bench.procs`): worker:0 builds one graph with every
    measure's variables, initializes them, answers ready, then runs one repetition per request
    (``(kind, arg)`` -> ``("ok", seconds)``), so the parent interleaves it with zmqflow's."""
    try:
        tf = _import_tf()
        spec = json.loads(spec_json)
        n_ps = len(spec["ps"])
        with _quiet_stderr():
            server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker", task_index=0)
        graph = tf.Graph()
        with graph.as_default():
            with graph.device("/job:ps/task:0"):
                scalar = tf.compat.v1.get_variable("scalar", initializer=0.0)
            add_one = tf.compat.v1.assign_add(scalar, 1.0).op  # the op only: zmqflow's assign_add returns nothing
            dense = {mb: _dense_block(tf, graph, n_ps, mb, plan["nvars"]) for mb in plan["model_mbs"]}
            ids, upstream, looked, emb_push = _embedding_block(tf, graph, n_ps, plan["rows"])
            t_ids, t_ups, t_looked, t_push = _tables_block(tf, graph, n_ps, TABLES, plan["table_rows"])
            init = tf.compat.v1.global_variables_initializer()
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", "/job:worker/task:0"])
        sess = tf.compat.v1.Session(server.target, graph=graph, config=config)
        sess.run(init)
    except Exception as exc:  # reported to the parent, not lost
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    batches = id_batches(plan)
    g = np.full((BATCH, DIM), 1e-3, np.float32)

    def round_trips(_: Any) -> float:
        def trips() -> None:
            for _ in range(plan["trips"]):
                sess.run(add_one)

        return _timed(trips)

    def dense_step(mb: float) -> list[float]:
        vs, push, grads = dense[mb]
        return [_timed(lambda: sess.run(vs)), _timed(lambda: sess.run(push, feed_dict=grads))]

    def embedding_step(i: int) -> list[float]:
        b = batches[i]
        return [_timed(lambda: sess.run(looked, {ids: b})), _timed(lambda: sess.run(emb_push, {ids: b, upstream: g}))]

    t_batches = table_batches(plan)
    t_grads = {u: np.full((TABLE_BATCH, TABLE_DIM), 1e-3, np.float32) for u in t_ups}

    def tables_step(i: int) -> list[float]:
        feed = dict(zip(t_ids, t_batches[i]))
        return [_timed(lambda: sess.run(t_looked, feed)), _timed(lambda: sess.run(t_push, {**feed, **t_grads}))]

    def check(mb: float) -> float:
        return float(np.mean(sess.run(dense[mb][0][0])[:4]))

    ops = {"scalar": round_trips, "dense": dense_step, "embedding": embedding_step, "tables": tables_step,
           "check": check}
    conn.send(("ready", None))
    while True:
        try:
            kind, arg = conn.recv()
        except EOFError:  # parent gone
            break
        if kind == "stop":
            break
        try:
            conn.send(("ok", ops[kind](arg)))
        except Exception as exc:
            conn.send(("error", f"{kind}: {type(exc).__name__}: {exc}"))
    sess.close()
    os._exit(0)  # as the ps tasks: the gRPC server's threads would hold the exit


def id_batches(plan: dict[str, Any]) -> list[np.ndarray]:
    """The id batches both sides look up and push, in order (the same seed, the same ids)."""
    rng = np.random.default_rng(plan["seed"])
    return [zipf_ids(rng, BATCH, plan["rows"]) for _ in range(plan["batches"])]


def table_batches(plan: dict[str, Any]) -> list[list[np.ndarray]]:
    """Each batch's ids for every one of the TABLES tables (the same seed on both sides)."""
    rng = np.random.default_rng(plan["seed"] + 1)
    return [[zipf_ids(rng, TABLE_BATCH, plan["table_rows"]) for _ in range(TABLES)] for _ in range(plan["batches"])]
