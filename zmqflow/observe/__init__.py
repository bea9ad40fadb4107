"""What a task shows while it runs: metrics, the timeline, progress and stragglers.

Sans-IO recorders that every layer above may feed (``metrics``); ``endpoint`` is the one piece
that does IO, prometheus-client's HTTP server, kept here because both ``serve`` and the bridge
runtime start it.
"""
