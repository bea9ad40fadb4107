"""The client side: sessions, handles on variables and tables, placement, checkpoints, the ring."""
