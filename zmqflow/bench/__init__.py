"""Benchmarks that measure zmqflow against the raw libraries it is built on, in the same run.

Each benchmark has ``run(quick=..., json_out=...)`` and ``format_table(result)`` (what
``zmqflow bench <name>`` calls) and runs as ``python -m zmqflow.bench.<name>``:

* :mod:`.transport`: tensor throughput and request/reply latency of zmqflow's RPC path against a
  raw pyzmq DEALER/ROUTER over inproc, ipc and tcp loopback, with numpy memcpy as the reference.
* :mod:`.ps`: pull and push of a whole model over 1-4 ps shards, and scalar updates, vs raw pyzmq.
* :mod:`.embedding`: sharded lookups and pushes vs numpy ``take``; the memory of a big table.
* :mod:`.allreduce`: the ring vs gloo (with torch), memcpy, and PS push/pull.
* :mod:`.anchors`: the same work on TF's gRPC parameter servers (``zmqflow bench ps --vs tf1``,
  with the ``[anchors]`` extra), run side by side with zmqflow's; ``plot`` draws the curves.
* :mod:`.torch_ddp`: ``zmqflow.torch.DistributedOptimizer`` (ring) vs torch DDP over gloo, 2 ranks.
* :mod:`.torch_embedding`: ``zmqflow.torch`` EmbeddingBag lookup+push vs ``torch.nn.EmbeddingBag``.
  (The two run together as ``zmqflow bench torch``.)
* :mod:`.netns`: ``zmqflow bench cluster --netns``: ps and workers each in a network namespace,
  joined by rate-limited veth links (1, 10 Gbit/s), PS throughput as a fraction of the link limit.
* :mod:`.recovery`: how long sync training stops when a ps shard is killed, vs a bare restart.

Shared by them: :mod:`.procs` (server processes), :mod:`.stats` (timing and statistics),
:mod:`.machine` (what it ran on, how busy it was), :mod:`.report` (tables and JSON lines).
"""

__all__: list[str] = []
