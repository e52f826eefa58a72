"""Triton kernels for the GPU path, each with a plain-torch reference beside it (imported as dark.kernels)."""
from __future__ import annotations

import os

import torch


def available(device: torch.device) -> bool:
    """Whether the engine should use the Triton kernels on this device: CUDA with Triton importable.

    DARK_KERNELS=0 turns them off (the plain-torch path, e.g. for a before/after comparison).
    """
    if torch.device(device).type != "cuda" or os.environ.get("DARK_KERNELS", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
