"""Benchmarks, each runnable as `python -m bench.<name>` (see README.md)."""
