"""Training on a cluster: strategies, the monitored training session, hooks."""
