"""The layer inputs a checkpointed training pass keeps for its backward, in pinned host memory instead of on the
device.

A checkpointed pass keeps one tensor a layer ([tokens, hidden] in bf16: a 4096-token pass of a 7B model, 28 x 29
MB = 0.8 GB). Each is copied to pinned host memory on a side stream while the forward goes on, and copied back
when the backward reaches its layer: the device holds one or two layers' inputs at a time, so a long batch can run
as one pass (a pass's host work, tens of thousands of operator calls, does not grow with its tokens) in the memory
two half passes took. When the backward takes a layer's input, the input of the layer before it starts back on the
side stream, so its copy (~0.6 ms for 29 MB) runs while this layer's recompute and backward do; only the last
layer's input is copied back on the step's own stream, which waits for it. Without that prefetch the waits cost ~12
ms of a 440 ms 7B step (bench/RESULTS.md).
"""
from __future__ import annotations

import os
import weakref
from contextlib import contextmanager

import torch


class _OnHost:
    """One saved tensor in pinned host memory: copied (its copy out has run), and once it is on its way back,
    back (the device tensor) and ready (its copy in has run); before (the one saved before it, to prefetch when
    this one is taken; a weak reference: a pass whose graph is dropped without a backward frees its own)."""
    __slots__ = ("host", "copied", "back", "ready", "before", "__weakref__")

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event, before: "_OnHost | None"):
        self.host, self.copied = host, copied
        self.before = weakref.ref(before) if before is not None else None
        self.back = self.ready = None


class InputsToHost:
    """saved_tensors_hooks for a checkpointed layer call: its input goes to the host (only that tensor: the
    rotary tables and the rest stay where they are)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.moved = 0  # bytes sent to the host (all passes)
        self.prefetched = 0  # tensors brought back ahead of their backward, on the side stream
        self._last: _OnHost | None = None  # the tensor saved last: the next one's `before`

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
        self._last = _OnHost(host, copied, self._last)
        return self._last

    def _in(self, packed):
        if not isinstance(packed, _OnHost):
            return packed
        current = torch.cuda.current_stream(self.device)
        if packed.back is None:  # not prefetched (the pass's last layer): copied in on the step's stream
            current.wait_event(packed.copied)
            back = packed.host.to(self.device, non_blocking=True)
        else:
            current.wait_event(packed.ready)
            back = packed.back
            back.record_stream(current)  # made on the side stream, used (and freed) on this one
        before = packed.before() if packed.before is not None else None
        packed.host = packed.back = packed.before = None  # each is taken once; the pinned block goes back
        if (before is not None and before.host is not None and before.back is None
                and os.environ.get("DARK_INPUTS_AHEAD", "1") != "0"):  # 0: each copied back when taken (an A/B)
            self._prefetch(before)
        return back

    def _prefetch(self, packed: _OnHost) -> None:
        """Start packed's copy back on the side stream: the backward takes it next (the layer before). It starts
        when the device reaches this layer's backward (the current stream's work queued so far), not when the host,
        which runs ahead, asks: one copy at a time on the bus, beside serving's own."""
        self.stream.wait_event(packed.copied)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            packed.back = packed.host.to(self.device, non_blocking=True)
            packed.ready = torch.cuda.Event()
            packed.ready.record()
        self.prefetched += 1
