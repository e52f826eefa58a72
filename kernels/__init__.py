"""Triton kernels for the GPU path, each with a plain-torch reference beside it (imported as dark.kernels)."""
