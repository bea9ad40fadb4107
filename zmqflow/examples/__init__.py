"""Scripts run by ``zmqflow demo`` and ``zmqflow launch``; each hosts its own task's server."""
