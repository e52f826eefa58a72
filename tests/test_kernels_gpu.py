"""The Triton kernels at real sizes (Qwen2.5-7B shapes, bf16) against their plain-torch references, on CUDA.

    python -m pytest -q -m gpu tests/test_kernels_gpu.py
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16_TOL = 2e-2


@pytest.fixture(autouse=True)
def _kernels_importable():
    from dark.models.decoder import kernel_module

    kernel_module()  # dark.kernels, also in a checkout on PYTHONPATH without an install


def rel_err(out, ref) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("batch,max_ctx", [(1, 384), (1, 8192), (32, 2048)])
def test_paged_decode_qwen_shapes(batch, max_ctx):
    from dark.kernels.paged_attention import paged_decode, paged_decode_reference

    heads, kvh, d, bs = 28, 4, 128, 16
    g = torch.Generator(device="cuda").manual_seed(batch + max_ctx)
    pages = -(-max_ctx // bs)
    blocks = batch * pages + 8
    kc = torch.randn(blocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(blocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(blocks, device="cuda", generator=g)[:batch * pages].view(batch, pages).to(torch.int32)
    ctx = torch.randint(1, max_ctx + 1, (batch,), device="cuda", generator=g)
    ctx[0] = max_ctx
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = paged_decode(q, kc, vc, tables, ctx, d ** -0.5)
    ref = paged_decode_reference(q, kc, vc, tables, ctx, d ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("fan_in,fan_out", [(3584, 3584), (3584, 512), (3584, 18944), (18944, 3584), (3584, 152064)])
def test_lora_qwen_shapes(tokens, fan_in, fan_out):
    from dark.kernels.lora import lora_apply, lora_reference

    g = torch.Generator(device="cuda").manual_seed(fan_in + fan_out + tokens)
    slots, max_rank, rank = 8, 64, 16
    A = torch.zeros(slots, max_rank, fan_in, device="cuda", dtype=torch.bfloat16)
    B = torch.zeros(slots, max_rank, fan_out, device="cuda", dtype=torch.bfloat16)
    A[:, :rank] = torch.randn(slots, rank, fan_in, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    B[:, :rank] = torch.randn(slots, rank, fan_out, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    x = torch.randn(tokens, fan_in, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.randn(tokens, fan_out, device="cuda", generator=g).to(torch.bfloat16)
    token_slots = torch.randint(-1, slots, (tokens,), device="cuda", generator=g)
    token_slots[0] = 3
    out = lora_apply(x, y.clone(), A, B, token_slots, rank)
    ref = lora_reference(x, y, A, B, token_slots, rank)
    assert rel_err(out, ref) < BF16_TOL
    delta, delta_ref = out.double() - y.double(), ref.double() - y.double()
    assert (delta - delta_ref).norm() <= BF16_TOL * delta_ref.norm() + 1e-3


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("splits", [[3584, 512, 512], [18944, 18944]])
def test_grouped_lora_qwen_shapes(tokens, splits):
    """The fused q/k/v and gate/up groups of Qwen2.5-7B: one shrink and one expand for the whole group."""
    from dark.kernels.lora import lora_apply, lora_reference

    g = torch.Generator(device="cuda").manual_seed(sum(splits) + tokens)
    slots, max_rank, rank, fan_in = 8, 64, 16, 3584
    A = torch.zeros(slots, len(splits) * max_rank, fan_in, device="cuda", dtype=torch.bfloat16)
    B = torch.zeros(slots, max_rank, sum(splits), device="cuda", dtype=torch.bfloat16)
    for m in range(len(splits)):
        A[:, m * max_rank:m * max_rank + rank] = torch.randn(slots, rank, fan_in, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    B[:, :rank] = torch.randn(slots, rank, sum(splits), device="cuda", generator=g).to(torch.bfloat16) * 0.02
    x = torch.randn(tokens, fan_in, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.randn(tokens, sum(splits), device="cuda", generator=g).to(torch.bfloat16)
    token_slots = torch.randint(-1, slots, (tokens,), device="cuda", generator=g)
    token_slots[0] = 3
    out = lora_apply(x, y.clone(), A, B, token_slots, rank, splits=splits, stride=max_rank)
    ref = lora_reference(x, y, A, B, token_slots, rank, splits=splits, stride=max_rank)
    delta, delta_ref = out.double() - y.double(), ref.double() - y.double()
    assert (delta - delta_ref).norm() <= BF16_TOL * delta_ref.norm() + 1e-3


def test_norm_rope_qwen_shapes():
    from dark.kernels.norm_rope import rms_norm, rms_norm_reference, rotary, rotary_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 3584, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(3584, device="cuda", generator=g).add(0.5).to(torch.bfloat16)
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)) < 1e-2
    q = torch.randn(32, 28, 128, device="cuda", generator=g).to(torch.bfloat16)
    ang = torch.rand(32, 64, device="cuda", generator=g) * 100
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    assert rel_err(rotary(q, cos, sin), rotary_reference(q, cos, sin)) < 1e-2
