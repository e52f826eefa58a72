"""Runs one scheduled step through the model: flat batch in, one sampled token per finished prefill/decode out."""
from __future__ import annotations

import torch

from ..lora.slots import AdapterSlots
from ..models.decoder import CausalLM
from .attention import KVCache, PagedAttention
from .sampler import sample
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, slots: AdapterSlots):
        self.model, self.cache, self.slots = model, cache, slots
        self.device = cache.data.device

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> dict[int, tuple[int, float | None]]:
        """Compute the scheduled tokens; sequences whose chunk reaches their end get a sampled token.

        Returns {sequence id: (token, its log-probability or None)}.
        """
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
