"""Benchmarks and lab scripts (not installed; run as ``python -m benchmarks.…`` from the repo root)."""
