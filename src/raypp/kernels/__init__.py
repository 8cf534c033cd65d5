"""Triton kernels of the CUDA path, in one place.

Entry points take plain tensors (and a ``pdl`` flag where programmatic dependent
launch applies); launch settings come from :mod:`raypp.kernels.tuning`, keyed by
device and shape class. Each kernel has a test that compares it with a plain
PyTorch reference (``tests/test_cuda_kernels.py``). Importing any of these modules
imports Triton, so only CUDA code paths import them.

- :mod:`~raypp.kernels.attention`: paged KV store and decode attention, SDPA prefill
  (each optionally over a sliding window)
- :mod:`~raypp.kernels.decode_attention`: rotary + KV store + decode attention, one launch
- :mod:`~raypp.kernels.norm`, :mod:`~raypp.kernels.linear`: the fused decode chain's
  RMSNorm (also per q/k head, in place), GEMV and split-K GEMM
- :mod:`~raypp.kernels.sampling`: greedy argmax and the multi-step input advance
"""
