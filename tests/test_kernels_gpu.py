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


@pytest.mark.parametrize("stages", [None, 2, 3])
@pytest.mark.parametrize("batch,max_ctx", [(1, 384), (1, 8192), (32, 2048)])
def test_paged_decode_qwen_shapes(batch, max_ctx, stages):
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
    out = paged_decode(q, kc, vc, tables, ctx, d ** -0.5, num_stages=stages)
    ref = paged_decode_reference(q, kc, vc, tables, ctx, d ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("fan_in,fan_out", [(3584, 3584), (3584, 512), (3584, 18944), (18944, 3584), (3584, 152064)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_qwen_shapes(tokens, fan_in, fan_out, fused):
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
    out = lora_apply(x, y.clone(), A, B, token_slots, rank, fused=fused)
    ref = lora_reference(x, y, A, B, token_slots, rank)
    assert rel_err(out, ref) < BF16_TOL
    delta, delta_ref = out.double() - y.double(), ref.double() - y.double()
    assert (delta - delta_ref).norm() <= BF16_TOL * delta_ref.norm() + 1e-3


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("splits", [[3584, 512, 512], [18944, 18944]])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_grouped_lora_qwen_shapes(tokens, splits, fused):
    """The q/k/v and gate/up groups of Qwen2.5-7B: one launch (fused) or one shrink and one expand for the group."""
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
    out = lora_apply(x, y.clone(), A, B, token_slots, rank, splits=splits, stride=max_rank, fused=fused)
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


def _ulps(out, ref) -> int:
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[out.dtype]
    return int((out.view(bits).long() - ref.view(bits).long()).abs().max()) if out.numel() else 0


@pytest.mark.parametrize("tokens", [1, 32, 256])
def test_add_rms_norm_qwen_shapes(tokens):
    """The residual add and the RMSNorm after it in one launch at Qwen2.5-7B's hidden size (3584, bf16): the sum
    is torch's x + delta to the bit (both round to nearest even), the norm rms_norm's of it (within an ulp: an FMA
    may contract differently) and the reference's to bf16 rounding."""
    from dark.kernels.norm_rope import add_rms_norm, add_rms_norm_reference, rms_norm

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, 3584, device="cuda", generator=g) * 4).to(torch.bfloat16)
    delta = torch.randn(tokens, 3584, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(3584, device="cuda", generator=g).add(0.5).to(torch.bfloat16)
    normed, summed = add_rms_norm(x, delta, w, 1e-6)
    ref_normed, ref_summed = add_rms_norm_reference(x, delta, w, 1e-6)
    assert torch.equal(summed, ref_summed)
    assert _ulps(normed, rms_norm(ref_summed, w, 1e-6)) <= 1
    assert rel_err(normed, ref_normed) < 1e-2


def _qkv_store_case(tokens, g, dtype=torch.bfloat16):
    """A Qwen2.5-7B layer's decode q/k/v (28 query heads, 4 KV heads of 128): y, cos, sin, the layer's caches
    (blocks of 16) and slots scattered over them, the last quarter of the rows -1 (a graph bucket's padding)."""
    nh, nkv, d, bs, blocks = 28, 4, 128, 16, 512
    y = torch.randn(tokens, (nh + 2 * nkv) * d, device="cuda", generator=g).to(dtype)
    ang = torch.rand(tokens, d // 2, device="cuda", generator=g) * 1000
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    kc = torch.randn(blocks, bs, nkv, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(blocks, bs, nkv, d, device="cuda", generator=g).to(dtype)
    slots = torch.randperm(blocks * bs, device="cuda", generator=g)[:tokens]
    if tokens > 1:
        slots[tokens - tokens // 4:] = -1
    return (nh, nkv, d), y, cos, sin, kc, vc, slots


@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_qkv_rotary_store_qwen_shapes(tokens):
    """Rotary of q and k and the KV store in one launch: q and the caches as rotary + store_kv leave them (within
    an ulp: an FMA may contract differently; v to the bit), the reference's to bf16 rounding, and no cache entry
    outside the step's slots touched."""
    from dark.kernels.norm_rope import rotary
    from dark.kernels.paged_attention import qkv_rotary_store, qkv_rotary_store_reference, store_kv

    g = torch.Generator(device="cuda").manual_seed(tokens)
    (nh, nkv, d), y, cos, sin, kc, vc, slots = _qkv_store_case(tokens, g)
    k0, v0 = kc.clone(), vc.clone()
    k_ref, v_ref, k_old, v_old = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = qkv_rotary_store(y, nh, nkv, d, cos, sin, kc, vc, slots)
    q_ref = qkv_rotary_store_reference(y, nh, nkv, d, cos, sin, k_ref, v_ref, slots)
    qs, ks, vs = y.split([nh * d, nkv * d, nkv * d], -1)
    q_old = rotary(qs.reshape(tokens, nh, d), cos, sin)
    store_kv(rotary(ks.reshape(tokens, nkv, d), cos, sin), vs.reshape(tokens, nkv, d), k_old, v_old, slots)
    assert _ulps(q, q_old) <= 1 and _ulps(kc, k_old) <= 1 and torch.equal(vc, v_old)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(kc, k_ref) < 1e-2 and torch.equal(vc, v_ref)
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots[slots >= 0]] = False
    for c, c0 in ((kc, k0), (vc, v0)):
        assert torch.equal(c.view(-1, nkv, d)[untouched], c0.view(-1, nkv, d)[untouched])


def test_fused_decode_attention_in_a_cuda_graph():
    """A decode layer's attention through the fused route captured in one CUDA graph (qkv_rotary_store, then
    paged_decode, as PagedDecodeAttention.attend_fused_qkv runs them): replays after new slots, positions and
    contexts are copied into the static tensors store at the new slots and give the reference attention."""
    from dark.kernels.paged_attention import (paged_decode, paged_decode_reference, qkv_rotary_store,
                                              qkv_rotary_store_reference)

    g = torch.Generator(device="cuda").manual_seed(5)
    rows = 8
    (nh, nkv, d), y, cos, sin, kc, vc, _ = _qkv_store_case(rows, g)
    blocks, bs = kc.shape[:2]
    pages = 8
    tables = torch.randperm(blocks, device="cuda", generator=g)[:rows * pages].view(rows, pages).to(torch.int32)
    slots = torch.full((rows,), -1, device="cuda", dtype=torch.long)
    ctx = torch.zeros(rows, device="cuda", dtype=torch.long)
    out = torch.empty(rows, nh, d, device="cuda", dtype=torch.bfloat16)

    def step():
        q = qkv_rotary_store(y, nh, nkv, d, cos, sin, kc, vc, slots)
        out.copy_(paged_decode(q, kc, vc, tables, ctx, d ** -0.5))

    graph = _capture(step)
    for replay in range(3):
        lengths = torch.randint(1, pages * bs + 1, (rows,), device="cuda", generator=g)
        lengths[-1] = 0  # a padded row: nothing stored, zeros out
        pos = (lengths - 1).clamp_min(0)
        new_slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs
        new_slots[-1] = -1
        y.copy_(torch.randn(y.shape, device="cuda", generator=g).to(y.dtype))
        ang = pos[:, None].float() * (10000 ** (-torch.arange(0, d, 2, device="cuda") / d))[None]
        cos.copy_(torch.cat([ang, ang], -1).cos())
        sin.copy_(torch.cat([ang, ang], -1).sin())
        slots.copy_(new_slots)
        ctx.copy_(lengths)
        k_ref, v_ref = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        q_ref = qkv_rotary_store_reference(y, nh, nkv, d, cos, sin, k_ref, v_ref, slots)
        assert rel_err(kc, k_ref) < 1e-2 and torch.equal(vc, v_ref), replay
        ref = paged_decode_reference(q_ref, k_ref, v_ref, tables, ctx, d ** -0.5)
        assert rel_err(out, ref) < BF16_TOL and (out[-1] == 0).all(), replay


def test_norm_rope_train_qwen_shapes():
    """The training Functions at a Qwen2.5-7B layer's sizes (512 tokens, hidden 3584, 28/4 heads of 128,
    intermediate 18944, bf16): forward and the input's gradient against autograd through the references."""
    from dark.kernels.norm_rope import (qkv_rotary_reference, qkv_rotary_train, rms_norm_reference, rms_norm_train,
                                        rotary_reference, rotary_train, silu_mul_reference, silu_mul_train)

    T, hidden, nh, nkv, d, inter = 512, 3584, 28, 4, 128, 18944
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    def check(fn, ref_fn, x, *args):
        leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
        outs, refs = fn(leaf, *args), ref_fn(ref_leaf, *args)
        outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
        dys = [randn(*o.shape) for o in outs]
        for o, r in zip(outs, refs):
            assert o.shape == r.shape and o.dtype == r.dtype and rel_err(o, r) < BF16_TOL
        dx, = torch.autograd.grad(outs, leaf, dys)
        ref_dx, = torch.autograd.grad(refs, ref_leaf, dys)
        assert rel_err(dx, ref_dx) < BF16_TOL

    ang = torch.rand(T, d // 2, device="cuda", generator=g) * 100
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    w = torch.rand(hidden, device="cuda", generator=g).add(0.5).to(torch.bfloat16)
    check(rms_norm_train, rms_norm_reference, randn(T, hidden), w, 1e-6)
    check(rotary_train, rotary_reference, randn(T, nh, d), cos, sin)
    check(qkv_rotary_train, qkv_rotary_reference, randn(T, (nh + 2 * nkv) * d), nh, nkv, d, cos, sin)
    check(silu_mul_train, silu_mul_reference, randn(T, 2 * inter), inter)


# the segment (SGMV) kernels at decode sizes: 64 sequences over 32 adapters (each twice, shuffled), 48 of them
# padded to a 64-row graph bucket with -1, one adapter for all 64, 256 sequences over 8 adapters, a batch of one
def _step_slots(mix: str, g) -> torch.Tensor:
    if mix == "64_over_32":
        slots = torch.arange(32, device="cuda").repeat(2)
    elif mix == "48_over_32_padded_64":
        slots = torch.cat([torch.arange(32, device="cuda"), torch.arange(16, device="cuda") * 2,
                           torch.full((16,), -1, device="cuda")])
    elif mix == "64_one_slot":
        slots = torch.full((64,), 7, device="cuda")
    elif mix == "256_over_8":
        slots = torch.arange(8, device="cuda").repeat(32)
    else:
        assert mix == "single"
        return torch.tensor([5], device="cuda")
    return slots[torch.randperm(len(slots), device="cuda", generator=g)]


QWEN_LAYOUTS = {  # (fan_in, member outs): the decoder's four LoRA calls per layer, and the LM head
    "qkv": (3584, [3584, 512, 512]), "o": (3584, [3584]), "gate_up": (3584, [18944, 18944]),
    "down": (18944, [3584]), "lm_head": (3584, [152064]),
}


def _qwen_case(layout, rank, max_rank, slots_n, tokens, dtype, g):
    fan_in, outs = QWEN_LAYOUTS[layout]
    members = len(outs)
    A = torch.zeros(slots_n, members * max_rank, fan_in, device="cuda", dtype=dtype)
    B = torch.zeros(slots_n, max_rank, sum(outs), device="cuda", dtype=dtype)
    for m in range(members):
        A[:, m * max_rank:m * max_rank + rank] = (torch.randn(slots_n, rank, fan_in, device="cuda", generator=g)
                                                  * 0.02).to(dtype)
    B[:, :rank] = (torch.randn(slots_n, rank, sum(outs), device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(tokens, fan_in, device="cuda", generator=g).to(dtype)
    y = torch.randn(tokens, sum(outs), device="cuda", generator=g).to(dtype)
    kw = dict(splits=outs, stride=max_rank) if members > 1 else {}
    return A, B, x, y, kw


def _check_delta(out, ref, y, token_slots, tol):
    none = token_slots < 0
    assert torch.equal(out[none], y[none]), "a token without an adapter must be left alone"
    delta, delta_ref = out.double() - y.double(), ref.double() - y.double()
    assert (delta - delta_ref).norm() <= tol * delta_ref.norm() + 1e-3


@pytest.mark.parametrize("mix", ["64_over_32", "48_over_32_padded_64", "64_one_slot", "256_over_8", "single"])
@pytest.mark.parametrize("layout", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("rank", [16, 8])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_segments_qwen_shapes(mix, layout, rank, fused):
    from dark.kernels.lora import lora_apply, lora_reference, lora_segments

    g = torch.Generator(device="cuda").manual_seed(len(mix) * 100 + len(layout) + rank)
    token_slots = _step_slots(mix, g)
    A, B, x, y, kw = _qwen_case(layout, rank, 64, 32, len(token_slots), torch.bfloat16, g)
    segments = lora_segments(token_slots, 32)  # once per forward, as SlotLoRA.with_kernels does (32 slots)
    out = lora_apply(x, y.clone(), A, B, token_slots, rank, segments=segments, fused=fused, **kw)
    ref = lora_reference(x, y, A, B, token_slots, rank, **kw)
    _check_delta(out, ref, y, token_slots, BF16_TOL)


@pytest.mark.parametrize("layout", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_segments_qwen_shapes_fp32(layout, fused):
    """fp32 factors: the "ieee" dots, to fp32 rounding."""
    from dark.kernels.lora import lora_apply, lora_reference

    g = torch.Generator(device="cuda").manual_seed(len(layout))
    token_slots = _step_slots("64_over_32", g)
    A, B, x, y, kw = _qwen_case(layout, 16, 16, 32, len(token_slots), torch.float32, g)
    out = lora_apply(x, y.clone(), A, B, token_slots, 16, fused=fused, **kw)
    ref = lora_reference(x, y, A, B, token_slots, 16, **kw)
    assert rel_err(out - y, ref - y) < 1e-4


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_lm_head_qwen_shape(fused):
    from dark.kernels.lora import lora_apply, lora_reference

    g = torch.Generator(device="cuda").manual_seed(11)
    token_slots = _step_slots("64_over_32", g)[:16]
    A, B, x, y, kw = _qwen_case("lm_head", 16, 16, 32, 16, torch.bfloat16, g)
    out = lora_apply(x, y.clone(), A, B, token_slots, 16, fused=fused, **kw)
    _check_delta(out, lora_reference(x, y, A, B, token_slots, 16, **kw), y, token_slots, BF16_TOL)


def _capture(step):
    """A CUDA graph of step(), compiled and run once outside the capture first (as the engine warms up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_segments_in_a_cuda_graph(fused):
    """The sort and the kernels (one launch per projection when fused, two otherwise) captured in one CUDA graph
    (as the decode step is): a new mix of slots copied into the static slot tensor gives that mix's deltas on
    replay, with no host sync in the capture."""
    from dark.kernels.lora import lora_apply, lora_reference, lora_segments

    g = torch.Generator(device="cuda").manual_seed(1)
    A, B, x, y, kw = _qwen_case("qkv", 16, 64, 32, 64, torch.bfloat16, g)
    static = _step_slots("64_over_32", g)
    out = y.clone()

    def step():
        out.copy_(y)
        lora_apply(x, out, A, B, static, 16, segments=lora_segments(static, 32), fused=fused, **kw)

    graph = _capture(step)
    for mix in ("48_over_32_padded_64", "64_one_slot", "64_over_32"):
        static.copy_(_step_slots(mix, g))
        graph.replay()
        torch.cuda.synchronize()
        _check_delta(out, lora_reference(x, y, A, B, static, 16, **kw), y, static, BF16_TOL)


def _decode_layer_case(tokens, g):
    """One decoder layer's four LoRA calls at Qwen2.5-7B sizes (32 slots of max rank 64, rank 16, bf16): for each,
    (A, B, x, y, kw, out) with out the buffer a captured step writes."""
    cases = {}
    for layout in ("qkv", "o", "gate_up", "down"):
        A, B, x, y, kw = _qwen_case(layout, 16, 64, 32, tokens, torch.bfloat16, g)
        cases[layout] = (A, B, x, y, kw, y.clone())
    return cases


@pytest.mark.parametrize("tokens,mixes", [(1, ([5], [0], [-1], [31], [5])),
                                          (64, ("64_over_32", "48_over_32_padded_64", "64_one_slot", "64_over_32")),
                                          (256, ("256_over_8", "256_over_8"))])  # two shuffles
def test_lora_fused_decode_layer_in_a_cuda_graph(tokens, mixes):
    """A layer's four LoRA calls (q/k/v, o, gate/up, down), one fused launch each, captured in one CUDA graph with
    the block table: each replay after a new mix of slots (a batch of one: its slot tensor is its table, -1 too)
    gives that mix's deltas, and the fused kernel gives the two kernels' result to bf16 rounding."""
    from dark.kernels.lora import lora_apply, lora_reference, lora_segments

    g = torch.Generator(device="cuda").manual_seed(tokens)
    cases = _decode_layer_case(tokens, g)
    static = torch.tensor(mixes[0], device="cuda") if tokens == 1 else _step_slots(mixes[0], g)

    def step():
        segments = lora_segments(static, 32)
        for A, B, x, y, kw, out in cases.values():
            out.copy_(y)
            lora_apply(x, out, A, B, static, 16, segments=segments, fused=True, **kw)

    graph = _capture(step)
    for mix in mixes:
        static.copy_(torch.tensor(mix, device="cuda") if tokens == 1 else _step_slots(mix, g))
        graph.replay()
        torch.cuda.synchronize()
        for layout, (A, B, x, y, kw, out) in cases.items():
            _check_delta(out, lora_reference(x, y, A, B, static, 16, **kw), y, static, BF16_TOL)
            two = lora_apply(x, y.clone(), A, B, static, 16, fused=False, **kw)
            if (static >= 0).any():
                assert rel_err(out - y, two - y) < 1e-2, layout
            else:
                assert torch.equal(out, y) and torch.equal(two, y), layout


@pytest.mark.parametrize("tokens", [1, 64])
def test_lora_fused_is_one_launch_per_projection(tokens):
    """Launches the profiler sees for a layer's four LoRA calls: four fused kernels, else four shrinks and four
    expands."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from dark.kernels.lora import lora_apply, lora_segments

    g = torch.Generator(device="cuda").manual_seed(3)
    cases = _decode_layer_case(tokens, g)
    slots = torch.tensor([7], device="cuda") if tokens == 1 else _step_slots("64_over_32", g)
    segments = lora_segments(slots, 32)
    for fused in (True, False):  # compiled before the profiled calls
        for A, B, x, y, kw, out in cases.values():
            lora_apply(x, out, A, B, slots, 16, segments=segments, fused=fused, **kw)
    torch.cuda.synchronize()
    for fused, want in ((True, {"_fused_kernel": 4}), (False, {"_shrink_kernel": 4, "_expand_kernel": 4})):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for A, B, x, y, kw, out in cases.values():
                lora_apply(x, out, A, B, slots, 16, segments=segments, fused=fused, **kw)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        if not kernels:
            pytest.skip("the profiler records no CUDA kernels here (no CUPTI)")
        seen = {name: sum(name in k for k in kernels) for name in ("_fused_kernel", "_shrink_kernel", "_expand_kernel")}
        assert {k: v for k, v in seen.items() if v} == want, kernels


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_slot_lora_kernels_qwen_step(fused, monkeypatch):
    """SlotLoRA.with_kernels on 64 decode rows over 32 adapters of rank 16 on every projection, against the dense
    torch path, per fused group; the kernels as DARK_LORA_FUSED picks them."""
    from types import SimpleNamespace

    from dark.config import LoraConfig
    from dark.lora.slots import AdapterSlots, SlotLoRA
    from dark.lora.weights import AdapterWeights
    from dark.models.decoder import kernel_module

    monkeypatch.setattr(kernel_module("lora"), "FUSED", fused)

    shapes = {"q_proj": (3584, 3584), "k_proj": (3584, 512), "v_proj": (3584, 512), "o_proj": (3584, 3584),
              "gate_proj": (3584, 18944), "up_proj": (3584, 18944), "down_proj": (18944, 3584)}
    cfg = SimpleNamespace(projection_shapes=lambda: shapes)
    slots = AdapterSlots(cfg, 32, 64, torch.device("cuda"), torch.bfloat16)
    for s in range(32):
        w = AdapterWeights.init(LoraConfig(r=16, alpha=32, target_modules=tuple(shapes)), shapes, 1, seed=s)
        for a, b in w.tensors.values():
            b.normal_(0, 0.02)
        slots.load(s, w)
    g = torch.Generator(device="cuda").manual_seed(2)
    token_slots = _step_slots("48_over_32_padded_64", g)
    fast = SlotLoRA.with_kernels(slots, token_slots)
    dense = SlotLoRA(slots, sorted({s for s in token_slots.tolist() if s >= 0}), token_slots)
    for group, fan_in, outs in (("qkv", 3584, 4608), ("gate_up", 3584, 37888)):
        x = torch.randn(64, fan_in, device="cuda", generator=g).to(torch.bfloat16)
        y = torch.randn(64, outs, device="cuda", generator=g).to(torch.bfloat16)
        ref = dense.apply_group(0, group, x, y.clone())
        out = fast.apply_group(0, group, x, y.clone())
        _check_delta(out, ref, y, token_slots, BF16_TOL)
    x = torch.randn(64, 18944, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.randn(64, 3584, device="cuda", generator=g).to(torch.bfloat16)
    _check_delta(fast.apply(0, "down_proj", x, y.clone()), dense.apply(0, "down_proj", x, y.clone()), y,
                 token_slots, BF16_TOL)


@pytest.mark.parametrize("n,k,bias", [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False),
                                      (3584, 18944, False), (152064, 3584, False)])
def test_gemv_qwen_shapes(n, k, bias):
    """The batch-1 projections of Qwen2.5-7B (q/k/v with bias, o, gate/up, down, LM head) through the GEMV kernel."""
    from dark.kernels.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    out = gemv(x, w, b).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("n,k,bias", [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False),
                                      (3584, 18944, False), (152064, 3584, False)])
def test_skinny_qwen_shapes(m, n, k, bias):
    """The decode projections of Qwen2.5-7B at 2-16 sequences through the skinny product, eager and replayed twice
    in a CUDA graph on new inputs (the tiles' counters must be back at zero after every call)."""
    from dark.kernels import hopper
    from dark.kernels.skinny import skinny

    if not hopper(torch.device("cuda")):
        pytest.skip("the copy engine's descriptors need Hopper")
    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None

    def ref():
        return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())

    assert rel_err(skinny(x, w, b).float(), ref()) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny(x, w, b)
    for seed in (1, 2):
        x.copy_(torch.randn(m, k, device="cuda", generator=g.manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out.float(), ref()) < 1e-2


@pytest.mark.parametrize("t", [16, 64, 128])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)])
def test_dual_qwen_shapes(n, k, t):
    """The dual product (8 decode rows and t training rows through one read of each Qwen2.5-7B projection) against
    the two torch products, eager and replayed in a CUDA graph on new inputs (its sums zeroed in the graph)."""
    from dark.kernels import hopper
    from dark.kernels.dual import dual

    if not hopper(torch.device("cuda")):
        pytest.skip("the copy engine's descriptors need Hopper")
    g = torch.Generator(device="cuda").manual_seed(n + k + t)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(8, k, device="cuda", generator=g).bfloat16()
    dy = torch.randn(t, n, device="cuda", generator=g).bfloat16()
    y, dx = dual(x, dy, w)
    assert rel_err(y, x.float() @ w.float().t()) < 1e-4 and rel_err(dx, dy.float() @ w.float()) < 1e-4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.zero_()
        dx.zero_()
        dual(x, dy, w, y, dx)
    for seed in (1, 2):
        x.copy_(torch.randn(8, k, device="cuda", generator=g.manual_seed(seed)).bfloat16())
        dy.copy_(torch.randn(t, n, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, x.float() @ w.float().t()) < 1e-4 and rel_err(dx, dy.float() @ w.float()) < 1e-4


def _mlp_weights(seed: int):
    """A generator and the norm, gate/up and down_proj weights of a Qwen2.5-7B layer's MLP (random bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden, inter = 3584, 18944
    norm_w = torch.rand(hidden, device="cuda", generator=g).bfloat16() + 0.5
    w_gu = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    w_down = (torch.randn(hidden, inter, device="cuda", generator=g) * 0.02).bfloat16()
    return g, norm_w, w_gu, w_down


def _replays_match_ordinary_launches(chain, inputs) -> None:
    """chain captured in a CUDA graph under programmatic dependent launch and replayed on each input gives bit for
    bit what its ordinary launches give."""
    from dark.kernels import pdl

    assert not pdl(torch.device("cuda"))["PDL"]  # outside dependent_launch(): the kernels launch as usual
    expected = [chain(x) for x in inputs]
    static = inputs[0].clone()
    graph, out = _graph_under_dependent_launch(chain, static)
    for x, ref in zip(inputs, expected):
        static.copy_(x)
        graph.replay()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_skinny_chain_under_dependent_launch():
    """Eight rows through the MLP of Qwen2.5-7B as a decode step runs it with the skinny product (norm, gate/up,
    silu, down, residual add and norm, twice), in a CUDA graph under programmatic dependent launch, replayed on new
    inputs: bit for bit the ordinary launches. A skinny program reading x, or its tile's workspace and counter,
    before the kernel before it finished would not be."""
    from dark.kernels.norm_rope import add_rms_norm, rms_norm, silu_mul
    from dark.kernels import hopper
    from dark.kernels.skinny import skinny

    if not hopper(torch.device("cuda")):
        pytest.skip("the copy engine's descriptors need Hopper")
    g, norm_w, w_gu, w_down = _mlp_weights(11)

    def chain(x):
        h = rms_norm(x, norm_w, 1e-6)
        for _ in range(2):
            d = skinny(silu_mul(skinny(h, w_gu), w_down.shape[1]), w_down)
            h, x = add_rms_norm(x, d, norm_w, 1e-6)
        return h

    _replays_match_ordinary_launches(chain, [torch.randn(8, w_down.shape[0], device="cuda", generator=g).bfloat16()
                                             for _ in range(4)])


def test_dependent_launch_chain_in_a_cuda_graph():
    """Programmatic dependent launch (each kernel starts while the one before finishes, and waits in-kernel for its
    writes): a chain of the decode kernels, each reading what the one before wrote, captured in a CUDA graph and
    replayed on new inputs, gives bit for bit what the same chain gives launched the ordinary way. A kernel that
    read its input before the wait would read the previous replay's values."""
    from dark.kernels import dependent_launch, pdl
    from dark.kernels.gemv import gemv
    from dark.kernels.norm_rope import add_rms_norm, rms_norm, silu_mul

    with dependent_launch():
        assert pdl(torch.device("cuda")).get("launch_pdl") == (torch.cuda.get_device_capability()[0] >= 9)
    g, norm_w, w_gu, w_down = _mlp_weights(7)
    inter = w_down.shape[1]

    def chain(x):
        h = rms_norm(x, norm_w, 1e-6)
        for i in range(4):
            act = gemv(h, w_gu, glu=True) if i % 2 else silu_mul(gemv(h, w_gu), inter)
            d = gemv(act, w_down)
            h, x = add_rms_norm(x, d, norm_w, 1e-6)
        return h

    _replays_match_ordinary_launches(chain, [torch.randn(1, w_down.shape[0], device="cuda", generator=g).bfloat16()
                                             for _ in range(6)])


def _graph_under_dependent_launch(fn, *args):
    """fn(*args) captured in a CUDA graph under programmatic dependent launch, after one ordinary call of it there
    (which compiles its kernels): (the graph, the outputs its replays write)."""
    from dark.kernels import dependent_launch

    graph = torch.cuda.CUDAGraph()
    with dependent_launch():
        fn(*args)
        with torch.cuda.graph(graph):
            out = fn(*args)
    return graph, out


def test_adapter_codes_chain_under_dependent_launch():
    """A batch of one with an adapter, Qwen2.5-7B shapes: the norms and the attention's merge write the codes that
    the GEMVs after them add, down_proj's GEMV writes its codes and the next norm adds its delta (no lora_shrink),
    in a CUDA graph under programmatic dependent launch, replayed on new
    inputs: bit for bit the ordinary launches, and near the plain-torch math (a kernel reading its input before its
    wait, or the codes before they are written, would not be)."""
    from dark.kernels.gemv import codes_parts, gemv
    from dark.kernels.paged_attention import paged_decode
    from dark.kernels.norm_rope import add_rms_norm, rms_norm

    g = torch.Generator(device="cuda").manual_seed(3)
    hidden, inter, r, H, D = 3584, 18944, 16, 28, 128
    norm_w = torch.rand(hidden, device="cuda", generator=g).bfloat16() + 0.5
    w_gu = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    w_o = (torch.randn(hidden, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    A_gu = (torch.randn(2, 2 * r, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    B_gu = (torch.randn(2, r, 2 * inter, device="cuda", generator=g) * 0.02).bfloat16()
    w_down = (torch.randn(hidden, inter, device="cuda", generator=g) * 0.02).bfloat16()
    A_d = (torch.randn(2, r, inter, device="cuda", generator=g) * 0.02).bfloat16()
    B_d = (torch.randn(2, r, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    A_o = (torch.randn(2, r, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    B_o = (torch.randn(2, r, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    kc = torch.randn(40, 16, 4, D, device="cuda", generator=g).bfloat16()
    vc = torch.randn(40, 16, 4, D, device="cuda", generator=g).bfloat16()
    tables = torch.arange(40, dtype=torch.int32, device="cuda")[None, 3:]
    ctx = torch.tensor([300], device="cuda")
    slot = torch.tensor([1], dtype=torch.int32, device="cuda")

    def chain(x, q):
        cg = {"A": A_gu, "slot": slot, "rank": r, "members": 2, "stride": r,
              "out": torch.empty(1, 1, 2, 16, device="cuda")}
        h = rms_norm(x, norm_w, 1e-6, cg)
        act = gemv(h, w_gu, glu=True, lora={"h": cg["out"], "B": B_gu, "slot": slot, "rank": r, "splits": [inter, inter]})
        co = {"A": A_o, "slot": slot, "rank": r, "out": torch.empty(1, H, 1, 16, device="cuda")}
        att = paged_decode(q + act[:, :H * D].view(1, H, D), kc, vc, tables, ctx, 0.09, codes=co).reshape(1, H * D)
        o = gemv(att, w_o, lora={"h": co["out"], "B": B_o, "slot": slot, "rank": r})
        cg2 = {**cg, "out": torch.empty(1, 1, 2, 16, device="cuda")}
        h, x = add_rms_norm(x, o, norm_w, 1e-6, cg2)
        act = gemv(h, w_gu, glu=True, lora={"h": cg2["out"], "B": B_gu, "slot": slot, "rank": r,
                                             "splits": [inter, inter]})
        # down_proj: its GEMV writes the codes, the next norm adds the delta (with the next codes)
        cd = {"A": A_d, "B": B_d, "slot": slot, "rank": r, "out": torch.empty(1, codes_parts(inter), 1, 16, device="cuda")}
        d = gemv(act, w_down, codes_out=cd)
        cg3 = {**cg, "out": torch.empty(1, 1, 2, 16, device="cuda")}
        h, _ = add_rms_norm(x, d, norm_w, 1e-6, cg3, delta_lora=cd)
        return h, cg3["out"]

    inputs = [(torch.randn(1, hidden, device="cuda", generator=g).bfloat16(),
               torch.randn(1, H, D, device="cuda", generator=g).bfloat16()) for _ in range(4)]
    expected = [chain(x, q) for x, q in inputs]
    x0, q0 = inputs[0][0].clone(), inputs[0][1].clone()
    graph, out = _graph_under_dependent_launch(chain, x0, q0)
    for (x, q), ref in zip(inputs, expected):
        x0.copy_(x)
        q0.copy_(q)
        graph.replay()
        for got, want in zip(out, ref):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the first GEMV's output (the adapter's delta with SiLU * up) against plain torch, fp32 on the same inputs
    x = inputs[-1][0]
    hn = rms_norm(x, norm_w, 1e-6).float()
    codes = hn @ A_gu[1].float().T  # [1, 2r]: gate's codes, then up's
    gu = hn @ w_gu.float().T + codes @ torch.block_diag(B_gu[1, :, :inter].float(), B_gu[1, :, inter:].float())
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    cg = {"A": A_gu, "slot": slot, "rank": r, "members": 2, "stride": r, "out": torch.empty(1, 1, 2, 16, device="cuda")}
    first = gemv(rms_norm(x, norm_w, 1e-6, cg), w_gu, glu=True,
                 lora={"h": cg["out"], "B": B_gu, "slot": slot, "rank": r, "splits": [inter, inter]})
    assert (first.float() - act).abs().max() / act.abs().max() < 2e-2


def test_gemv_glu_qwen_shape():
    """Qwen2.5-7B's gate/up at batch 1 through the GEMV with SiLU * up in its epilogue, against the reference and
    against the GEMV then silu_mul."""
    from dark.kernels.gemv import gemv
    from dark.kernels.norm_rope import silu_mul, silu_mul_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1, 3584, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * 18944, 3584, device="cuda", generator=g) * 0.02).bfloat16()
    out = gemv(x, w, glu=True).float()
    assert rel_err(out, silu_mul_reference(x.float() @ w.float().T, 18944)) < BF16_TOL
    assert rel_err(out, silu_mul(gemv(x, w), 18944).float()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_prefill_step_varlen_flash_matches_reference(dtype):
    """A step of decode rows, fresh prefills and chunks continuing cached contexts, at Qwen2.5-7B's heads
    (28 query, 4 key/value, dim 128) in blocks of 16: the packed flash path equals causal attention per
    sequence, and the padded masked path too."""
    from test_attention import paged_step_case

    import dark.engine.attention as attention

    seqs = ((300, 1), (0, 517), (130, 211), (37, 1), (0, 1), (1000, 64), (0, 16))
    attn, out, ref = paged_step_case("cuda", dtype, heads=28, kvh=4, dim=128, bs=16, seqs=seqs)
    assert attn.varlen
    out = out.cpu()
    assert rel_err(out, ref) < BF16_TOL
    for row in (0, 1, 517, 518 + 210, out.shape[0] - 1):  # single rows too: a ragged batch is where offsets slip
        assert rel_err(out[row], ref[row]) < BF16_TOL, row
    attention.VARLEN_ATTENTION = False
    try:
        attn, padded, ref = paged_step_case("cuda", dtype, heads=28, kvh=4, dim=128, bs=16, seqs=seqs)
        assert not attn.varlen
        assert rel_err(padded.cpu(), ref) < BF16_TOL
    finally:
        attention.VARLEN_ATTENTION = True


@pytest.mark.parametrize("seqs", [((300, 1), (0, 517), (130, 211), (37, 1), (0, 1), (1000, 64), (0, 16)),
                                  ((300, 1), (37, 1), (0, 1), (2000, 1), (0, 517), (130, 211))])
def test_paged_prefill_step_sends_its_decode_rows_to_the_decode_kernel(seqs):
    """The runner's path (decode_kernel: its Triton kernels on): a step mixing prefill chunks with single-token
    rows attends those rows through paged_decode and the chunks through the packed flash batch, interleaved rows
    (first case) or the decode rows first, as the scheduler puts running sequences (second): each row equals
    causal attention over its own sequence, and the flash path's output within bf16 rounding."""
    from test_attention import paged_step_case

    attn, out, ref = paged_step_case("cuda", torch.bfloat16, heads=28, kvh=4, dim=128, bs=16, seqs=seqs,
                                     decode_kernel=True)
    assert attn.varlen and attn.decode is not None and attn.prefill_rows is not None
    decode_rows = [i for i, n in enumerate(n for _, n in seqs) if n == 1]
    assert attn.decode[1].shape[0] == len(decode_rows)
    if decode_rows == list(range(len(decode_rows))):
        assert attn.decode[0] == slice(0, len(decode_rows)) and attn.prefill_rows.start == len(decode_rows)
    out = out.cpu()
    assert rel_err(out, ref) < BF16_TOL
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    for i, (_, n) in enumerate(seqs):  # every decode row, and the first and last row of each chunk
        for row in {starts[i], starts[i] + n - 1}:
            assert rel_err(out[row], ref[row]) < BF16_TOL, row
    _, flash, _ = paged_step_case("cuda", torch.bfloat16, heads=28, kvh=4, dim=128, bs=16, seqs=seqs)
    assert rel_err(out, flash.cpu()) < BF16_TOL


def test_mixed_step_decode_rows_compile_nothing_the_decode_graphs_did_not(triton_compiles):
    """The decode rows of a step that also holds prompt chunks go to paged_decode in the variant a decode graph of
    their bucket compiled (its context ranges, its pipelining, dependent launch on): after one call launched as a
    decode graph launches it, the mixed step compiles no attention kernel (each compile took ~0.5 s in the middle
    of serving on the H200). Unusual head counts, so no other test compiled this variant first."""
    from dark.engine.runner import GRAPH_BUCKETS
    from dark.models.decoder import kernel_module
    from test_attention import paged_step_case

    heads, kvh, dim, bs = 12, 2, 64, 16
    seqs = ((300, 1), (0, 517), (37, 1), (0, 1), (1000, 64), (90, 1), (5, 1))
    bucket = next(b for b in GRAPH_BUCKETS if b >= sum(1 for _, n in seqs if n == 1))
    kc = torch.randn(64, bs, kvh, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.arange(bucket * 4, device="cuda", dtype=torch.int32).view(bucket, 4) % 64
    tables = torch.cat([tables, torch.zeros(bucket, 60, device="cuda", dtype=torch.int32)], 1)  # 16-aligned rows
    ctx = torch.full((bucket,), 50, device="cuda", dtype=torch.int64)
    q = torch.randn(bucket, heads, dim, device="cuda", dtype=torch.bfloat16)
    with kernel_module().dependent_launch():  # as a decode graph's warm-up and capture call it
        kernel_module("paged_attention").paged_decode(q, kc, vc, tables, ctx, dim ** -0.5)
    compiled = triton_compiles
    compiled.clear()  # what the graph-like call above compiled
    attn, out, ref = paged_step_case("cuda", torch.bfloat16, heads=heads, kvh=kvh, dim=dim, bs=bs, seqs=seqs,
                                     decode_kernel=True)
    torch.cuda.synchronize()
    assert attn.decode is not None and attn.decode[3] > 1  # context ranges: the merge kernel runs too
    assert not {"_paged_decode_kernel", "_merge_kernel"} & set(compiled), compiled
    assert rel_err(out.cpu(), ref) < BF16_TOL


def test_qkv_delta_in_the_rotary_under_dependent_launch():
    """A batch of one with an adapter, Qwen2.5-7B shapes: the norm writes q/k/v's codes, their GEMV runs as the
    base model's and qkv_rotary_store adds the delta, reading the codes before its own wait (the norm is two
    kernels back); in a CUDA graph under programmatic dependent launch, replayed on new inputs: bit for bit the
    ordinary launches (the codes read before they were written would not be), and within bf16 rounding of the
    GEMV that adds the delta itself."""
    from dark.kernels.gemv import gemv
    from dark.kernels.norm_rope import add_rms_norm
    from dark.kernels.paged_attention import qkv_rotary_store

    g = torch.Generator(device="cuda").manual_seed(7)
    hidden, nh, nkv, d, r = 3584, 28, 4, 128, 16
    outs = [nh * d, nkv * d, nkv * d]
    norm_w = torch.rand(hidden, device="cuda", generator=g).bfloat16() + 0.5
    w = (torch.randn(sum(outs), hidden, device="cuda", generator=g) * 0.02).bfloat16()
    bias = (torch.randn(sum(outs), device="cuda", generator=g) * 0.02).bfloat16()
    A = (torch.randn(2, 3 * r, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    B = (torch.randn(2, r, sum(outs), device="cuda", generator=g) * 0.05).bfloat16()
    kc = torch.randn(8, 16, nkv, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(8, 16, nkv, d, device="cuda", generator=g).bfloat16()
    slot = torch.tensor([1], dtype=torch.int32, device="cuda")
    mapping = torch.tensor([37], device="cuda")
    ang = torch.rand(1, d // 2, device="cuda", generator=g) * 6
    cos, sin = torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16()

    def chain(x, pending, late=True):
        codes = {"A": A, "slot": slot, "rank": r, "members": 3, "stride": r,
                 "out": torch.empty(1, 1, 3, 16, device="cuda")}
        h, _ = add_rms_norm(x, pending, norm_w, 1e-6, codes)
        spec = {"h": codes["out"], "B": B, "slot": slot, "rank": r, "splits": outs}
        if late:
            return qkv_rotary_store(gemv(h, w, bias), nh, nkv, d, cos, sin, kc, vc, mapping, lora=spec)
        return qkv_rotary_store(gemv(h, w, bias, lora=spec), nh, nkv, d, cos, sin, kc, vc, mapping)

    def cache_row():
        return kc.view(-1, nkv, d)[37].clone(), vc.view(-1, nkv, d)[37].clone()

    inputs = [tuple(torch.randn(1, hidden, device="cuda", generator=g).bfloat16() for _ in range(2)) for _ in range(4)]
    expected = []
    for x, p in inputs:
        expected.append((chain(x, p), *cache_row()))
        in_gemv = chain(x, p, late=False)
        assert rel_err(expected[-1][0], in_gemv) < 1e-2
    x0, p0 = inputs[0][0].clone(), inputs[0][1].clone()
    graph, out = _graph_under_dependent_launch(chain, x0, p0)
    for (x, p), (q, k, v) in zip(inputs, expected):
        x0.copy_(x)
        p0.copy_(p)
        graph.replay()
        torch.cuda.synchronize()
        got_k, got_v = cache_row()
        torch.testing.assert_close(out, q, rtol=0, atol=0)
        torch.testing.assert_close(got_k, k, rtol=0, atol=0)
        torch.testing.assert_close(got_v, v, rtol=0, atol=0)
