"""A decoder layer under LoRA training, checkpointed with a hand-written backward.

A checkpointed training pass keeps each layer's input and runs the layer again in backward. Through
torch.utils.checkpoint that second run records an autograd graph of the layer, then runs a nested backward over
it: per layer a few dozen graph nodes made and walked, on top of the operator calls themselves. Here the layer is
one autograd Function: its forward is the layer without autograd, and its backward makes the tensors the gradients
read (in one plain pass, the down projection's product and its adapter delta skipped: nothing reads them) and then
the gradients, operator by operator. Only the attention's backward goes through autograd (SDPA's own backward, one
node). Measured (bench/RESULTS.md, 2026-12-03): the same gradients (~1e-14 apart in fp64), a 0.1 GiB lower peak
and ~25% fewer Python calls a job, and no faster 7B step on an H200, which waits for the GPU, not for these calls.

The base weights are frozen: gradients go to the layer's input and to the LoRA factors, which come in as one
(A, B) pair per unit of the layer: q/k/v (A stacked, B block-diagonal), o_proj, gate/up, down_proj. B is scaled.

Used by CausalLM.hidden_states where it applies (`applies`): a layer with q/k/v and gate/up fused, no q/k norm,
every fused group either wholly adapted or not at all, no autocast; elsewhere the reentrant checkpoint.
DARK_LAYER_PASS=0 is the A/B switch (the reentrant checkpoint everywhere).
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F

UNITS = ("qkv", "o_proj", "gate_up", "down_proj")


def applies(layer, lora, x: torch.Tensor) -> bool:
    a = layer.self_attn
    return (os.environ.get("DARK_LAYER_PASS", "1") != "0" and hasattr(lora, "layer_factors")
            and a.qkv is not None and a.q_norm is None and layer.mlp.gate_up is not None
            and not torch.is_autocast_enabled(x.device.type))


class _Ops:
    """The layer's elementwise parts and their backward: dark's Triton kernels (fused) or torch (plain, as the
    decoder's own plain path computes them)."""

    def __init__(self, fused: bool):
        self.fused = fused
        if fused:
            from .decoder import kernel_module
            self.k = kernel_module("norm_rope")

    def norm(self, x, w, eps):
        if self.fused:
            return self.k.rms_norm(x, w, eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def norm_backward(self, x, w, dy, eps):
        if self.fused:
            return self.k.rms_norm_backward(x, w, dy, eps)
        # y = w * x * r, r = (mean(x^2) + eps)^-1/2: dx = r * g - x * r^3 * mean(g * x), g = w * dy
        wide = torch.promote_types(x.dtype, torch.float32)  # as the forward's x.float(), fp64 kept
        xf = x.to(wide)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        g = dy.to(wide) * w.to(wide)
        return (r * g - xf * (r.pow(3) * (g * xf).mean(-1, keepdim=True))).to(x.dtype)

    def qkv(self, y, nh, nkv, d, cos, sin):
        if self.fused:
            return self.k.qkv_rotary_split(y, nh, nkv, d, cos, sin)
        from .decoder import _rotate
        t = y.shape[0]
        q, k, v = y.split([nh * d, nkv * d, nkv * d], -1)
        q, k = _rotate(q.reshape(t, nh, d), cos, sin), _rotate(k.reshape(t, nkv, d), cos, sin)
        return q, k, v.reshape(t, nkv, d).contiguous()

    def qkv_backward(self, dq, dk, dv, cos, sin, nh, nkv, d):
        if self.fused:
            return self.k.qkv_rotary_backward(dq, dk, dv, cos, sin, nh, nkv, d)
        t = dq.shape[0]

        def back(g):  # the transpose of x -> x * cos + rotate_half(x) * sin
            s = g * sin[:, None, :]
            half = g.shape[-1] // 2
            return (g * cos[:, None, :] + torch.cat((s[..., half:], -s[..., :half]), -1)).reshape(t, -1)
        return torch.cat([back(dq), back(dk), dv.reshape(t, -1)], 1)

    def silu_mul(self, g, size, inplace: bool = False):
        """inplace (fused; g read by nothing after): written over g's gate half (a 4096-token 7B pass: 155 MB)."""
        if self.fused:
            return self.k.silu_mul(g, size, inplace=inplace)
        gate, up = g.split(size, -1)
        return F.silu(gate) * up

    def silu_mul_backward(self, g, da, size):
        """The gradient for g; on the fused path written over g (nothing reads g after)."""
        if self.fused:
            return self.k.silu_mul_backward(g, da, size, reuse=True)
        wide = torch.promote_types(g.dtype, torch.float32)
        gate, up = g.to(wide).split(size, -1)
        s = torch.sigmoid(gate)
        daf = da.to(wide)
        return torch.cat([daf * up * s * (1 + gate * (1 - s)), daf * gate * s], -1).to(g.dtype)


def _delta(y, x, ab):
    """y += (x @ A^T) @ B^T in place; returns the codes x @ A^T (None without factors)."""
    if ab is None:
        return None
    codes = x @ ab[0].t()
    y.addmm_(codes, ab[1].t())
    return codes


KEPT = ("x", "q", "k", "v", "x1", "g")  # what a layer keeps in a loan of KV blocks (dark.engine.loan)


def kept_shapes(layer, tokens: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors (KEPT order) a layer's backward reads back instead of recomputing them: its input,
    q/k/v after the rotary, the attention block's output added to the input, and the gate/up product."""
    sa, mlp = layer.self_attn, layer.mlp
    width = layer.input_layernorm.weight.shape[0]
    return [(tokens, width), (tokens, sa.nh, sa.d), (tokens, sa.nkv, sa.d), (tokens, sa.nkv, sa.d), (tokens, width),
            (tokens, mlp.gate_up[0].shape[0])]


def _linear(x, wb, out=None):
    """F.linear(x, *wb), written into out when given."""
    if out is None:
        return F.linear(x, *wb)
    torch.mm(x, wb[0].t(), out=out)
    if len(wb) > 1 and wb[1] is not None:
        out.add_(wb[1])
    return out


def _run(layer, x, cos, sin, attn, f: dict, ops: _Ops, keep: bool, kept: dict | None = None):
    """The layer's forward without autograd. keep (the recompute in backward): returns what the gradients read,
    with the attention run under autograd, and without the down projection's product. kept (the first run, in a
    loan of KV blocks): the KEPT tensors are written there, the gate/up product in place."""
    sa, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    t, nh, nkv, d = x.shape[0], sa.nh, sa.nkv, sa.d
    if kept is not None:
        kept["x"].copy_(x)
    h1 = ops.norm(x, n1.weight, n1.eps)
    y = F.linear(h1, *sa.qkv)
    c1 = _delta(y, h1, f["qkv"])
    q, k, v = ops.qkv(y, nh, nkv, d, cos, sin)
    del y
    if kept is not None:
        q, k, v = kept["q"].copy_(q), kept["k"].copy_(k), kept["v"].copy_(v)
    if keep:
        q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        with torch.enable_grad():
            att = attn.attend(sa.layer, q, k, v)
        o = att.detach().reshape(t, nh * d)
    else:
        o = attn.attend(sa.layer, q, k, v).reshape(t, nh * d)
    z = F.linear(o, sa.o_proj.weight, sa.o_proj.bias)
    c2 = _delta(z, o, f["o_proj"])
    x1 = z.add_(x)
    del z
    if kept is not None:
        x1 = kept["x1"].copy_(x1)
    h2 = ops.norm(x1, n2.weight, n2.eps)
    g = _linear(h2, mlp.gate_up, kept["g"] if kept is not None else None)
    c3 = _delta(g, h2, f["gate_up"])
    a = ops.silu_mul(g, mlp.size, inplace=not keep and kept is None)
    down = mlp.down_proj
    if keep:
        c4 = a @ f["down_proj"][0].t() if f["down_proj"] is not None else None
        return dict(h1=h1, c1=c1, q=q, k=k, v=v, att=att, o=o, c2=c2, x1=x1, h2=h2, g=g, c3=c3, a=a, c4=c4)
    del g
    out = F.linear(a, down.weight, down.bias)
    _delta(out, a, f["down_proj"])
    return out.add_(x1)


def _from_kept(layer, kept: dict, cos, sin, attn, f: dict, ops: _Ops):
    """What _run(keep=True) returns, from a first run's KEPT tensors: only the norms, the codes, the attention's
    forward and the GLU run again, no projection."""
    sa, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    t, nh, d = kept["x"].shape[0], sa.nh, sa.d
    h1 = ops.norm(kept["x"], n1.weight, n1.eps)
    q, k, v = (kept[n].detach().requires_grad_() for n in ("q", "k", "v"))
    with torch.enable_grad():
        att = attn.attend(sa.layer, q, k, v)
    o = att.detach().reshape(t, nh * d)
    x1, g = kept["x1"], kept["g"]
    h2 = ops.norm(x1, n2.weight, n2.eps)
    a = ops.silu_mul(g, mlp.size)

    def codes(unit, inp):
        return inp @ f[unit][0].t() if f[unit] is not None else None
    return dict(h1=h1, c1=codes("qkv", h1), q=q, k=k, v=v, att=att, o=o, c2=codes("o_proj", o), x1=x1, h2=h2, g=g,
                c3=codes("gate_up", h2), a=a, c4=codes("down_proj", a))


def _unit_backward(dy, x, w, ab, codes, need_dx: bool = True):
    """For y = x @ W^T (+ (x @ A^T) @ B^T): (dx, dA, dB), W frozen (dx None unless need_dx)."""
    dx = dy @ w if need_dx else None
    if ab is None:
        return dx, None, None
    dcodes = dy @ ab[1]
    db = dy.t() @ codes
    da = dcodes.t() @ x
    if dx is not None:
        dx.addmm_(dcodes, ab[0])
    return dx, da, db


def _backward(layer, x, cos, sin, attn, f: dict, ops: _Ops, dout, need_dx: bool = True, kept: dict | None = None):
    """(dx, {unit: (dA, dB)}) of the layer at input x for the output's gradient dout (dx None unless need_dx: the
    first layer's input, the embeddings, needs none). kept: the first run's KEPT tensors (x is kept["x"])."""
    sa, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    nh, nkv, d = sa.nh, sa.nkv, sa.d
    if kept is not None:
        x = kept["x"]
        s = _from_kept(layer, kept, cos, sin, attn, f, ops)
    else:
        s = _run(layer, x, cos, sin, attn, f, ops, keep=True)
    grads = {}
    da_in, *grads["down_proj"] = _unit_backward(dout, s.pop("a"), mlp.down_proj.weight, f["down_proj"], s.pop("c4"))
    dg = ops.silu_mul_backward(s.pop("g"), da_in, mlp.size)
    del da_in
    dh2, *grads["gate_up"] = _unit_backward(dg, s.pop("h2"), mlp.gate_up[0], f["gate_up"], s.pop("c3"))
    del dg
    dx1 = ops.norm_backward(s.pop("x1"), n2.weight, dh2, n2.eps).add_(dout)
    del dh2
    do, *grads["o_proj"] = _unit_backward(dx1, s.pop("o"), sa.o_proj.weight, f["o_proj"], s.pop("c2"))
    q, k, v, att = s.pop("q"), s.pop("k"), s.pop("v"), s.pop("att")
    dq, dk, dv = torch.autograd.grad(att, (q, k, v), do.view(att.shape))
    del q, k, v, att, do
    dy = ops.qkv_backward(dq, dk, dv, cos, sin, nh, nkv, d)
    del dq, dk, dv
    dh1, *grads["qkv"] = _unit_backward(dy, s.pop("h1"), sa.qkv[0], f["qkv"], s.pop("c1"), need_dx)
    del dy
    if not need_dx:
        return None, grads
    return ops.norm_backward(x, n1.weight, dh1, n1.eps).add_(dx1), grads


class _LayerPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, layer, attn, context, placement, *factors):
        f = dict(zip(UNITS, _pairs(factors)))
        ctx.layer, ctx.attn, ctx.context, ctx.placement = layer, attn, context, placement
        # kept in a loan: x is one of the placement's tensors (its own memory goes when the next layer is done)
        ctx.save_for_backward(x if placement is None else None, cos, sin, *factors)
        kept = dict(zip(KEPT, placement.tensors)) if placement is not None else None
        with context() if context is not None else nullcontext() as moved:
            out = _run(layer, x, cos, sin, attn, f, _Ops(layer.self_attn.fused), keep=False, kept=kept)
        if moved is not None:  # made on the stream switched to, read on this one next
            out.record_stream(torch.cuda.current_stream(out.device))
        return out

    @staticmethod
    def backward(ctx, dout):
        x, cos, sin, *factors = ctx.saved_tensors
        f = dict(zip(UNITS, _pairs(factors)))
        layer, placement = ctx.layer, ctx.placement
        kept = dict(zip(KEPT, placement.tensors)) if placement is not None else None
        with ctx.context() if ctx.context is not None else nullcontext() as moved:
            dx, grads = _backward(layer, x, cos, sin, ctx.attn, f, _Ops(layer.self_attn.fused), dout,
                                  ctx.needs_input_grad[0], kept)
        if placement is not None:  # its room is free for the next pass (whose work queues after this one's)
            placement.release()
            ctx.placement = None
        out = [dx] + _flat({unit: grads[unit] if f[unit] is not None else None for unit in UNITS})
        if moved is not None:
            around = torch.cuda.current_stream(dout.device)
            for g in out:
                if g is not None:
                    g.record_stream(around)
        return (out[0], None, None, None, None, None, None, *out[1:])


def _pairs(factors):
    """[A, B, A, B, ...] (None, None for a unit without factors) -> [(A, B) or None, ...]."""
    return [None if factors[i] is None else (factors[i], factors[i + 1]) for i in range(0, len(factors), 2)]


def _flat(by_unit: dict) -> list:
    """{unit: (A, B) or None} -> [A, B, A, B, ...] in UNITS order, (None, None) for a unit without factors."""
    return [t for unit in UNITS for t in (by_unit[unit] if by_unit[unit] is not None else (None, None))]


def layer_pass(layer, x, cos, sin, attn, factors: dict, context=None, placement=None) -> torch.Tensor:
    """The layer's output for x, differentiable in x and in factors ({unit: (A, B) or None}, UNITS), keeping only
    x for backward. context: a callable giving a context manager that the forward and the backward run in (the
    trainer's stream choice; what it yields is the stream switched to, or None). placement: room in a loan of KV
    blocks (dark.engine.loan) for the KEPT tensors, kept_shapes(layer, tokens): the backward then runs no
    projection again."""
    return _LayerPass.apply(x, cos, sin, layer, attn, context, placement, *_flat(factors))
