"""The rewrites of `hlopar-unstack-layer-scans`: unrolling layer loops and unstacking their values."""
