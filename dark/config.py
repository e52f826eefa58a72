"""Settings for the engine, LoRA adapters and learning, as validated dataclasses."""
from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import InvalidRequestError

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = DEFAULT_LORA_TARGETS + ("lm_head",)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidRequestError(msg)


@dataclass
class EngineConfig:
    """How the engine uses the device. Zero means "choose from the device and the model"."""

    device: str = ""                 # "cuda", "cpu", "cuda:1"; empty picks cuda when available
    dtype: str = ""                  # "bfloat16", "float16", "float32"; empty: bf16 on cuda, fp32 on cpu
    max_num_seqs: int = 64           # sequences decoded together in one step
    max_num_batched_tokens: int = 4096  # tokens (prefill chunks + decodes) in one step
    max_model_len: int = 0           # context limit; 0 takes the model's, capped at 32768
    block_size: int = 16             # tokens per KV-cache block
    num_kv_blocks: int = 0           # 0: sized from kv_cache_memory_fraction on cuda, 2048 blocks on cpu
    kv_cache_memory_fraction: float = 0.5  # of the free device memory after loading, for the KV cache
    max_adapter_slots: int = 8       # adapters resident on the device at once
    max_lora_rank: int = 64
    enable_prefix_caching: bool = True
    train_sms: int = -1              # CUDA: streaming multiprocessors a learn job's steps may use while requests are
                                     # served (a green context), leaving the others to serving alone; -1: half of
                                     # them; 0: all, shared with serving by stream priority. Idle: always all
    warm_learning: bool | None = None  # at start, one throwaway training step on the learn thread (nothing saved or
                                     # served), so the first correction does not pay the process's one-time setup
                                     # of training (2-3 s on an H200 at 7B); None: on CUDA only
    warm_serving: bool | None = None  # at start, a few throwaway requests (1-8 at once, with and without an adapter)
                                     # so that the first requests do not compile kernels or capture decode graphs
                                     # (dark.engine.warm); None: on CUDA only

    def validate(self) -> "EngineConfig":
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16")
        _check(self.block_size in (8, 16, 32, 64), "block_size must be one of 8, 16, 32, 64")
        _check(self.max_model_len >= 0, "max_model_len must be >= 0")
        _check(self.num_kv_blocks >= 0, "num_kv_blocks must be >= 0")
        _check(0.05 <= self.kv_cache_memory_fraction <= 0.95, "kv_cache_memory_fraction must be in [0.05, 0.95]")
        _check(self.max_adapter_slots >= 1, "max_adapter_slots must be >= 1")
        _check(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        _check(isinstance(self.train_sms, int) and self.train_sms >= -1,
               "train_sms must be an integer >= -1 (-1: half the SMs while serving, 0: all)")
        _check(self.warm_learning in (None, True, False), "warm_learning must be true, false or null (on CUDA only)")
        _check(self.warm_serving in (None, True, False), "warm_serving must be true, false or null (on CUDA only)")
        _check(self.dtype in ("", "bfloat16", "float16", "float32"), f"dtype {self.dtype!r} is not one of bfloat16, float16, float32")
        return self


@dataclass
class LoraConfig:
    """Shape of a new adapter. Saved as PEFT's adapter_config.json."""

    r: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def validate(self, max_rank: int | None = None) -> "LoraConfig":
        _check(isinstance(self.r, int) and self.r >= 1, "LoRA rank r must be a positive integer")
        _check(max_rank is None or self.r <= max_rank, f"LoRA rank {self.r} exceeds the engine's max_lora_rank {max_rank}")
        _check(self.alpha > 0, "LoRA alpha must be positive")
        self.target_modules = tuple(self.target_modules)
        bad = [m for m in self.target_modules if m not in LORA_TARGETS]
        _check(not bad and self.target_modules, f"unknown LoRA target modules {bad}; choose from {list(LORA_TARGETS)}")
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def settings_from_kwargs(cls, kwargs: dict):
    """Pull the fields of `cls` out of kwargs (removing them) and build a validated instance."""
    names = {f.name for f in fields(cls)}
    picked = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    return cls(**picked).validate()


@dataclass
class LearnConfig:
    """How a learn job trains. The job stops as soon as the taught answers come back (verified)."""

    lr: float = 3e-3
    max_steps: int = 60              # cap; a job that is not verified by then reports verified=False
    min_steps: int = 1
    verify_min_prob: float = 0.5     # each taught token must be the model's choice with at least this probability
    batch_size: int = 16             # examples per step (new ones first, then replayed ones)
    replay: int = 24                 # earlier examples of the same adapter replayed in each job, so skills accumulate
    replay_check: bool = True        # the replayed examples train only once they slip: a step trains the new examples
                                     # (their rewordings, the replays that slipped), and when those verify the other
                                     # replays are checked in passes without gradients; one that misses trains from
                                     # then on. The job stops only when all of them verify, as before. False: every
                                     # replay trains in every step (each step's cost grows with the adapter's history)
    kl_weight: float = 1.0           # keep answers to unrelated anchor prompts where the adapter-free model had them
    anchor_loss: str = "replay"      # "replay": train on the base model's own answers; "kl": KL to its distributions
    anchor_prompts: tuple[str, ...] = ()  # prompts whose adapter-free answers must not change; empty: a built-in set
    protect_energy: float = 0.99     # keep A's updates out of the directions holding this share of everyday
                                     # activations (dark.learn.protect); 0 turns it off
    dpo_beta: float = 0.5            # preference strength for corrections (the replaced answer is rejected)
    dpo_weight: float = 0.5
    rejected_tokens: int = 64        # a rejected (or unlearned) reply counts from where it departs from the taught
                                     # one, for this many tokens: a 512-token ramble costs each step as much as 64
                                     # tokens do, and greedy decoding leaves it at its opening; -1: the whole reply
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    augment: bool = True             # also train on simple rewordings of each taught prompt
    cpu_bf16: bool = False           # on a CPU with bf16 instructions, train under bf16 autocast (then confirm in fp32)
    checkpoint_tokens: int = 384     # a training pass over more tokens than this keeps only each layer's input and
                                     # recomputes the layer in backward (activation checkpointing); 0: always, -1: never.
                                     # Measured on a 7B (H200): a pass keeps ~6.6 MiB a token without it (384 tokens:
                                     # 2.6 GiB), ~0.23 MiB with it (4096 tokens: 1.9 GiB), for ~80 ms more a step
    inputs_to_host_tokens: int = 3072  # CUDA: a checkpointed pass over more tokens than this keeps its layers'
                                     # inputs in pinned host memory until backward needs them (dark.learn.offload),
                                     # not on the device (7B: 0.2 MiB a token, 0.8 GiB for 4096 tokens); -1: never.
                                     # A correction's shorter pass keeps them on the device (the copies cost more
                                     # than they save there)
    kv_loan: bool = True             # a checkpointed pass on a serving engine keeps what each layer's backward reads in
                                     # free KV-cache blocks, borrowed for the job when enough are free beyond a quarter
                                     # of the cache (dark.engine.loan), instead of running the layer's projections
                                     # again in backward; layers that find no room checkpoint as before
    micro_tokens: int = 4096         # a training batch of more tokens than this runs as parts of at most this many,
                                     # each part's backward right after its forward: one part's activations at a
                                     # time; -1: never split. A pass's host work (~30k operator calls at 7B) does not
                                     # grow with its tokens: two parts cost nearly twice one where the host bounds
                                     # the step (a correction; a 2 x 2048 batch on an H200 with layer checkpointing)
    logits_chunk: int = 128          # rows of logits ([rows, vocabulary] in fp32) made at once for the loss: 256 rows
                                     # of a 152k vocabulary and their backward take ~0.6 GiB, 1024 rows ~2.4 GiB
    park_moments: bool | None = None  # between a job's steps the optimizer's fp32 moments wait in pinned host memory,
                                     # so the passes' peak holds no moments (7B: ~0.3 GiB) for one copy back each
                                     # step; None: on CUDA only, True / False: always / never

    def validate(self) -> "LearnConfig":
        _check(self.lr > 0, "lr must be positive")
        _check(isinstance(self.max_steps, int) and self.max_steps >= 1, "max_steps must be a positive integer")
        _check(isinstance(self.min_steps, int) and 0 <= self.min_steps <= self.max_steps, "min_steps must be in [0, max_steps]")
        _check(0 < self.verify_min_prob < 1, "verify_min_prob must be in (0, 1)")
        _check(self.batch_size >= 1 and self.replay >= 0, "batch_size must be >= 1 and replay >= 0")
        _check(isinstance(self.replay_check, bool),
               "replay_check must be true or false (false: every replayed example trains in every step)")
        _check(self.anchor_loss in ("replay", "kl"), "anchor_loss must be 'replay' or 'kl'")
        _check(0 <= self.protect_energy < 1, "protect_energy must be in [0, 1)")
        _check(isinstance(self.checkpoint_tokens, int) and self.checkpoint_tokens >= -1,
               "checkpoint_tokens must be an integer >= -1 (0: always checkpoint, -1: never)")
        _check(isinstance(self.logits_chunk, int) and self.logits_chunk >= 1, "logits_chunk must be a positive integer")
        _check(isinstance(self.inputs_to_host_tokens, int) and self.inputs_to_host_tokens >= -1,
               "inputs_to_host_tokens must be an integer >= -1 (-1: never)")
        _check(isinstance(self.micro_tokens, int) and (self.micro_tokens >= 1 or self.micro_tokens == -1),
               "micro_tokens must be a positive integer, or -1 (never split a training batch)")
        _check(self.park_moments in (None, True, False), "park_moments must be true, false or null (on CUDA only)")
        self.anchor_prompts = tuple(self.anchor_prompts)
        _check(all(isinstance(p, str) and p.strip() for p in self.anchor_prompts), "anchor_prompts must be non-empty strings")
        if not self.anchor_prompts:
            from .learn.trainer import ANCHOR_PROMPTS

            self.anchor_prompts = ANCHOR_PROMPTS
        _check(self.kl_weight >= 0 and self.dpo_weight >= 0 and self.dpo_beta > 0, "kl_weight, dpo_weight must be >= 0 and dpo_beta > 0")
        _check(isinstance(self.rejected_tokens, int) and (self.rejected_tokens >= 1 or self.rejected_tokens == -1),
               "rejected_tokens must be a positive integer, or -1 (the whole rejected reply)")
        return self
