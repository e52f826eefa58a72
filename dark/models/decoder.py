"""One decoder for the Llama, Qwen2/2.5 and Qwen3 families, with per-family switches; Qwen2-VL's and Qwen2.5-VL's language
models run as a Qwen2 (text only: their vision tower is neither built nor read).

Parameter names mirror Hugging Face's (`model.layers.0.self_attn.q_proj.weight`), so checkpoints load as
they are. The forward pass works on a flat list of tokens from many sequences; how attention finds each
token's context (paged KV cache for serving, a dense causal batch for training) and which LoRA weights
apply to each token are passed in, so serving and training run the same modules on the same base weights.
"""
from __future__ import annotations

import contextvars
import importlib
import importlib.util
import json
import os
import re
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..errors import ModelLoadError
from . import train_layer

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl")
# vision-language model types whose language model is another family's decoder: Qwen2-VL's and Qwen2.5-VL's are
# Qwen2's (same layers, QKV bias; their M-RoPE gives a text-only prompt the same position in all three sections, which
# is the 1-D rotary of Qwen2)
TEXT_DECODER = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}
# their vision tower's checkpoint tensors, which dark skips without reading: under visual.* in the hub's checkpoints,
# model.visual.* in transformers 5's own layout
VISION_TENSORS = ("visual.", "model.visual.")
# where transformers 5 keeps their language model (a checkpoint saved with save_original_format=False uses these
# names; PEFT names an adapter's tensors by them): model.language_model.layers.0 there is dark's model.layers.0
LANGUAGE_MODEL = "model.language_model"


