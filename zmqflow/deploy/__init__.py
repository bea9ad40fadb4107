"""Where clusters run: manifests rendered from a cluster's shape (Kubernetes)."""
