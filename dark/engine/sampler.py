"""Per-request token choice: greedy, or temperature with top-k / top-p, seeded per request when asked."""
from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
    """logits [batch, vocab] (fp32) -> one token id per sequence, and their log-probabilities if any asked."""
    tokens, chosen = sample_on_device(logits, seqs)
    return tokens.tolist(), chosen.tolist() if chosen is not None else None


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sample() without waiting for the device: token ids [batch] (int64) and their log-probabilities [batch]
    (fp32, None unless a sequence asked) as tensors on logits' device, queued behind the step that made logits.
    logits may be in the model's dtype (a decode step's): the argmax is the same, and the rows that need more
    (temperature, log-probabilities) widen to fp32 first."""
    tokens = _choose(logits, seqs)
    if not any(s.params.logprobs for s in seqs):
        return tokens, None
    return tokens, logits.float().log_softmax(-1).gather(1, tokens[:, None])[:, 0]


def _choose(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
    if not rows:
        return greedy
    out = greedy.clone()
    idx = torch.tensor(rows, device=logits.device)
    sub = logits[idx].float() / torch.tensor([seqs[i].params.temperature for i in rows], device=logits.device)[:, None]
    top_k = [seqs[i].params.top_k for i in rows]
    if any(top_k):
        k = torch.tensor([t if t > 0 else sub.shape[1] for t in top_k], device=logits.device)
        kth = sub.sort(dim=-1, descending=True).values.gather(1, (k - 1).clamp(max=sub.shape[1] - 1)[:, None])
        sub = sub.masked_fill(sub < kth, float("-inf"))
    if any(seqs[i].params.top_p < 1 for i in rows):  # decided on the host: no wait for the device
        top_p = torch.tensor([seqs[i].params.top_p for i in rows], device=logits.device)
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already cover top_p; the first one always stays
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        sub = sub.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = sub.softmax(-1)
    free = [j for j, i in enumerate(rows) if seqs[i].params.seed is None]
    if free:  # the unseeded rows in one draw, not a launch or more per row
        at = idx if len(free) == len(rows) else idx[free]
        out[at] = torch.multinomial(probs if len(free) == len(rows) else probs[free], 1)[:, 0]
    for j, i in enumerate(rows):
        seq = seqs[i]
        if seq.params.seed is None:
            continue
        if seq.generator is None:
            seq.generator = torch.Generator(device=logits.device).manual_seed(seq.params.seed)
        out[i] = torch.multinomial(probs[j], 1, generator=seq.generator)[0]
    return out
