"""Benchmarks: communicator hops, throughput, latency, pipeline timelines."""
