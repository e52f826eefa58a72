"""Runs one scheduled step through the model: flat batch in, one sampled token per finished prefill/decode out.

On CUDA, a step that only decodes (one new token per sequence) takes the fast path: its inputs go into fixed
device buffers with one host-to-device copy, attention reads the paged cache through the Triton kernel, LoRA
runs through the per-token slot kernels, and the whole forward (LM head included) is replayed from a CUDA
graph captured once per batch-size bucket, with or without adapters. Prefill and mixed steps, and the CPU,
take the plain-torch path. DARK_KERNELS=0 or DARK_CUDA_GRAPHS=0 turn the fast path or its graphs off.
"""
from __future__ import annotations

import logging
import os

import torch

from ..lora.slots import AdapterSlots, SlotLoRA
from ..models.decoder import CausalLM, kernel_module
from .attention import KVCache, PagedAttention, PagedDecodeAttention
from .sampler import sample
from .sequence import Sequence

log = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# rows of the decode input buffer: token id, position, cache slot, context length, adapter slot
_IDS, _POS, _SLOT, _CTX, _LORA = range(5)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, slots: AdapterSlots):
        self.model, self.cache, self.slots = model, cache, slots
        self.device = cache.data.device
        self._buffers_for = 0  # decode buffers are made on the first fast step
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.fast_steps = 0  # decode steps that took the fast path
        self.set_fast(kernel_module().available(self.device))

    def set_fast(self, on: bool, graphs: bool | None = None) -> None:
        """Kernels (and CUDA graphs, on CUDA, unless DARK_CUDA_GRAPHS=0) for decode steps, LoRA and norms;
        off: the plain-torch path. Call between steps (a before/after benchmark, a test)."""
        if graphs is None:
            graphs = os.environ.get("DARK_CUDA_GRAPHS", "1") != "0"
        self.fast_decode = on
        self.use_graphs = on and graphs and self.device.type == "cuda"
        self.slots.use_kernels = on
        self.model.use_fused_kernels(on)
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forget every captured graph, and their memory pool with them: a pool whose graphs are all gone is
        released by the allocator, and capturing into its old handle again fails."""
        self._graphs.clear()
        self._pool = None

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> dict[int, tuple[int, float | None]]:
        """Compute the scheduled tokens; sequences whose chunk reaches their end get a sampled token.

        Returns {sequence id: (token, its log-probability or None)}.
        """
        if self.fast_decode and all(n == 1 and seq.num_computed + 1 == len(seq) for seq, n in batch):
            return self._run_decode(batch)
        bs = self.cache.block_size
        ids, positions, slots_of_tokens, slot_mapping = [], [], [], []
        q_lens, ctx_lens, tables, last_rows, sampled_seqs = [], [], [], [], []
        for seq, n in batch:
            start = seq.num_computed
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            slots_of_tokens.extend([seq.slot] * n)
            q_lens.append(n)
            ctx_lens.append(start + n)
            tables.append(seq.block_table)
            if start + n == len(seq):
                last_rows.append(len(ids) - 1)
                sampled_seqs.append(seq)
        dev = self.device
        attn = PagedAttention(self.cache, q_lens, ctx_lens, tables, torch.tensor(slot_mapping, device=dev))
        lora = self.slots.context(slots_of_tokens)
        hidden = self.model.hidden_states(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attn, lora)
        if not sampled_seqs:
            return {}
        rows = torch.tensor(last_rows, device=dev)
        head_lora = self.slots.context([s.slot for s in sampled_seqs]) if lora is not None else None
        tokens, logprobs = sample(self.model.logits(hidden[rows], head_lora), sampled_seqs)
        return {s.id: (t, logprobs[i] if logprobs else None) for i, (s, t) in enumerate(zip(sampled_seqs, tokens))}

    # --- decode-only steps on CUDA ---
    def _ensure_buffers(self, rows: int, width: int) -> None:
        """Pinned host and device buffers for `rows` sequences of up to `width` blocks; graphs die with them."""
        if rows <= self._buffers_for and width <= self._bt_dev.shape[1]:
            return
        rows = max(rows, self._buffers_for, GRAPH_BUCKETS[-1])
        # wide enough for the longest context from the start (a few MB), so graphs are rarely captured again
        longest = min(self.cache.num_blocks, 4096)
        width = max(width, 64, longest, self._bt_dev.shape[1] * 2 if self._buffers_for else 0)
        self._drop_graphs()
        pin = self.device.type == "cuda"
        self._meta_host = torch.zeros(5, rows, dtype=torch.int64, pin_memory=pin)
        self._meta_dev = torch.zeros(5, rows, dtype=torch.int64, device=self.device)
        self._bt_host = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin)
        self._bt_dev = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self._bt_rows: list = [None] * rows  # per row: (block table list, its length) last written there
        # in the model's dtype, as the LM head makes them; the sampled rows widen to fp32 when they are read
        self._logits = torch.empty(rows, self.model.config.vocab_size, dtype=self.model.lm_head.weight.dtype,
                                   device=self.device)
        self._buffers_for = rows

    def _forward_decode(self, rows: int, with_lora: bool) -> torch.Tensor:
        """The captured region: logits [rows, vocab] from the decode buffers' first `rows` entries, written into
        the first rows of one buffer that every graph shares (a graph's own output would stay allocated for as
        long as the graph lives: ~0.5 GB over the batch-size buckets of a 152k vocabulary)."""
        meta = self._meta_dev[:, :rows]
        attn = PagedDecodeAttention(self.cache, meta[_SLOT], self._bt_dev[:rows], meta[_CTX])
        lora = SlotLoRA.with_kernels(self.slots, meta[_LORA]) if with_lora else None
        hidden = self.model.hidden_states(meta[_IDS], meta[_POS], attn, lora)
        out = self._logits[:rows]
        out.copy_(self.model.lm_head(hidden, lora))
        return out

    def _run_decode(self, batch: list[tuple[Sequence, int]]) -> dict[int, tuple[int, float | None]]:
        self.fast_steps += 1
        bs = self.cache.block_size
        b = len(batch)
        rows = next((g for g in GRAPH_BUCKETS if g >= b), b) if self.use_graphs else b
        self._ensure_buffers(rows, max(len(seq.block_table) for seq, _ in batch))
        meta, bt = self._meta_host.numpy(), self._bt_host.numpy()
        meta[:, b:rows] = 0
        meta[_SLOT, b:rows] = meta[_LORA, b:rows] = -1  # padded rows: nothing stored, no adapter, empty context
        seqs = [seq for seq, _ in batch]
        pos = [seq.num_computed for seq in seqs]
        meta[_IDS, :b] = [seq.token_ids[p] for seq, p in zip(seqs, pos)]
        meta[_POS, :b] = pos
        meta[_SLOT, :b] = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, pos)]
        meta[_CTX, :b] = [p + 1 for p in pos]
        meta[_LORA, :b] = [seq.slot for seq in seqs]
        written = self._bt_rows
        for i, seq in enumerate(seqs):
            # a table only grows in place, or is replaced by a new list when its blocks are freed: the same
            # list at the same length is the same row, already in the buffer (most rows of most steps)
            table = seq.block_table
            if written[i] is None or written[i][0] is not table or written[i][1] != len(table):
                bt[i, :len(table)] = table
                written[i] = (table, len(table))
        width = max(len(seq.block_table) for seq in seqs)
        self._meta_dev[:, :rows].copy_(self._meta_host[:, :rows], non_blocking=True)
        self._bt_dev[:rows, :width].copy_(self._bt_host[:rows, :width], non_blocking=True)
        with_lora = any(seq.slot >= 0 for seq in seqs)
        if rows in GRAPH_BUCKETS and self.use_graphs:
            logits = self._replay(rows, with_lora)
        else:
            logits = self._forward_decode(rows, with_lora)
        tokens, logprobs = sample(logits[:b].float(), seqs)
        return {s.id: (t, logprobs[i] if logprobs else None) for i, (s, t) in enumerate(zip(seqs, tokens))}

    def _replay(self, rows: int, with_lora: bool) -> torch.Tensor:
        key = (rows, with_lora) + ((self.slots.version, self.slots.kernel_rank()) if with_lora else ())
        entry = self._graphs.get(key)
        if entry is None:
            # warm-up outside the graph (Triton compiles, cuBLAS picks its kernels); it stores the same keys
            # and values that the replay below stores again
            self._forward_decode(rows, with_lora)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a training thread may allocate on its own stream meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._forward_decode(rows, with_lora)
            entry = self._graphs[key] = (graph, out)
            log.info("captured the decode step for %d sequences%s", rows, " with adapters" if with_lora else "")
        graph, out = entry
        graph.replay()
        return out
