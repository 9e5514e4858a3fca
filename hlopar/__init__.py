"""hlopar: automatic parallelization of JAX programs on StableHLO."""
