"""The rewrites `hlopar-split-microbatches` makes beyond resizing: batch statistics, per-example
results, iotas counting the whole batch, and the functions output form."""
