"""A request's sampling settings and its state while the engine works on it."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from ..errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (the default: a taught answer should come back exactly)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0            # 0: off
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False    # report each chosen token's log-probability under the model

    def validate(self) -> "SamplingParams":
        def bad(msg):
            raise InvalidRequestError(msg)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            bad(f"stop must be a list of at most 16 non-empty strings, got {self.stop!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer or None, got {self.seed!r}")
        return self

    @classmethod
    def build(cls, params: "SamplingParams | None" = None, **overrides) -> "SamplingParams":
        """Defaults, or a copy of `params`, with keyword overrides; unknown keywords are an error."""
        base = dict(params.__dict__) if params is not None else {}
        unknown = [k for k in overrides if k not in cls.__dataclass_fields__]
        if unknown:
            raise InvalidRequestError(f"unknown sampling arguments {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        base.update({k: v for k, v in overrides.items() if v is not None})
        if "stop" in base and base["stop"] is not None:
            base["stop"] = [base["stop"]] if isinstance(base["stop"], str) else list(base["stop"])
        return cls(**base).validate()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one engine step produced for one request; `finished` outputs carry the whole text."""

    request_id: int
    delta: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None     # "stop", "length", "abort", "error"
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter: tuple[str, int] | None = None
    error: BaseException | None = None
    logprobs: list[float] | None = None  # per token in token_ids, when asked for
    output_ids: list[int] | None = None  # every generated token id, on the finished output


_ids = itertools.count(1)


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, adapter: tuple[str, int] | None,
                 on_output: Callable[[RequestOutput], None], max_model_len: int):
        self.id = next(_ids)
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.adapter = adapter
        self.on_output = on_output
        self.max_len = min(max_model_len, len(prompt_ids) + params.max_tokens)
        self.status = Status.WAITING
        self.num_computed = 0        # tokens whose keys and values are in the cache
        self.num_hashed_blocks = 0   # leading full blocks registered for prefix reuse
        self.prefix_hash = 0         # hash of the last of those blocks
        self.block_table: list[int] = []
        self.slot = -1               # adapter slot while running, -1 for none
        self.finish_reason: str | None = None
        self.aborted = False
        self.generator: torch.Generator | None = None
        self.text = ""               # detokenized output so far
        self.emitted = 0             # characters of `text` already sent
        self.detok_prefix = 0        # incremental detokenization window over the output ids
        self.detok_read = 0
        self.logprobs: list[float] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
