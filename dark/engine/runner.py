"""Runs one scheduled step through the model: flat batch in, one sampled token per finished prefill/decode out.

On CUDA, a step that only decodes (one new token per sequence) takes the fast path: its inputs go into fixed
device buffers from pinned host ones (the block tables only when one changed; a greedy graph writes its tokens where
the step after it reads its inputs), attention reads the paged cache through the Triton kernel, LoRA
runs through the per-token slot kernels, and the whole forward (LM head included) is replayed from a CUDA
graph captured once per batch-size bucket, with or without adapters. When nothing waits to join, the step
after it is launched on the sampled tokens still on the device before they are read back (the engine's host
work between two steps then overlaps the next one). Prefill and mixed steps, and the CPU, take the plain-torch
path. DARK_KERNELS=0 or DARK_CUDA_GRAPHS=0 turn the fast path or its graphs off, DARK_DECODE_AHEAD=0 the
launching ahead.
"""
from __future__ import annotations

import logging
import os

import torch

from ..lora.slots import AdapterSlots, SlotLoRA
from ..models.decoder import CausalLM, kernel_module
from .attention import KVCache, PagedAttention, PagedDecodeAttention
from .sampler import sample, sample_on_device
from .sequence import Sequence

log = logging.getLogger(__name__)

# above 128 rows a decode step's matmuls grow with every row (below, they take the weights' read time whatever the
# rows), so the buckets there are 16 apart: a batch pads to at most 15 rows more
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160, 176, 192, 208, 224, 240, 256)
# rows of the decode input buffer: token id, position, cache slot, context length, adapter slot
_IDS, _POS, _SLOT, _CTX, _LORA, _PREV = range(6)  # _PREV: the row of the step before (launched ahead)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, slots: AdapterSlots):
        self.model, self.cache, self.slots = model, cache, slots
        self.device = cache.data.device
        self._buffers_for = 0  # decode buffers are made on the first fast step
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._replay_stream = None  # the stream the graphs replay on (the engine's)
        # a stream of a partition of the SMs (dark.engine.green) that steps may run on: graphs replayed there are
        # captured there, since a graph's kernels run where they were captured, whatever stream replays them
        self.partition: torch.cuda.Stream | None = None
        self.partition_sms: int | None = None  # its SMs: the kernels that size their grids by SMs plan for these
        self._pool = None
        self.fast_steps = 0  # decode steps that took the fast path
        # launch the next decode step before this one's tokens are back: "graphs" where decode steps are CUDA
        # graphs (elsewhere the step launched ahead would run before the tokens are returned: a step more of
        # latency, for nothing), "always", or "never" (DARK_DECODE_AHEAD=0)
        self.lookahead = "never" if os.environ.get("DARK_DECODE_AHEAD", "1") == "0" else "graphs"
        self.ahead_launched = self.ahead_used = 0  # decode steps launched early, and those the engine then took
        self.ahead_narrowed = 0  # of those launched, the ones without the sequences that the step before ended
        self.tables_skipped = 0  # fast steps whose block tables were already on the device (no copy)
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
        released by the allocator, and capturing into its old handle again fails. A replay may still be queued
        (a step launched ahead, or the one just launched when the buffers grow): its graph and memory stay until
        the device is past it."""
        if self._graphs and self._replay_stream is not None:
            self._replay_stream.synchronize()
        self._graphs.clear()
        self._pool = None
        self._ahead = None

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], ahead: bool = False) -> dict[int, tuple[int, float | None]]:
        """Compute the scheduled tokens; sequences whose chunk reaches their end get a sampled token.

        ahead: the next step is likely the same sequences decoding on (nothing waits to join them), so a decode
        step may launch it before returning (see _run_decode).

        Returns {sequence id: (token, its log-probability or None)}.
        """
        if self.partition is None or torch.cuda.current_stream(self.device) != self.partition:
            return self._run(batch, ahead)
        # on serving's partition of the SMs, kernels that size their grids by SMs plan for its SMs alone
        with kernel_module().sm_budget(self.partition_sms):
            return self._run(batch, ahead)

    def _run(self, batch: list[tuple[Sequence, int]], ahead: bool) -> dict[int, tuple[int, float | None]]:
        if self.fast_decode and all(n == 1 and seq.num_computed + 1 == len(seq) for seq, n in batch):
            return self._run_decode(batch, ahead)
        self._ahead = None
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
        attn = PagedAttention(self.cache, q_lens, ctx_lens, tables, torch.tensor(slot_mapping, device=dev),
                              decode_kernel=self.fast_decode)
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
        """Pinned host and device buffers for `rows` sequences of up to `width` blocks; graphs die with them.

        The host side comes twice (a step launched ahead fills one while the other's copy may still be queued),
        each with the block-table rows last written into it."""
        if rows <= self._buffers_for and width <= self._bt_dev.shape[1]:
            return
        rows = max(rows, self._buffers_for, GRAPH_BUCKETS[-1])
        # wide enough for the longest context from the start (a few MB), so graphs are rarely captured again
        longest = min(self.cache.num_blocks, 4096)
        width = max(width, 64, longest, self._bt_dev.shape[1] * 2 if self._buffers_for else 0)
        self._drop_graphs()  # a step launched ahead goes with them
        pin = self.device.type == "cuda"
        self._host = [_HostSide(rows, width, pin) for _ in range(2)]
        self._turn = 0
        self._meta_dev = torch.zeros(6, rows, dtype=torch.int64, device=self.device)
        self._bt_dev = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        # in the model's dtype, as the LM head makes them; the sampled rows widen to fp32 when they are read
        self._logits = torch.empty(rows, self.model.config.vocab_size, dtype=self.model.lm_head.weight.dtype,
                                   device=self.device)
        # per row of the device's block table: (the block table list, its length) that was last copied there
        self._bt_dev_rows: list = [None] * rows
        self._buffers_for = rows

    def _forward_decode(self, rows: int, with_lora: bool, greedy: bool = False) -> torch.Tensor:
        """The captured region: logits [rows, vocab] from the decode buffers' first `rows` entries, written into
        the first rows of one buffer that every graph shares (a graph's own output would stay allocated for as
        long as the graph lives: ~0.5 GB over the batch-size buckets of a 152k vocabulary). greedy: the step's
        tokens too, each row's argmax written over the rows' token ids in the decode meta (no fp32 copy of the logits,
        no launches after the graph; the step after, launched on them, copies no ids: they are its inputs already)."""
        meta = self._meta_dev[:, :rows]
        attn = PagedDecodeAttention(self.cache, meta[_SLOT], self._bt_dev[:rows], meta[_CTX])
        lora = SlotLoRA.with_kernels(self.slots, meta[_LORA]) if with_lora else None
        with kernel_module().dependent_launch():  # each kernel overlaps the tail of the one before (Hopper)
            hidden = self.model.hidden_states(meta[_IDS], meta[_POS], attn, lora)
            out = self._logits[:rows]
            out.copy_(self.model.lm_head(hidden, lora))
            if greedy:
                torch.argmax(out, dim=-1, out=self._meta_dev[_IDS, :rows])
        return out

    def _run_decode(self, batch: list[tuple[Sequence, int]], ahead: bool) -> dict[int, tuple[int, float | None]]:
        """One decode step. With `ahead` (on CUDA graphs), the step after it is launched before this one's tokens
        are read back, on the device's copy of them, so the device never waits for the host's work between two
        steps; the next call uses it when its batch is the one foreseen (the same sequences, each one token on,
        the same adapter weights), and forgets it otherwise (what it wrote in the cache is written again)."""
        self.fast_steps += 1
        seqs = [seq for seq, _ in batch]
        step, self._ahead = self._ahead, None
        if step is not None and step.foresaw(seqs, self.slots.version):
            self.ahead_used += 1
        else:
            step = self._launch(seqs, 0, None)
        go = self.lookahead == "always" or (self.lookahead == "graphs" and self.use_graphs)
        rows = self._going_on(seqs) if ahead and go else None
        if rows:
            self._ahead = self._launch([seqs[i] for i in rows], 1, step, None if len(rows) == len(seqs) else rows)
            self.ahead_launched += 1
            self.ahead_narrowed += len(rows) < len(seqs)
        return step.collect()

    def _going_on(self, seqs: list[Sequence]) -> list[int] | None:
        """The rows whose next step can be launched before their tokens are known, or None when none should be:
        a sequence whose token now ends it by length is left out of the next step (the others go on without it);
        any other sequence needs the cache block of its next position already allocated, and no seeded sampling
        (a step thrown away would use up a seeded generator's draw)."""
        bs = self.cache.block_size
        rows = []
        for i, seq in enumerate(seqs):
            nxt = seq.num_computed + 1
            if nxt + 1 >= seq.max_len:
                continue
            if nxt // bs >= len(seq.block_table) or seq.params.seed is not None:
                return None
            rows.append(i)
        return rows

    def _launch(self, seqs: list[Sequence], on: int, prev: "_Step | None", prev_rows: list[int] | None = None) -> "_Step":
        """Queue one decode step of `seqs` at their positions `num_computed + on` (on = 1: the step after
        `prev`, whose sampled tokens, still on the device, are its inputs: row prev_rows[i] of them for seqs[i],
        or row i when prev_rows is None) and the sampling after it."""
        bs = self.cache.block_size
        b = len(seqs)
        rows = next((g for g in GRAPH_BUCKETS if g >= b), b) if self.use_graphs else b
        self._ensure_buffers(rows, max(len(seq.block_table) for seq in seqs))
        host = self._host[self._turn]
        self._turn ^= 1
        host.ready()  # its last copy to the device has run
        meta, bt = host.meta.numpy(), host.bt.numpy()
        meta[:, b:rows] = 0
        meta[_SLOT, b:rows] = meta[_LORA, b:rows] = -1  # padded rows: nothing stored, no adapter, empty context
        pos = [seq.num_computed + on for seq in seqs]
        if prev is None:
            meta[_IDS, :b] = [seq.token_ids[p] for seq, p in zip(seqs, pos)]
        meta[_POS, :b] = pos
        meta[_SLOT, :b] = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, pos)]
        meta[_CTX, :b] = [p + 1 for p in pos]
        meta[_LORA, :b] = [seq.slot for seq in seqs]
        if prev_rows is not None:
            meta[_PREV, :b] = prev_rows
        # prev's tokens where this step reads its ids (a greedy graph writes them there): the ids' row is not copied
        # (unless the buffers were made anew since prev)
        in_place = (prev is not None and prev.ids_in_meta
                    and prev.tokens.untyped_storage().data_ptr() == self._meta_dev.untyped_storage().data_ptr())
        # the whole of meta (6 x the buffers' rows, 12 KB at 256) or all of it but the ids, not its first `rows`
        # columns: such a slice is not contiguous, and torch would copy it through a pageable staging tensor and a
        # kernel (bench/probe_step_gaps.py)
        if in_place:
            self._meta_dev[_IDS + 1:].copy_(host.meta[_IDS + 1:], non_blocking=True)
        else:
            self._meta_dev.copy_(host.meta, non_blocking=True)
        # the block tables only when a row differs from what the device holds (a table grows by a block every
        # block_size tokens; most steps copy none). A table only grows in place, or is replaced by a new list when
        # its blocks are freed: the same list at the same length is the same row
        written, on_dev, stale = host.bt_rows, self._bt_dev_rows, False
        for i, seq in enumerate(seqs):
            if not _holds(written[i], seq.block_table):
                bt[i, :len(seq.block_table)] = seq.block_table
                written[i] = (seq.block_table, len(seq.block_table))
            stale = stale or not _holds(on_dev[i], seq.block_table)
        if stale:
            width = max(len(seq.block_table) for seq in seqs)
            self._bt_dev[:rows, :width].copy_(host.bt[:rows, :width], non_blocking=True)
            on_dev[:b] = written[:b]
            on_dev[b:rows] = [None] * (rows - b)  # padded rows: whatever the host buffer held, perhaps cut at width
        else:
            self.tables_skipped += 1
        host.copied()
        if prev is not None and prev_rows is None:
            if not in_place:
                self._meta_dev[_IDS, :b].copy_(prev.tokens)
        elif prev is not None:  # through the pinned copy: a list made into an index would wait for the device
            # into a new tensor first: prev's tokens may be the very row written
            picked = torch.index_select(prev.tokens, 0, self._meta_dev[_PREV, :b])
            self._meta_dev[_IDS, :b].copy_(picked)
        with_lora = any(seq.slot >= 0 for seq in seqs)
        if rows in GRAPH_BUCKETS and self.use_graphs:
            # greedy rows only, no log-probabilities: the graph picks the tokens itself
            greedy = all(seq.params.temperature == 0 and not seq.params.logprobs for seq in seqs)
            logits = self._replay(rows, with_lora, greedy)
            if greedy:
                return _Step(seqs, pos, self.slots.version, self._meta_dev[_IDS, :b], None, host, ids_in_meta=True)
        else:
            logits = self._forward_decode(rows, with_lora)
        tokens, logprobs = sample_on_device(logits[:b], seqs)
        return _Step(seqs, pos, self.slots.version, tokens, logprobs, host)

    def _replay(self, rows: int, with_lora: bool, greedy: bool) -> torch.Tensor:
        key = (rows, with_lora, greedy) + ((self.slots.version, self.slots.kernel_rank()) if with_lora else ())
        stream = torch.cuda.current_stream(self.device)
        confined = self.partition is not None and stream == self.partition
        if confined:
            key += (stream.cuda_stream,)
        entry = self._graphs.get(key)
        if entry is None:
            # warm-up outside the graph (Triton compiles, cuBLAS picks its kernels); it stores the same keys
            # and values that the replay below stores again. A greedy one writes its tokens over the ids: they
            # are put back for the replay
            ids = self._meta_dev[_IDS, :rows].clone()
            self._forward_decode(rows, with_lora, greedy)
            self._meta_dev[_IDS, :rows].copy_(ids)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a training thread may allocate on its own stream meanwhile
            with torch.cuda.graph(graph, pool=self._pool, stream=stream if confined else None,
                                  capture_error_mode="thread_local"):
                out = self._forward_decode(rows, with_lora, greedy)
            entry = self._graphs[key] = (graph, out)
            log.info("captured the decode step for %d sequences%s%s%s", rows, " with adapters" if with_lora else "",
                     ", greedy" if greedy else "", " in serving's partition of the SMs" if confined else "")
        graph, out = entry
        self._replay_stream = stream
        graph.replay()
        return out


