"""Speculative decoding: proposers, the draft-length controller and verification."""