def kernel_module(name: str | None = None):
    """dark.kernels (or dark.kernels.<name>): the top-level kernels/ folder, which pyproject.toml maps into the
    package. A source checkout run through PYTHONPATH, with no install, lacks that mapping: alias it here."""
    if "dark.kernels" not in sys.modules:
        try:
            importlib.import_module("dark.kernels")
        except ModuleNotFoundError:
            folder = Path(__file__).resolve().parents[2] / "kernels"
            spec = importlib.util.spec_from_file_location("dark.kernels", folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["dark.kernels"] = module
            spec.loader.exec_module(module)
    return importlib.import_module(f"dark.kernels.{name}" if name else "dark.kernels")


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool       # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool         # Llama/Qwen3 when attention_bias
    mlp_bias: bool
    qk_norm: bool        # Qwen3: RMSNorm over each head's q and k
    hf_config: object = None  # the transformers config of the language model, for rotary variants

    @property
    def hf_backbone(self) -> str:
        """The language model's module path in the transformers model of this family (model.layers.0 here is
        <hf_backbone>.layers.0 there): PEFT names an adapter's tensors by it."""
        return LANGUAGE_MODEL if self.family in TEXT_DECODER else "model"

    @property
    def hf_skipped(self) -> str | None:
        """A regex of the transformers model's modules that dark does not build (a Qwen2(.5)-VL's vision tower), for
        an exported adapter's exclude_modules: PEFT would otherwise put LoRA layers on the vision MLP's gate/up/down
        projections too; None when there are none."""
        return "|".join(re.escape(p) + ".*" for p in VISION_TENSORS) if self.family in TEXT_DECODER else None

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills (its name here), or None for a tensor dark does not load."""
        if self.family not in TEXT_DECODER:
            return name
        if name.startswith(VISION_TENSORS):
            return None
        if name.startswith(LANGUAGE_MODEL + "."):
            return "model." + name[len(LANGUAGE_MODEL) + 1:]
        return name

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        from transformers import AutoConfig

        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}; save the model again with save_pretrained") from e
        family = raw.get("model_type", "")
        if family not in SUPPORTED_FAMILIES:
            raise ModelLoadError(
                f"model type {family!r} in {path} is not supported; dark runs {', '.join(SUPPORTED_FAMILIES)}"
            )
        try:
            outer = AutoConfig.from_pretrained(folder)
        except Exception as e:  # transformers raises many kinds for a config it cannot use
            raise ModelLoadError(f"transformers cannot read {path} as a {family} config: {e}") from e
        # Qwen2(.5)-VL: the language model's parameters are its text_config, both where the file nests them (as
        # transformers 5 writes it) and where they sit at the top level (the original hub layout: transformers
        # moves them into text_config as it reads); the head's tie stays on the outer config
        hf = outer.get_text_config() if family in TEXT_DECODER else outer
        decoder = TEXT_DECODER.get(family, family)
        heads = hf.num_attention_heads
        if family in TEXT_DECODER:
            # their attention takes hidden_size // heads whatever the config says (transformers' Qwen2_5_VLAttention,
            # Qwen2VLAttention)
            if hf.hidden_size % heads:
                raise ModelLoadError(f"{path}: hidden_size {hf.hidden_size} is not a multiple of the "
                                     f"{heads} attention heads")
            head_dim = hf.hidden_size // heads
        else:
            head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(outer, "tie_word_embeddings", False)),
            qkv_bias=decoder == "qwen2" or attention_bias,
            o_bias=decoder != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=decoder == "qwen3",
            hf_config=hf,
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every projection LoRA may target."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, self.intermediate_size), "up_proj": (h, self.intermediate_size),
            "down_proj": (self.intermediate_size, h), "lm_head": (h, self.vocab_size),
        }


class Attention(Protocol):
    """How a layer's queries find their keys: paged cache (serving) or a dense causal batch (training).

    One that also has `attend_fused_qkv(layer, y, nh, nkv, d, cos, sin)` takes, in passes without autograd with the
    fused kernels on, the fused q/k/v projection output y [T, (nh + 2 * nkv) * d] as it is, unrotated, and returns
    attend's output for it (PagedDecodeAttention: rotary and the cache store in one launch); others get q, k and v.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class LoRA(Protocol):
    """Adds each token's adapter delta to a projection's output.

    A LoRA that also has `apply_group(layer, group, x, y)` takes the fused projections ("qkv": q, k and v;
    "gate_up": gate and up) in one call on their concatenated output; one without it gets each projection
    on its own (the layers then run the separate GEMMs, on views of the same fused weights).
    """

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


def fuse_linears(linears: list["Linear"], extra_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the given projections' rows back to back; each projection's parameter
    becomes a view of its rows, so one GEMM computes them all and nothing is stored twice. extra_rows: zero rows
    after theirs (dark.lora.slots.AdapterSlots.extend_weights puts every adapter slot's A there)."""
    def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
        n = sum(p.shape[0] for p in parts)
        whole = parts[0].new_empty((n + extra_rows, *parts[0].shape[1:]))
        torch.cat(parts, out=whole[:n])
        whole[n:].zero_()
        return whole

    weight = stacked([m.weight.data for m in linears])
    bias = stacked([m.bias.data for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


def _grouped(lora) -> bool:
    return lora is None or hasattr(lora, "apply_group")


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """F.linear; for one token in a pass without autograd with the fused kernels on (a batch-1 decode step), the
    Triton GEMV (dark.kernels.gemv), which reads the weights faster than cuBLAS at every such shape measured; for
    2-16 tokens on a Hopper GPU with DARK_SKINNY=1, the skinny product (dark.kernels.skinny: TMA loads, K split
    over programs)."""
    if _gemv_applies(x, fused):
        return kernel_module("gemv").gemv(x, weight, bias)
    if _skinny_applies(x, weight, fused):
        return kernel_module("skinny").skinny(x, weight, bias)
    return F.linear(x, weight, bias)


def project_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product on the kernel path without an adapter's delta (SlotLoRA.extended's GEMM over the extended weight):
    the GEMV for one row, the skinny product for 2-16 on Hopper with DARK_SKINNY=1, else F.linear."""
    return _project(x, weight, bias, True)


def _skinny_applies(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> bool:
    """2-16 rows without autograd with the fused kernels on, on a GPU with the bulk tensor copy engine (compute
    capability 9 and up: where it read a decode step's weights faster than cuBLAS, bench/probe_reader_partition.py),
    when DARK_SKINNY=1. Off by default: within 1-2% of cuBLAS either way in the engine's decode steps on an H100
    (bench/ab_decode_env.py --env DARK_SKINNY=1; bench/RESULTS.md 2026-12-07), not yet measured there on the H200."""
    if os.environ.get("DARK_SKINNY", "0") != "1" or not fused or torch.is_grad_enabled():
        return False
    return kernel_module().hopper(x.device) and kernel_module("skinny").applies(x, weight)


def _gemv_applies(x: torch.Tensor, fused: bool) -> bool:
    return fused and x.dim() == 2 and x.shape[0] == 1 and not torch.is_grad_enabled()


def _gemv_lora(lora, layer: int, key: str, x: torch.Tensor, group: bool = False):
    """What the GEMV needs to add the adapter's delta itself (a batch of one on the kernel path: SlotLoRA.gemv_lora);
    None with nothing to add, False when the delta must be added after the projection (lora.apply)."""
    if lora is None:
        return None
    fn = getattr(lora, "gemv_lora", None)
    if fn is None or os.environ.get("DARK_GEMV_LORA", "1") == "0":
        return False
    return fn(layer, key, x, group)


def _norm_codes(lora, layer: int, key: str, x: torch.Tensor, parts: int = 1) -> dict | None:
    """For a batch of one on the kernel path: where the kernel before a projection writes the adapter's codes for
    it (SlotLoRA.norm_codes): the norm before a fused group ("qkv", "gate_up"), the attention's merge before
    o_proj (in `parts` partial sums, one a head), so the GEMV needs no lora_shrink launch; else None."""
    fn = getattr(lora, "norm_codes", None)
    if fn is None or x.dim() != 2 or x.shape[0] != 1 or os.environ.get("DARK_GEMV_LORA", "1") == "0":
        return None
    return fn(layer, key, x, parts)


def _defer_codes(lora, layer: int, key: str, x: torch.Tensor) -> dict | None:
    """For a batch of one on the kernel path: the codes a projection's GEMV writes for the next residual add's norm
    to add its adapter's delta (SlotLoRA.defer_codes); None: the GEMV adds it itself, or there is none."""
    fn = getattr(lora, "defer_codes", None)
    return fn(layer, key, x) if fn is not None else None


def _take_deferred(lora) -> dict | None:
    """The adapter delta a layer's down_proj left for the next residual add's norm (SlotLoRA.defer_codes)."""
    fn = getattr(lora, "take_deferred", None)
    return fn() if fn is not None else None


def _project_lora(x, weight, bias, fused: bool, lora, layer: int, key: str, group: bool = False) -> torch.Tensor:
    """_project plus the adapter's delta (lora.apply / apply_group); for one token on the kernel path, in the GEMV."""
    if _gemv_applies(x, fused):
        ep = _gemv_lora(lora, layer, key, x, group)
        if ep is not False:
            return kernel_module("gemv").gemv(x, weight, bias, lora=ep)
    if lora is not None and fused:  # several tokens with adapters (decode): base and codes in one GEMM
        ext = getattr(lora, "extended", None)
        y = ext(layer, key, x) if ext is not None else None
        if y is not None:
            return y
    y = _project(x, weight, bias, fused)
    if lora is None:
        return y
    return lora.apply_group(layer, key, x, y) if group else lora.apply(layer, key, x, y)


# True while a checkpointed layer runs again in backward (set by _checkpointed): a recompute only has to give the
# tensors the layer's backward reads, so a projection whose output nothing in it reads skips its product
_RECOMPUTING = contextvars.ContextVar("dark_recomputing", default=False)


def _checkpointed(fn):
    """fn for a reentrant checkpoint: its first run has autograd off and its recompute in backward has it on; the
    recompute runs with _RECOMPUTING set."""
    def run(*args):
        token = _RECOMPUTING.set(torch.is_grad_enabled())
        try:
            return fn(*args)
        finally:
            _RECOMPUTING.reset(token)
    return run


class _UnreadProduct(torch.autograd.Function):
    """x @ weight.T for a frozen weight, where nothing in backward reads the product's values (a layer's last
    projection, recomputed): forward gives zeros without the GEMM, backward the gradient of x as F.linear's."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight  # a frozen parameter, never changed in place during a pass
        return x.new_zeros(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight.to(grad.dtype), None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, layer: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.layer, self.name = layer, name
        self.fused = False  # CausalLM.use_fused_kernels
        # the layer's last projection: only the residual add reads its output, and a recompute's output is not
        # read (backward needs its input, for the gradient of the adapter's A, and its weight)
        self.output_unread_in_recompute = name == "down_proj"

    def forward(self, x: torch.Tensor, lora: LoRA | None) -> torch.Tensor:
        if (self.output_unread_in_recompute and _RECOMPUTING.get() and torch.is_grad_enabled()
                and os.environ.get("DARK_RECOMPUTE_SKIP", "1") != "0"):  # 0: the whole layer again (an A/B)
            # a checkpointed layer's recompute: its down_proj product (~29% of a 7B layer's FLOPs) is skipped, the
            # adapter's delta still runs (its codes are what the factors' gradients read)
            y = _UnreadProduct.apply(x, self.weight)
            return y if lora is None else lora.apply(self.layer, self.name, x, y)
        return _project_lora(x, self.weight, self.bias, self.fused, lora, self.layer, self.name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.fused = False  # CausalLM.use_fused_kernels

    def forward(self, x: torch.Tensor, codes: dict | None = None) -> torch.Tensor:
        """codes (a batch of one on the kernel path; _norm_codes): the adapter's codes of the projections after
        this norm, computed in its launch (kernels.norm_rope.norm_codes); ignored on the other paths."""
        if self.fused:
            kernels = kernel_module("norm_rope")
            if not torch.is_grad_enabled():
                return kernels.rms_norm(x, self.weight, self.eps, codes)
            if not self.weight.requires_grad:
                return kernels.rms_norm_train(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # fp32 for half precision; fp64 stays
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor, codes: dict | None = None,
                    delta_lora: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + delta), x + delta): one launch of the Triton add_rms_norm in passes without autograd with the
        fused kernels on (the add's values, and rms_norm's of them), else the add, then forward. codes: as in
        forward; delta_lora: an adapter delta still to be added to delta (SlotLoRA.defer_codes; only ever made on
        the fused path)."""
        if self.fused and not torch.is_grad_enabled():
            return kernel_module("norm_rope").add_rms_norm(x, delta, self.weight, self.eps, codes, delta_lora)
        assert delta_lora is None, "an adapter delta left for the norm off the kernel path"
        x = x + delta
        return self(x), x


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf = cfg.hf_config
        params = getattr(hf, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
            # in fp32 as transformers (and vLLM) compute it: the model's makers checked its logits that way; the exact
            # values differ by an ulp, ~2e-3 of angle at position 32k
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scale = 1.0
        else:  # llama3, yarn, linear, ...: transformers knows the formulas
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ModelLoadError(f"rope type {rope_type!r} of this {cfg.family} model is not supported; "
                                     f"transformers knows default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
            with torch.device("cpu"):  # computed values, also while CausalLM is built on the meta device (load_model)
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scale = float(scale)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # in x's dtype: under CPU bf16 autocast (LearnConfig.cpu_bf16) x is a bf16 projection output while cos and sin
    # are fp32, and attention needs q and k in the dtype of v; elsewhere they share a dtype and this is a no-op
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer, self.nh, self.nkv, self.d = layer, cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, cfg.qkv_bias, layer, "q_proj")
        self.k_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, layer, "k_proj")
        self.v_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, layer, "v_proj")
        self.o_proj = Linear(cfg.num_heads * d, h, cfg.o_bias, layer, "o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused = False  # CausalLM.use_fused_kernels
        self.qkv = None      # (weight, bias) of q, k and v in one, once CausalLM.fuse_projections ran

    def late_lora(self, x: torch.Tensor, attn: Attention) -> bool:
        """Whether q/k/v's adapter delta is added by the decode attention's qkv_rotary_store rather than by the
        projection (one token on the kernel path, an attention with attend_fused_qkv, no q/k norm);
        DARK_QKV_LORA_LATE=0: never."""
        return (self.qkv is not None and self.fused and not torch.is_grad_enabled() and self.q_norm is None
                and hasattr(attn, "attend_fused_qkv") and _gemv_applies(x, self.fused)
                and os.environ.get("DARK_QKV_LORA_LATE", "1") != "0")

    def forward(self, x, cos, sin, attn: Attention, lora: LoRA | None):
        t = x.shape[0]
        training = self.fused and torch.is_grad_enabled()  # the Triton kernels' autograd forms
        if self.qkv is not None and _grouped(lora):
            # one token on the decode path: the GEMV runs as the base model's and qkv_rotary_store, which reads each
            # head's columns anyway, adds the adapter's delta (a few KB of B a head) before rotating
            late = self.late_lora(x, attn) and _gemv_lora(lora, self.layer, "qkv", x, True)
            if late is False:
                y = _project_lora(x, *self.qkv, self.fused, lora, self.layer, "qkv", group=True)
            else:
                y = kernel_module("gemv").gemv(x, *self.qkv)
            if training and self.q_norm is None:
                # split, rotary and their backward in a few launches, one gradient for y
                q, k, v = kernel_module("norm_rope").qkv_rotary_train(y, self.nh, self.nkv, self.d, cos, sin)
                return self.o_proj(attn.attend(self.layer, q, k, v).reshape(t, self.nh * self.d), lora)
            if self.fused and not training and self.q_norm is None and hasattr(attn, "attend_fused_qkv"):
                # serving's decode attention: rotary of q and k and the cache store in one launch, on y as it is
                codes = _norm_codes(lora, self.layer, "o_proj", y, parts=self.nh)  # from the attention's merge
                out = attn.attend_fused_qkv(self.layer, y, self.nh, self.nkv, self.d, cos, sin, codes, late or None)
                return self.o_proj(out.reshape(t, self.nh * self.d), lora)
            q, k, v = y.split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], -1)
            q, k, v = q.reshape(t, self.nh, self.d), k.reshape(t, self.nkv, self.d), v.reshape(t, self.nkv, self.d)
        else:
            q = self.q_proj(x, lora).view(t, self.nh, self.d)
            k = self.k_proj(x, lora).view(t, self.nkv, self.d)
            v = self.v_proj(x, lora).view(t, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:
            kernels = kernel_module("norm_rope")
            rotary = kernels.rotary_train if training else kernels.rotary
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        else:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = attn.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.nh * self.d), lora)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, b, layer, "gate_proj")
        self.up_proj = Linear(h, i, b, layer, "up_proj")
        self.down_proj = Linear(i, h, b, layer, "down_proj")
        self.layer, self.size = layer, i
        self.gate_up = None  # (weight, bias) of gate and up in one, once CausalLM.fuse_projections ran
        self.fused = False   # CausalLM.use_fused_kernels

    def forward(self, x, lora: LoRA | None, defer: bool = False):
        """defer (a batch of one on the kernel path, DecoderLayer's defer): down_proj's adapter delta may be left
        for the next residual add's norm to add (SlotLoRA.defer_codes): the output then lacks it."""
        if self.gate_up is not None and _grouped(lora):
            if self.gate_up[1] is None and _gemv_applies(x, self.fused):
                ep = _gemv_lora(lora, self.layer, "gate_up", x, group=True)
                if ep is not False:  # one token: the GEMV adds the adapter's delta and gives silu(gate) * up itself
                    act = kernel_module("gemv").gemv(x, self.gate_up[0], glu=True, lora=ep)
                    spec = _defer_codes(lora, self.layer, "down_proj", act) if defer else None
                    if spec is not None:
                        return kernel_module("gemv").gemv(act, self.down_proj.weight, self.down_proj.bias, codes_out=spec)
                    return self.down_proj(act, lora)
            y = _project_lora(x, *self.gate_up, self.fused, lora, self.layer, "gate_up", group=True)
            if self.fused:  # silu(gate) * up in one launch (and one for its backward)
                kernels = kernel_module("norm_rope")
                if torch.is_grad_enabled():  # y is this call's own: its backward's gradient may overwrite it
                    act = kernels.silu_mul_train(y, self.size, reuse_input=True)
                else:  # over the gate half of y: a prefill step of 8k tokens holds ~0.3 GB less at 7B
                    act = kernels.silu_mul(y, self.size, inplace=True)
                return self.down_proj(act, lora)
            gate, up = y.split(self.size, -1)
        else:
            gate, up = self.gate_proj(x, lora), self.up_proj(x, lora)
        return self.down_proj(F.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer)

    def forward(self, x, cos, sin, attn, lora, pending=None, defer: bool = False):
        """x -> x after the layer. defer (CausalLM.hidden_states: passes without autograd, fused kernels on): each
        residual add goes into the Triton add_rms_norm of the norm after it, so the layer takes and returns
        (x, pending): pending (None in the first layer) is the previous MLP's output, still to be added to x."""
        if not defer:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, lora)
            return x + self.mlp(self.post_attention_layernorm(x), lora)
        layer = self.self_attn.layer
        codes = _norm_codes(lora, layer, "qkv", x)
        if pending is None:
            h = self.input_layernorm(x, codes)
        else:  # the previous MLP's output, with its down_proj's adapter delta if that was left to this norm
            h, x = self.input_layernorm.add_forward(x, pending, codes, _take_deferred(lora))
        out = self.self_attn(h, cos, sin, attn, lora)
        h, x = self.post_attention_layernorm.add_forward(x, out, _norm_codes(lora, layer, "gate_up", x))
        return x, self.mlp(h, lora, defer=True)


