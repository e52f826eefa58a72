"""Two disjoint SM partitions of one GPU, each with a stream (CUDA green contexts, through the driver API).

torch's `GreenContext.create(num_sms=N)` always takes its N SMs from the start of the device, so two of them overlap
and nothing keeps the other SMs for someone else. Here one split of the device's SMs gives a partition of (at least)
the SMs asked for and the partition of the rest, and each gets a green context and a stream. Serving can then
decode on one and a training step run on the other, and neither's thread blocks ever wait for an SM the other holds.

The driver is reached through ctypes (libcuda is always there where CUDA is); a device or driver without green
contexts (CUDA < 12.4, or a GPU before Volta) raises RuntimeError, and callers fall back to sharing every SM.
"""
from __future__ import annotations

import ctypes
import threading

import torch

_RESOURCE_BYTES = 512   # CUdevResource is 144-160 bytes in CUDA 12.4-13 headers: room to spare for the driver to write
_SM_COUNT_AT = 96       # offset of CUdevSmResource.smCount: after the 4-byte type and 92 bytes of internal padding
_SM_RESOURCE = 1        # CU_DEV_RESOURCE_TYPE_SM
_DEFAULT_STREAM = 1     # CU_GREEN_CTX_DEFAULT_STREAM, required by cuGreenCtxCreate
_NON_BLOCKING = 1       # CU_STREAM_NON_BLOCKING


class _Resource(ctypes.Structure):
    _fields_ = [("raw", ctypes.c_ubyte * _RESOURCE_BYTES)]

    @property
    def sm_count(self) -> int:
        return int.from_bytes(bytes(self.raw[_SM_COUNT_AT:_SM_COUNT_AT + 4]), "little")


_lib = None
_lock = threading.Lock()
_KEEP: list = []  # green contexts are never destroyed: memory used on their streams may be freed at interpreter exit


def _driver():
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"no CUDA driver library: {e}") from e
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA driver error {rc} ({(name.value or b'?').decode()})")


class Partition:
    """A green context on some of the device's SMs and a stream whose kernels run only there."""

    def __init__(self, stream: torch.cuda.Stream, sms: int):
        self.stream, self.sms = stream, sms

    def __repr__(self) -> str:
        return f"Partition({self.sms} SMs)"


def split(device: torch.device, sms: int, priorities: tuple[int, int] = (0, 0)) -> tuple[Partition, Partition]:
    """(a partition of at least `sms` SMs, the partition of the device's other SMs), disjoint. The driver rounds
    `sms` up to its granularity (8 on Hopper); each stream gets the given priority (lower runs first)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < sms < total:
        raise ValueError(f"a split needs 0 < sms < {total} (the device's SMs), got {sms}")
    torch.cuda.init()
    lib = _driver()
    with _lock:
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        whole, part, rest = _Resource(), _Resource(), _Resource()
        _check(lib.cuDeviceGetDevResource(dev, ctypes.byref(whole), _SM_RESOURCE), "cuDeviceGetDevResource")
        groups = ctypes.c_uint(1)
        _check(lib.cuDevSmResourceSplitByCount(ctypes.byref(part), ctypes.byref(groups), ctypes.byref(whole),
                                               ctypes.byref(rest), 0, ctypes.c_uint(sms)),
               f"cuDevSmResourceSplitByCount({sms} of {whole.sm_count} SMs)")
        if groups.value != 1 or rest.sm_count == 0:
            raise RuntimeError(f"the driver split {whole.sm_count} SMs into {groups.value} group(s) of "
                               f"{part.sm_count} and {rest.sm_count} left: no two partitions")
        out = []
        for res, priority in zip((part, rest), priorities):
            desc = ctypes.c_void_p()
            _check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), ctypes.byref(res), 1), "cuDevResourceGenerateDesc")
            ctx = ctypes.c_void_p()
            _check(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _DEFAULT_STREAM), "cuGreenCtxCreate")
            handle = ctypes.c_void_p()
            _check(lib.cuGreenCtxStreamCreate(ctypes.byref(handle), ctx, _NON_BLOCKING, ctypes.c_int(priority)),
                   "cuGreenCtxStreamCreate")
            _KEEP.append(ctx)
            out.append(Partition(torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index)),
                                 res.sm_count))
    return out[0], out[1]
