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
