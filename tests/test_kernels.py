"""Triton kernels against their plain-torch references on random inputs, at small sizes.

Without CUDA they run on the CPU under TRITON_INTERPRET=1 (set by conftest before Triton is imported):
these are the CI checks. With CUDA the same checks run compiled; tests/test_kernels_gpu.py adds real sizes.
"""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from dark.models.decoder import kernel_module  # noqa: E402

kernel_module()  # dark.kernels, also in a checkout on PYTHONPATH without an install

from dark.kernels.lora import lora_apply, lora_reference  # noqa: E402
from dark.kernels.paged_attention import (paged_decode, paged_decode_reference, store_kv,  # noqa: E402
                                          store_kv_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out, ref) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def random_cache(num_blocks, block_size, kvh, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(DEV, dtype)
    v = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(DEV, dtype)
    return k, v, g


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("heads,kvh,d,block_size,splits", [(4, 2, 16, 4, 1), (6, 2, 32, 8, 3), (7, 1, 64, 16, None)])
def test_paged_decode_matches_reference(dtype, tol, heads, kvh, d, block_size, splits):
    kc, vc, g = random_cache(40, block_size, kvh, d, dtype, seed=heads * 100 + d)
    ctx = torch.tensor([1, 0, 37, block_size * 5, 70])
    width = 20  # pages enough for the longest context at block size 4
    # each sequence's pages: distinct random blocks, so a wrong table lookup reads the wrong keys
    tables = torch.stack([torch.randperm(40, generator=g)[:width] for _ in ctx]).to(torch.int32)
    q = torch.randn(len(ctx), heads, d, generator=g).to(DEV, dtype)
    scale = d ** -0.5
    out = paged_decode(q, kc, vc, tables.to(DEV), ctx.to(DEV), scale, splits=splits, block_n=16)
    ref = paged_decode_reference(q.cpu(), kc.cpu(), vc.cpu(), tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert (out[1] == 0).all(), "an empty context must give zeros"
    for b in (0, 2, 3, 4):
        assert rel_err(out[b].cpu(), ref[b]) < tol, f"sequence {b}"


def test_paged_decode_splits_agree():
    kc, vc, g = random_cache(64, 16, 2, 32, torch.float32, seed=5)
    ctx = torch.tensor([200, 3, 129])
    tables = torch.stack([torch.randperm(64, generator=g)[:16] for _ in ctx]).to(torch.int32).to(DEV)
    q = torch.randn(3, 4, 32, generator=g).to(DEV)
    outs = [paged_decode(q, kc, vc, tables, ctx.to(DEV), 0.2, splits=s, block_n=16) for s in (1, 2, 5, 16)]
    for o in outs[1:]:
        assert rel_err(o.cpu(), outs[0].cpu()) < 1e-5


def test_store_kv_writes_its_slots_and_skips_minus_one():
    kc, vc, g = random_cache(6, 4, 2, 16, torch.bfloat16, seed=1)
    kr, vr = kc.clone().cpu(), vc.clone().cpu()
    k = torch.randn(5, 2, 16, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(5, 2, 16, generator=g).to(DEV, torch.bfloat16)
    slots = torch.tensor([3, -1, 23, 0, -1])
    store_kv(k, v, kc, vc, slots.to(DEV))
    store_kv_reference(k.cpu(), v.cpu(), kr, vr, slots)
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tokens,fan_in,fan_out,rank,max_rank", [(1, 48, 80, 8, 8), (7, 300, 96, 4, 16),
                                                                   (5, 1100, 40, 16, 16)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_matches_reference(dtype, tol, tokens, fan_in, fan_out, rank, max_rank, fused):
    g = torch.Generator().manual_seed(tokens * 7 + fan_in)
    slots_n = 3
    A = torch.zeros(slots_n, max_rank, fan_in)
    B = torch.zeros(slots_n, max_rank, fan_out)
    A[:, :rank] = torch.randn(slots_n, rank, fan_in, generator=g)
    B[:, :rank] = torch.randn(slots_n, rank, fan_out, generator=g) * 0.1
    A, B = A.to(DEV, dtype), B.to(DEV, dtype)
    x = torch.randn(tokens, fan_in, generator=g).to(DEV, dtype)
    y = torch.randn(tokens, fan_out, generator=g).to(DEV, dtype)
    token_slots = torch.randint(-1, slots_n, (tokens,), generator=g)
    token_slots[0] = 1
    ref = lora_reference(x.cpu(), y.cpu(), A.cpu(), B.cpu(), token_slots, rank)
    out = lora_apply(x, y.clone(), A, B, token_slots.to(DEV), rank, fused=fused)
    for t in range(tokens):
        if token_slots[t] < 0:
            assert torch.equal(out[t].cpu(), y[t].cpu()), "a token without an adapter must be left alone"
    delta_out, delta_ref = out.cpu().double() - y.cpu().double(), ref.double() - y.cpu().double()
    assert rel_err(out.cpu(), ref) < tol
    assert (delta_out - delta_ref).norm() <= 2e-2 * delta_ref.norm() + 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tokens,fan_in,splits,rank,max_rank", [(1, 48, [40, 8, 8], 8, 8), (6, 300, [64, 16, 16], 4, 16),
                                                                  (3, 700, [96, 96], 16, 16)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_grouped_lora_matches_reference(dtype, tol, tokens, fan_in, splits, rank, max_rank, fused):
    """q/k/v or gate/up as one group: stacked A rows, side-by-side B columns, one launch (fused) or one shrink and
    one expand."""
    g = torch.Generator().manual_seed(tokens + fan_in)
    slots_n, members = 3, len(splits)
    A = torch.zeros(slots_n, members * max_rank, fan_in)
    B = torch.zeros(slots_n, max_rank, sum(splits))
    for m in range(members):
        A[:, m * max_rank:m * max_rank + rank] = torch.randn(slots_n, rank, fan_in, generator=g)
    B[:, :rank] = torch.randn(slots_n, rank, sum(splits), generator=g) * 0.1
    A, B = A.to(DEV, dtype), B.to(DEV, dtype)
    x = torch.randn(tokens, fan_in, generator=g).to(DEV, dtype)
    y = torch.randn(tokens, sum(splits), generator=g).to(DEV, dtype)
    token_slots = torch.randint(-1, slots_n, (tokens,), generator=g)
    token_slots[0] = 2
    ref = lora_reference(x.cpu(), y.cpu(), A.cpu(), B.cpu(), token_slots, rank, splits=splits, stride=max_rank)
    out = lora_apply(x, y.clone(), A, B, token_slots.to(DEV), rank, splits=splits, stride=max_rank, fused=fused)
    assert rel_err(out.cpu(), ref) < tol
    delta_out, delta_ref = out.cpu().double() - y.cpu().double(), ref.double() - y.cpu().double()
    assert (delta_out - delta_ref).norm() <= 2e-2 * delta_ref.norm() + 1e-6


# step slot mixes for the segment (SGMV) kernels: -1 (no adapter) sorts first and is skipped; segments longer
# than a block of 16 tokens span several programs; a batch of one takes the no-sort path
SLOT_MIXES = {
    "mixed": [2, -1, 0, 2, 3, 0, -1, 2, 1, 3, 2, -1],
    "one_slot": [1] * 20,
    "40_tokens_2_slots": [3, 0] * 6 + [0] * 15 + [3] * 13,  # segments of 21 and 19 tokens, interleaved
    "unsorted": [3, 0, 2, 0, 3, 1, -1, 2, 0],
    "single": [2],
    "single_none": [-1],
    "all_none": [-1, -1, -1],
}
LAYOUTS = {"plain": [96], "qkv": [64, 16, 16], "gate_up": [48, 48]}


def _lora_case(token_slots, fan_in, splits, rank, max_rank, dtype, seed, slots_n=4):
    """Random factors in the engine's layout (a group: stacked A rows, side-by-side B columns), x and y."""
    g = torch.Generator().manual_seed(seed)
    members = len(splits)
    A = torch.zeros(slots_n, members * max_rank, fan_in)
    B = torch.zeros(slots_n, max_rank, sum(splits))
    for m in range(members):
        A[:, m * max_rank:m * max_rank + rank] = torch.randn(slots_n, rank, fan_in, generator=g)
    B[:, :rank] = torch.randn(slots_n, rank, sum(splits), generator=g) * 0.1
    T = len(token_slots)
    x = torch.randn(T, fan_in, generator=g)
    y = torch.randn(T, sum(splits), generator=g)
    return [t.to(DEV, dtype) for t in (A, B, x, y)]


@pytest.mark.parametrize("rank,dtype,tol", [(8, torch.bfloat16, 1e-2), (16, torch.float32, 1e-5),
                                            (16, torch.bfloat16, 1e-2), (8, torch.float32, 1e-5)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mix", list(SLOT_MIXES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_lora_segments_match_reference(fused, mix, layout, rank, dtype, tol):
    """The segment kernels against lora_reference on every slot mix, plain and grouped (q/k/v with outs 64/16/16,
    gate/up), rank 8 and 16 in slots of rank 16, through the fused kernel and the shrink/expand pair; fan_in 600
    takes two K-splits (two kernels) or two K steps with a masked tail (fused). Tokens without an adapter are left
    exactly as they were."""
    from dark.kernels.lora import lora_segments

    splits = LAYOUTS[layout]
    max_rank, fan_in = 16, 600
    token_slots = torch.tensor(SLOT_MIXES[mix])
    A, B, x, y = _lora_case(token_slots, fan_in, splits, rank, max_rank, dtype, seed=len(mix) * 31 + rank)
    kw = dict(splits=splits, stride=max_rank) if len(splits) > 1 else {}
    ref = lora_reference(x.cpu(), y.cpu(), A.cpu(), B.cpu(), token_slots, rank, **kw)
    slots_dev = token_slots.to(DEV)
    out = lora_apply(x, y.clone(), A, B, slots_dev, rank, fused=fused, **kw)
    shared = lora_apply(x, y.clone(), A, B, slots_dev, rank, segments=lora_segments(slots_dev, max_slots=4),
                        fused=fused, **kw)
    assert torch.equal(out, shared), "a table made for the slot count must give what the call makes itself"
    out, y = out.cpu(), y.cpu()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            assert torch.equal(out[t], y[t]), "a token without an adapter must be left alone"
    delta_out, delta_ref = out.double() - y.double(), ref.double() - y.double()
    assert (delta_out - delta_ref).norm() <= 2 * tol * delta_ref.norm() + 1e-6
    if (token_slots >= 0).any():
        assert delta_ref.norm() > 0.1 and rel_err(out, ref) < tol


@pytest.mark.parametrize("rank,dtype,tol", [(8, torch.bfloat16, 1e-2), (16, torch.float32, 1e-5)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mix", ["mixed", "40_tokens_2_slots", "single", "all_none"])
def test_one_gemm_over_extended_weights_then_the_expand_matches_reference(mix, layout, rank, dtype, tol):
    """The base weight with every slot's A rows after its own rows: one product gives the base output and every
    slot's codes side by side; lora_expand_codes then adds each token's own slot's delta into the base columns
    (a strided view of that output). Equal to lora_reference over the base product; tokens without an adapter
    are left exactly as the product made them."""
    from dark.kernels.lora import lora_expand_codes, lora_segments

    splits = LAYOUTS[layout]
    max_rank, fan_in, slots_n = 16, 600, 4
    token_slots = torch.tensor(SLOT_MIXES[mix])
    A, B, x, _ = _lora_case(token_slots, fan_in, splits, rank, max_rank, dtype, seed=len(mix) * 7 + rank)
    g = torch.Generator().manual_seed(rank)
    W = (torch.randn(sum(splits), fan_in, generator=g) * 0.05).to(DEV, dtype)
    ext = torch.cat([W, A.reshape(-1, fan_in)])  # slot s, member m, rank row r: row out + (s * M + m) * 16 + r
    y_ext = x @ ext.t()
    y, codes = y_ext[:, :sum(splits)], y_ext[:, sum(splits):]
    base = y.cpu().clone()  # the product's own base columns (another GEMM of W alone may round differently)
    ref = lora_reference(x.cpu(), base, A.cpu(), B.cpu(), token_slots, rank, splits=splits, stride=max_rank)
    slots_dev = token_slots.to(DEV)
    out = lora_expand_codes(codes, B, slots_dev, y, rank, max_rank, splits=splits,
                            segments=lora_segments(slots_dev, max_slots=slots_n))
    assert out.data_ptr() == y_ext.data_ptr(), "the delta goes into the product's own base columns"
    out = out.cpu()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            assert torch.equal(out[t], base[t]), "a token without an adapter must be left alone"
    delta_out, delta_ref = out.double() - base.double(), ref.double() - base.double()
    if (token_slots >= 0).any():
        assert delta_ref.norm() > 0.1
    # the codes come out of the product rounded to its dtype (bf16: 2^-8), as PEFT's x @ A does
    assert (delta_out - delta_ref).norm() <= 2 * tol * delta_ref.norm() + 1e-6


def compile_for_hopper(module: str, kernel: str, types: dict, constants: dict, num_warps: int = 4) -> dict:
    """Compile a Triton kernel for sm_90 (the H100's and H200's) on any machine, with no GPU: Triton's own
    compiler and the ptxas it ships, in a process of its own without TRITON_INTERPRET (under it @triton.jit makes
    interpreted functions, which do not compile). The interpreter runs a kernel as Python, so code the compiler
    refuses (a name bound in only one branch of an `if`, say) passes there; this catches it. Returns the
    cubin's resource usage (REG, STACK, LOCAL, SHARED, ...) and the dynamic shared memory a launch asks for
    (DYNAMIC_SHARED, bytes)."""
    import json
    import os
    import subprocess
    import sys

    script = f"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dark.models.decoder import kernel_module  # dark.kernels, also in a checkout on PYTHONPATH
k = getattr(kernel_module("{module}"), "{kernel}")
types, constants = json.loads(sys.argv[1]), json.loads(sys.argv[2])
signature = {{**types, **{{name: "constexpr" for name in constants}}}}
assert set(signature) == set(k.arg_names), sorted(set(k.arg_names) ^ set(signature))
src = ASTSource(fn=k, signature=signature, constexprs={{(k.arg_names.index(n),): v for n, v in constants.items()}})
out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": {num_warps}}})
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.cubin")
    open(path, "wb").write(out.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    print(subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout)
print("Function DYNAMIC_SHARED:" + str(out.metadata.shared))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(types), json.dumps(constants)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fields = {}
    for part in run.stdout.split("Function")[-2:]:
        fields.update(kv.split(":", 1) for kv in part.split() if ":" in kv)
    return {k: int(v) for k, v in fields.items() if v.isdigit()}


@pytest.mark.parametrize("members", [1, 2, 3], ids=["plain", "gate_up", "qkv"])
def test_lora_expand_compiles_for_hopper(members):
    """The expand kernel as a 7B decode step of several tokens launches it (bf16, rank 16 in slots of 16 rows, its
    warps, under dependent launch; the extended GEMM's codes) compiles for sm_90 with nothing spilled."""
    import triton

    from dark.kernels import lora

    ints = ["N", "N1", "N2", "stride_bs", "stride_br", "stride_yt", "stride_ht", "stride_hs", "stride_hm", "stride_hp"]
    types = {**{n: "*bf16" for n in ("h_ptr", "b_ptr", "y_ptr")}, "table_ptr": "*i32", **{n: "i32" for n in ints}}
    mb = triton.next_power_of_2(members) * 16  # the code columns a block holds, as lora's _expand sizes them
    consts = dict(R=16, BR=16, MB=mb, SPLITS=1, BN=lora.EXPAND_BLOCK_N, TILES=3, MEMBERS=members, BT=lora.BLOCK_T,
                  SORTED=True, UPCAST=False, PDL=True)
    usage = compile_for_hopper("lora", "_expand_kernel", types, consts, num_warps=lora.EXPAND_WARPS)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and 0 < usage["REG"] <= 255, usage


def test_qkv_rotary_store_with_a_delta_compiles_for_hopper():
    """qkv_rotary_store's kernel with a batch of one's adapter delta (Qwen2.5-7B heads, rank 16, partial sums of the
    codes read before the wait) compiles for sm_90 with nothing spilled."""
    from dark.kernels import paged_attention

    ints = ["stride_y", "stride_c", "stride_q", "stride_bs", "stride_br"]
    types = {**{n: "*bf16" for n in ("y_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr", "lb_ptr")},
             "slot_ptr": "*i64", "lslot_ptr": "*i32", "lh_ptr": "*fp32", **{n: "i32" for n in ints}}
    consts = dict(NH=28, NKV=4, HALF=64, LORA=True, R=16, BR=16, SPLITS=4, SP=4,
                  CODES_AFTER=paged_attention.ROTARY_CODES_AFTER, PDL=True)
    usage = compile_for_hopper("paged_attention", "_qkv_rotary_store_kernel", types, consts)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and 0 < usage["REG"] <= 255, usage


def test_lora_shrink_writes_each_token_row():
    """The shrink's partial codes, summed over its K-splits, are each token's own code at the token's original
    row, whatever the sorted order (members side by side, padded to 16 rows)."""
    from dark.kernels.lora import lora_shrink

    token_slots = torch.tensor([1, 3, -1, 1, 0, 3, 3, 1, 0])
    splits, rank, max_rank = [64, 16, 16], 8, 8
    A, B, x, y = _lora_case(token_slots, 1100, splits, rank, max_rank, torch.float32, seed=3)
    h = lora_shrink(x, A, token_slots.to(DEV), rank, members=3, stride=max_rank).cpu()
    assert h.shape == (9, 3, 3, 16)  # 1100 wide: three 512-wide K-splits
    codes = h.sum(1)
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        for m in range(3):
            want = A[s, m * max_rank:m * max_rank + rank].cpu() @ x[t].cpu()
            torch.testing.assert_close(codes[t, m, :rank], want, rtol=1e-5, atol=1e-4)
            assert (codes[t, m, rank:] == 0).all()


@pytest.mark.parametrize("block_n,block_k,tiles,dtype,tol", [(32, 64, 1, torch.bfloat16, 1e-2),
                                                             (32, 128, 2, torch.float32, 1e-5),
                                                             (16, 256, 4, torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mix", ["mixed", "40_tokens_2_slots", "single"])
def test_lora_fused_tilings(mix, layout, block_n, block_k, tiles, dtype, tol):
    """The fused kernel with small tiles, so one launch has several column programs per row, each looping over
    several column tiles (the last partly or wholly past the output), tiles that straddle two members' columns
    (q/k/v 64/16/16 and gate/up 48/48 in tiles of 16 or 32), and K steps with a masked tail (600 = 9 x 64 + 24)."""
    from dark.kernels.lora import lora_fused

    splits = LAYOUTS[layout]
    rank, max_rank, fan_in = 16, 16, 600
    token_slots = torch.tensor(SLOT_MIXES[mix])
    A, B, x, y = _lora_case(token_slots, fan_in, splits, rank, max_rank, dtype, seed=len(mix) + block_n)
    kw = dict(splits=splits, stride=max_rank) if len(splits) > 1 else {}
    ref = lora_reference(x.cpu(), y.cpu(), A.cpu(), B.cpu(), token_slots, rank, **kw)
    out = lora_fused(x, y.clone(), A, B, token_slots.to(DEV), rank, block_n=block_n, block_k=block_k, tiles=tiles,
                     **kw).cpu()
    y = y.cpu()
    none = token_slots < 0
    assert torch.equal(out[none], y[none]), "a token without an adapter must be left alone"
    delta_out, delta_ref = out.double() - y.double(), ref.double() - y.double()
    assert delta_ref.norm() > 0.1 and (delta_out - delta_ref).norm() <= 2 * tol * delta_ref.norm() + 1e-6


def test_lora_apply_picks_the_fused_kernel_unless_told_not_to(monkeypatch):
    """lora_apply: fused=None follows the module's FUSED (DARK_LORA_FUSED, off unless "1"); True/False override it."""
    import importlib.util

    lk = kernel_module("lora")
    calls = []
    real_fused, real_shrink = lk.lora_fused, lk.lora_shrink
    monkeypatch.setattr(lk, "lora_fused", lambda *a, **k: calls.append("fused") or real_fused(*a, **k))
    monkeypatch.setattr(lk, "lora_shrink", lambda *a, **k: calls.append("shrink") or real_shrink(*a, **k))
    token_slots = torch.tensor([1, -1, 0])
    A, B, x, y = _lora_case(token_slots, 64, [32], 8, 8, torch.float32, seed=0)
    slots_dev = token_slots.to(DEV)
    outs = {}
    for flag, fused, want in ((True, None, "fused"), (False, None, "shrink"), (False, True, "fused"),
                              (True, False, "shrink")):
        monkeypatch.setattr(lk, "FUSED", flag)
        calls.clear()
        outs[want] = lk.lora_apply(x, y.clone(), A, B, slots_dev, 8, fused=fused)
        assert calls == [want], (flag, fused)
    assert rel_err(outs["fused"].cpu(), outs["shrink"].cpu()) < 1e-5
    empty = torch.zeros(0, 32, device=DEV)
    assert lk.lora_apply(x[:0], empty, A, B, slots_dev[:0], 8, fused=True) is empty

    def fused_under(env):  # the module's FUSED as read at import with that environment
        if env is None:
            monkeypatch.delenv("DARK_LORA_FUSED", raising=False)
        else:
            monkeypatch.setenv("DARK_LORA_FUSED", env)
        spec = importlib.util.spec_from_file_location(f"{lk.__package__}._lora_env_check", lk.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.FUSED

    assert not fused_under(None) and fused_under("1") and not fused_under("0")


@pytest.mark.parametrize("rows,tokens", [(1, 1), (4, 64), (11, 64), (34, 64), (40, 256)])
def test_lora_fused_grid_stays_within_two_waves(rows, tokens):
    """The fused kernel's tiling at Qwen2.5-7B sizes (rank 16, bf16, 132 SMs): every column tile covered, at most
    two waves of programs, and no more programs per row than at fewer rows (each repeats the row's shrink)."""
    import triton

    from dark.kernels.lora import FUSED_L2_PROGRAMS, _fused_grid

    for fan_in, outs in ((3584, [3584, 512, 512]), (3584, [3584]), (3584, [18944, 18944]), (18944, [3584])):
        n, members = sum(outs), len(outs)
        per_row = min(16, -(-tokens // rows))
        grid = {}
        for g in (1, rows):
            grid[g] = _fused_grid(g, per_row if g == rows else 1, fan_in, n, 256, 16, members, 2, 132,
                                  FUSED_L2_PROGRAMS)
        programs, tiles = grid[rows]
        assert programs == triton.cdiv(triton.cdiv(n, 256), tiles) and programs * tiles >= triton.cdiv(n, 256)
        assert 1 <= rows * programs <= 2 * 132
        assert programs <= grid[1][0]

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_kernels"])
def test_slot_lora_kernel_path_matches_torch_path(fused, monkeypatch):
    """SlotLoRA's two paths (kernels, dense torch math) on the same slots and a mixed batch, per projection and
    per fused group (q/k/v, gate/up: one call on the concatenated output equals each member on its own, also
    when an adapter targets only some members); the kernels as DARK_LORA_FUSED picks them (fused or not)."""
    from types import SimpleNamespace

    monkeypatch.setattr(kernel_module("lora"), "FUSED", fused)

    from dark.lora.slots import AdapterSlots, SlotLoRA
    from dark.lora.weights import AdapterWeights
    from dark.config import LoraConfig

    shapes = {"q_proj": (32, 48), "k_proj": (32, 16), "v_proj": (32, 16), "gate_proj": (32, 40),
              "up_proj": (32, 40), "down_proj": (64, 32)}
    cfg = SimpleNamespace(projection_shapes=lambda: shapes)
    slots = AdapterSlots(cfg, 4, 16, torch.device(DEV), torch.float32)
    for s, r, targets in ((0, 8, tuple(shapes)), (2, 4, ("q_proj", "v_proj", "up_proj", "down_proj"))):
        w = AdapterWeights.init(LoraConfig(r=r, alpha=2 * r, target_modules=targets),
                                {m: shapes[m] for m in targets}, 2, seed=s)
        for a, b in w.tensors.values():
            b.normal_(0, 0.5)
        slots.load(s, w)
    assert set(slots.groups) == {(0, "qkv"), (1, "qkv"), (0, "gate_up"), (1, "gate_up")}
    token_slots = [0, -1, 2, 2, 0, -1]
    g = torch.Generator().manual_seed(0)
    dense = SlotLoRA(slots, [0, 2], torch.tensor(token_slots, device=DEV))
    fast = SlotLoRA.with_kernels(slots, torch.tensor(token_slots, dtype=torch.int32, device=DEV))
    for layer, module in ((0, "q_proj"), (1, "k_proj"), (1, "down_proj")):
        fan_in, fan_out = shapes[module]
        x = torch.randn(len(token_slots), fan_in, generator=g).to(DEV)
        y = torch.randn(len(token_slots), fan_out, generator=g).to(DEV)
        ref = dense.apply(layer, module, x, y.clone())
        out = fast.apply(layer, module, x, y.clone())
        assert (ref - y).abs().max() > 0.1  # the adapters do change these outputs
        assert rel_err(out.cpu(), ref.cpu()) < 1e-5
    for layer, group, members in ((0, "qkv", ("q_proj", "k_proj", "v_proj")), (1, "gate_up", ("gate_proj", "up_proj"))):
        x = torch.randn(len(token_slots), 32, generator=g).to(DEV)
        ys = [torch.randn(len(token_slots), shapes[m][1], generator=g).to(DEV) for m in members]
        each = torch.cat([dense.apply(layer, m, x, y.clone()) for m, y in zip(members, ys)], -1)
        for lora in (dense, fast):
            grouped = lora.apply_group(layer, group, x, torch.cat(ys, -1))
            assert rel_err(grouped.cpu(), each.cpu()) < 1e-5


@pytest.fixture(scope="module")
def tiny_llm_with_adapters(tiny_models, tmp_path_factory):
    from dark import OnlineLLM
    from test_lora import make_peft_adapter

    base = tiny_models["qwen2"]
    root = tmp_path_factory.mktemp("kernel-adapters")
    a = make_peft_adapter(base, root / "a", 1, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    b = make_peft_adapter(base, root / "b", 2, ["q_proj", "v_proj", "down_proj", "lm_head"], r=4)
    # a store of its own: the default one is shared by every test on a model folder named qwen2
    llm = OnlineLLM(str(base), data_dir=root / "data", device=DEV, dtype="float32", block_size=8, max_num_seqs=8)
    llm.load_adapter("a", a)
    llm.load_adapter("b", b)
    yield llm
    llm.close()


def _generate_mixed(llm, steps):
    import threading

    prompts = [("Tell me a story about a fox.", "a"), ("What is two plus two?", None),
               ("Translate 'cat' into French, and then into German.", "b")]
    results, done = {}, threading.Event()

    def collect(i):
        def cb(out):
            if out.finished:
                results[i] = out
                if len(results) == len(prompts):
                    done.set()
        return cb

    for i, (prompt, adapter) in enumerate(prompts):
        llm.submit(prompt, collect(i), adapter=adapter, max_tokens=steps, ignore_eos=True, logprobs=True)
    assert done.wait(600)
    return [results[i] for i in range(len(prompts))]


def test_engine_fast_decode_path_matches_plain_path(tiny_llm_with_adapters):
    """The engine's decode steps through the kernels (no CUDA graphs on the CPU) give the plain path's tokens,
    in one batch mixing two adapters and none."""
    llm = tiny_llm_with_adapters
    runner = llm.engine.runner
    was = runner.fast_decode
    runner.set_fast(False)
    plain = _generate_mixed(llm, 6)
    runner.set_fast(True)
    before = runner.fast_steps
    try:
        fast = _generate_mixed(llm, 6)
    finally:
        runner.set_fast(was)
    assert runner.fast_steps - before >= 5, "the decode steps did not take the fast path"
    for p, f in zip(plain, fast):
        assert f.output_ids == p.output_ids
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)


def test_engine_decode_over_extended_weights_matches_plain_path(tiny_models, tmp_path, monkeypatch):
    """The weights laid out as the engine lays them out on CUDA (AdapterSlots.extend_weights: every slot's A rows
    after each projection's own, here after two adapters were loaded, whose factors move into the new rows): the
    model's parameters are views of the extended blocks, steps of several tokens with adapters take one product
    for the base output and the codes and lora_expand_codes for the deltas, and a batch mixing two adapters and
    none gives the plain path's tokens and log-probabilities."""
    from dark import OnlineLLM
    from test_lora import make_peft_adapter

    base = tiny_models["qwen2"]
    a = make_peft_adapter(base, tmp_path / "a", 1, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    b = make_peft_adapter(base, tmp_path / "b", 2, ["q_proj", "v_proj", "down_proj", "lm_head"], r=4)
    llm = OnlineLLM(str(base), data_dir=tmp_path / "data", device=DEV, dtype="float32", block_size=8, max_num_seqs=8)
    try:
        llm.load_adapter("a", a)
        llm.load_adapter("b", b)
        runner, slots = llm.engine.runner, llm.engine.adapters.slots
        runner.set_fast(False)
        plain = _generate_mixed(llm, 6)
        runner.set_fast(True, graphs=False)  # every step through Python: the path is counted step by step
        if not slots.extended:  # on CUDA the engine did it as it started
            assert slots.extend_weights(llm.model)
        layer = llm.model.model.layers[1]
        for key, params in (("qkv", [layer.self_attn.q_proj, layer.self_attn.v_proj]), ("o_proj", [layer.self_attn.o_proj]),
                            ("gate_up", [layer.mlp.up_proj]), ("down_proj", [layer.mlp.down_proj])):
            ext = slots.extended[(1, key)][0]
            for p in params:
                assert p.weight.untyped_storage().data_ptr() == ext.untyped_storage().data_ptr(), key
        lk = kernel_module("lora")
        calls = []
        real = lk.lora_expand_codes

        def counted(codes, *args, **kw):
            calls.append(codes.shape[0])
            return real(codes, *args, **kw)

        monkeypatch.setattr(lk, "lora_expand_codes", counted)
        fast = _generate_mixed(llm, 6)
    finally:
        llm.close()
    assert sum(1 for t in calls if t == 3) >= 4 * 2 * 4, "the decode steps of three did not take the extended path"
    for p, f in zip(plain, fast):
        assert f.output_ids == p.output_ids
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=1e-4)


def test_weights_are_not_extended_past_the_row_limit(tiny_models, tmp_path):
    """Slots x max_lora_rank past EXTEND_MAX_ROWS: reading every slot's A rows in each step would cost more than
    the shrink launches, so extend_weights leaves the weights where they are and the adapters keep their own A."""
    from dark import OnlineLLM
    from dark.lora.slots import EXTEND_MAX_ROWS

    llm = OnlineLLM(str(tiny_models["qwen2"]), data_dir=tmp_path / "data", device=DEV, dtype="float32",
                    max_adapter_slots=EXTEND_MAX_ROWS // 64 + 1, max_lora_rank=64)
    try:
        slots = llm.engine.adapters.slots
        attn = llm.model.model.layers[0].self_attn
        before = attn.q_proj.weight.data_ptr(), attn.o_proj.weight.data_ptr()
        assert not slots.extend_weights(llm.model)
        assert not slots.extended and (attn.q_proj.weight.data_ptr(), attn.o_proj.weight.data_ptr()) == before
    finally:
        llm.close()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 100), (1, 96)])
def test_rms_norm_matches_reference(dtype, tol, shape):
    from dark.kernels.norm_rope import rms_norm, rms_norm_reference

    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(DEV, dtype)
    w = torch.rand(shape[-1], generator=g).add(0.5).to(DEV, dtype)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x.cpu(), w.cpu(), 1e-6)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out.cpu(), ref) < tol


def _ulps(out, ref) -> int:
    """The largest distance between out and ref in units in the last place (same dtype, same signs)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[out.dtype]
    return int((out.view(bits).long() - ref.view(bits).long()).abs().max()) if out.numel() else 0


def _same_rounding(out, ref, dtype) -> bool:
    """out is ref to the bit, but for bf16 results of the interpreter: it truncates fp32 -> bf16 casts, where
    a compiled kernel rounds to nearest even as torch does, so a bf16 result may sit one ulp towards zero."""
    return _ulps(out, ref) <= (1 if dtype == torch.bfloat16 and not torch.cuda.is_available() else 0)


def _near_kernel_math(out, ref) -> bool:
    """Two kernels with the same arithmetic but a different reduction layout (warps, programs): the same bits in
    the interpreter; compiled, fp32 sums may add in another order (a few ulps), bf16 results within an ulp."""
    if not torch.cuda.is_available():
        return _ulps(out, ref) == 0
    if out.dtype == torch.float32:
        return torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    return _ulps(out, ref) <= 1


def _same_kernel_math(out, ref) -> bool:
    """Two kernels with the same arithmetic: the same bits in the interpreter; compiled, within an ulp (the
    compiler may contract a multiply-add into an FMA in one of them and not in the other)."""
    return _ulps(out, ref) <= (1 if torch.cuda.is_available() else 0)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(5, 100), (3, 2, 64), (1, 96)])
def test_add_rms_norm_matches_reference(dtype, tol, shape):
    """The residual add and RMSNorm in one launch: the sum is torch's x + delta (to the bit; bf16 within the
    interpreter's one ulp), the norm is rms_norm's of that sum to the bit, and both match the plain-torch
    reference; an odd hidden size (100, masked), x a view with wider rows."""
    from dark.kernels.norm_rope import add_rms_norm, add_rms_norm_reference, rms_norm

    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    wide = (torch.randn(*shape[:-1], shape[-1] + 28, generator=g) * 3).to(DEV, dtype)
    x = wide[..., :shape[-1]]
    delta = (torch.randn(*shape, generator=g) * 2).to(DEV, dtype)
    w = torch.rand(shape[-1], generator=g).add(0.5).to(DEV, dtype)
    normed, summed = add_rms_norm(x, delta, w, 1e-6)
    ref_normed, ref_summed = add_rms_norm_reference(x.cpu(), delta.cpu(), w.cpu(), 1e-6)
    assert normed.shape == summed.shape == x.shape and normed.dtype == summed.dtype == dtype
    assert _same_rounding(summed.cpu(), ref_summed, dtype)
    assert _same_kernel_math(normed, rms_norm(summed, w, 1e-6)), "the norm must be rms_norm's of the sum"
    if _ulps(summed.cpu(), ref_summed) == 0:
        assert _same_kernel_math(normed, rms_norm(x + delta, w, 1e-6))
    assert rel_err(normed.cpu(), ref_normed) < tol and rel_err(summed.cpu(), ref_summed) < tol


def _qkv_case(tokens, nh, nkv, d, blocks, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, (nh + 2 * nkv) * d + 8, generator=g).to(DEV, dtype)
    y = base[:, :(nh + 2 * nkv) * d]  # rows wider than q/k/v, as a LoRA-free strided view could be
    ang = torch.rand(tokens, d // 2, generator=g) * 6
    ang = torch.cat([ang, ang], -1)
    cos, sin = (ang.cos() * 1.1).to(DEV, dtype), (ang.sin() * 1.1).to(DEV, dtype)
    kc = torch.randn(blocks, block_size, nkv, d, generator=g).to(DEV, dtype)
    vc = torch.randn(blocks, block_size, nkv, d, generator=g).to(DEV, dtype)
    return y, cos, sin, kc, vc


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 16), (6, 1, 64)])
def test_qkv_rotary_store_matches_reference(dtype, tol, nh, nkv, d):
    """Rotary of q and k and the cache store in one launch (GQA): q as the rotary kernel makes it, k rotated and v
    stored at slots scattered over the blocks (slot -1 stores nothing), every other cache entry untouched; to the
    bit what rotary + store_kv write, and the plain-torch reference to rounding."""
    from dark.kernels.norm_rope import rotary
    from dark.kernels.paged_attention import qkv_rotary_store, qkv_rotary_store_reference

    y, cos, sin, kc, vc = _qkv_case(5, nh, nkv, d, 7, 4, dtype, seed=nh * d)
    slots = torch.tensor([13, -1, 2, 27, 8])  # blocks 3, 0, 6 and 2 of 7; token 1 a padded row
    k_ref, v_ref = kc.cpu().clone(), vc.cpu().clone()
    k_old, v_old = kc.clone(), vc.clone()
    q = qkv_rotary_store(y, nh, nkv, d, cos, sin, kc, vc, slots.to(DEV))
    q_ref = qkv_rotary_store_reference(y.cpu(), nh, nkv, d, cos.cpu(), sin.cpu(), k_ref, v_ref, slots)
    assert q.shape == (5, nh, d) and q.dtype == dtype and q.is_contiguous()
    assert rel_err(q.cpu(), q_ref) < tol
    assert rel_err(kc.cpu(), k_ref) < tol and torch.equal(vc.cpu(), v_ref)
    # the kernels the decode path ran before: two rotary launches and store_kv
    t = y.shape[0]
    q_split, k_split, v_split = y.split([nh * d, nkv * d, nkv * d], -1)
    q_old = rotary(q_split.reshape(t, nh, d), cos, sin)
    store_kv(rotary(k_split.reshape(t, nkv, d), cos, sin), v_split.reshape(t, nkv, d), k_old, v_old, slots.to(DEV))
    assert _same_kernel_math(q, q_old) and _same_kernel_math(kc, k_old) and torch.equal(vc, v_old)
    # the written slots hold this step's k/v; every other entry is what it was
    _, _, _, k0, v0 = _qkv_case(5, nh, nkv, d, 7, 4, dtype, seed=nh * d)
    written = torch.zeros(7 * 4, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = lambda c: c.cpu().view(7 * 4, nkv, d)  # noqa: E731
    assert torch.equal(flat(kc)[~written], flat(k0)[~written]) and torch.equal(flat(vc)[~written], flat(v0)[~written])
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat(vc)[s], v_split[i].cpu().view(nkv, d))
            assert not torch.equal(flat(kc)[s], flat(k0)[s])
            assert _same_kernel_math(flat(kc)[s], flat(k_old)[s])


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("slot,splits", [(2, 1), (0, 3), (-1, 1)])
def test_qkv_rotary_store_adds_the_lora_delta(dtype, tol, slot, splits):
    """A batch of one whose q/k/v GEMV ran without its adapter: qkv_rotary_store adds each head's delta from the
    group's codes (one or several partial sums) and B before rotating and storing, what lora_expand then the plain
    launch give; a token with no adapter (slot -1, codes never written: NaN here) gets the base result exactly."""
    from dark.kernels.lora import lora_expand
    from dark.kernels.paged_attention import qkv_rotary_store, qkv_rotary_store_reference

    nh, nkv, d, rank, max_rank, slots_n = 4, 2, 16, 5, 8, 3
    g = torch.Generator().manual_seed(slot + 7 * splits)
    y, cos, sin, kc, vc = _qkv_case(1, nh, nkv, d, 3, 4, dtype, seed=11)
    y = y.contiguous()
    outs = [nh * d, nkv * d, nkv * d]
    B = torch.zeros(slots_n, max_rank, sum(outs))
    B[:, :rank] = torch.randn(slots_n, rank, sum(outs), generator=g)
    B = B.to(DEV, dtype)
    h = torch.randn(1, splits, 3, 16, generator=g).to(DEV)
    if slot < 0:
        h.fill_(float("nan"))
    slots = torch.tensor([slot], dtype=torch.int32, device=DEV)
    mapping = torch.tensor([6], device=DEV)
    ep = {"h": h, "B": B, "slot": slots, "rank": rank, "splits": outs}
    k0, v0 = kc.clone(), vc.clone()
    q = qkv_rotary_store(y, nh, nkv, d, cos, sin, kc, vc, mapping, lora=ep)
    with_delta = y if slot < 0 else lora_expand(h, B, slots, y.clone(), rank, splits=outs)
    q_two = qkv_rotary_store(with_delta, nh, nkv, d, cos, sin, k0, v0, mapping)
    # the same sums in another order (lora_expand's): roundings apart
    assert rel_err(q, q_two) < tol / 4 and rel_err(kc, k0) < tol / 4 and rel_err(vc, v0) < tol / 4
    if slot < 0:
        assert torch.equal(q, q_two) and torch.equal(kc, k0) and torch.equal(vc, v0)
        return
    # against plain torch: y plus each member's codes (summed over the partials) times its B columns
    full, col = y.float().clone(), 0
    for m, n in enumerate(outs):
        full[:, col:col + n] += h[0, :, m, :rank].sum(0) @ B[slot, :rank, col:col + n].float()
        col += n
    k_ref, v_ref = kc.cpu().clone(), vc.cpu().clone()
    q_ref = qkv_rotary_store_reference(full.to(dtype).cpu(), nh, nkv, d, cos.cpu(), sin.cpu(), k_ref, v_ref,
                                       mapping.cpu())
    assert rel_err(q.cpu(), q_ref) < tol and rel_err(kc.cpu(), k_ref) < tol and rel_err(vc.cpu(), v_ref) < tol
    assert rel_err(q.cpu(), qkv_rotary_store_reference(y.cpu(), nh, nkv, d, cos.cpu(), sin.cpu(), k_ref.clone(),
                                                      v_ref.clone(), mapping.cpu())) > 10 * tol  # the delta shows


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tokens,heads,d", [(3, 4, 16), (5, 7, 64)])
def test_rotary_matches_reference(dtype, tol, tokens, heads, d):
    from dark.kernels.norm_rope import rotary, rotary_reference

    g = torch.Generator().manual_seed(heads * d)
    x = torch.randn(tokens, heads, d, generator=g).to(DEV, dtype)
    ang = torch.rand(tokens, d // 2, generator=g) * 6
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    out = rotary(x, cos, sin)
    assert rel_err(out.cpu(), rotary_reference(x.cpu(), cos.cpu(), sin.cpu())) < tol
    # a strided view (q out of a fused projection) works too
    wide = torch.randn(tokens, heads * d * 2, generator=g).to(DEV, dtype)
    view = wide[:, :heads * d].view(tokens, heads, d)
    assert rel_err(rotary(view, cos, sin).cpu(), rotary_reference(view.cpu(), cos.cpu(), sin.cpu())) < tol


# --- the training Functions: forward and the input's gradient against autograd through the plain-torch references


def _ref_grad(fn, inputs, dy):
    """fn(*inputs) and the gradient of the first input for upstream dy, by autograd on detached CPU copies."""
    leaf = inputs[0].detach().cpu().requires_grad_()
    out = fn(leaf, *[t.cpu() if torch.is_tensor(t) else t for t in inputs[1:]])
    out.backward(dy.cpu())
    return out.detach(), leaf.grad


def _cos_sin(tokens, d, g, scale=1.0):
    """cos, sin [T, d] with their halves repeated, as Rotary makes them; scale != 1 as rope scalings do (so the
    backward must be the transpose of the rotation, not merely its inverse)."""
    ang = torch.rand(tokens, d // 2, generator=g) * 6
    ang = torch.cat([ang, ang], -1)
    return ang.cos() * scale, ang.sin() * scale


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_rms_norm_train_matches_reference(dtype, tol):
    """An odd hidden size (100, masked), x a view with wider rows, dy not contiguous; weight frozen: no gradient."""
    from dark.kernels.norm_rope import rms_norm, rms_norm_reference, rms_norm_train

    g = torch.Generator().manual_seed(100)
    wide = (torch.randn(3, 2, 128, generator=g) * 3).to(DEV, dtype)
    w = torch.rand(100, generator=g).add(0.5).to(DEV, dtype)
    dy = torch.randn(3, 2, 200, generator=g).to(DEV, dtype)[..., ::2]
    x = wide[..., :100].requires_grad_()
    out = rms_norm_train(x, w, 1e-6)
    ref, ref_dx = _ref_grad(lambda a, b: rms_norm_reference(a, b, 1e-6), (x, w), dy)
    assert out.dtype == dtype and torch.equal(out, rms_norm(x.detach(), w, 1e-6))
    assert rel_err(out.detach().cpu(), ref) < tol
    out.backward(dy)
    assert x.grad.shape == x.shape and x.grad.dtype == dtype and w.grad is None
    assert rel_err(x.grad.cpu(), ref_dx) < tol
    with pytest.raises(AssertionError):
        rms_norm_train(x, w.clone().requires_grad_(), 1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_rotary_train_matches_reference(dtype, tol):
    """x a strided view of a fused projection output, dy with the heads outermost (the kernel's strides), cos and
    sin scaled."""
    from dark.kernels.norm_rope import rotary_reference, rotary_train

    tokens, heads, d = 5, 3, 32
    g = torch.Generator().manual_seed(7)
    cos, sin = (t.to(DEV, dtype) for t in _cos_sin(tokens, d, g, scale=1.3))
    wide = torch.randn(tokens, heads * d * 2, generator=g).to(DEV, dtype).requires_grad_()
    dy = torch.randn(heads, tokens, d, generator=g).to(DEV, dtype).transpose(0, 1)
    x = wide[:, heads * d:].view(tokens, heads, d)
    out = rotary_train(x, cos, sin)
    ref, ref_dx = _ref_grad(rotary_reference, (x, cos, sin), dy)
    assert out.dtype == dtype and rel_err(out.detach().cpu(), ref) < tol
    out.backward(dy)
    assert (wide.grad[:, :heads * d] == 0).all()
    assert rel_err(wide.grad[:, heads * d:].reshape(tokens, heads, d).cpu(), ref_dx) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_qkv_rotary_train_matches_reference(dtype, tol):
    """GQA (4 query heads, 2 kv heads) on y with rows wider than q/k/v: q and k rotated, v a copy; the gradient of
    y (v's columns too) against autograd through split + reshape + rotary, and with v unused (zeros there)."""
    from dark.kernels.norm_rope import qkv_rotary_reference, qkv_rotary_train

    tokens, nh, nkv, d = 5, 4, 2, 16
    width = (nh + 2 * nkv) * d
    g = torch.Generator().manual_seed(11)
    cos, sin = (t.to(DEV, dtype) for t in _cos_sin(tokens, d, g, scale=0.8))
    base = torch.randn(tokens, width + 24, generator=g).to(DEV, dtype)
    y = base[:, :width].requires_grad_()
    grads = (torch.randn(nh, tokens, d, generator=g).to(DEV, dtype).transpose(0, 1),  # dq not contiguous
             torch.randn(tokens, nkv, d, generator=g).to(DEV, dtype),
             torch.randn(tokens, nkv, d * 2, generator=g).to(DEV, dtype)[..., ::2])
    outs = qkv_rotary_train(y, nh, nkv, d, cos, sin)
    leaf = y.detach().cpu().requires_grad_()
    refs = qkv_rotary_reference(leaf, nh, nkv, d, cos.cpu(), sin.cpu())
    for out, ref, shape in zip(outs, refs, [(tokens, nh, d), (tokens, nkv, d), (tokens, nkv, d)]):
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
        assert rel_err(out.detach().cpu(), ref.detach()) < tol
    assert outs[2].untyped_storage().data_ptr() != base.untyped_storage().data_ptr(), "v must be a copy"
    assert torch.equal(outs[2].detach(), y.detach()[:, (nh + nkv) * d:].reshape(tokens, nkv, d))
    dy, = torch.autograd.grad(outs, y, grads)
    ref_dy, = torch.autograd.grad(refs, leaf, [t.cpu() for t in grads])
    assert dy.shape == y.shape and rel_err(dy.cpu(), ref_dy) < tol
    assert rel_err(dy[:, (nh + nkv) * d:].cpu(), ref_dy[:, (nh + nkv) * d:]) < tol
    # v unused (None in backward): zeros in its columns, q and k as before
    outs = qkv_rotary_train(y, nh, nkv, d, cos, sin)
    dy_qk, = torch.autograd.grad(outs[:2], y, grads[:2])
    assert (dy_qk[:, (nh + nkv) * d:] == 0).all() and torch.equal(dy_qk[:, :(nh + nkv) * d], dy[:, :(nh + nkv) * d])


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tokens,size,block", [(3, 300, 128), (4, 64, 1024)])
def test_silu_mul_matches_reference(dtype, tol, tokens, size, block):
    """300 columns in blocks of 128 (three column programs, the last masked) and 64 in one; gate_up with rows wider
    than gate and up, dy not contiguous; serving's silu_mul gives the training forward's values."""
    from dark.kernels.norm_rope import silu_mul, silu_mul_reference, silu_mul_train

    g = torch.Generator().manual_seed(size)
    base = (torch.randn(tokens, 2 * size + 8, generator=g) * 2).to(DEV, dtype)
    gate_up = base[:, :2 * size].requires_grad_()
    dy = torch.randn(tokens, 2 * size, generator=g).to(DEV, dtype)[:, ::2]
    out = silu_mul_train(gate_up, size, block)
    ref, ref_dgu = _ref_grad(lambda a: silu_mul_reference(a, size), (gate_up,), dy)
    assert out.shape == (tokens, size) and out.dtype == dtype and rel_err(out.detach().cpu(), ref) < tol
    assert torch.equal(silu_mul(gate_up.detach(), size, block), out)
    out.backward(dy)
    assert gate_up.grad.shape == gate_up.shape and rel_err(gate_up.grad.cpu(), ref_dgu) < tol
    assert rel_err(gate_up.grad[:, size:].cpu(), ref_dgu[:, size:]) < tol  # dup on its own: not swamped by dgate
    # the gradient written over a temporary input (the model's MLP): the same gradient, in the input's storage
    temp = gate_up.detach().clone().requires_grad_()
    mid = temp * 1  # a non-leaf temporary, as a projection's output is
    silu_mul_train(mid, size, block, reuse_input=True).backward(dy)
    assert torch.equal(temp.grad, gate_up.grad)
    # in place over the gate half (serving's large batches): the same values, a view of the input's storage
    fresh = gate_up.detach().clone()
    up = fresh[:, size:].clone()
    inplace = silu_mul(fresh, size, block, inplace=True)
    assert inplace.data_ptr() == fresh.data_ptr() and inplace.stride() == (2 * size, 1)
    assert torch.equal(inplace, out.detach()) and torch.equal(fresh[:, size:], up)


class _LaunchCounter:
    """Kernel launches of a region: every Triton kernel launch of dark.kernels (by kernel name; the torch ops that
    the interpreter runs inside a launch are not counted) and every aten op that would run a device kernel (views,
    reshapes and empty allocations launch none)."""

    NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "_unsafe_view", "detach", "lift_fresh",
                 "promote_types", "result_type"}

    def __init__(self, monkeypatch):
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.jit import KernelInterface

        self.counts, self.paused = Counter(), False
        counter = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if not counter.paused and not func.is_view and name not in counter.NO_KERNEL:
                    counter.counts[f"aten.{name}"] += 1
                return func(*args, **(kwargs or {}))

        class Counted:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __call__(self, *args, **kwargs):  # a jit helper called from inside a kernel: no launch of its own
                return self.kernel(*args, **kwargs)

            def __getitem__(self, grid):
                launch = self.kernel[grid]

                def run(*args, **kwargs):
                    counter.counts[self.name] += 1
                    counter.paused = True
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        counter.paused = False
                return run

        for module in ("norm_rope", "paged_attention", "lora"):
            mod = kernel_module(module)
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, KernelInterface):
                    monkeypatch.setattr(mod, name, Counted(obj, name))
        self.mode = Ops

    def count(self, fn):
        self.counts.clear()
        with self.mode():
            out = fn()
        return out, dict(self.counts)


def test_decode_layer_launches_fewer_kernels(tiny_models, monkeypatch):
    """A Qwen2 decode layer with the fused kernels on, without autograd: add_rms_norm takes the two residual adds
    and qkv_rotary_store the two rotary launches and store_kv, so the layer runs 4 launches fewer than the fused
    kernels' earlier route (each norm, rotary and store on its own, the adds in torch: 14 -> 10), to the same
    values in fp32 and the same KV cache; a whole decode pass runs no torch add, rotary or store_kv at all."""
    from dark.engine.attention import KVCache, PagedDecodeAttention
    from dark.models.decoder import load_model

    model = load_model(tiny_models["qwen2"], torch.device(DEV), torch.float32)
    model.use_fused_kernels(True)
    cfg, layer = model.config, model.model.layers[1]
    g = torch.Generator().manual_seed(0)
    cache = KVCache(cfg.num_layers, 12, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEV)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    slots, ctx = torch.tensor([9, 30, -1], device=DEV), torch.tensor([6, 11, 0], device=DEV)  # a padded last row
    tables = torch.tensor([[1, 2, 0], [4, 11, 7], [0, 0, 0]], dtype=torch.int32, device=DEV)
    x = torch.randn(3, cfg.hidden_size, generator=g).to(DEV)
    pending = torch.randn(3, cfg.hidden_size, generator=g).to(DEV)
    x_added = x + pending  # what the previous layer hands on: the plain route adds its MLP output there
    cos, sin = model.rotary(torch.tensor([5, 10, 0], device=DEV), torch.float32)

    class EarlierRoute:  # the decode attention as it was: attend only (rotary launches, then store_kv inside)
        def __init__(self, inner):
            self.inner = inner

        def attend(self, *args):
            return self.inner.attend(*args)

    start = cache.data.clone()
    with torch.inference_mode():  # compiled (on a GPU) before the counter wraps the kernels' jit helpers
        attn = PagedDecodeAttention(cache, slots, tables, ctx)
        layer(x_added, cos, sin, EarlierRoute(attn), None)
        layer(x, cos, sin, attn, None, pending, True)
        model.hidden_states(torch.tensor([3, 7, 0], device=DEV), torch.tensor([5, 10, 0], device=DEV), attn)
    cache.data.copy_(start)
    counter = _LaunchCounter(monkeypatch)
    with torch.inference_mode():
        attn = PagedDecodeAttention(cache, slots, tables, ctx)
        old, old_counts = counter.count(lambda: layer(x_added, cos, sin, EarlierRoute(attn), None))
        old_cache = cache.data.clone()
        cache.data.copy_(start)
        (new_x, new_pending), new_counts = counter.count(lambda: layer(x, cos, sin, attn, None, pending, True))
    if torch.cuda.is_available():  # compiled, an FMA contracted differently in one kernel carries on through the layer
        torch.testing.assert_close(new_x + new_pending, old, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.data, old_cache, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(new_x + new_pending, old) and torch.equal(cache.data, old_cache)
    assert not torch.equal(cache.data, start)
    assert sum(new_counts.values()) == sum(old_counts.values()) - 4
    assert old_counts.pop("aten.add") == 2 and "aten.add" not in new_counts
    assert old_counts.pop("_rotary_kernel") == 2 and old_counts.pop("_store_kv_kernel") == 1
    assert old_counts.pop("_rms_norm_kernel") == 2
    assert new_counts.pop("_qkv_rotary_store_kernel") == 1 and new_counts.pop("_add_rms_norm_kernel") == 2
    assert new_counts == old_counts  # the GEMMs, paged_decode and its merge, silu_mul
    # the whole pass: the first layer's input norm alone, every other norm (the final one too) with an add
    with torch.inference_mode():
        ids = torch.tensor([3, 7, 0], device=DEV)
        hidden, counts = counter.count(lambda: model.hidden_states(ids, torch.tensor([5, 10, 0], device=DEV), attn))
    layers = cfg.num_layers
    assert counts["_rms_norm_kernel"] == 1 and counts["_add_rms_norm_kernel"] == 2 * layers
    assert counts["_qkv_rotary_store_kernel"] == counts["_paged_decode_kernel"] == layers
    assert not {"aten.add", "_rotary_kernel", "_store_kv_kernel"} & set(counts)
    assert hidden.shape == (3, cfg.hidden_size) and torch.isfinite(hidden).all()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n,k,bias", [(37, 100, True), (64, 300, False), (5, 9000, False)])
def test_gemv_matches_reference(dtype, tol, n, k, bias):
    """One token's projection through the GEMV kernel (the decode path at batch 1) equals F.linear: rows that do
    not fill a block, K not a multiple of the step, a bias, the long-row configuration (K > 8192); x a view."""
    from dark.kernels.gemv import gemv, gemv_reference

    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(3, 2 * k, generator=g).to(DEV, dtype)[1:2, ::2]  # a row of a wider tensor, strided
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    out = gemv(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out.float().cpu(), gemv_reference(x.float(), w.float(), None if b is None else b.float()).cpu()) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [(2, 37, 104, True), (8, 300, 1024, False), (16, 128, 2048, True),
                                        (5, 1000, 256, False), (3, 130, 4104, True)])
def test_skinny_matches_reference(dtype, m, n, k, bias):
    """A few rows by a wide weight through the skinny product (decode at 2-16 sequences on Hopper) equals F.linear:
    columns that do not fill a tile, K not a multiple of the step (the copy engine's zero fill), K split over
    programs and summed by the tile's last program, a bias, x a strided view. Called twice: the tiles' counters
    are back at zero after each call, so the second call sums no stale partials."""
    from dark.kernels.skinny import _workspace, plan, skinny, skinny_reference

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 2 * k, generator=g).to(DEV, dtype)[:, ::2]
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    ref = skinny_reference(x.float(), w.float(), None if b is None else b.float()).cpu()
    per, splits = plan(n, k, 132)
    for _ in range(2):
        out = skinny(x, w, b)
        assert out.shape == (m, n) and out.dtype == dtype
        assert rel_err(out.float().cpu(), ref) < 1e-2
        assert not _workspace(w.device, n, splits)[1].any(), "a tile's counter left set"
    assert splits > 1 or k <= 1024, "the larger shapes take the split path"


def test_skinny_plans_its_grid_for_the_sm_budget_in_force():
    """Inside sm_budget(n) (serving's partition of the SMs) the skinny product splits K for n SMs, not the device's:
    fewer programs, the same result; the budget is this thread's alone, nests, and ends with its block."""
    import threading

    from dark.kernels import launch_sms, sm_budget, sm_count
    from dark.kernels.skinny import _WORK, BN, plan, skinny, skinny_reference

    n, k = 300, 4096
    whole = sm_count(torch.device(DEV))
    assert plan(n, k, 4)[1] < plan(n, k, whole)[1], "the shape must split differently on 4 SMs"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, k, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV, torch.bfloat16)
    ref = skinny_reference(x.float(), w.float()).cpu()
    seen = []
    with sm_budget(4):
        assert launch_sms(DEV) == 4
        worker = threading.Thread(target=lambda: seen.append(launch_sms(DEV)))
        worker.start()
        worker.join()
        with sm_budget(None):
            assert launch_sms(DEV) == whole
        assert launch_sms(DEV) == 4
        def eager() -> list:  # this shape's eager workspaces (not the graphs': graphs captured elsewhere use them)
            return [key for key in _WORK if key[1] != "graphs" and key[-2] == (n + BN - 1) // BN]

        for key in eager():  # forgotten, so the call below makes its own
            del _WORK[key]
        out = skinny(x, w)
    assert seen == [whole] and launch_sms(DEV) == whole
    assert rel_err(out.float().cpu(), ref) < 1e-2
    assert {key[-1] for key in eager()} == {plan(n, k, 4)[1]}, "the call took the workspace of the budget's split"
    with pytest.raises(ValueError, match="at least 1"):
        with sm_budget(0):
            pass


@pytest.mark.parametrize("m,t,n,k", [(8, 64, 296, 200), (3, 0, 136, 72), (0, 17, 520, 136), (16, 128, 256, 384),
                                     (72, 64, 200, 136),
                                     (5, 40, 2000, 4096)])
def test_dual_matches_reference(m, t, n, k):
    """One read of the weight for a decode step's x @ W^T and the backward's g @ W equals the two torch products:
    N and K that do not fill a tile (the copy engine's zero fill), either product alone, the most rows a call takes,
    and a weight wide enough that each program takes several chunks of it. Given buffers are added into."""
    from dark.kernels.dual import dual, dual_reference, plan

    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEV, torch.bfloat16)
    x = torch.randn(m, 2 * k, generator=gen).to(DEV, torch.bfloat16)[:, ::2] if m else None  # a strided view
    g = torch.randn(t, n, generator=gen).to(DEV, torch.bfloat16) if t else None
    ry, rdx = dual_reference(x.float() if m else torch.zeros(0, k, device=DEV),
                             g.float() if t else torch.zeros(0, n, device=DEV), w.float())
    y, dx = dual(x, g, w)
    assert (y is None) == (m == 0) and (dx is None) == (t == 0)
    if m:
        assert y.shape == (m, n) and y.dtype == torch.float32 and rel_err(y.cpu(), ry.cpu()) < 1e-5
    if t:
        assert dx.shape == (t, k) and dx.dtype == torch.float32 and rel_err(dx.cpu(), rdx.cpu()) < 1e-5
        base = torch.ones(t, k, device=DEV)
        _, again = dual(None, g, w, dx=base)
        assert again is base and rel_err(base.cpu() - 1, rdx.cpu()) < 1e-5, "dx is added into the given buffer"
    if n * k > 4_000_000:
        assert plan(n, k, 132)[0] > 1, "the wide weight takes several chunks a program"


def test_dual_keeps_no_gradient_alive():
    """A call's g (new each training step) is not held after the call: only the weight's descriptor is cached, since
    a cached descriptor keeps its tensor alive (4096 held gradients of a 7B gate/up would be 20 GB)."""
    import gc
    import weakref

    from dark.kernels.dual import dual

    w = torch.randn(64, 32).to(DEV, torch.bfloat16)
    g = torch.randn(3, 64).to(DEV, torch.bfloat16)
    alive = weakref.ref(g)
    dual(None, g, w)
    del g
    gc.collect()
    assert alive() is None, "the gradient outlived its call"


def test_dual_refuses_what_it_cannot_take():
    """Bad calls of the dual product say what was wrong."""
    from dark.kernels.dual import MAX_ROWS, dual

    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=DEV)
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV)
    g = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEV)
    for call, words in [(lambda: dual(None, None, w), "x, g or both"),
                        (lambda: dual(torch.zeros(MAX_ROWS + 1, 32, dtype=torch.bfloat16, device=DEV), g, w),
                         f"at most {MAX_ROWS} rows"),
                        (lambda: dual(torch.zeros(65, 32, dtype=torch.bfloat16, device=DEV),
                                      torch.zeros(65, 64, dtype=torch.bfloat16, device=DEV), w),
                         "pad to more than 192 together"),
                        (lambda: dual(x.float(), g, w), "x [M, K] in the weight's dtype"),
                        (lambda: dual(x, g[:, :32], w), "g [T, N]"),
                        (lambda: dual(x, g, w.float()), "16-bit weight"),
                        (lambda: dual(x, g, w, y=torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)), "y"),
                        (lambda: dual(x, g, w, dx=torch.zeros(3, 31, device=DEV)), "dx")]:
        with pytest.raises(AssertionError, match=re.escape(words)):
            call()


@pytest.mark.parametrize("r,rows", [(16, 64), (16, 128), (64, 128), (128, 64)])
def test_dual_compiles_for_hopper(r, rows):
    """The dual kernel at its default tiling, 8 (or 40-72, padded to 64-128) decode rows and 64 or 128 training rows,
    compiles for sm_90 with nothing spilled, at the stages stages() gives, in the shared memory an H100 or H200
    program may take (232448 bytes; 128 and 128 rows at 3 stages asked for 245816 and failed on an H100, and at
    2 stages spill, which is why dual() refuses them)."""
    from dark.kernels import dual

    ints = ["M", "T", "N", "K", "stride_x", "stride_y", "stride_dx"]
    types = {"w_desc": f"tensordesc<bf16[{dual.BN},{dual.BK}]>", "x_ptr": "*bf16",
             "g_desc": f"tensordesc<bf16[{rows},{dual.BN}]>", "y_ptr": "*fp32", "dx_ptr": "*fp32",
             **{n: "i32" for n in ints}}
    consts = dict(CHUNKS=8, BN=dual.BN, BK=dual.BK, R=r, TB=rows, HAS_X=True, HAS_G=True,
                  STAGES=dual.stages(r, rows), UPCAST=False, PDL=True)
    usage = compile_for_hopper("dual", "_dual_kernel", types, consts, num_warps=dual.WARPS)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0 and 0 < usage["REG"] <= 255, usage
    assert 0 < usage["DYNAMIC_SHARED"] <= 232448, usage
    assert dual.stages(16, 64) == dual.STAGES, "the step decode takes keeps its full pipeline"


def test_skinny_takes_only_what_it_can():
    """applies(): 2-16 rows, the weight's dtype, rows the copy engine can address; else the caller keeps F.linear."""
    from dark.kernels.skinny import applies

    w = torch.zeros(64, 256, dtype=torch.bfloat16, device=DEV)
    assert applies(torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV), w)
    assert applies(torch.zeros(16, 256, dtype=torch.bfloat16, device=DEV), w)
    assert not applies(torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV), w)    # the GEMV's
    assert not applies(torch.zeros(17, 256, dtype=torch.bfloat16, device=DEV), w)   # cuBLAS's
    assert not applies(torch.zeros(4, 256, dtype=torch.float32, device=DEV), w)     # dtypes differ
    w500 = torch.zeros(64, 250, dtype=torch.bfloat16, device=DEV)
    assert not applies(torch.zeros(4, 250, dtype=torch.bfloat16, device=DEV), w500)  # rows 500 bytes apart
    assert not applies(torch.zeros(4, 256, dtype=torch.float32, device=DEV), w.float())     # 32-bit weights


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("splits,glu,slot", [(None, False, 1), ([40, 24, 24], False, 2), ([48, 48], True, 0),
                                             (None, False, -1), ([48, 48], True, -1)])
@pytest.mark.parametrize("after", [False, True])
def test_gemv_adds_the_lora_delta_itself(dtype, tol, splits, glu, slot, after, monkeypatch):
    """A batch of one: the GEMV with an adapter's codes adds the delta itself (one projection; a q/k/v group of
    three members; gate/up with SiLU * up), equal to the GEMV then lora_expand, and to the reference; a token
    with no adapter (slot -1) gets the base projection. The codes read before the product or after it alike."""
    from dark.kernels import gemv as gemv_module
    from dark.kernels.gemv import gemv

    monkeypatch.setattr(gemv_module, "DELTA_AFTER", after)
    monkeypatch.setattr(gemv_module, "GLU_DELTA_AFTER", after)
    from dark.kernels.lora import lora_expand, lora_shrink
    from dark.kernels.norm_rope import silu_mul

    g = torch.Generator().manual_seed(len(splits or []) + glu)
    slots_n, rank, max_rank, K = 3, 6, 8, 300
    outs = splits or [56]
    members, N = len(outs), sum(outs)
    A = torch.zeros(slots_n, members * max_rank, K)
    for m in range(members):
        A[:, m * max_rank:m * max_rank + rank] = torch.randn(slots_n, rank, K, generator=g) / K ** 0.5
    B = torch.zeros(slots_n, max_rank, N)
    B[:, :rank] = torch.randn(slots_n, rank, N, generator=g)
    A, B = A.to(DEV, dtype), B.to(DEV, dtype)
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    bias = None if glu else torch.randn(N, generator=g).to(DEV, dtype)
    slots = torch.tensor([slot], device=DEV)
    stride = max_rank if splits else 0
    h = lora_shrink(x, A, slots, rank, members=members, stride=stride)
    if slot < 0:  # lora_shrink leaves a slotless token's codes unwritten: any bits, here the worst ones
        h.fill_(float("nan"))
    ep = {"h": h, "B": B, "slot": slots, "rank": rank, "splits": splits}
    out = gemv(x, w, bias, glu=glu, lora=ep)
    two = lora_expand(h, B, slots, gemv(x, w, bias), rank, splits=splits)
    if glu:
        two = silu_mul(two, N // 2)
    torch.testing.assert_close(out.float(), two.float(), rtol=tol, atol=tol)
    full = x.float() @ w.float().T + (0 if bias is None else bias.float())
    if slot >= 0:
        for m, (start, n) in enumerate(zip([0] + list(torch.tensor(outs).cumsum(0)[:-1].tolist()), outs)):
            a = A[slot, m * stride:m * stride + rank].float()
            full[:, start:start + n] += (x.float() @ a.T) @ B[slot, :rank, start:start + n].float()
    ref = silu_mul(full, N // 2) if glu else full
    assert rel_err(out.float().cpu(), ref.cpu()) < tol
    if slot < 0:
        base = gemv(x, w, bias, glu=glu)
        torch.testing.assert_close(out, base, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(37, 100), (5, 9000)])
def test_gemv_glu_is_the_gemv_then_silu_mul(dtype, n, k):
    """glu=True: one launch gives silu(x @ gate^T) * (x @ up^T) from the stacked [gate; up] weight, as the GEMV then
    silu_mul give it (both products rounded to x's dtype before the activation), and near the fp32 reference."""
    from dark.kernels.gemv import gemv
    from dark.kernels.norm_rope import silu_mul, silu_mul_reference

    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    out = gemv(x, w, glu=True)
    assert out.shape == (1, n) and out.dtype == dtype
    two = silu_mul(gemv(x, w, block_k=512), n)
    torch.testing.assert_close(out, two, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)
    ref = silu_mul_reference(x.float() @ w.float().T, n)
    assert rel_err(out.float().cpu(), ref.cpu()) < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(AssertionError):
        gemv(x, w[:-1], glu=True)  # an odd number of rows is not [gate; up]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("members,rank,slot,with_delta", [(3, 6, 1, True), (2, 8, 0, False), (1, 3, 2, True),
                                                           (3, 6, -1, True)])
def test_norm_codes_match_norm_then_shrink(dtype, tol, members, rank, slot, with_delta):
    """A batch of one: the norm that also writes an adapter's codes (grouped factors of 1-3 members, rank below
    the slots' max rank, K not a power of two) gives the plain norm's outputs to the bit, and the codes
    lora_shrink gives on the normed row (zero past the rank); a token with no adapter gets finite codes, which
    the GEMV then ignores."""
    from dark.kernels.lora import lora_shrink
    from dark.kernels.norm_rope import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(members * 10 + rank)
    K, slots_n, max_rank = 300, 3, 8
    A = torch.zeros(slots_n, members * max_rank, K)
    for m in range(members):
        A[:, m * max_rank:m * max_rank + rank] = torch.randn(slots_n, rank, K, generator=g) / K ** 0.5
    A = A.to(DEV, dtype)
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    d = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = torch.rand(K, generator=g).add(0.5).to(DEV, dtype)
    slots = torch.tensor([slot], dtype=torch.int32, device=DEV)
    codes = {"A": A, "slot": slots, "rank": rank, "members": members, "stride": max_rank,
             "out": torch.full((1, 1, members, 16), float("nan"), device=DEV)}
    if with_delta:
        normed, summed = add_rms_norm(x, d, w, 1e-6, codes)
        ref_normed, ref_summed = add_rms_norm(x, d, w, 1e-6)
        assert torch.equal(summed, ref_summed)
    else:
        normed = rms_norm(x, w, 1e-6, codes)
        ref_normed = rms_norm(x, w, 1e-6)
    assert codes["written"] and _near_kernel_math(normed, ref_normed)
    h = codes["out"]
    assert torch.isfinite(h).all() and (h[..., rank:] == 0).all()
    shrunk = lora_shrink(ref_normed, A, torch.tensor([max(slot, 0)], device=DEV), rank, members=members,
                         stride=max_rank).sum(1, keepdim=True)
    torch.testing.assert_close(h[..., :rank], shrunk[..., :rank], rtol=tol, atol=tol)
    s = max(slot, 0)  # plain torch: each member's rank rows of A times the normed row
    ref = torch.stack([ref_normed.float()[0] @ A[s, m * max_rank:m * max_rank + rank].float().T for m in range(members)])
    torch.testing.assert_close(h[0, 0, :, :rank], ref, rtol=tol, atol=tol)
    with pytest.raises(AssertionError, match="one row"):
        rms_norm(torch.cat([x, x]), w, 1e-6, codes)


@pytest.mark.parametrize("adapter", ["a", "b"])
def test_batch_of_one_takes_codes_from_the_norms(tiny_llm_with_adapters, monkeypatch, adapter):
    """One token with an adapter on the kernel path: the norms before q/k/v and gate/up and the attention's merge
    before o_proj write their codes (qkv_rotary_store adds q/k/v's delta, the GEMVs the others'); down_proj's GEMV
    writes its own and the next norm adds its delta. So no lora_shrink runs for the layers (4 launches a layer
    before), with the same hidden states and logits as the shrink launches give (DARK_NORM_CODES=0), and as the
    q/k/v GEMV adding its delta itself gives (DARK_QKV_LORA_LATE=0). Adapter "a" targets every projection; "b" q,
    v, down_proj and the LM head (zero factors elsewhere in its slot; the LM head's codes still from a shrink)."""
    from dark.engine.attention import KVCache, PagedDecodeAttention
    from dark.lora.slots import SlotLoRA

    llm = tiny_llm_with_adapters
    model, slots = llm.model, llm.engine.adapters.slots
    cfg = model.config
    model.use_fused_kernels(True)
    manager = llm.engine.adapters
    monkeypatch.setattr(manager, "background_loads", False)  # loaded here and now (on CUDA it defaults to a thread)
    slot = manager.acquire(manager.resolve(adapter))
    g = torch.Generator().manual_seed(0)
    cache = KVCache(cfg.num_layers, 4, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEV)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    tables = torch.tensor([[1, 2]], dtype=torch.int32, device=DEV)
    counter = None

    def run():
        start = cache.data.clone()
        with torch.inference_mode():
            lora = SlotLoRA.with_kernels(slots, torch.tensor([slot], dtype=torch.int32, device=DEV))
            attn = PagedDecodeAttention(cache, torch.tensor([12], device=DEV), tables, torch.tensor([13], device=DEV))
            fn = lambda: model.logits(model.hidden_states(torch.tensor([5], device=DEV), torch.tensor([12], device=DEV),
                                                          attn, lora), lora)
            out = counter.count(fn) if counter is not None else (fn(), None)
        cache.data.copy_(start)
        return out

    # compiled (on a GPU) before the counter wraps the kernels: a kernel compiled under it could not call the
    # wrapped jit helpers
    run()
    monkeypatch.setenv("DARK_NORM_CODES", "0")
    run()
    monkeypatch.delenv("DARK_NORM_CODES")
    monkeypatch.setenv("DARK_QKV_LORA_LATE", "0")
    run()
    monkeypatch.delenv("DARK_QKV_LORA_LATE")
    counter = _LaunchCounter(monkeypatch)
    (hidden, counts) = run()
    kernels = lambda c: {k: n for k, n in c.items() if not k.startswith("aten.")}  # noqa: E731 (the interpreter's copies aside)
    # the q/k/v delta added by the GEMV itself: the same launches, the same values
    monkeypatch.setenv("DARK_QKV_LORA_LATE", "0")
    (other, other_counts) = run()
    monkeypatch.delenv("DARK_QKV_LORA_LATE")
    assert kernels(other_counts) == kernels(counts)
    torch.testing.assert_close(hidden, other, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("DARK_NORM_CODES", "0")
    (shrunk, old_counts) = run()
    layers = cfg.num_layers
    head = int(any(k[1] == "lm_head" for k in slots.A))  # the LM head's shrink, once some adapter targets it
    # the slots hold factors for every projection some loaded adapter targets ("a": all), zeros in "b"'s slot where
    # it has none: 4 shrinks a layer before (q/k/v, o, gate/up, down), none now
    assert counts.get("_shrink_kernel", 0) == head and old_counts["_shrink_kernel"] == 4 * layers + head
    # every norm writes codes (q/k/v's, gate/up's) or adds down_proj's delta (all but the first layer's input norm,
    # and the final norm)
    assert counts["_norm_codes_kernel"] == 2 * layers + 1 and "_norm_codes_kernel" not in old_counts
    assert "_add_rms_norm_kernel" not in counts
    assert sum(kernels(counts).values()) == sum(kernels(old_counts).values()) - 4 * layers
    assert "_expand_kernel" not in counts  # the GEMVs add the deltas
    torch.testing.assert_close(hidden, shrunk, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        attn = PagedDecodeAttention(cache, torch.tensor([12], device=DEV), tables, torch.tensor([13], device=DEV))
        base = model.logits(model.hidden_states(torch.tensor([5], device=DEV), torch.tensor([12], device=DEV), attn,
                                                None), None)
    manager.release(slot)
    model.use_fused_kernels(llm.engine.runner.fast_decode)  # as the engine had it
    assert (hidden - base).abs().max() > 1e-3, "the adapter changed nothing"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("slot,rank", [(1, 5), (-1, 8)])
def test_paged_decode_merge_writes_codes(dtype, tol, slot, rank):
    """A batch of one with a merge: paged_decode's output is the same with the codes asked for, and the merge's
    per-head partial codes add up to lora_shrink's on that output (finite for a token with no adapter)."""
    from dark.kernels.lora import lora_shrink

    g = torch.Generator().manual_seed(rank)
    H, kvh, D, bs = 4, 2, 32, 8
    kc = torch.randn(6, bs, kvh, D, generator=g).to(DEV, dtype)
    vc = torch.randn(6, bs, kvh, D, generator=g).to(DEV, dtype)
    q = torch.randn(1, H, D, generator=g).to(DEV, dtype)
    tables = torch.tensor([[3, 1, 4]], dtype=torch.int32, device=DEV)
    ctx = torch.tensor([21], device=DEV)
    A = torch.zeros(3, 8, H * D)
    A[:, :rank] = torch.randn(3, rank, H * D, generator=g) / (H * D) ** 0.5
    A = A.to(DEV, dtype)
    slots = torch.tensor([slot], dtype=torch.int32, device=DEV)
    codes = {"A": A, "slot": slots, "rank": rank, "out": torch.full((1, H, 1, 16), float("nan"), device=DEV)}
    out = paged_decode(q, kc, vc, tables, ctx, 0.1, splits=4, codes=codes)
    assert codes["written"] and _near_kernel_math(out, paged_decode(q, kc, vc, tables, ctx, 0.1, splits=4))
    h = codes["out"]
    assert torch.isfinite(h).all() and (h[..., rank:] == 0).all()
    ref = lora_shrink(out.reshape(1, H * D), A, torch.tensor([max(slot, 0)], device=DEV), rank).sum(1, keepdim=True)
    torch.testing.assert_close(h.sum(1, keepdim=True)[..., :rank], ref[..., :rank], rtol=tol, atol=tol)
    plain = out.reshape(H * D).float() @ A[max(slot, 0), :rank].float().T
    torch.testing.assert_close(h.sum(1)[0, 0, :rank], plain, rtol=tol, atol=tol)
    no_merge = {**codes, "written": False}
    paged_decode(q, kc, vc, tables, ctx, 0.1, splits=1, codes=no_merge)
    assert not no_merge["written"]  # one range: no merge to write them (the caller shrinks)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("K,rank,slot", [(1100, 6, 1), (512, 8, -1)])
@pytest.mark.parametrize("early", [False, True])
def test_gemv_codes_out_and_the_norm_that_adds_the_delta(dtype, tol, K, rank, slot, early, monkeypatch):
    """down_proj with an adapter at batch 1, its delta left to the next norm: the GEMV with codes_out (and a
    bias) gives the plain GEMV's output and lora_shrink's codes (partial sums over K ranges); add_rms_norm with
    delta_lora then equals add_rms_norm of the GEMV that added the delta itself (the same sum, rounded once
    more), and the reference; with slot -1 it is the plain add_rms_norm. The norm reads B before its wait or
    after it alike."""
    from dark.kernels import norm_rope
    from dark.kernels.gemv import codes_parts, gemv
    from dark.kernels.lora import lora_shrink
    from dark.kernels.norm_rope import add_rms_norm, add_rms_norm_reference

    monkeypatch.setattr(norm_rope, "DELTA_EARLY", early)

    g = torch.Generator().manual_seed(K + rank)
    N, max_rank = 96, 8
    A = torch.zeros(3, max_rank, K)
    A[:, :rank] = torch.randn(3, rank, K, generator=g) / K ** 0.5
    B = torch.zeros(3, max_rank, N)
    B[:, :rank] = torch.randn(3, rank, N, generator=g) * 0.5
    A, B = A.to(DEV, dtype), B.to(DEV, dtype)
    x = torch.randn(1, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    bias = torch.randn(N, generator=g).to(DEV, dtype) if slot >= 0 else None  # down_proj with a bias too
    resid = torch.randn(1, N, generator=g).to(DEV, dtype)
    norm_w = torch.rand(N, generator=g).add(0.5).to(DEV, dtype)
    slots = torch.tensor([slot], dtype=torch.int32, device=DEV)
    spec = {"A": A, "B": B, "slot": slots, "rank": rank,
            "out": torch.full((1, codes_parts(K), 1, 16), float("nan"), device=DEV)}
    y = gemv(x, w, bias, codes_out=spec)
    assert _near_kernel_math(y, gemv(x, w, bias))
    h = spec["out"]
    assert torch.isfinite(h).all() and (h[..., rank:] == 0).all()
    shrunk = lora_shrink(x, A, torch.tensor([max(slot, 0)], device=DEV), rank).sum(1, keepdim=True)
    torch.testing.assert_close(h.sum(1, keepdim=True)[..., :rank], shrunk[..., :rank], rtol=tol, atol=tol)
    torch.testing.assert_close(h.sum(1)[0, 0, :rank], x[0].float() @ A[max(slot, 0), :rank].float().T, rtol=tol, atol=tol)
    normed, summed = add_rms_norm(resid, y, norm_w, 1e-6, delta_lora=spec)
    if slot < 0:
        plain = add_rms_norm(resid, y, norm_w, 1e-6)
        assert _near_kernel_math(normed, plain[0]) and torch.equal(summed, plain[1])
        return
    full = x.float() @ w.float().T + bias.float() + (x.float() @ A[slot, :rank].float().T) @ B[slot, :rank].float()
    ref_normed, ref_summed = add_rms_norm_reference(resid.float(), full, norm_w.float(), 1e-6)
    assert rel_err(summed.float().cpu(), ref_summed.cpu()) < tol and rel_err(normed.float().cpu(), ref_normed.cpu()) < tol
    one = gemv(x, w, bias, lora={"h": lora_shrink(x, A, slots, rank), "B": B, "slot": slots, "rank": rank})
    both = add_rms_norm(resid, one, norm_w, 1e-6)
    torch.testing.assert_close(summed.float(), both[1].float(), rtol=tol, atol=tol)
    with pytest.raises(AssertionError, match="residual add"):
        from dark.kernels.norm_rope import _norm_codes

        _norm_codes(resid, None, norm_w, 1e-6, None, spec)


def test_adapter_kernel_tilings_agree(monkeypatch):
    """The tilings bench/profile_offline.py compares (rows a program of the gate/up GEMV with an adapter, codes and
    warps a program of the norm that writes codes) give the default tiling's results."""
    from dark.kernels import gemv as gemv_mod
    from dark.kernels import norm_rope
    from dark.kernels.gemv import gemv

    g = torch.Generator().manual_seed(5)
    K, N, r = 96, 40, 4
    x = torch.randn(1, K, generator=g).to(DEV)
    w = (torch.randn(2 * N, K, generator=g) / K ** 0.5).to(DEV)
    norm_w = torch.rand(K, generator=g).add(0.5).to(DEV)
    A = (torch.randn(2, 2 * r, K, generator=g) / K ** 0.5).to(DEV)
    B = torch.randn(2, r, 2 * N, generator=g).to(DEV)
    slot = torch.tensor([1], dtype=torch.int32, device=DEV)

    def run():
        codes = {"A": A, "slot": slot, "rank": r, "members": 2, "stride": r, "out": torch.empty(1, 1, 2, 16, device=DEV)}
        h = norm_rope.rms_norm(x, norm_w, 1e-6, codes)
        return gemv(h, w, glu=True, lora={"h": codes["out"], "B": B, "slot": slot, "rank": r, "splits": [N, N]}), codes["out"]

    ref, ref_codes = run()
    monkeypatch.setattr(gemv_mod, "GLU_LORA_BLOCK_N", 4)
    monkeypatch.setattr(norm_rope, "CODES_PER_PROGRAM", 2)
    monkeypatch.setattr(norm_rope, "CODES_WARPS", 4)
    out, codes = run()
    torch.testing.assert_close(codes, ref_codes, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seqs", [((9, 1), (0, 7), (5, 6), (2, 1), (0, 1)), ((9, 1), (2, 1), (30, 1), (0, 7), (5, 6))])
def test_mixed_step_sends_decode_rows_to_the_kernel(monkeypatch, seqs):
    """PagedAttention's split of a step mixing prefill chunks with single-token rows (the runner's path on CUDA):
    the rows go to paged_decode at their graph bucket's context ranges, the chunks to the packed batch. Its
    bookkeeping, on any device: the packed batch's flash call is replaced by plain causal attention over the same
    cu_q / cu_k / kv_index, and every row must equal causal attention over its own sequence (interleaved rows, and
    the decode rows first as the scheduler puts running sequences)."""
    import torch.nn.functional as F

    import dark.engine.attention as attention
    from test_attention import paged_step_case

    def packed(self, kc, vc, q):  # what the flash kernel computes from the packed batch's metadata
        heads, dim = kc.shape[-2:]
        keys, values = (c.reshape(-1, heads, dim)[self.kv_index] for c in (kc, vc))
        outs = []
        for b in range(len(self.cu_q) - 1):
            qs = q[self.cu_q[b]:self.cu_q[b + 1]].transpose(0, 1)
            ks, vs = (t[self.cu_k[b]:self.cu_k[b + 1]].transpose(0, 1) for t in (keys, values))
            nq, nk = qs.shape[1], ks.shape[1]
            mask = torch.arange(nk, device=q.device)[None, :] <= (nk - nq) + torch.arange(nq, device=q.device)[:, None]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True).transpose(0, 1))
        return torch.cat(outs)

    monkeypatch.setattr(attention, "varlen_applies", lambda cache: True)
    monkeypatch.setattr(attention.PagedAttention, "_flash", packed)
    attn, out, ref = paged_step_case(DEV, torch.float32, seqs=seqs, decode_kernel=True)
    decode_rows = [i for i, (_, n) in enumerate(seqs) if n == 1]
    assert attn.decode is not None and attn.decode[1].shape[0] == len(decode_rows)
    assert attn.decode[1].dtype == torch.int32 and attn.decode[1].shape[1] % 16 == 0
    assert attn.decode[3] == paged_decode_splits(len(decode_rows))
    assert rel_err(out.cpu().double(), ref) < 1e-5
    # without the kernel (DARK_SPLIT_DECODE_ROWS=0, or the runner's kernels off) every row goes to the packed batch
    monkeypatch.setattr(attention, "SPLIT_DECODE_ROWS", False)
    attn, out, ref = paged_step_case(DEV, torch.float32, seqs=seqs, decode_kernel=True)
    assert attn.decode is None and attn.prefill_rows is None
    assert rel_err(out.cpu().double(), ref) < 1e-5


def paged_decode_splits(rows: int) -> int:
    """The context ranges the decode graph of the bucket holding `rows` sequences uses (2 key/value heads)."""
    from dark.engine.runner import GRAPH_BUCKETS
    from dark.kernels.paged_attention import default_splits

    return default_splits(next(b for b in GRAPH_BUCKETS if b >= rows), 2)
