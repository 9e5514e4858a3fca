"""Reference runners the tests compare hlopar's runtime with; the package does not use them.

- `sequential_mpmd`: an MPMD program's fragments in program order, one at a time;
- `microbatched`: a split step's microbatches in turn, then its update, without a pipeline.
"""