def _holds(row, table: list[int]) -> bool:
    """Whether a buffer row recorded as `row` ((block table list, its length) last put there) holds `table`."""
    return row is not None and row[0] is table and row[1] == len(table)


class _HostSide:
    """One set of pinned host buffers for the decode inputs, and an event after their last copy to the device."""

    def __init__(self, rows: int, width: int, pin: bool):
        self.meta = torch.zeros(6, rows, dtype=torch.int64, pin_memory=pin)
        self.bt = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin)
        self.bt_rows: list = [None] * rows  # per row: (block table list, its length) last written there
        self.tokens = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)  # a step's sampled tokens, read back
        self.logprobs = torch.zeros(rows, dtype=torch.float32, pin_memory=pin)
        self.event = torch.cuda.Event() if pin else None

    def copied(self) -> None:
        if self.event is not None:
            self.event.record()

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _Step:
    """A launched decode step: what it computed (sequences, their positions, block tables and adapter slots, the
    adapters' version) and its sampled tokens, on their way to the pinned buffers of the host side it used."""

    def __init__(self, seqs, pos, version, tokens, logprobs, host: _HostSide, ids_in_meta: bool = False):
        self.seqs, self.pos, self.version = seqs, pos, version
        self.tables = [seq.block_table for seq in seqs]
        self.slots = [seq.slot for seq in seqs]
        self.tokens = tokens  # on the device: the inputs of a step launched after this one
        self.ids_in_meta = ids_in_meta  # tokens is the decode meta's ids row, which the next graph reads
        b = len(seqs)
        pin = host.event is not None
        self._tokens = host.tokens[:b]
        self._tokens.copy_(tokens, non_blocking=pin)
        self._logprobs = None
        if logprobs is not None:
            self._logprobs = host.logprobs[:b]
            self._logprobs.copy_(logprobs, non_blocking=pin)
        self._event = torch.cuda.Event() if pin else None
        if self._event is not None:
            self._event.record()

    def foresaw(self, seqs: list[Sequence], version: int) -> bool:
        """Whether this step is the one the engine now asks for: the same sequences in the same order, each
        now at the position it computed (the token before it appended), with the same block table and adapter
        slot, and the same adapter weights."""
        return (version == self.version and len(seqs) == len(self.seqs)
                and all(a is b and a.num_computed == p and len(a) == p + 1 and a.block_table is t and a.slot == s
                        for a, b, p, t, s in zip(seqs, self.seqs, self.pos, self.tables, self.slots)))

    def collect(self) -> dict[int, tuple[int, float | None]]:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._tokens.tolist()
        logprobs = self._logprobs.tolist() if self._logprobs is not None else None
        return {s.id: (t, logprobs[i] if logprobs else None) for i, (s, t) in enumerate(zip(self.seqs, tokens))}
