"""GPU lab scripts: the one-GPU decode benchmark, the multi-GPU suites and their probes."""
