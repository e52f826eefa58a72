"""Adapter slots on the device and the batched multi-adapter LoRA math.

Each projection keeps one stacked tensor per factor across all slots: A [slots, rank, in] and
B [slots, rank, out] (B pre-scaled). For a step whose tokens use slots s_1..s_n, the delta of every
projection is two matmuls, whatever the mix of adapters: x @ A[active] gives each token its rank-r code
under every active adapter, a one-hot mask keeps the token's own, and that times the stacked B gives the
delta. No Python loop over adapters, and tokens without an adapter cost nothing extra when none is active.

On CUDA, batches of up to KERNEL_MAX_TOKENS tokens (decode, short prefills) use the Triton LoRA kernels
instead (dark.kernels.lora): the step's slots are sorted once per forward, so tokens of one adapter form a
segment and each segment reads its adapter's factors once (per 16 tokens); a shrink and an expand launch per
projection or fused group (DARK_LORA_FUSED=1: one fused kernel, which measured slower on the H200); the only per-step
input is a device tensor of slots, which a CUDA graph can keep (the sort is captured with it).

On CUDA the engine also lays each layer's q/k/v, o_proj, gate/up and down_proj weight out with every slot's A rows
after the projection's own rows (extend_weights; the model's parameters are views of the base rows). A step of
several tokens with adapters (decode) then runs the projection as one GEMM over the whole block, which gives the
base output and every slot's codes side by side, and only the expand launch adds each token's own slot's delta
(SlotLoRA.extended): the shrink launch is gone and cuBLAS reads the A bytes in the GEMM's own pass (H200, 64
sequences over 32 adapters: 6.99 -> 6.21 ms a step). A batch of one keeps the GEMV path, which reads the base rows.
"""
from __future__ import annotations

import os

import torch

from ..models.decoder import ModelConfig, fuse_linears, kernel_module, project_fused
from .weights import AdapterWeights, Key

# an adapter version's factors on the device, in the slots' layout and precision (AdapterSlots.stage)
Staged = dict[Key, tuple[torch.Tensor, torch.Tensor]]


