"""One engine step (decode, prefill, tensor parallel, GPU) against its floor."""
