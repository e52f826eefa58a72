"""Token choice for a batch that mixes greedy, unseeded and seeded rows (dark.engine.sampler)."""
from __future__ import annotations

import torch

from dark.engine.sampler import sample
from dark.engine.sequence import SamplingParams, Sequence


def seq(**params) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(max_tokens=4, **params), None, lambda out: None, 64)


def test_mixed_batch_keeps_each_rows_rule():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(7, vocab)
    logits[:, 10] += 30.0  # token 10 dominates every row
    logits[3, 20] = logits[3, 10]  # row 3: tokens 10 and 20 tie at the top
    seqs = [seq(), seq(temperature=1.0, top_k=1), seq(temperature=0.8, seed=5), seq(temperature=1.0, top_k=2),
            seq(), seq(temperature=1.0, top_p=0.5), seq(temperature=1.0, seed=7, top_k=1)]
    tokens, _ = sample(logits, seqs)
    assert tokens[0] == tokens[4] == 10           # greedy
    assert tokens[1] == tokens[6] == 10           # top_k 1, unseeded and seeded
    assert tokens[3] in (10, 20)                  # top_k 2 of a tie
    assert tokens[5] == 10                        # top_p 0.5: the dominant token alone covers it
    # a seeded row draws the same token as it does alone, whatever else the batch holds
    alone, _ = sample(logits[2:3].clone(), [seq(temperature=0.8, seed=5)])
    assert tokens[2] == alone[0]


def test_unseeded_rows_follow_their_distribution():
    """Many unseeded rows drawn together: each row draws from its own (tempered, top-k) distribution."""
    torch.manual_seed(1)
    n = 4000
    logits = torch.full((n, 8), -1e9)
    logits[:, 0] = logits[:, 1] = 0.0              # two equally likely tokens ...
    logits[n // 2:, 2] = 0.0                       # ... three in the second half
    seqs = [seq(temperature=1.0) for _ in range(n)]
    tokens, _ = sample(logits, seqs)
    first, second = torch.tensor(tokens[:n // 2]), torch.tensor(tokens[n // 2:])
    assert set(first.tolist()) == {0, 1} and set(second.tolist()) == {0, 1, 2}
    assert abs((first == 0).float().mean().item() - 0.5) < 0.05
    assert abs((second == 2).float().mean().item() - 1 / 3) < 0.05


def test_logits_in_the_models_dtype_choose_as_fp32_does():
    """A decode step hands over bf16 logits: greedy rows pick the fp32 argmax, seeded rows draw the same token as
    from fp32 (the rows widen before the temperature), and log-probabilities come back in fp32."""
    from dark.engine.sampler import sample_on_device

    torch.manual_seed(3)
    logits = torch.randn(6, 300).to(torch.bfloat16)
    seqs = [seq(), seq(logprobs=True), seq(temperature=0.7, seed=11), seq(temperature=1.3, seed=2, top_p=0.9),
            seq(), seq(temperature=0.5, seed=4, top_k=5)]
    ref_seqs = [seq(**{k: getattr(s.params, k) for k in ("temperature", "seed", "top_p", "top_k", "logprobs")})
                for s in seqs]
    tokens, logprobs = sample_on_device(logits, seqs)
    ref_tokens, ref_logprobs = sample_on_device(logits.float(), ref_seqs)
    assert tokens.tolist() == ref_tokens.tolist()
    assert tokens[0] == logits[0].float().argmax() and tokens[4] == logits[4].float().argmax()
    assert logprobs.dtype == torch.float32 and torch.equal(logprobs, ref_logprobs)
