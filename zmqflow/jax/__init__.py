"""JAX on zmqflow: collectives over pytrees, a gradient-averaging optax transformation, embeddings."""
