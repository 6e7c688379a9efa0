"""gpuwire benchmark suite: ``python -m bench --help``; method in docs/performance.md."""