# past this (long prefills), the dense torch math: cuBLAS GEMMs over the active adapters; up to it the kernels,
# which read each adapter once per 16 of its tokens (the decode graphs go up to 256 sequences)
KERNEL_MAX_TOKENS = 256
# extend_weights lays the weights out only up to this many A rows a member (slots x max_lora_rank): every step of
# several tokens with adapters reads all of them, in use or not. H200, 7B (bench/RESULTS.md, 2026-12-04): 528 rows
# add ~0.23 ms to the GEMMs and save the ~0.94 ms of shrink launches, so the two meet near 2,000 rows
EXTEND_MAX_ROWS = 1536
# projections that share their input and run as one GEMM in the decoder (CausalLM.fuse_projections)
GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
MEMBERS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class AdapterSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.device, self.dtype = device, dtype
        self.shapes = cfg.projection_shapes()
        self.A: dict[Key, torch.Tensor] = {}
        self.B: dict[Key, torch.Tensor] = {}
        # per fused group (dark.kernels.lora): A [slots, members * max_rank, in] (stacked rows) and
        # B [slots, max_rank, sum of outs] (side by side), with the members' out sizes; each member's A/B above
        # is a view of its part, so one shrink and one expand give the whole group's delta
        self.groups: dict[Key, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        self.rank = [0] * num_slots
        # per slot, the rows of each projection's factors that may hold something (the rest are zeros): a load
        # writes its own rank rows and zeroes only what its slot's previous adapter left past them
        self._written: list[dict[Key, int]] = [{} for _ in range(num_slots)]
        self._pinned: dict[torch.dtype, torch.Tensor] = {}  # stage_from_host's packing buffers
        self.use_kernels = kernel_module().available(device)
        # bumps when a factor tensor is allocated: CUDA graphs captured before then lack that projection
        self.version = 0
        # (layer, "qkv" / "gate_up" / "o_proj" / "down_proj") -> (weight, bias, out): the model's weight with every
        # slot's A rows after its own out rows (extend_weights), so one GEMM gives a step of several tokens its base
        # output and every slot's codes side by side (SlotLoRA.extended); the A of those keys are views of it
        self.extended: dict[Key, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
        self._ext_A: dict[Key, torch.Tensor] = {}

    def extend_weights(self, model) -> bool:
        """Lay each layer's q/k/v, o_proj, gate/up and down_proj weight out again with room for every slot's A rows
        after the projection's own (zeros until an adapter loads), the model's parameters becoming views of the
        base rows: base-only products, the batch-1 GEMVs and training read those rows as before (the same
        contiguous block), and a decode step of several tokens with adapters runs one GEMM over the whole that
        gives every slot's codes with the base output: no shrink launch, the A bytes read by cuBLAS in the same
        pass (SlotLoRA.extended). The A rows are allocated here rather than on first load: the weights must not
        move once CUDA graphs have captured them. Call before anything captures the weights (the engine does, as
        it starts); factors already loaded move into the new rows. Returns whether it did: not past
        EXTEND_MAX_ROWS rows a member (slots x max_lora_rank), where the shrink launches cost less."""
        if self.num_slots * self.max_rank > EXTEND_MAX_ROWS:
            return False
        with torch.no_grad():
            for layer, block in enumerate(model.model.layers):
                a, m = block.self_attn, block.mlp
                if a.qkv is not None:
                    a.qkv = self._extend((layer, "qkv"), [a.q_proj, a.k_proj, a.v_proj])
                if m.gate_up is not None:
                    m.gate_up = self._extend((layer, "gate_up"), [m.gate_proj, m.up_proj])
                for lin in (a.o_proj, m.down_proj):
                    self._extend((layer, lin.name), [lin])
        return True

    def _extend(self, key: Key, linears) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projections' weight (and bias) again with every slot's A rows after theirs (fuse_linears: the old
        weight is freed once nothing holds it); returns the views of their own rows."""
        assert all(lin.weight.dtype == self.dtype for lin in linears)
        out = sum(lin.weight.shape[0] for lin in linears)
        ext, ext_bias = fuse_linears(linears, self.num_slots * len(linears) * self.max_rank)
        self.extended[key] = (ext, ext_bias, out)
        A = self._ext_A[key] = ext[out:].view(self.num_slots, len(linears) * self.max_rank, ext.shape[1])
        # factors loaded before (a late call): their rows move into the new block
        if key[1] in MEMBERS and key in self.groups:
            old, B, outs = self.groups[key]
            A.copy_(old)
            self._register_group(key, A, B, outs)
        elif key in self.A:
            A.copy_(self.A[key])
            self.A[key] = A
            self.version += 1
        return ext[:out], None if ext_bias is None else ext_bias[:out]

    def _register_group(self, key: Key, A: torch.Tensor, B: torch.Tensor, outs: list[int]) -> None:
        """A fused group's factors (A [slots, members * max_rank, in], B [slots, max_rank, sum of outs]) and each
        member's views of its part."""
        self.groups[key] = (A, B, outs)
        mr, col = self.max_rank, 0
        for i, (m, n) in enumerate(zip(MEMBERS[key[1]], outs)):
            self.A[(key[0], m)] = A[:, i * mr:(i + 1) * mr]
            self.B[(key[0], m)] = B[:, :, col:col + n]
            col += n
        self.version += 1

    def _ensure(self, key: Key) -> None:
        # allocated on first use, so the 150k-wide LM head costs memory only once an adapter targets it
        if key not in self.A and key[1] in GROUPS and all(m in self.shapes for m in MEMBERS[GROUPS[key[1]]]):
            group = GROUPS[key[1]]
            members = MEMBERS[group]
            fan_in = self.shapes[members[0]][0]
            outs = [self.shapes[m][1] for m in members]
            mr = self.max_rank
            kw = dict(dtype=self.dtype, device=self.device)
            A = self._ext_A.get((key[0], group))
            if A is None:
                A = torch.zeros(self.num_slots, len(members) * mr, fan_in, **kw)
            self._register_group((key[0], group), A, torch.zeros(self.num_slots, mr, sum(outs), **kw), outs)
        elif key not in self.A:
            fan_in, fan_out = self.shapes[key[1]]
            A = self._ext_A.get(key)
            self.A[key] = A if A is not None else torch.zeros(self.num_slots, self.max_rank, fan_in, dtype=self.dtype,
                                                              device=self.device)
            self.B[key] = torch.zeros(self.num_slots, self.max_rank, fan_out, dtype=self.dtype, device=self.device)
            self.version += 1

    def stage(self, factors: dict[Key, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> Staged:
        """Factors already on this device (a learn job's, as training left them: fp32 A [r, in], B [out, r]) in the
        slots' layout and precision, for load(): A rounded to the slot dtype, B transposed, scaled and rounded once,
        exactly as load() makes them from host factors. The caller's stream must have finished them (and made
        these) before load() runs on another; load() marks them used by its own stream."""
        with torch.no_grad():
            return {k: (a.detach().to(self.dtype, copy=True), (b.detach().t() * scaling).to(self.dtype))
                    for k, (a, b) in factors.items()}

    def stage_from_host(self, weights: AdapterWeights, pinned: bool = True) -> Staged:
        """stage() for a version in host memory (~150 MB of fp32 at 7B, rank 16), on the caller's stream: packed into
        one host buffer, which crosses in copies of up to STAGE_CHUNK bytes, each staged (rounded to the slots'
        dtype) as it lands, so the device holds one chunk of the fp32 factors at a time beside the staged copy,
        not all of them. pinned: the buffer is page-locked and kept for the next (the adapter manager's loader
        thread, its only user, waits for the copies before the next); else a new pageable one, whose copies
        return once done."""
        keys = list(weights.tensors)
        host = [t.reshape(-1) for k in keys for t in weights.tensors[k]]
        groups, size, group = [], 0, []
        for i, k in enumerate(keys):  # keys whole (A and B) in a chunk, the chunks up to STAGE_CHUNK bytes
            n = sum(t.numel() * t.element_size() for t in weights.tensors[k])
            if group and size + n > STAGE_CHUNK:
                groups.append(group)
                group, size = [], 0
            group.append(i)
            size += n
        if group:
            groups.append(group)
        staged: Staged = {}
        packed = _pack(host, self._pinned if pinned and self.device.type == "cuda" else None)
        for group in groups:
            moved = iter(_chunk_to_device(packed, [j for i in group for j in (2 * i, 2 * i + 1)], self.device))
            factors = {keys[i]: (next(moved).view(weights.tensors[keys[i]][0].shape),
                                 next(moved).view(weights.tensors[keys[i]][1].shape)) for i in group}
            staged.update(self.stage(factors, weights.scaling))
        return staged

    def load(self, slot: int, weights: AdapterWeights, staged: Staged | None = None) -> None:
        """Put an adapter version into `slot`. staged: the version's factors on the device already (stage()); else
        they cross from the host, one copy per dtype. Only rows that can hold something are written: the
        adapter's rank rows, and rows of the slot's previous adapter past them (zeroed)."""
        r = weights.config.r
        if r > self.max_rank:
            from ..errors import InvalidRequestError

            raise InvalidRequestError(f"adapter rank {r} exceeds the engine's max_lora_rank {self.max_rank}; "
                                      f"start the engine with max_lora_rank={r} or more")
        for key in weights.tensors:
            self._ensure(key)
        keys = [k for k in self.A if k in weights.tensors]
        if staged is None:
            staged = self.stage_from_host(weights, pinned=False)
        elif self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for t in (t for k in keys for t in staged[k]):  # made on another stream, whose allocator frees them:
                t.record_stream(stream)                     # not before this stream's copies ran
        srcs = [t for k in keys for t in staged[k]]
        dsts = [t for k in keys for t in (self.A[k][slot, :r], self.B[k][slot, :r])]
        stale = []  # rows the previous adapter wrote that this one does not
        for k, rows in self._written[slot].items():
            keep = r if k in weights.tensors else 0
            if rows > keep:
                stale += [self.A[k][slot, keep:rows], self.B[k][slot, keep:rows]]
        with torch.no_grad():
            if stale:
                torch._foreach_zero_(stale)
            torch._foreach_copy_(dsts, srcs)
        self._written[slot] = {k: r for k in keys}
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


# bytes of host factors one host-to-device copy of stage_from_host carries (a 7B layer's rank-16 factors: ~5.5 MB)
STAGE_CHUNK = 16 << 20


def _pack(tensors: list[torch.Tensor], pinned: dict[torch.dtype, torch.Tensor] | None = None):
    """The tensors (host, 1-d) packed into one host buffer per dtype: ({dtype: buffer}, [(dtype, offset, numel)] in
    their order). pinned: page-locked buffers by dtype, grown as needed and reused (the copies out of one then run
    at the bus's speed, queued on the current stream: the caller waits for them before packing again)."""
    where, buffers = [], {}
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        n = sum(tensors[i].numel() for i in idx)
        if pinned is None:
            buffers[dtype] = torch.cat([tensors[i] for i in idx])
        else:
            if dtype not in pinned or pinned[dtype].numel() < n:
                pinned[dtype] = torch.empty(n, dtype=dtype, pin_memory=True)
            buffers[dtype] = pinned[dtype][:n]
            torch.cat([tensors[i] for i in idx], out=buffers[dtype])
    offsets = {dtype: 0 for dtype in buffers}
    for t in tensors:
        where.append((t.dtype, offsets[t.dtype], t.numel()))
        offsets[t.dtype] += t.numel()
    return buffers, where


def _chunk_to_device(packed, idx: list[int], device: torch.device) -> list[torch.Tensor]:
    """Tensors idx (ascending) of a _pack on `device`: one copy per dtype of the span of the buffer they take."""
    buffers, where = packed
    out: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(where[i][0] for i in idx):
        mine = [i for i in idx if where[i][0] == dtype]
        start, end = where[mine[0]][1], where[mine[-1]][1] + where[mine[-1]][2]
        flat = buffers[dtype][start:end]
        flat = flat.to(device, non_blocking=flat.is_pinned())
        for i in mine:
            out[i] = flat[where[i][1] - start:where[i][1] - start + where[i][2]]
    return [out[i] for i in idx]


class SlotLoRA:
    def __init__(self, slots: AdapterSlots, active: list[int], token_slots: torch.Tensor | None):
        """token_slots None: every token uses the one active slot."""
        self.slots, self.active, self.token_slots = slots, active, token_slots
        self.r = max(slots.rank[s] for s in active)
        self.uniform = token_slots is None
        self.kernel_slots = self.kernel_segments = None
        self._codes, self._deferred = {}, None
        if not self.uniform:
            ids = torch.tensor(active, device=token_slots.device)
            self.index = ids
            self.onehot = (token_slots[:, None] == ids[None, :]).to(slots.dtype)[:, :, None]

    @classmethod
    def with_kernels(cls, slots: AdapterSlots, token_slots: torch.Tensor) -> "SlotLoRA":
        """Kernel path: token_slots an integer device tensor ([T], -1 = none); may be a CUDA graph's static input.

        The slots are sorted into the kernels' block table here, once for every projection of the forward
        (inside the graph when captured: fixed shapes, no host sync)."""
        lora = cls.__new__(cls)
        lora.slots, lora.active, lora.token_slots, lora.uniform = slots, None, None, False
        lora.kernel_slots, lora.r = token_slots, slots.kernel_rank()
        lora.kernel_segments = kernel_module("lora").lora_segments(token_slots, slots.num_slots)
        lora._codes, lora._deferred = {}, None
        return lora

    def norm_codes(self, layer: int, key: str, x: torch.Tensor, parts: int = 1) -> dict | None:
        """A batch of one on the kernel path: a place for the codes of a fused group ("qkv", "gate_up") or of one
        projection, which the kernel before it fills in its own launch (the norm: kernels.norm_rope's `codes`;
        the attention's merge: paged_decode's, in `parts` partial sums); gemv_lora then takes them instead of
        launching lora_shrink. None off that path, or with no factors there. DARK_NORM_CODES=0: never."""
        if not self._early_codes(x):
            return None
        if key in MEMBERS:
            entry = self.slots.groups.get((layer, key))
            if entry is None:
                return None
            A, members, stride = entry[0], len(entry[2]), self.slots.max_rank
        else:
            A, members, stride = self.slots.A.get((layer, key)), 1, 0
            if A is None:
                return None
        spec = {"A": A, "slot": self.kernel_slots, "rank": self.r, "members": members, "stride": stride,
                "out": self._code_buffer(parts, members, A.device)}
        self._codes[(layer, key)] = spec
        return spec

    def _early_codes(self, x: torch.Tensor) -> bool:
        """Whether the codes of x's projections may come from a kernel other than lora_shrink (norm_codes,
        defer_codes): a batch of one on the kernel path, unless DARK_NORM_CODES=0."""
        return (self.kernel_slots is not None and self.kernel_segments.dim() == 1 and x.shape[0] == 1
                and os.environ.get("DARK_NORM_CODES", "1") != "0")

    def _code_buffer(self, parts: int, members: int, device: torch.device) -> torch.Tensor:
        """Codes as lora_shrink lays them out for one token: [1, parts, members, BR] fp32."""
        br = max(16, 1 << (self.r - 1).bit_length())
        return torch.empty(1, parts, members, br, device=device, dtype=torch.float32)

    def defer_codes(self, layer: int, key: str, x: torch.Tensor) -> dict | None:
        """A batch of one on the kernel path: the projection's GEMV computes only the codes of its adapter (gemv's
        codes_out, in programs beside the product's) and the delta is added by the residual add's norm after it
        (add_rms_norm's delta_lora), which takes it with take_deferred: a lora_shrink launch fewer (down_proj).
        None off that path, or with no factors there. DARK_NORM_CODES=0: never."""
        A = self.slots.A.get((layer, key)) if self._early_codes(x) else None
        if A is None:
            return None
        assert self._deferred is None, "a deferred delta was never added"
        self._deferred = {"A": A, "B": self.slots.B[(layer, key)], "slot": self.kernel_slots, "rank": self.r,
                          "out": self._code_buffer(kernel_module("gemv").codes_parts(x.shape[1]), 1, A.device)}
        return self._deferred

    def take_deferred(self) -> dict | None:
        """The delta defer_codes left for the next residual add's norm (its delta_lora), once."""
        spec, self._deferred = self._deferred, None
        return spec

    def gemv_lora(self, layer: int, key: str, x: torch.Tensor, group: bool = False):
        """A batch of one on the kernel path: the codes of this projection (group: of this fused group) from
        lora_shrink, and what the GEMV needs to add the delta itself (dark.kernels.gemv's `lora`), in place of
        lora_expand's launch after it. None when no adapter has factors there; False off that path."""
        if self.kernel_slots is None or self.kernel_segments.dim() != 1 or x.shape[0] != 1:
            return False
        if group:
            entry = self.slots.groups.get((layer, key))
            if entry is None:
                return None
            A, B, outs = entry
            stride = self.slots.max_rank
        else:
            A, B, outs, stride = self.slots.A.get((layer, key)), self.slots.B.get((layer, key)), None, 0
            if A is None:
                return None
        spec = self._codes.pop((layer, key), None)
        if spec is not None and spec.get("written"):  # the norm before computed them (norm_codes)
            h = spec["out"]
        else:
            h = kernel_module("lora").lora_shrink(x, A, self.kernel_slots, self.r, members=len(outs) if outs else 1,
                                                  stride=stride, segments=self.kernel_segments)
        return {"h": h, "B": B, "slot": self.kernel_slots, "rank": self.r, "splits": outs}

    def extended(self, layer: int, key: str, x: torch.Tensor) -> torch.Tensor | None:
        """A step of several tokens on the kernel path (decode), for a projection whose weight extend_weights laid
        out with every slot's A rows: one GEMM over the whole gives the base output and every slot's codes side by
        side, and lora_expand_codes adds each token's own slot's delta into the base columns. Returns the output
        (a view, rows as wide as the whole) or None: not on this path (a batch of one, a long prefill, autograd,
        DARK_LORA_EXT=0), or no adapter targets the projection (the caller runs the plain product)."""
        if (self.kernel_slots is None or x.dim() != 2 or not 1 < x.shape[0] <= KERNEL_MAX_TOKENS
                or torch.is_grad_enabled() or os.environ.get("DARK_LORA_EXT", "1") == "0"):
            return None
        ext = self.slots.extended.get((layer, key))
        if ext is None:
            return None
        if key in MEMBERS:
            entry = self.slots.groups.get((layer, key))
            if entry is None:
                return None
            _, B, outs = entry
        else:
            B, outs = self.slots.B.get((layer, key)), None
            if B is None:
                return None
        weight, bias, out = ext
        y = project_fused(x, weight, bias)
        return kernel_module("lora").lora_expand_codes(y[:, out:], B, self.kernel_slots, y[:, :out], self.r,
                                                       self.slots.max_rank, splits=outs,
                                                       segments=self.kernel_segments)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        A = self.slots.A.get((layer, module))
        if A is None:
            return y
        return self._delta(A, self.slots.B[(layer, module)], self.r, x, y)

    def apply_group(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The delta of every projection in a fused group ("qkv", "gate_up") on their concatenated output."""
        entry = self.slots.groups.get((layer, group))
        if entry is None:
            return y
        A, B, outs = entry
        if self.kernel_slots is not None:
            return kernel_module("lora").lora_apply(x, y, A, B, self.kernel_slots, self.r, splits=outs,
                                                    stride=self.slots.max_rank, segments=self.kernel_segments)
        col = 0
        for m, n in zip(MEMBERS[group], outs):
            self.apply(layer, m, x, y[:, col:col + n])  # adds into y's columns
            col += n
        return y

    def _delta(self, A: torch.Tensor, B: torch.Tensor, r: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (a projection's fresh output, serving: no autograd) with the delta added in place: a large prefill step
        holds no second [tokens, out] tensor (gate/up at 8k tokens: ~0.6 GB at 7B)."""
        if self.kernel_slots is not None:
            return kernel_module("lora").lora_apply(x, y, A, B, self.kernel_slots, r, segments=self.kernel_segments)
        if self.uniform:
            s = self.active[0]
            return y.addmm_(x @ A[s, :r].t(), B[s, :r])
        n = len(self.active)
        a = A[self.index, :r].reshape(n * r, -1)
        b = B[self.index, :r].reshape(n * r, -1)
        h = (x @ a.t()).view(x.shape[0], n, r) * self.onehot
        return y.addmm_(h.view(x.shape[0], n * r), b)
