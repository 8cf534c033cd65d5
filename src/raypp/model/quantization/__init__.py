"""FP8: the checkpoints big models ship in, read stage- and TP-locally with their scales.

- :mod:`~raypp.model.quantization.fp8`: e4m3 arithmetic (every rounding rule, plain torch);
- :mod:`~raypp.model.quantization.config`: :class:`QuantConfig`, an FP8 weight format;
- :mod:`~raypp.model.quantization.resolve` (+ :mod:`~.compressed`): the format a
  checkpoint's ``quantization_config`` and the ``quantization`` option name;
- :mod:`~raypp.model.quantization.checkpoint`: a weight and its scale narrowed together
  for a layer's ``weight_loader`` (FP8 values, scales, or dequantized values);
- :mod:`~raypp.model.quantization.linear`: what an FP8 layer holds on a GPU computing in
  FP8, and its GEMM (CPU holds dequantized weights and never runs it).
"""
