"""The layer inputs a checkpointed training pass keeps for its backward, in pinned host memory instead of on the
device.

A checkpointed pass keeps one tensor a layer ([tokens, hidden] in bf16: a 4096-token pass of a 7B model, 28 x 29
MB = 0.8 GB). Each is copied to pinned host memory on a side stream while the forward goes on, and copied back
when the backward reaches its layer: the device holds one layer's input at a time, so a long batch can run as one
pass (a pass's host work, tens of thousands of operator calls, does not grow with its tokens) in the memory two
half passes took. The copy back is queued on the step's stream when the backward reaches the layer, and the
layer's recompute waits for it (~0.6 ms for 29 MB): measured, ~12 ms of a 440 ms 7B step (bench/RESULTS.md).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class _OnHost:
    __slots__ = ("host", "copied")

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event):
        self.host, self.copied = host, copied


class InputsToHost:
    """saved_tensors_hooks for a checkpointed layer call: its input goes to the host (only that tensor: the
    rotary tables and the rest stay where they are)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.moved = 0  # bytes sent to the host (all passes)

    @contextmanager
    def keeping(self, x: torch.Tensor):
        """Within this block, a tensor autograd saves that is x is kept on the host."""
        ptr, shape = x.data_ptr(), x.shape

        def pack(t: torch.Tensor):
            if t.data_ptr() != ptr or t.shape != shape:
                return t
            return self._out(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._in):
            yield

    def _out(self, t: torch.Tensor) -> _OnHost:
        # the pinned block comes from torch's caching host allocator: after a process's first passes no new
        # pinning, and a block is not handed out again before the copies that use it have run
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        t.record_stream(self.stream)  # its memory is not reused before the copy has read it
        self.moved += t.numel() * t.element_size()
        return _OnHost(host, copied)

    def _in(self, packed):
        if not isinstance(packed, _OnHost):
            return packed
        torch.cuda.current_stream(self.device).wait_event(packed.copied)
        return packed.host.to(self.device, non_blocking=True)