def _within(fn, context):
    """fn, each of its calls made inside context() (None: fn itself)."""
    if context is None:
        return fn

    def run(*args):
        with context():
            return fn(*args)
    return run


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, -1, "lm_head")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_fused_kernels(self, on: bool) -> None:
        """RMSNorm, rotary and SiLU * mul through the Triton kernels (dark.kernels.norm_rope): plain kernels in
        passes without autograd (serving, reference passes), their autograd Functions in training passes (one
        launch each way instead of ~7-10 small kernels and their backward). A single token's projections (batch-1
        decode) go through the GEMV kernel (dark.kernels.gemv). Passes without autograd also fold each
        residual add into the norm after it (add_rms_norm), and give an attention with attend_fused_qkv (the decode
        one) the fused q/k/v output to rotate and store in one launch."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, SelfAttention, MLP, Linear)):
                m.fused = on

    def fuse_projections(self) -> None:
        """q/k/v and gate/up each as one weight (their parameters become views of it): a decode step then
        runs 4 GEMMs per layer instead of 7, and a LoRA with apply_group adds its deltas in 2 calls fewer."""
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
            m.gate_up = fuse_linears([m.gate_proj, m.up_proj])

    def hidden_states(self, input_ids, positions, attn: Attention, lora: LoRA | None = None,
                      checkpoint: bool = False, saved=None, layer_context=None, loan=None) -> torch.Tensor:
        """Final-norm hidden states of a flat batch of tokens ([T] ids and positions) -> [T, hidden].

        checkpoint (training): when gradients are on, autograd keeps only each layer's input and runs the
        layer again in backward, instead of keeping every intermediate of every layer (the MLP's alone are
        several times the hidden size per token). Passes without gradients (serving) ignore it; with the fused
        kernels on, they hand each layer's MLP output on unadded (DecoderLayer's defer), to the next norm's launch.
        saved (with checkpoint): where the layers' inputs wait for backward, a dark.learn.offload.InputsToHost.
        layer_context (with checkpoint): a callable giving a context manager that each checkpointed layer call runs
        in, the first run and the recompute in backward alike (the trainer's stream choice).
        loan (with checkpoint): a dark.engine.loan.Loan of free KV blocks; the layers whose kept tensors find room
        there keep them and recompute no projection in backward (train_layer's KEPT), the others checkpoint.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        if self.model.norm.fused and not torch.is_grad_enabled():
            # the residual adds folded into the next norm's launch (add_rms_norm): 2 launches fewer a layer, the
            # same values; the last MLP's output is added in the final norm's
            pending = None
            for layer in self.model.layers:
                x, pending = layer(x, cos, sin, attn, lora, pending, True)
            if pending is None:
                return self.model.norm(x)
            return self.model.norm.add_forward(x, pending, delta_lora=_take_deferred(lora))[0]
        remat = checkpoint and torch.is_grad_enabled()
        # per layer under checkpointing: its factors for the hand-written backward (train_layer), or None (the
        # reentrant checkpoint)
        by_hand = [lora.layer_factors(layer.self_attn.layer, x.dtype)
                   if remat and train_layer.applies(layer, lora, x) else None for layer in self.model.layers]
        if remat and not x.requires_grad and any(f is None for f in by_hand):
            # the reentrant checkpoint below gives a gradient only to outputs of an input that needs one (its
            # backward then reaches the LoRA factors used inside): the embeddings are frozen, so their output
            # is made to need one
            x = x.detach().requires_grad_()
        for layer, factors in zip(self.model.layers, by_hand):
            placement = None
            if factors is not None and loan is not None and x.dtype == loan.dtype:
                placement = loan.place(train_layer.kept_shapes(layer, x.shape[0]))
            if placement is not None:
                x = train_layer.layer_pass(layer, x, cos, sin, attn, factors, layer_context, placement)
            elif factors is not None:
                with saved.keeping(x) if saved is not None else nullcontext():
                    x = train_layer.layer_pass(layer, x, cos, sin, attn, factors, layer_context)
            elif remat:
                # reentrant: the first run is a plain pass without autograd, and the second an ordinary forward
                # and backward; the non-reentrant form hooks every tensor saved in both runs (in Python: ~4x
                # the Python calls of a training step). The layers hold no randomness: no RNG state to stash
                with saved.keeping(x) if saved is not None else nullcontext():
                    x = torch.utils.checkpoint.checkpoint(_checkpointed(_within(layer, layer_context)), x, cos, sin,
                                                          attn, lora,
                                                          use_reentrant=True, preserve_rng_state=False)
            else:
                x = layer(x, cos, sin, attn, lora)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor, lora: LoRA | None = None) -> torch.Tensor:
        return self.lm_head(hidden, lora).float()

    def load_weights(self, tensors, dtype: torch.dtype, device: torch.device) -> None:
        """Fill the parameters from (name, tensor) pairs, checking that every parameter got a value.

        The model may be built on the meta device: each parameter is replaced, never copied into, so a 7B
        model never exists twice in host memory.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        seen = set()
        for name, tensor in tensors:
            if name not in params:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in a {self.config.family} model")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            owner, _, attr = name.rpartition(".")
            value = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
            setattr(self.get_submodule(owner), attr, value)
            seen.add(name)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            seen.add("lm_head.weight")
        missing = [n for n in params if n not in seen]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        self.rotary.to(device)
        self.fuse_projections()


def load_model(folder: Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Build the decoder for the folder's config and load its safetensors weights onto the device."""
    from .loader import iter_safetensors

    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.rotary = Rotary(cfg)  # a computed buffer, not a checkpoint tensor: build it for real
    model.load_weights(iter_safetensors(folder, rename=cfg.checkpoint_name), dtype, device)
    return model.eval()
