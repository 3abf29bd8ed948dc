"""Moved to ``kvstore.testing.tinymodel`` (issue 17); this shim goes once no test imports it."""

from kvstore.testing.tinymodel import make_tiny_llama  # moved

__all__ = ["make_tiny_llama"]
