"""Transport benchmark: zmqflow RPC vs raw pyzmq over inproc, ipc and tcp loopback.

A thin wrapper; the benchmark lives in ``zmqflow/bench/transport.py`` (see ``bench/README.md``).
Same as ``python -m zmqflow.bench.transport`` and ``zmqflow bench transport``:

    python bench/transport.py --quick
    python bench/transport.py --json transport.jsonl --transport tcp
"""

import sys

from zmqflow.bench.transport import main

if __name__ == "__main__":
    sys.exit(main())
