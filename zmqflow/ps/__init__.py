"""Parameter-server shards: the variable store, sync accumulation, the catalog of names."""
