"""Free KV-cache blocks lent to training, which keeps a checkpointed pass's activations in them.

A checkpointed training pass keeps only each layer's input and runs the layer's GEMMs again in backward (at 7B
about a quarter of a step's FLOPs), because device memory outside the KV cache is for serving. The KV cache,
though, is mostly free while few requests run: sized for the longest batches, it holds a handful of short
conversations most of the time. So a training job borrows a run of free blocks from the engine (consecutive
block ids: in the cache's [layers, 2, blocks, ...] layout that is one contiguous region per layer and key/value),
keeps there what the backward of each layer reads (its input, q/k/v, the attention block's output and the MLP's
gate/up product), and gives the blocks back when the job ends. Its backward then recomputes only the elementwise
parts (norms, the GLU, the attention's forward from the kept q/k/v) and no projection.

Serving always keeps `KEEP_FREE` of the cache's blocks free: a job borrows only what is free beyond that, or nothing
(and checkpoints as before), and lent blocks carry no prefix-cache entries. Should serving still run short while a
loan is out (a burst of long requests), the job gives the blocks back at its next step and checkpoints from there.
"""
from __future__ import annotations

import logging
import math
import threading
import weakref

import torch

log = logging.getLogger(__name__)

KEEP_FREE = 0.25  # of the cache's blocks, always left to serving
ALIGN = 128       # elements: each kept tensor starts on a 256-byte boundary in bf16


