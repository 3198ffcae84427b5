"""Pier: a KServe-v2 / Triton-compatible model server."""

__version__ = "0.1.0"
