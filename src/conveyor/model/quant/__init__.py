"""Quantized weights: the scheme a model runs with (``--quantization`` or the checkpoint's
``quantization_config``), the integer weights with their scales (``weight.py``), the
checkpoint formats read into them (``formats.py``), the modules that compute with them
(``linear.py``), their backends measured per shape (``backends.py``) and the step that
puts them in a loaded model (``apply.py``)."""
