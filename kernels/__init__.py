"""Triton kernels for the GPU path, each with a plain-torch reference beside it (imported as dark.kernels)."""
from __future__ import annotations

import contextlib
import functools
import os
import threading

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


_HOPPER: dict = {}


def hopper(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 9 or up (programmatic dependent launch, the bulk tensor
    copy engine's descriptors), asked of the driver once a device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _HOPPER:
        _HOPPER[key] = torch.cuda.get_device_capability(key)[0] >= 9
    return _HOPPER[key]


# SMs assumed where the device cannot be asked (the CPU interpreter): the H100's and H200's count, so the tests
# there take the tilings the GPU takes
DEFAULT_SMS = 132


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device, asked of the driver once; DEFAULT_SMS elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


_scope = threading.local()


@contextlib.contextmanager
def _scoped(name: str, value):
    """This thread's launch setting `name` is `value` within the block, as it was after."""
    before = getattr(_scope, name, None)
    setattr(_scope, name, value)
    try:
        yield
    finally:
        setattr(_scope, name, before)


@contextlib.contextmanager
def sm_budget(sms: int | None):
    """Within this block (on this thread), kernels that size their grids by the SMs they run on (launch_sms) take
    `sms`: the engine's decode steps in serving's partition of the SMs (dark.engine.green) while a learn job has
    the others, where a grid made for every SM would put twice the programs an SM it was tuned for. None: the
    device's own count."""
    if sms is not None and sms < 1:
        raise ValueError(f"an SM budget must be at least 1, got {sms}")
    with _scoped("sms", sms):
        yield


def launch_sms(device: torch.device) -> int:
    """The SMs a kernel launched now on `device` may count on: the sm_budget in force, else sm_count(device)."""
    budget = getattr(_scope, "sms", None)
    return budget if budget is not None else sm_count(device)


@contextlib.contextmanager
def dependent_launch(on: bool = True):
    """Within this block (on this thread), the forward kernels launch with programmatic dependent launch where
    the device has it (see pdl). The engine's decode steps run in it, their CUDA-graph captures and the warm-up
    before them alike (so the kernels are compiled before the capture)."""
    with _scoped("on", on):
        yield


def pdl(device: torch.device) -> dict:
    """Launch options for the forward kernels on `device`: {"PDL": True, "launch_pdl": True} inside
    dependent_launch() on a device with programmatic dependent launch (compute capability 9 and up: Hopper),
    else {"PDL": False}.

    With it a kernel is launched while the one before it in the stream is still finishing: its programs start
    as the earlier kernel's last ones run, do what does not depend on it (a GEMV reads its first weight columns),
    then wait in `wait_prior` until the earlier kernel's writes are visible. A decode step is ~300 short kernels
    back to back, so the gaps between them are a good part of it (on the H200 at Qwen2.5-7B shapes, batch 1:
    4.16 -> 3.98 ms a step). Decode steps only: the kernels of prefill and training launch as before.
    DARK_PDL=0 turns it off."""
    if not getattr(_scope, "on", False):
        return {"PDL": False}
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("DARK_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True} if hopper(device) else {"PDL": False}


_DESC: dict = {}


def tma_descriptor(t: torch.Tensor, block: list[int], cached: bool = True):
    """A TMA descriptor of t's tiles of `block`. The bulk tensor copy engine fills zeros past t's edges, so kernels
    need no masks on the tiles they load through it. Cached (the default) it is made once for a tensor's address,
    shape, strides and tiling, and the cache keeps the tensor alive: for the engine's weights, which keep their
    addresses. A tensor made for one call (a gradient, a contiguous copy) takes cached=False."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not cached:
        return TensorDescriptor.from_tensor(t, list(block))
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), tuple(block))
    d = _DESC.get(key)
    if d is None:
        if len(_DESC) > 4096:
            _DESC.clear()
        d = _DESC[key] = TensorDescriptor.from_tensor(t, list(block))
    return d


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        """Under programmatic dependent launch: wait until the kernel before this one in the stream has finished
        and its writes are visible (nothing it writes may be read, and nothing it reads written, before this),
        then let the next kernel start launching. A no-op without it."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
