"""Rival anchors: the same work done by another system in the same run, so a ratio says how zmqflow
compares with what users would otherwise deploy.

* :mod:`.tf1`: TensorFlow 1-style parameter servers (``tf.distribute.Server`` ps tasks, a
  ``tf.compat.v1`` worker session, between-graph) beside zmqflow's ps shards: scalar
  ``assign_add`` round trips, a dense model's pull + SGD push, an embedding lookup + sparse push.
  Needs the optional ``[anchors]`` extra (tensorflow-cpu). ``zmqflow bench ps --vs tf1``.
* :mod:`.tf1_side`: the TensorFlow processes (tensorflow is imported there only, in them).
* :mod:`.plot`: throughput-against-size curves (matplotlib, the ``[plot]`` extra) for
  ``--plot FILE`` of ``zmqflow bench ps`` and ``zmqflow bench allreduce``.

The gloo anchor of the allreduce benchmark lives in :mod:`zmqflow.bench.allreduce`.
"""

__all__: list[str] = []
