"""Continuous batching: each step mixes the running sequences' next tokens with new prompts' prefill chunks."""
from __future__ import annotations

from collections import deque

from ..lora.manager import AdapterManager
from .block_manager import BlockManager
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, adapters: AdapterManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks, self.adapters = blocks, adapters
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # sequences that cannot start, with why (their adapter version went away, or could not be loaded): taken
        # out of the queue by schedule(), failed by the engine
        self.failed: list[tuple[Sequence, Exception]] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick (sequence, number of tokens to compute) pairs for one step within the token budget."""
        budget, batch = self.max_tokens, []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted below to make room for an earlier sequence
                continue
            n = min(len(seq) - seq.num_computed, budget)
            if n <= 0:
                continue
            while not self.blocks.ensure(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.append((seq, n))
                budget -= n
                if n == 1 and len(seq) < seq.max_len:
                    # the next position's block too where one is free, so that the runner can launch the step
                    # after this one before its token is back (a block a step early; none taken from others)
                    self.blocks.ensure(seq, len(seq) + 1)
        loading = []  # waiting for their adapter version to reach the device: the ones behind them go first
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.adapter is not None:
                try:
                    slot = self.adapters.acquire(seq.adapter)
                except Exception as e:  # e.g. the adapter was deleted while the request waited
                    self.waiting.popleft()
                    self.failed.append((seq, e))
                    continue
                if slot is None:
                    if self.adapters.loading(seq.adapter):
                        loading.append(self.waiting.popleft())
                        continue
                    break  # every slot serves running sequences: wait for one to finish
                seq.slot = slot
            if not self.blocks.allocate(seq):
                self._release_slot(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed, budget)
            batch.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(loading))  # still first in line, in their order
        return batch

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.adapters.release(seq.slot)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Give a sequence's blocks back; it recomputes its tokens when it is scheduled again."""
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        self._release_slot(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        self._release_slot(seq)
        seq.status = Status.FINISHED
