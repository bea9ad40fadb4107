"""What the framework bridges share: the process-wide runtime (task, server, session, ring)."""
