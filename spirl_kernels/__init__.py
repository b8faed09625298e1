"""Triton kernels (the lowest layer: imports only torch, triton and the standard library)."""
