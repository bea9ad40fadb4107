"""Scaling past one host on one machine: ``zmqflow bench cluster --netns`` puts every task in
its own network namespace, joined to one bridge by a rate-limited veth pair, and reports PS
throughput as a fraction of what the links allow.

* :mod:`.plan`: the layout and the ``ip``/``tc`` command lines, as data.
* :mod:`.net`: building it, always taking it down, and sweeping leftovers (``--cleanup``).
* :mod:`.calc`: the link bound and the measurement window.
* :mod:`.worker`: the worker process (pull, then push, in rounds).
* :mod:`.run`: the benchmark and its table.
"""

__all__: list[str] = []
