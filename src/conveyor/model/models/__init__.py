"""The model families, one module each over the shared decoder (``decoder.py``), found by
their Hugging Face ``architectures`` name through ``registry.py``."""
