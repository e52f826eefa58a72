"""One adapter version in host memory, and its PEFT-format folder (adapter_config.json + adapter_model.safetensors)."""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import LORA_TARGETS, LoraConfig
from ..errors import InvalidRequestError

log = logging.getLogger(__name__)
Key = tuple[int, str]  # (layer index, module name); the LM head is (-1, "lm_head")

# a factor's name as PEFT saves it: base_model.model.<the language model's path>.layers.N.(self_attn|mlp).<module>, the
# path being model (Llama, Qwen2, Qwen3) or model.language_model (Qwen2-VL, Qwen2.5-VL in transformers 5), or lm_head
_PEFT_NAME = re.compile(r"^base_model\.model\.(?:model\.(?:language_model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.)?(\w+)"
                        r"\.lora_([AB])(?:\.default)?\.weight$")
# factors of a vision tower (a Qwen2(.5)-VL adapter trained with PEFT on gate/up/down_proj, which adapts the vision
# MLP's too): dark serves text, and a text prompt never runs them
_VISION_FACTOR = re.compile(r"^base_model\.model\.(?:model\.)?visual\.")


@dataclass
class AdapterWeights:
    """LoRA factors in fp32: A [r, in] and B [out, r] per projection; the delta is scaling * B @ A."""

    config: LoraConfig
    tensors: dict[Key, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    scaling: float = 0.0

    def __post_init__(self):
        if not self.scaling:
            self.scaling = self.config.scaling

    @classmethod
    def init(cls, config: LoraConfig, shapes: dict[str, tuple[int, int]], num_layers: int, seed: int = 0) -> "AdapterWeights":
        """A fresh adapter: A like PEFT's default (Kaiming-uniform), B zero, so it starts as the base model."""
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for module in config.target_modules:
            fan_in, fan_out = shapes[module]
            bound = 1.0 / math.sqrt(fan_in)
            for layer in ([-1] if module == "lm_head" else range(num_layers)):
                a = (torch.rand(config.r, fan_in, generator=gen) * 2 - 1) * bound
                tensors[(layer, module)] = (a, torch.zeros(fan_out, config.r))
        return cls(config, tensors)

    def clone(self) -> "AdapterWeights":
        return AdapterWeights(self.config, {k: (a.clone(), b.clone()) for k, (a, b) in self.tensors.items()}, self.scaling)

    def save(self, folder: Path, base_model: str = "", backbone: str = "model", exclude_modules: str | None = None) -> None:
        """Write a PEFT-compatible folder atomically: a temporary folder beside it, then one rename.

        backbone: the language model's module path in the base model's transformers class, which PEFT names the
        factors by (ModelConfig.hf_backbone: "model", or "model.language_model" for Qwen2(.5)-VL); exclude_modules: a
        regex of that class's modules PEFT must not adapt (ModelConfig.hf_skipped: a Qwen2(.5)-VL vision tower, whose
        MLP has gate/up/down projections of the same names)."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            state = {}
            for (layer, module), (a, b) in self.tensors.items():
                prefix = "base_model.model." + (
                    "lm_head" if module == "lm_head" else f"{backbone}.layers.{layer}.{_block(module)}.{module}")
                # in the precision they are held in (fp32 from dark's trainer, whose factors train in fp32 on any
                # device; bf16 or fp16 factors loaded from elsewhere stay as they are)
                state[f"{prefix}.lora_A.weight"] = _stored(a)
                state[f"{prefix}.lora_B.weight"] = _stored(b)
            save_file(state, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
            cfg = {
                "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": self.config.r, "lora_alpha": self.config.alpha, "target_modules": list(self.config.target_modules),
                "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
                "use_dora": False, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
                "modules_to_save": None, "init_lora_weights": True,
            }
            if exclude_modules:
                cfg["exclude_modules"] = exclude_modules
            (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, folder: Path) -> "AdapterWeights":
        folder = Path(folder)
        cfg_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not cfg_path.is_file() or not weights_path.is_file():
            raise InvalidRequestError(
                f"{folder} is not a PEFT LoRA folder: it needs adapter_config.json and adapter_model.safetensors")
        raw = json.loads(cfg_path.read_text())
        if raw.get("peft_type", "LORA") != "LORA":
            raise InvalidRequestError(f"{folder} holds a {raw.get('peft_type')} adapter; only LoRA adapters are supported")
        for unsupported in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
            if raw.get(unsupported):
                raise InvalidRequestError(f"{folder}: adapters with {unsupported} are not supported")
        r, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
        scaling = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
        pairs: dict[Key, dict[str, torch.Tensor]] = {}
        vision = 0
        for name, tensor in load_file(weights_path).items():
            if ".base_layer." in name:
                continue  # PEFT saves copies of base weights beside LoRA factors of the head; the engine keeps its own
            if _VISION_FACTOR.match(name):
                vision += 1
                continue
            m = _PEFT_NAME.match(name)
            if not m or m.group(2) not in LORA_TARGETS:
                raise InvalidRequestError(f"{folder}: tensor {name!r} is not a LoRA factor of a supported projection")
            layer = -1 if m.group(2) == "lm_head" else int(m.group(1))
            pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor.float()
        if vision:
            log.info("%s: %d factors of the vision tower left out (dark serves text only)", folder, vision)
        if not pairs:
            raise InvalidRequestError(f"{folder} holds no LoRA factor of a language model's projections")
        targets = sorted({module for _, module in pairs})
        config = LoraConfig(r=r, alpha=alpha, target_modules=tuple(targets)).validate()
        return cls(config, {k: (v["A"], v["B"]) for k, v in pairs.items()}, scaling)


def _stored(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t.float()).contiguous().cpu()


def _block(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
