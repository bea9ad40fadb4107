"""``settle_gc``, which ``zmqflow serve`` applies once its server is up: a served push of many
variables runs without a single collection of the cycle collector, where the default thresholds
collect on every push. Run in a process of its own: the collector's settings are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, gc, sys
    import numpy as np
    import zmqflow as zf
    from zmqflow.state import optim
    from zmqflow.testing import local_cluster
    from zmqflow.transport.memory import GC_YOUNG, settle_gc

    collections = [0]
    gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))

    async def pushes(sess, grads, n):
        collections[0] = 0
        for _ in range(n):
            await sess.push_pull(grads)
        return collections[0]

    async def main():
        async with local_cluster({"ps": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["ps:0"].target, timeout=30) as sess:
                opt = optim.SyncReplicas(optim.SGD(learning_rate=0.01), replicas_to_aggregate=1)
                for i in range(200):
                    await sess.variable(f"v{i}", np.zeros(256, np.float32), optimizer=opt)
                grads = {f"v{i}": np.ones(256, np.float32) for i in range(200)}
                await pushes(sess, grads, 5)
                before = await pushes(sess, grads, 20)
                settle_gc()
                assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GC_YOUNG, gc.get_threshold()
                after = await pushes(sess, grads, 20)
                value = (await sess.pull(["v0"]))["v0"]
                assert np.allclose(value, -0.01 * 45), value  # every push applied
                print(before, after)

    asyncio.run(main())
""")


def test_a_settled_process_steps_many_variables_without_collecting():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    before, after = map(int, p.stdout.split())
    assert before >= 20  # the default thresholds: a collection or more a push
    assert after == 0
