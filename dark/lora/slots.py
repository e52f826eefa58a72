"""Adapter slots on the device and the batched multi-adapter LoRA math.

Each projection keeps one stacked tensor per factor across all slots: A [slots, rank, in] and
B [slots, rank, out] (B pre-scaled). For a step whose tokens use slots s_1..s_n, the delta of every
projection is two matmuls, whatever the mix of adapters: x @ A[active] gives each token its rank-r code
under every active adapter, a one-hot mask keeps the token's own, and that times the stacked B gives the
delta. No Python loop over adapters, and tokens without an adapter cost nothing extra when none is active.

On CUDA, batches of up to KERNEL_MAX_TOKENS tokens (decode) use the Triton shrink/expand kernels instead
(dark.kernels.lora): each token reads only its own adapter's factors, two launches per projection, and the
only per-step input is a device tensor of slots, which a CUDA graph can keep.
"""
from __future__ import annotations

import torch

from ..models.decoder import ModelConfig, kernel_module
from .weights import AdapterWeights, Key


KERNEL_MAX_TOKENS = 64  # past this (long prefills), the dense torch math reads each adapter once


class AdapterSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.device, self.dtype = device, dtype
        self.shapes = cfg.projection_shapes()
        self.A: dict[Key, torch.Tensor] = {}
        self.B: dict[Key, torch.Tensor] = {}
        self.rank = [0] * num_slots
        self.use_kernels = kernel_module().available(device)
        # bumps when a factor tensor is allocated: CUDA graphs captured before then lack that projection
        self.version = 0

    def _ensure(self, key: Key) -> None:
        # allocated on first use, so the 150k-wide LM head costs memory only once an adapter targets it
        if key not in self.A:
            fan_in, fan_out = self.shapes[key[1]]
            self.A[key] = torch.zeros(self.num_slots, self.max_rank, fan_in, dtype=self.dtype, device=self.device)
            self.B[key] = torch.zeros(self.num_slots, self.max_rank, fan_out, dtype=self.dtype, device=self.device)
            self.version += 1

    def load(self, slot: int, weights: AdapterWeights) -> None:
        r = weights.config.r
        if r > self.max_rank:
            from ..errors import InvalidRequestError

            raise InvalidRequestError(f"adapter rank {r} exceeds the engine's max_lora_rank {self.max_rank}; "
                                      f"start the engine with max_lora_rank={r} or more")
        for key in weights.tensors:
            self._ensure(key)
        for key in self.A:
            self.A[key][slot].zero_()
            self.B[key][slot].zero_()
            if key in weights.tensors:
                a, b = weights.tensors[key]
                self.A[key][slot, :r] = a.to(self.device, self.dtype)
                self.B[key][slot, :r] = (b.t() * weights.scaling).to(self.device, self.dtype)
        self.rank[slot] = r

    def kernel_rank(self) -> int:
        """Rows of A/B the kernels read: the largest loaded rank (rows past a slot's own rank are zeros)."""
        return max(1, max(self.rank))

    def context(self, token_slots: list[int]) -> "SlotLoRA | None":
        """LoRA for a flat batch whose token i uses slot token_slots[i] (-1: no adapter)."""
        active = sorted({s for s in token_slots if s >= 0})
        if not active:
            return None
        if self.use_kernels and len(token_slots) <= KERNEL_MAX_TOKENS:
            return SlotLoRA.with_kernels(self, torch.tensor(token_slots, dtype=torch.int32).to(self.device, non_blocking=True))
        uniform = len(active) == 1 and all(s == active[0] for s in token_slots)
        return SlotLoRA(self, active, None if uniform else torch.tensor(token_slots, device=self.device))


class SlotLoRA:
    def __init__(self, slots: AdapterSlots, active: list[int], token_slots: torch.Tensor | None):
        """token_slots None: every token uses the one active slot."""
        self.slots, self.active, self.token_slots = slots, active, token_slots
        self.r = max(slots.rank[s] for s in active)
        self.uniform = token_slots is None
        self.kernel_slots = None
        if not self.uniform:
            ids = torch.tensor(active, device=token_slots.device)
            self.index = ids
            self.onehot = (token_slots[:, None] == ids[None, :]).to(slots.dtype)[:, :, None]

    @classmethod
    def with_kernels(cls, slots: AdapterSlots, token_slots: torch.Tensor) -> "SlotLoRA":
        """Kernel path: token_slots an int32 device tensor ([T], -1 = none); may be a CUDA graph's static input."""
        lora = cls.__new__(cls)
        lora.slots, lora.active, lora.token_slots, lora.uniform = slots, None, None, False
        lora.kernel_slots, lora.r = token_slots, slots.kernel_rank()
        return lora

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        A = self.slots.A.get((layer, module))
        if A is None:
            return y
        if self.kernel_slots is not None:
            return kernel_module("lora").lora_apply(x, y, A, self.slots.B[(layer, module)], self.kernel_slots, self.r)
        B, r = self.slots.B[(layer, module)], self.r
        if self.uniform:
            s = self.active[0]
            return y + (x @ A[s, :r].t()) @ B[s, :r]
        n = len(self.active)
        a = A[self.index, :r].reshape(n * r, -1)
        b = B[self.index, :r].reshape(n * r, -1)
        h = (x @ a.t()).view(x.shape[0], n, r) * self.onehot
        return y + h.view(x.shape[0], n * r) @ b
