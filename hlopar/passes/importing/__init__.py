"""What `hlopar-import` does beyond upstream passes: inlining calls and reading the shardings
an export carries."""
