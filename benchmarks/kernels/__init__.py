"""Kernel sweeps: the decode GEMV / GEMM launch settings against cuBLAS."""
