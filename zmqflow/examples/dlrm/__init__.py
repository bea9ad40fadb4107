"""``zmqflow demo --model dlrm``: a DLRM-style click model on a synthetic Criteo-shaped log, its
tables on ps shards and its dense gradients averaged by ring (``zmqflow.torch.hybrid``), beside
the same model trained by plain torch in one process.

``data`` needs only numpy; ``model``, ``reference`` and ``train`` need torch.
"""
