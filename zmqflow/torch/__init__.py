"""PyTorch on zmqflow: Horovod-shaped collectives, a DistributedOptimizer, embedding tables on ps shards."""
