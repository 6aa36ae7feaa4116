"""Benchmarks: ``python -m torch_kvops.bench --help``."""
