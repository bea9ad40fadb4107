"""Sans-IO state: shard store, embedding tables, optimizers, partitioners, the ring schedule.

Nothing here awaits, opens a socket or knows about asyncio: the services drive these classes.
"""
