"""Command-line tools: trtbuild and benchmarks."""
