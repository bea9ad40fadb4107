"""The ``zmqflow`` command line: serve, launch, status, bench, demo."""