class Loan:
    """Blocks [start, start + count) of a KV cache as one flat region per (layer, key/value), and a first-fit
    placement of kept tensors in them. A placement lives until every tensor placed since the loan was last empty is
    released (the layers of one pass, or of a few passes whose backward has not run yet)."""

    def __init__(self, cache_data: torch.Tensor, start: int, count: int):
        self.start, self.count = start, count
        layers = cache_data.shape[0]
        self.regions = [cache_data[layer, kv, start:start + count].reshape(-1)
                        for layer in range(layers) for kv in range(2)]
        self.dtype, self.device = cache_data.dtype, cache_data.device
        self.nbytes = sum(r.numel() for r in self.regions) * cache_data.element_size()
        self._used = [0] * len(self.regions)
        self._cap = [r.numel() for r in self.regions]  # less what hold() keeps at the regions' ends for the job
        self._live = 0
        self._lock = threading.Lock()  # releases may come from autograd's threads
        self.placed = 0  # placements made over the loan's life (layers kept)
        self.bases_bytes = 0  # the protector's bases held here for the job (dark.learn.protect.keep_in)

    def place(self, shapes: list[tuple[int, ...]]) -> "Placement | None":
        """Room for tensors of these shapes (the cache's dtype), all of them or none (None: no room left)."""
        order = sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i]))  # the largest first: first fit
        with self._lock:
            used = list(self._used)
            out: list[torch.Tensor | None] = [None] * len(shapes)
            for i in order:
                n = math.prod(shapes[i])
                for j, region in enumerate(self.regions):
                    if used[j] + n <= self._cap[j]:
                        out[i] = region[used[j]:used[j] + n].view(shapes[i])
                        used[j] += -(-n // ALIGN) * ALIGN
                        break
                else:
                    return None
            self._used = used
            self._live += 1
            self.placed += 1
        return Placement(self, out)

    def hold(self, numel: int) -> torch.Tensor | None:
        """Room for `numel` elements for the rest of the loan (data kept across passes), at the end of the last
        region that has it beyond what is placed there now; None if none has."""
        with self._lock:
            for j in range(len(self.regions) - 1, -1, -1):
                top = (self._cap[j] - numel) // ALIGN * ALIGN
                if top >= self._used[j]:
                    self._cap[j] = top
                    return self.regions[j][top:top + numel]
        return None

    def _release(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0:
                self._used = [0] * len(self.regions)


class Placement:
    """Tensors placed in a loan; their room goes back to it on release() (at the latest when this is collected).
    Work queued on them before the release runs before any later work on the trainer's streams (each step and
    part waits for the last), so the room is reused in order."""

    def __init__(self, loan: Loan, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self._finalizer = weakref.finalize(self, loan._release)

    def release(self) -> None:
        self._finalizer()  # once: a second call does nothing


def fits(shapes: list[list[tuple[int, ...]]], regions: int, capacity: int) -> int:
    """How many of the layers (each a list of tensor shapes, in order) first-fit placement puts in `regions`
    regions of `capacity` elements each."""
    used = [0] * regions
    for k, layer in enumerate(shapes):
        for n in sorted((math.prod(s) for s in layer), reverse=True):
            j = next((j for j in range(regions) if used[j] + n <= capacity), None)
            if j is None:
                return k
            used[j] += -(-n // ALIGN) * ALIGN
    return len(shapes)


class KVLender:
    """The trainer's side of an engine's loans: borrow() on the training thread (the engine lends between two of its
    steps), give_back() once the training work on the loan is queued."""

    def __init__(self, engine):
        self.engine = engine
        cache = engine.cache.data
        self.per_block = math.prod(cache.shape[3:])  # elements of one block in one (layer, key/value) region
        self.element_size = cache.element_size()
        self.regions = cache.shape[0] * 2

    def borrow(self, layers: list[list[tuple[int, ...]]], dtype: torch.dtype, held: list[int] = ()) -> Loan | None:
        """A loan with room for these layers' kept tensors (as many of the layers as the free blocks allow) and for
        tensors of `held` elements kept for the whole job (Loan.hold: the protector's bases), or None when not even
        one layer's fit, the dtypes differ, or the engine is closed."""
        cache, blocks = self.engine.cache, self.engine.blocks
        if not layers or cache.data.dtype != dtype:
            return None
        total = len(blocks.ref)
        keep_free = math.ceil(KEEP_FREE * total)
        biggest = max(math.prod(s) for layer in layers for s in layer)
        count = -(-(biggest + ALIGN) // self.per_block)
        wanted = layers + ([[(n,) for n in held]] if held else [])
        while fits(wanted, self.regions, count * self.per_block) < len(wanted) and count < total:
            count = min(total, math.ceil(count * 1.1))
        if held:  # held tensors go at the regions' ends, placements at their starts: a margin for the two packings
            count = min(total, math.ceil(count * 1.05))

        def lend():
            room = blocks.num_free - keep_free
            n = min(count, room)
            if fits(layers[:1], self.regions, n * self.per_block) < 1:
                return None
            start = blocks.lend(n, keep_free)
            return None if start is None else (start, n)

        try:
            got = self.engine.call_between_steps(lend).result(timeout=60)
        except RuntimeError:  # the engine is closed
            return None
        if got is None:
            return None
        loan = Loan(cache.data, *got)
        log.debug("borrowed KV blocks %d..%d (%.2f GB) for training", got[0], got[0] + got[1] - 1, loan.nbytes / 1e9)
        return loan

    def wanted(self) -> bool:
        """Whether serving has run short of free blocks while some are lent (a request waits, or a sequence was
        preempted): the trainer then gives its loan back at the next step and checkpoints from there."""
        return self.engine.blocks.short

    def give_back(self, loan: Loan) -> None:
        """Zero the lent blocks (serving never reads what training left there), wait for the device to be done with
        them, and hand them back to the engine."""
        cuda = loan.device.type == "cuda"
        if cuda:  # the job's work may be on any of the trainer's streams
            torch.cuda.synchronize(loan.device)
        with torch.no_grad():
            torch._foreach_zero_(loan.regions)
        if cuda:
            torch.cuda.synchronize(loan.device)
        try:
            self.engine.call_between_steps(lambda: self.engine.blocks.take_back(loan.start, loan.count)).result(60)
        except RuntimeError:  # the engine is closed: its blocks go with it
            pass
