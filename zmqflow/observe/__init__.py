"""What a task shows while it runs: metrics, the timeline, progress and stragglers.

Sans-IO recorders that every layer above may feed; the endpoints that serve them live in ``cli``.
"""
