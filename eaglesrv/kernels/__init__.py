"""Kernels behind small interfaces, each with a pure-torch reference that is its test oracle."""
