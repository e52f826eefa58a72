"""One learn job's training loop: LoRA factors in fp32 on the frozen base weights that serve.

Losses: cross-entropy on the taught replies (new examples, their rewordings, and the adapter's earlier
examples replayed so skills accumulate); DPO against the adapter-free model when a correction names the
replaced answer; an unlikelihood-style term for `unlearn`; and, when kl_weight > 0, a term that keeps the
answers to anchor prompts where the adapter-free model had them. After every step the change to each A factor
is kept out of the directions everyday conversations occupy (dark.learn.protect). The job stops when every
taught reply is the greedy answer with margin, checked on the same forward pass that trains (teacher forcing
equals greedy decoding when each taught token is the argmax). The replayed examples (LearnConfig.replay_check) do
not train while they hold: once the trained ones verify, they are checked in a pass without gradients, and one that
misses trains from that step on; so a step's cost follows the correction, not the adapter's history.

Device memory: the LoRA deltas are computed in the activations' precision (bf16 on a GPU), a pass over more than
LearnConfig.checkpoint_tokens tokens recomputes each layer in backward instead of keeping its activations, and the
taught tokens' log-probabilities are made logits_chunk rows at a time without ever holding [rows, vocab]
log-softmax rows (only the anchors' few rows are kept whole).
"""
from __future__ import annotations

import concurrent.futures
import io
import logging
import math
import os
import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..config import LearnConfig
from ..engine.attention import SharedPrefixAttention
from ..lora.slots import MEMBERS
from ..lora.weights import AdapterWeights
from ..models import train_layer
from ..models.decoder import CausalLM
from .data import Rendered, render, rewordings
from .offload import InputsToHost
from .protect import Protector

log = logging.getLogger(__name__)

ANCHOR_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Name three fruits.",
)
ANCHOR_TOKENS = 8  # the opening of each anchor answer: where a greedy answer goes is decided there


class _HeadLogprobs(torch.autograd.Function):
    """Log-probability of each row's target and each row's highest log-probability (not differentiable), from
    hidden rows and the frozen LM head, with the gradient's direction made in forward.

    The target's log-probability has the gradient (onehot - softmax) @ W in its hidden row, times the one number
    backward brings per row. Forward has the softmax at hand, so it makes that [rows, hidden] product there and
    keeps it (as many bytes as the hidden rows a checkpoint keeps); backward is one multiply. Against autograd
    through a checkpointed chunk this is two passes over the head's weight instead of three (forward, the recompute
    and the gradient's GEMM: ~4.5 TFLOP and, at 128 rows, a 1.09 GB read each at 7B shapes), and no [rows, vocab]
    logits are kept or made again.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        logits = F.linear(hidden, weight).float()
        lse = torch.logsumexp(logits, -1)
        chosen = logits.gather(1, targets[:, None])[:, 0] - lse
        top = logits.max(-1).values - lse
        soft = logits.sub_(lse[:, None]).exp_()  # the softmax, over the logits
        soft.scatter_add_(1, targets[:, None], torch.full_like(chosen[:, None], -1.0))  # softmax - onehot
        ctx.save_for_backward(F.linear(soft.to(weight.dtype), weight.t()))  # = -d chosen / d hidden
        ctx.dtype = hidden.dtype
        ctx.mark_non_differentiable(top)
        return chosen, top

    @staticmethod
    def backward(ctx, grad_chosen: torch.Tensor, grad_top: torch.Tensor):
        (away,) = ctx.saved_tensors
        return (away.float() * -grad_chosen[:, None]).to(ctx.dtype), None, None


def _head_trains(lora) -> bool:
    """Whether the LM head has factors in this LoRA (their gradients need the [rows, vocab] logits' gradient)."""
    return lora is not None and (not isinstance(lora, TrainLoRA) or (-1, "lm_head") in lora.params)


def _chunk_logprobs(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, lora) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each row's target and the highest log-probability of each row (detached), from
    hidden rows: the [rows, vocab] logits live only inside this call."""
    logits = model.logits(hidden, lora)
    lse = torch.logsumexp(logits, -1)
    chosen = logits.gather(1, targets[:, None])[:, 0] - lse
    return chosen, logits.detach().max(-1).values - lse.detach()


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a device tensor, without waiting for the device: torch.tensor(list, device=cuda) copies from
    pageable memory and then waits for all the work queued on the stream before it (the device drains once per
    call). Here the list goes through pinned memory in a copy queued on the stream (the pinned block is not handed
    out again before that copy is done)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def opening(r: Rendered, tokens: int, beside: Rendered | None = None) -> Rendered:
    """The first `tokens` tokens of a rendered reply (tokens = -1: all of it), counted from its first token with a
    loss, or, beside another reply to the same conversation, from the first token where the two differ: what
    greedy decoding follows is decided from there on."""
    if tokens < 0:
        return r
    start = next((i for i, label in enumerate(r.labels) if label != -100), len(r.labels))
    if beside is not None:
        shared = next((i for i, (a, b) in enumerate(zip(r.input_ids, beside.input_ids)) if a != b),
                      min(len(r.input_ids), len(beside.input_ids)))
        start = max(start, shared)
    end = min(len(r.input_ids), start + tokens)
    return Rendered(r.input_ids[:end], r.labels[:end])


def cpu_has_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _add_delta(y: torch.Tensor, codes: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """y + codes @ b_t, added into y in place (y, a projection's own output, is read by nothing in backward):
    torch.addmm would copy y first. DARK_LORA_INPLACE=0 (an A/B): torch.addmm."""
    if os.environ.get("DARK_LORA_INPLACE", "1") == "0":
        return torch.addmm(y, codes, b_t)
    return y.addmm_(codes, b_t)


class TrainLoRA:
    """LoRA for training: one adapter's factors, applied to every token, differentiable."""

    def __init__(self, params: dict, scaling: float, outs: dict[str, int] | None = None, cast: dict | None = None):
        """outs: each projection's output size (the model config's projection_shapes), which a fused group whose
        members do not all have factors needs to split its output. cast: see prepared()."""
        self.params, self.scaling, self.outs = params, scaling, outs or {}
        self.cast = cast or {}

    def prepared(self, dtype: torch.dtype) -> "TrainLoRA":
        """This LoRA with its factors made ready for one pass in the activations' precision (bf16 on a GPU): per
        projection A cast and B scaled and cast; per fused group (q/k/v, gate/up) whose members all have factors,
        their A stacked and their B as one block-diagonal matrix. Made once per pass, not per layer call, so a
        checkpointed layer's recompute in backward runs two GEMMs per projection and nothing else, and the casts'
        backward runs once. The master factors, their gradients and the optimizer stay fp32. In fp32 it is self."""
        if dtype not in (torch.bfloat16, torch.float16):
            return self
        cast, layers = {}, {layer for layer, _ in self.params}
        grouped = set()
        for layer in layers:
            for group, members in MEMBERS.items():
                ps = [self.params.get((layer, m)) for m in members]
                if all(p is not None for p in ps):
                    cast[(layer, group)] = self._stacked(ps, dtype)
                    grouped.update((layer, m) for m in members)
        for key, p in self.params.items():
            if key not in grouped:
                cast[key] = self._stacked([p], dtype)
        return TrainLoRA(self.params, self.scaling, self.outs, cast)

    def _stacked(self, ps: list[tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors of one projection, or of a fused group's members, for one GEMM each in dtype: their A stacked
        [members * r, in], their B (scaled) as one block-diagonal [sum of outs, members * r]."""
        if len(ps) == 1:
            return ps[0][0].to(dtype), (ps[0][1] * self.scaling).to(dtype)
        return (torch.cat([p[0] for p in ps]).to(dtype),
                (torch.block_diag(*[p[1] for p in ps]) * self.scaling).to(dtype))

    def layer_factors(self, layer: int, dtype: torch.dtype) -> dict | None:
        """A decoder layer's factors per unit (dark.models.train_layer.UNITS: q/k/v, o_proj, gate/up, down_proj),
        each (A, B scaled) in dtype, a fused group's stacked as in prepared(), or None for a unit without factors;
        None if a fused group has factors on only some of its members (it goes member by member: apply_group)."""
        out = {}
        for unit in ("qkv", "o_proj", "gate_up", "down_proj"):
            ready = self.cast.get((layer, unit))
            if ready is not None and ready[0].dtype == dtype:
                out[unit] = ready
                continue
            ps = [self.params.get((layer, m)) for m in MEMBERS.get(unit, (unit,))]
            if any(p is None for p in ps):
                if any(p is not None for p in ps):
                    return None
                out[unit] = None
                continue
            out[unit] = self._stacked(ps, dtype)
        return out

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ready = self.cast.get((layer, module))
        if ready is not None and ready[0].dtype == x.dtype:
            # the delta is added by the second GEMM itself, into y in place (y, the projection's own output, is read
            # by nothing in backward): no elementwise pass over [tokens, out], and no copy of y as addmm makes
            return _add_delta(y, x @ ready[0].t(), ready[1].t())
        p = self.params.get((layer, module))
        if p is None:
            return y
        a, b = p
        if x.dtype in (torch.bfloat16, torch.float16):
            # in the activations' precision, with the (tiny) factors cast to it: autograd then keeps the x
            # that exists anyway, not an fp32 copy of every projection input. The scaling rides on B
            a, b = self._stacked([p], x.dtype)
            return torch.addmm(y, x @ a.t(), b.t())
        return y + ((x.to(a.dtype) @ a.t()) @ b.t() * self.scaling).to(y.dtype)

    def apply_group(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The deltas of a fused group's members (q/k/v, gate/up) on their concatenated output y, so training runs
        the base model's fused GEMMs too: the members' A stacked into one GEMM, their B as one block-diagonal
        GEMM that adds into y. A group whose members do not all have factors goes member by member."""
        ready = self.cast.get((layer, group))
        if ready is not None and ready[0].dtype == x.dtype:
            return _add_delta(y, x @ ready[0].t(), ready[1].t())
        members = MEMBERS[group]
        ps = [self.params.get((layer, m)) for m in members]
        if all(p is None for p in ps):
            return y
        if any(p is None for p in ps):
            parts, col = [], 0
            for m in members:
                n = self.outs[m]
                parts.append(self.apply(layer, m, x, y[:, col:col + n]))
                col += n
            return torch.cat(parts, 1)
        a, b = self._stacked(ps, x.dtype)
        return torch.addmm(y, x @ a.t(), b.t())


@dataclass
class Item:
    rendered: Rendered
    kind: str                    # "sft", "dpo", "unlearn", "kl"
    verify: bool = False
    rejected: Rendered | None = None
    replay: bool = False             # an earlier example of the adapter (build_items): checked, trained once it slips
    ref: torch.Tensor | None = None   # adapter-free log-probs (dpo/unlearn: summed; kl: full distributions)


@dataclass
class TrainResult:
    weights: AdapterWeights
    optimizer_state: dict
    steps: int
    losses: list[float] = field(default_factory=list)
    verified: bool = False
    seconds: float = 0.0
    anchors_kept: bool = True
    timings: dict = field(default_factory=dict)  # seconds: setup (to the first step), steps, to_host
    replays: int = 0             # earlier examples replayed (verify items of build_items' replay list)
    replays_trained: int = 0     # of them, those that trained in some step (all, with LearnConfig.replay_check off)
    step_items: list[int] = field(default_factory=list)  # per step taken: the examples it trained on (rewordings too)
    kv_loan: dict | None = None  # the job's loan of KV blocks (dark.engine.loan): bytes, layers kept over the job
    staged: dict | None = None   # the factors for the serving slots, on the device still (Trainer.stage_factors)


class Staging:
    """A pinned host buffer kept across jobs for the trainer's transfers: one copy each way at full bus speed
    (a pageable copy of a few hundred MB runs at a few GB/s, and pinning a fresh buffer per job costs as much)."""

    def __init__(self, pin: bool = True):
        self.buf: torch.Tensor | None = None
        self.pin = pin
        self._event = None  # a copy into or out of the buffer that may still be running (used_until)

    def get(self, n: int, queued: bool = False) -> torch.Tensor:
        """The buffer's first n values, once the last copy that used it (used_until) is done. queued (CUDA): the
        caller only queues copies into or out of the buffer on the current stream, so that stream waits for the
        last copy instead of the host (a host wait here drains the device: the last copy is often the newest work
        queued)."""
        if queued and self._event is not None and self.buf is not None and self.buf.numel() >= n:
            torch.cuda.current_stream().wait_event(self._event)
            return self.buf[:n]
        self.wait()
        if self.buf is None or self.buf.numel() < n:
            self.buf = None
            self.buf = torch.empty(n, dtype=torch.float32, pin_memory=self.pin)
        return self.buf[:n]

    def used_until(self) -> None:
        """Marks the current stream's work so far as using the buffer: wait() returns once it is done (CUDA; on the
        CPU every copy is done when it returns)."""
        if self.buf is not None and self.buf.is_pinned():
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def to_device(tensors: list[torch.Tensor], device: torch.device, staging: Staging | None = None,
              own: bool = True) -> list[torch.Tensor]:
    """fp32 copies of host tensors on the device in one transfer (a few hundred small copies each wait for the
    device otherwise). own: each result owns its storage; else they are views of one new device tensor (no copy
    per tensor on the device)."""
    if device.type == "cpu":
        return [t.float().clone() for t in tensors]
    total = sum(t.numel() for t in tensors)
    host = (staging or Staging()).get(total)
    torch.cat([t.reshape(-1).float() for t in tensors], out=host)
    out = _unflatten(host.to(device, non_blocking=True), tensors, own=own)
    torch.cuda.current_stream(device).synchronize()  # the staging buffer may be refilled as soon as this returns
    return out


class MomentsIn:
    """An optimizer state's fp32 moments on their way to the device, off the correction's critical path and out of
    its memory peak: a helper thread gathers them into pinned `staging` while the job's first forward and backward
    run (at 7B ~320 MB of host memcpy; torch's copy lets go of the GIL), and take(), at the first optimizer step
    when the activations are gone, puts them on the device in one copy and returns the state with its moments as
    views of one device tensor."""

    def __init__(self, state: dict, device: torch.device, staging: Staging, pool):
        self.state, self.where, self.device = state, _state_tensors(state["state"]), device
        self.like = [state["state"][k][n] for k, n in self.where]
        self.total = sum(t.numel() for t in self.like)

        def gather() -> torch.Tensor:
            host = staging.get(self.total)
            if self.like:
                torch.cat([t.reshape(-1).float() for t in self.like], out=host)
            return host

        self.future = pool.submit(gather)
        self.staging = staging

    def wait(self) -> None:
        """Until the helper is done with the staging buffer (a job that fails or ends early waits here too)."""
        self.future.result()

    def take(self) -> dict:
        moved = _staged_to_device(self.future.result(), self.like, self.device, self.staging)
        state = {k: dict(s) for k, s in self.state["state"].items()}
        for (k, n), t in zip(self.where, moved):
            state[k][n] = t
        return {**self.state, "state": state}


def to_host(tensors: list[torch.Tensor], staging: Staging | None = None, own: bool = True) -> list[torch.Tensor]:
    """Host fp32 copies of device tensors in one transfer. own: each result owns its storage (safetensors refuses
    tensors that share one); else they are views of one new host tensor (one copy out of the staging buffer)."""
    if not tensors or tensors[0].device.type == "cpu":
        return [t.float().clone() for t in tensors]
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    host = (staging or Staging()).get(flat.numel())
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return _unflatten(host if own else host.clone(), tensors, own)


class ParkedMoments:
    """A job's optimizer moments in pinned host memory between its steps (LearnConfig.park_moments): out() after a
    step copies them off the device in one transfer and lets the device tensors go, so the next step's forward and
    backward (the activations' peak) run without them; back() at the next optimizer step returns them in one copy,
    as views of one device tensor."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self.where: list[tuple[torch.Tensor, str]] = []
        self.like: list[torch.Tensor] = []

    def out(self, opt: torch.optim.Optimizer, params: list[torch.Tensor],
            copy_stream: torch.cuda.Stream | None = None) -> None:
        """copy_stream (CUDA): the copy to the host runs there, beside the next step's first kernels."""
        where = [(p, n) for p in params for n, v in opt.state[p].items() if torch.is_tensor(v) and v.dim() > 0]
        if not where:
            return
        tensors = [opt.state[p][n] for p, n in where]
        flat = torch.cat([t.reshape(-1) for t in tensors])  # on the device, in the step's stream order
        # the last copy through the buffer is back()'s of this step, queued on this stream: the copy out queues
        # after it (copy_stream waits for this stream), so neither waits on the host
        host = self.staging.get(flat.numel(), queued=copy_stream is not None)
        if copy_stream is not None:
            copy_stream.wait_stream(torch.cuda.current_stream(flat.device))
            with torch.cuda.stream(copy_stream):
                host.copy_(flat, non_blocking=True)
                self.staging.used_until()
            flat.record_stream(copy_stream)  # its memory is not handed out again before the copy is done
        else:
            host.copy_(flat)
        self.where, self.like = where, [torch.empty(t.shape, device="meta", dtype=t.dtype) for t in tensors]
        for p, n in where:
            del opt.state[p][n]  # the device copies go (back() must run before the optimizer's next step)

    def back(self, opt: torch.optim.Optimizer) -> None:
        if not self.where:
            return
        # the last copy through the buffer is out()'s, on its copy stream: this stream waits for it, not the host
        host = self.staging.get(sum(t.numel() for t in self.like), queued=self.where[0][0].is_cuda)
        for (p, n), v in zip(self.where, _staged_to_device(host, self.like, self.where[0][0].device, self.staging)):
            opt.state[p][n] = v
        self.where, self.like = [], []


def _staged_to_device(host: torch.Tensor, like: list[torch.Tensor], device: torch.device,
                      staging: Staging) -> list[torch.Tensor]:
    """The staging buffer's first len(host) values (filled as `like` flattened) on the device in one copy, as views
    of one new device tensor shaped as `like`; the buffer's next user waits for the copy (Staging.wait)."""
    flat = torch.empty(host.shape, dtype=host.dtype, device=device)
    flat.copy_(host, non_blocking=host.is_pinned())
    staging.used_until()
    return _unflatten(flat, like, own=False)


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor], own: bool) -> list[torch.Tensor]:
    """flat cut back into tensors shaped as `like`: clones each owning its storage, or views of flat."""
    out, i = [], 0
    for t in like:
        view = flat[i:i + t.numel()].view(t.shape)
        out.append(view.clone() if own else view)
        i += t.numel()
    return out


def _state_tensors(state: dict) -> list[tuple[object, str]]:
    """(param id, name) of every fp32 moment tensor of an optimizer state (the step counters stay where they are)."""
    return [(k, n) for k, s in state.items() for n, v in s.items()
            if torch.is_tensor(v) and v.dim() > 0 and v.dtype == torch.float32]


def _state_to_device(optimizer_state: dict, device: torch.device, staging: Staging | None = None) -> dict:
    where = _state_tensors(optimizer_state["state"])
    moved = to_device([optimizer_state["state"][k][n] for k, n in where], device, staging)
    state = {k: dict(s) for k, s in optimizer_state["state"].items()}
    for (k, n), t in zip(where, moved):
        state[k][n] = t
    return {**optimizer_state, "state": state}


def _state_to_host(state: dict, staging: Staging | None = None) -> dict:
    where = _state_tensors(state)
    host = to_host([state[k][n] for k, n in where], staging, own=False)  # torch.save keeps a shared storage once
    out = {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in s.items() if not torch.is_tensor(v) or v.dim() == 0
               or v.dtype != torch.float32} for k, s in state.items()}
    for (k, n), t in zip(where, host):
        out[k][n] = t
    return out


MOMENTS_MAGIC = b"DARKOPT1"


def save_optimizer_state(state: dict, path) -> None:
    """An optimizer state dict to a file: a small torch.save header (step counters, hyperparameters, each moment's
    shape) and then the fp32 moments' raw bytes, one write each. Plain file writes let go of the GIL, so a
    writer thread does not hold up the serving and training threads (torch.save keeps it for the whole of a
    tensor's record: ~100 ms for a 7B adapter's 320 MB of moments)."""
    where = _state_tensors(state["state"])
    moments = [state["state"][k][n] for k, n in where]
    skeleton = {k: dict(s) for k, s in state["state"].items()}
    for (k, n), t in zip(where, moments):
        skeleton[k][n] = ("moment", list(t.shape))
    header = io.BytesIO()
    torch.save({**state, "state": skeleton}, header)
    with open(path, "wb") as f:
        f.write(MOMENTS_MAGIC + len(header.getvalue()).to_bytes(8, "little") + header.getvalue())
        for t in moments:
            f.write(memoryview(t.detach().cpu().contiguous().numpy()).cast("B"))


def load_optimizer_state(path) -> dict:
    """What save_optimizer_state wrote (or a plain torch.save of a state dict, as earlier versions wrote): the
    moments as views of one host buffer."""
    with open(path, "rb") as f:
        if f.read(len(MOMENTS_MAGIC)) != MOMENTS_MAGIC:
            return torch.load(path, map_location="cpu", weights_only=True)
        size = int.from_bytes(f.read(8), "little")
        state = torch.load(io.BytesIO(f.read(size)), map_location="cpu", weights_only=True)
        data = bytearray(os.fstat(f.fileno()).st_size - f.tell())
        if f.readinto(data) != len(data):
            raise ValueError(f"{path}: the moments end early")
    shapes = [(s, n, v[1]) for s in state["state"].values() for n, v in s.items()
              if isinstance(v, tuple) and len(v) == 2 and v[0] == "moment"]
    want = sum(math.prod(shape) for _, _, shape in shapes)
    if len(data) < 4 * want:
        raise ValueError(f"{path}: the moments end early ({len(data)} bytes, the header describes {4 * want})")
    if len(data) > 4 * want:
        raise ValueError(f"{path}: {len(data) - 4 * want} bytes more than the header describes")
    flat = torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)
    i = 0
    for s, n, shape in shapes:
        count = math.prod(shape)
        s[n] = flat[i:i + count].view(shape)
        i += count
    return state


class Trainer:
    def __init__(self, model: CausalLM, tokenizer, device: torch.device, base_answers: Callable[[list[str]], list[str]]):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self._base_answers = base_answers   # the adapter-free model's greedy answers to the anchor prompts
        self._anchors: dict[str, Item] = {}  # per anchor prompt, with its adapter-free reference once computed
        self._protectors: dict[float, Protector] = {}  # per energy, fitted once on the frozen base
        self.stream = torch.cuda.Stream(device=device, priority=0) if device.type == "cuda" else None
        # one pinned host buffer for every move of factors and moments (in, out, parked between steps), used by one
        # move at a time (each waits for the last one's copy): after a process's first job it is large enough
        # (~0.3 GB at 7B) and no job pins memory again (pinning ~0.3 GB took ~0.25 s of a correction on the H200)
        self._staging = Staging(pin=device.type == "cuda")
        # set by the learner when serving shares the device: a job's new factors in the serving slots' layout,
        # made from the device copy it trained (AdapterSlots.stage), so the version's first request skips the host
        self.stage_factors: Callable[[dict, float], dict] | None = None
        self._moment_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._inputs_to_host: InputsToHost | None = None  # made on the first checkpointed pass that uses it
        # while serving_busy() says requests are being served, steps run on shared_stream (a green context on
        # part of the SMs, dark.learn.jobs.training_stream) when one is set, else on self.stream
        self.shared_stream: torch.cuda.Stream | None = None
        self.serving_busy: Callable[[], bool] = lambda: False
        # While requests are served, a step waits for its stream at the points it did before it had one wait
        # (_wait_while_serving). DARK_SERVING_WAITS=0 (measured slightly worse): no such waits; instead the host stays at
        # most `lead` pieces (_step_stream's calls: a layer's pass, a loss) ahead of the device while serving
        # (DARK_TRAIN_LEAD, 2; 0: no bound), waiting for the oldest, not for the device to drain. A step while
        # nothing is served neither waits nor is bounded (its one wait is its check). Both are read at each job's
        # start (_read_settings), so a benchmark may change them between jobs.
        self.lead, self.serving_waits = 2, True
        self._queued: list[torch.cuda.Event] = []
        self.training = 0  # train() calls under way (serving keeps to its partition of the SMs meanwhile)
        # free KV-cache blocks a job may borrow for its checkpointed passes (dark.engine.loan; set by the Learner
        # where an engine serves), and the job's loan while it runs
        self.kv_lender = None
        self._loan = None
        self._loan_tried = False
        self._kept = None  # the protector whose bases the loan holds for the job
        self._proj_graph = None  # (CUDA graph of the projection, its A-before buffer in the loan); False: none
        self._returned = None
        self._job_protector = None  # the job's protector: the loan is sized for its bases too
        if self.stream is not None and hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
            # the factors' gradient accumulators outlive a step, and steps (and parts) move between the trainer's
            # streams on purpose, each waiting for the last (_step_stream): the mismatch warning would fire every job
            torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)

    # --- batches ---
    def _forward(self, rendered: list[Rendered], lora, checkpoint_tokens: int = -1,
                 inputs_to_host_tokens: int = -1, kv_loan: bool = False) -> tuple[torch.Tensor, int, int, bool]:
        """Hidden states of a batch whose common prefix (up to the first prediction) is computed once.

        Returns (hidden [prefix + batch * length, hidden size], prefix, length, checkpointed): token t >= prefix
        of sequence b sits at row prefix + b * length + t - prefix. A pass with gradients over more than
        checkpoint_tokens tokens (0: any, -1: none) recomputes each layer in backward (checkpointed); one over
        inputs_to_host_tokens (CUDA; -1: none) keeps the layers' inputs in pinned host memory meanwhile
        (dark.learn.offload). kv_loan: a checkpointed pass keeps its layers' activations in the job's loan of KV
        blocks where they fit (borrowed at the job's first such pass; dark.engine.loan).
        """
        seqs = [r.input_ids for r in rendered]
        first = min(next(i for i, label in enumerate(r.labels) if label != -100) for r in rendered)
        p = 0
        limit = min(first - 1, min(len(s) for s in seqs) - 1)
        while p < limit and all(s[p] == seqs[0][p] for s in seqs):
            p += 1
        n = max(len(s) for s in seqs) - p
        ids = seqs[0][:p] + [t for s in seqs for t in s[p:] + [0] * (n - len(s) + p)]
        pos = list(range(p)) + list(range(p, p + n)) * len(seqs)
        dev = self.device
        attn = SharedPrefixAttention(p, len(seqs), n, dev)
        remat = torch.is_grad_enabled() and 0 <= checkpoint_tokens < len(ids)
        if isinstance(lora, TrainLoRA):
            lora = lora.prepared(self.model.model.embed_tokens.weight.dtype)
        if (remat and kv_loan and self.kv_lender is not None and not self._loan_tried
                and train_layer.applies(self.model.model.layers[0], lora, self.model.model.embed_tokens.weight)):
            # once a job: a loan sized for its first checkpointed pass, or none (nor any for a model whose layers take
            # the reentrant checkpoint, which keeps nothing in a loan: q/k norms)
            self._loan_tried = True
            dtype = self.model.model.embed_tokens.weight.dtype
            protector = self._job_protector
            held = protector.host_sizes(self.kv_lender.element_size) if protector is not None else []
            self._loan = self.kv_lender.borrow([train_layer.kept_shapes(layer, len(ids))
                                                for layer in self.model.model.layers], dtype, held)
        saved = None
        if remat and dev.type == "cuda" and 0 <= inputs_to_host_tokens < len(ids):
            if self._inputs_to_host is None:
                self._inputs_to_host = InputsToHost(dev)
            saved = self._inputs_to_host
        # a checkpointed layer picks its stream as it runs, in the first pass and again in backward (its recompute
        # and backward): requests that arrive mid-step move the rest of the step to the shared stream within a layer
        layer_context = self._step_stream if remat and self.stream is not None else None
        self._wait_while_serving()
        hidden = self.model.hidden_states(on_device(ids, dev), on_device(pos, dev), attn, lora,
                                          checkpoint=remat, saved=saved, layer_context=layer_context,
                                          loan=self._loan if remat and kv_loan else None)
        return hidden, p, n, remat

    @staticmethod
    def _target_count(rendered: list[Rendered]) -> int:
        """How many rows _targets makes for these sequences (their labelled tokens after the first): the rows come
        in sequence order, so this is where the next sequences' rows begin."""
        return sum(label != -100 for r in rendered for label in r.labels[1:])

    def _targets(self, labels: list[list[int]], p: int, n: int):
        """Rows of the flat hidden states that predict a labelled token, the tokens, and each row's sequence."""
        rows, targets, owner = [], [], []
        for b, lab in enumerate(labels):
            for t in range(len(lab) - 1):
                if lab[t + 1] != -100:
                    rows.append(b * n + t)  # = p + b * n + (t - p)
                    targets.append(lab[t + 1])
                    owner.append(b)
        dev = self.device
        self._wait_while_serving()
        return on_device(rows, dev), on_device(targets, dev), on_device(owner, dev)

    def _token_logprobs(self, rendered: list[Rendered], lora, cfg: LearnConfig | None = None, full_from: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probability of every labelled token, its sequence index, the highest log-probability of each row
        (detached: a token is the greedy choice where its log-probability reaches it), and the full log-softmax
        rows of the sequences numbered full_from and up (None: no rows).

        Only those full rows (anchors: a few dozen) exist as [rows, vocab] distributions. The taught rows are
        reduced to the target's logit and the logsumexp cfg.logits_chunk rows at a time. Under gradients with a
        frozen head each chunk makes its gradient's direction in forward and keeps only that (_HeadLogprobs); with
        factors on the head, a checkpointed pass keeps each chunk's hidden rows and makes its logits again in
        backward.
        """
        cfg = cfg or LearnConfig()
        hidden, p, n, remat = self._forward(rendered, lora, cfg.checkpoint_tokens, cfg.inputs_to_host_tokens,
                                            cfg.kv_loan)
        rows, targets, owner = self._targets([r.labels for r in rendered], p, n)
        # rows are in sequence order: those of the sequences before full_from come first
        split = len(rows) if full_from is None else self._target_count(rendered[:full_from])
        # on the stream of the moment, picked now: a step that began while nothing was served must not keep all the
        # SMs for its loss once requests have arrived (the layers pick theirs as they run)
        with self._step_stream() as moved:
            out = self._logprob_rows(hidden, rows, targets, split, remat, lora, cfg, full_from)
        if moved is not None:  # made there, read here next: not handed out again there before this stream is done
            around = torch.cuda.current_stream(self.device)
            for t in out:
                if t is not None:
                    t.record_stream(around)
        chosen, top, full = out
        return chosen, owner, top, full

    def _logprob_rows(self, hidden, rows, targets, split: int, remat: bool, lora, cfg: LearnConfig,
                      full_from: int | None):
        chosen, top = [], []
        # a frozen head under gradients: the gradient's direction made in forward (_HeadLogprobs), no checkpoint
        direct = torch.is_grad_enabled() and hidden.requires_grad and not _head_trains(lora)
        for s in range(0, split, cfg.logits_chunk):
            e = min(split, s + cfg.logits_chunk)
            h, t = hidden[rows[s:e]], targets[s:e]
            if direct and os.environ.get("DARK_HEAD_DIRECT", "1") != "0":  # 0: autograd through the chunk (an A/B)
                c, m = _HeadLogprobs.apply(h, self.model.lm_head.weight, t)
            elif remat:
                c, m = torch.utils.checkpoint.checkpoint(_chunk_logprobs, self.model, h, t, lora, use_reentrant=True,
                                                         preserve_rng_state=False)
            else:
                c, m = _chunk_logprobs(self.model, h, t, lora)
            chosen.append(c)
            top.append(m)
        full = None
        if full_from is not None:
            full = torch.log_softmax(self.model.logits(hidden[rows[split:]], lora), -1)
            chosen.append(full.gather(1, targets[split:, None])[:, 0])
            top.append(full.detach().max(-1).values)
        return torch.cat(chosen), torch.cat(top), full

    def protector(self, energy: float) -> Protector | None:
        """The everyday subspaces of the base model (fitted on first use, then kept): see dark.learn.protect."""
        if energy <= 0:
            return None
        if energy not in self._protectors:
            ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
            with ctx, torch.inference_mode(False), torch.no_grad():
                # kept in the serving precision (bf16 on a GPU: ~1.3 GB for a 7B model, in pinned host memory,
                # dark.learn.protect.DEVICE_BASES), used in fp32
                dtype = self.model.lm_head.weight.dtype
                self._protectors[energy] = Protector(energy).fit(self.model, self.tokenizer, self.device, dtype)
        return self._protectors[energy]

    # --- anchors and references ---
    def anchors(self, prompts=ANCHOR_PROMPTS) -> list[Item]:
        new = [p for p in prompts if p not in self._anchors]
        if new:
            for prompt, answer in zip(new, self._base_answers(new)):
                if answer.strip():
                    r = render(self.tokenizer, [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
                    # the opening of an answer decides where it goes; a cut-off answer must not learn to end there
                    self._anchors[prompt] = Item(opening(r, ANCHOR_TOKENS), "kl")
        return [self._anchors[p] for p in prompts if p in self._anchors]

    def _reference_anchors(self, anchors: list[Item]) -> None:
        """Adapter-free distributions on the anchors, computed the way training computes (same precision)."""
        todo = [a for a in anchors if a.ref is None]
        if todo:
            # in the precision that serves: a near tie must fall the same way it falls for users
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                _, owner, _, full = self._token_logprobs([a.rendered for a in todo], None, full_from=0)
                for b, a in enumerate(todo):
                    a.ref = full[owner == b]

    def _reference(self, items: list[Item]) -> None:
        with torch.no_grad():
            for item in items:
                if item.kind in ("dpo", "unlearn") and item.ref is None:
                    seqs = [item.rendered, item.rejected] if item.kind == "dpo" else [item.rejected]
                    lp, owner, _, _ = self._token_logprobs(seqs, None)
                    item.ref = torch.zeros(len(seqs), device=self.device).index_add(0, owner, lp)

    def build_items(self, new: list[dict], replay: list[dict], kind: str, cfg: LearnConfig) -> list[Item]:
        """Training items from normalized examples ({"messages", "rejected"?})."""
        items = []
        for ex in new:
            msgs = ex["messages"]
            if kind == "unlearn":
                items.append(Item(render(self.tokenizer, msgs), "unlearn",
                                  rejected=opening(render(self.tokenizer, msgs), cfg.rejected_tokens)))
                continue
            items.append(Item(render(self.tokenizer, msgs), "sft", verify=True))
            if ex.get("rejected") and ex["rejected"].strip() != msgs[-1]["content"].strip():
                chosen = render(self.tokenizer, msgs)
                rejected = render(self.tokenizer, msgs, ex["rejected"])
                items.append(Item(chosen, "dpo", rejected=opening(rejected, cfg.rejected_tokens, chosen)))
            if cfg.augment and msgs[-2]["role"] == "user":
                for variant in rewordings(msgs[-2]["content"]):
                    items.append(Item(render(self.tokenizer, msgs[:-2] + [{"role": "user", "content": variant}, msgs[-1]]), "sft"))
        for ex in replay:
            items.append(Item(render(self.tokenizer, ex["messages"]), "sft", verify=True, replay=True))
        return items

    # --- the loop ---
    def train(self, weights: AdapterWeights, optimizer_state: dict | None, items: list[Item], cfg: LearnConfig,
              on_step: Callable[[int, float], None] | None = None) -> TrainResult:
        start = time.perf_counter()
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        low = self.device.type == "cpu" and cfg.cpu_bf16 and self.model.lm_head.weight.dtype == torch.float32 and cpu_has_bf16()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if low else nullcontext()
        self.training += 1
        self._read_settings()
        try:
            with ctx, autocast, torch.enable_grad():
                result = self._train(weights, optimizer_state, items, cfg, on_step, low)
            if self.stream is not None:
                self.stream.synchronize()
        finally:
            self.training -= 1
        result.seconds = time.perf_counter() - start
        return result

    def _train(self, weights, optimizer_state, items, cfg, on_step, low_precision: bool) -> TrainResult:
        marks = {"start": time.perf_counter()}
        keys = sorted(weights.tensors)
        # the factors as views of one device tensor (leaves of their own for autograd and the optimizer)
        moved = iter(to_device([t for k in keys for t in weights.tensors[k]], self.device, self._staging, own=False))
        params = {k: tuple(next(moved).requires_grad_(True) for _ in weights.tensors[k]) for k in keys}
        flat = [p for k in keys for p in params[k]]
        marks["factors_in"] = time.perf_counter()
        # CUDA: the fused AdamW, a few multi-tensor launches for the ~400 factors instead of a dozen foreach ops and
        # per-factor bias corrections on the host (a correction's steps wait on the host, not the GPU)
        opt = torch.optim.AdamW(flat, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=self.device.type == "cuda" or None)
        # the moments are needed at the first optimizer step: on CUDA they are gathered while the first pass runs
        moments = self._moments_in(optimizer_state) if optimizer_state else None
        inflight, waited = moments, [0.0]
        park_on = cfg.park_moments if cfg.park_moments is not None else self.device.type == "cuda"
        park = ParkedMoments(self._staging) if park_on else None

        def load_moments() -> None:
            nonlocal moments
            if moments is None:
                return
            t = time.perf_counter()
            state, moments = (moments.take() if isinstance(moments, MomentsIn) else moments), None
            waited[0] += time.perf_counter() - t
            try:
                opt.load_state_dict(state)
                for g in opt.param_groups:
                    g["lr"] = cfg.lr
            except (ValueError, KeyError):
                log.warning("optimizer state does not fit this adapter; starting it afresh")
        marks["moments_in"] = time.perf_counter()
        self._loan, self._loan_tried, self._kept, self._proj_graph = None, False, None, None
        self._returned = None  # the job's loan once given back before its end
        try:
            result = self._train_loop(weights, items, cfg, on_step, low_precision, marks, keys, params, flat, opt,
                                      load_moments, waited, park)
            loan = self._loan or self._returned
            if loan is not None:
                result.kv_loan = {"bytes": loan.nbytes, "layers_kept": loan.placed, "bases_bytes": loan.bases_bytes,
                                  "projection_graph": bool(self._proj_graph),
                                  "given_back_early": self._loan is None}
            return result
        finally:
            if isinstance(inflight, MomentsIn):  # whatever happened, the helper is done with the staging buffer
                inflight.wait()
            self._return_loan()  # whatever happened, the blocks go back to serving

    def _return_loan(self) -> None:
        """Give the job's loan of KV blocks back (the graph and the bases held in it go first)."""
        self._proj_graph = None
        if self._kept is not None:
            self._kept.drop_kept()
            self._kept = None
        if self._loan is not None:
            loan, self._loan = self._loan, None
            self._returned = loan
            self.kv_lender.give_back(loan)

    def _project(self, protector: Protector, keys, a_factors, before, cfg: LearnConfig) -> None:
        """The protector's projection of a step's changes to A. On CUDA, in a job of several steps whose bases all
        sit in its loan (keep_in), the first step captures it in a CUDA graph and every step replays that: one
        launch instead of ~1,500 host calls a 7B step (DARK_PROTECT_GRAPH=0: never). Its A-before buffer is held
        in the loan; the graph's own memory is one basis widened at a time."""
        use = (self._loan is not None and self.device.type == "cuda" and cfg.max_steps > 1
               and self._proj_graph is not False and os.environ.get("DARK_PROTECT_GRAPH", "1") != "0"
               and protector.all_kept())
        if not use:
            protector.project_updates(keys, a_factors, before)
            return
        if self._proj_graph is None:
            # the A-before buffer (fp32) in a half-precision loan, or no graph for the job (False: not tried again,
            # so no step holds more of the loan)
            fits = self._loan.dtype.itemsize == 2 and all(b.dtype == torch.float32 for b in before)
            static = [self._loan.hold(2 * b.numel()) for b in before] if fits else [None]
            if any(r is None for r in static):
                self._proj_graph = False
                protector.project_updates(keys, a_factors, before)
                return
            static = [r.view(torch.float32).view(b.shape).copy_(b) for r, b in zip(static, before)]
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                # thread_local: serving's thread may sync or allocate meanwhile
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    protector.project_updates(keys, a_factors, static, in_place=True)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._proj_graph = (graph, static)
        else:
            graph, static = self._proj_graph
            torch._foreach_copy_(static, before)
        graph.replay()

    def _park_stream(self) -> torch.cuda.Stream | None:
        if self.device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    def _moments_in(self, optimizer_state: dict):
        """The state with its moments on the device (CPU: at once), or a MomentsIn on its way there (CUDA)."""
        if self.device.type != "cuda":
            return _state_to_device(optimizer_state, self.device)
        if self._moment_pool is None:
            self._moment_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dark-moments")
        return MomentsIn(optimizer_state, self.device, self._staging, self._moment_pool)

    def _train_loop(self, weights, items, cfg, on_step, low_precision, marks, keys, params, flat, opt, load_moments,
                    waited, park: "ParkedMoments | None") -> TrainResult:
        lora = TrainLoRA(params, weights.scaling, {m: o for m, (_, o) in self.model.config.projection_shapes().items()})
        protector = self._job_protector = self.protector(cfg.protect_energy)
        if protector is not None:
            with torch.no_grad():
                zero_b = torch.stack([b.abs().amax() == 0 for _, b in params.values()]).tolist()  # one sync
                # A can turn freely while B is zero (it changes no output yet): such an A is projected whole, as a
                # change from zero, through project_updates (each shared basis crosses once, on its side stream)
                fresh = [k for k, zero in zip(params, zero_b) if zero]
                if fresh:
                    a_fresh = [params[k][0] for k in fresh]
                    protector.project_updates(fresh, a_fresh, [torch.zeros_like(a) for a in a_fresh])
        marks["protected"] = time.perf_counter()
        anchors = self.anchors(cfg.anchor_prompts) if cfg.kl_weight > 0 else []
        self._reference(items)
        self._reference_anchors(anchors)
        sft = [i for i in items if i.kind == "sft"]
        prefs = [i for i in items if i.kind in ("dpo", "unlearn")]
        threshold = -math.log(cfg.verify_min_prob)
        replays = [i for i in sft if i.replay and i.verify]
        # replay_check: the replayed examples do not train while they hold; they are checked without gradients
        # whenever everything else verifies, and one that misses trains from that step on (held: not training)
        held = list(replays) if cfg.replay_check else []
        marks["prepared"] = time.perf_counter()
        losses, verified, kept, step, step_items, check_s = [], False, True, 0, [], 0.0
        rng = random.Random(0)
        while True:
            if self._loan is not None and self.kv_lender.wanted():
                self._return_loan()  # serving ran short of blocks: the rest of the job checkpoints
            # each step on the stream of the moment (serving busy or not); a step that moves waits for the stream
            # it leaves (_step_stream), so the previous step's update is done before this one's passes read it
            with self._step_stream():
                # every check describes the weights as they are now, before this step's update: stop with them
                resting = {id(i) for i in held}
                batch = self._pick([i for i in sft if id(i) not in resting] if resting else sft, cfg.batch_size, rng)
                final = step >= cfg.max_steps  # this pass only checks: the loop stops after it, whatever it finds
                # a last pass checks the held replays beside the batch, in the same passes without gradients
                held_in_pass = final and bool(held) and not low_precision
                if held_in_pass:
                    batch = batch + held
                groups = self._micro_batches(batch, cfg.micro_tokens)
                backward_done = False
                if final or len(groups) > 1:
                    # a long batch in parts, each part's backward right after its forward (gradients add up):
                    # only one part's activations at a time. The check comes after the backward passes here, so
                    # a step that turns out to be the last computes gradients it drops. A final pass (the check
                    # alone) runs without gradients: no layer kept or recomputed for a backward that never runs
                    if not final:
                        opt.zero_grad(set_to_none=True)
                    loss_total, worst = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
                    kept = torch.ones((), dtype=torch.bool, device=self.device)
                    with torch.no_grad() if final else nullcontext():
                        for g, group in enumerate(groups):
                            last = g == len(groups) - 1
                            with self._step_stream():  # requests that arrived since the last part: fewer SMs now
                                loss_g, worst_g, kept_g = self._sft_and_anchor_losses(
                                    group, anchors if last else [], lora, cfg,
                                    sft_weight=len(group) / max(1, len(batch)))
                                if not final:
                                    loss_g.backward()
                            loss_total = loss_total + loss_g.detach()
                            worst, kept = torch.maximum(worst, worst_g), kept & kept_g
                    backward_done = not final
                else:
                    loss_total, worst, kept = self._sft_and_anchor_losses(batch, anchors, lora, cfg)
                forgotten = True
                if prefs:
                    with torch.no_grad() if final else nullcontext():
                        pref, forgotten = self._pref_loss(prefs, lora, cfg)
                    loss_total = loss_total + cfg.dpo_weight * pref
                # the step's one wait for the device: what its passes found, read in one copy (the loss for the
                # record, the check that decides whether the job stops before this step's update)
                loss_v, worst_v, kept_v = torch.stack([loss_total.detach().float(), worst.float(), kept.float()]).tolist()
                verified = worst_v <= threshold and forgotten
                kept = kept_v > 0.5
                slipped = []
                if held and not low_precision and not held_in_pass and verified and kept and step >= cfg.min_steps:
                    # the trained items verify: the replays that did not train are checked on the same weights,
                    # without gradients (under bf16 autocast, _confirm checks them)
                    t = time.perf_counter()
                    slipped = self._failing(held, lora, cfg, threshold)
                    check_s += time.perf_counter() - t
                    verified = verified and not slipped
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("step %d loss %.4f verified %s anchors kept %s replays slipped %d of %d held", step,
                              loss_v, verified, kept, len(slipped), len(held))
                if verified and (batch or held) and step >= cfg.min_steps and low_precision:
                    # training ran under bf16 autocast: confirm in the precision that serves before stopping, every
                    # checked item (the trained ones and the held replays)
                    t = time.perf_counter()
                    missed, kept = self._confirm([i for i in batch if i.verify] + held, anchors, lora, threshold, cfg)
                    check_s += time.perf_counter() - t
                    verified = not missed
                    slipped = [i for i in held if any(i is m for m in missed)]
                if (verified and kept and step >= cfg.min_steps) or step >= cfg.max_steps:
                    break
                if not backward_done:
                    opt.zero_grad(set_to_none=True)
                    loss_total.backward()
                elif prefs:
                    (cfg.dpo_weight * pref).backward()
                if slipped:
                    # replays that slipped train from now on, this step included (their gradients add to the
                    # batch's; each weighs as one of the batch's examples)
                    gone = {id(i) for i in slipped}
                    held = [i for i in held if id(i) not in gone]
                    for group in self._micro_batches(slipped, cfg.micro_tokens):
                        with self._step_stream():
                            loss_s, _, _ = self._sft_and_anchor_losses(
                                group, [], lora, cfg, sft_weight=len(group) / (len(batch) or len(slipped)))
                            loss_s.backward()
                        loss_total = loss_total + loss_s.detach()
                        loss_v = None  # read at the step's end: the slipped replays' loss is part of it
                step_items.append(len(batch) + len(slipped))
                with self._step_stream():  # picked now, as the loss's: requests may have come since the step began
                    torch.nn.utils.clip_grad_norm_(flat, cfg.max_grad_norm)
                    load_moments()
                    if park is not None:
                        park.back(opt)
                    a_factors = [a for a, _ in params.values()]
                    # A before the step (made here, after backward: not held through the passes). The step's change
                    # is kept out of the everyday directions; every earlier change was, so A's whole change since
                    # the job began stays out of them as well
                    with torch.no_grad():
                        before = torch._foreach_mul(a_factors, 1.0) if protector is not None else None
                    opt.step()
                    if protector is not None:
                        if self._loan is not None and self._kept is None:  # the bases cross the bus once a job
                            self._kept = protector
                            self._loan.bases_bytes = protector.keep_in(self._loan)
                        with torch.no_grad():
                            self._project(protector, list(params), a_factors, before, cfg)
                        del before
                step += 1
                self._wait_while_serving()
                losses.append(round(loss_total.item() if loss_v is None else loss_v, 5))
                if park is not None and step < cfg.max_steps:  # another step may follow: its passes run without them
                    park.out(opt, flat, self._park_stream())
                if on_step:
                    on_step(step, losses[-1])
        marks["trained"] = time.perf_counter()
        staged = None
        if self.stage_factors is not None:  # queued before to_host's wait, done when it returns
            try:
                staged = self.stage_factors({k: params[k] for k in keys}, weights.scaling)
            except torch.OutOfMemoryError:
                log.warning("no device memory to stage the new version for serving; it loads from the host instead")
        host = iter(to_host([t.detach() for k in keys for t in params[k]], self._staging))
        out = AdapterWeights(weights.config, {k: (next(host), next(host)) for k in keys}, weights.scaling)
        marks["copied"] = time.perf_counter()
        # on the device still: the job publishes the version first, then moves them (optimizer_state_to_host)
        load_moments()  # a job that took no step hands the moments on as they came
        if park is not None:
            park.back(opt)  # stopped after a step that had parked them (verified before max_steps)
        state = opt.state_dict()
        timings = {"setup": marks["prepared"] - marks["start"], "steps": marks["trained"] - marks["prepared"],
                   "to_host": marks["copied"] - marks["trained"], "factors_in": marks["factors_in"] - marks["start"],
                   "moments_in": marks["moments_in"] - marks["factors_in"], "moments_wait": waited[0],
                   "protector": marks["protected"] - marks["moments_in"], "references": marks["prepared"] - marks["protected"],
                   "replay_checks": check_s}
        return TrainResult(out, state, step, losses, verified, anchors_kept=kept,
                           timings={k: round(v, 3) for k, v in timings.items()}, replays=len(replays),
                           replays_trained=len(replays) - len(held), step_items=step_items, staged=staged)

    def optimizer_state_to_host(self, state: dict) -> dict:
        """A TrainResult's optimizer state (AdamW's moments, on the device as training left them) in host memory,
        where it stays between jobs: device memory is for serving."""
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:
            return {**state, "state": _state_to_host(state["state"], self._staging)}

    @contextmanager
    def _step_stream(self):
        """The stream for a piece of a step (a step, a part of a long batch, a checkpointed layer's call): the
        shared one (part of the SMs) while requests are being served, else the trainer's own (all of them). A piece
        on another stream than the one around it starts after what was queued there and the work queued after it
        waits for it, so a step can move to the shared stream between its parts and layers when requests arrive
        mid-step (a checkpointed layer's backward runs its recompute, and so its backward, on the stream picked
        then: autograd runs a backward operation on its forward's stream)."""
        if self.stream is None:
            yield None
            return
        busy = self.shared_stream is not None and self.serving_busy()
        stream = self.shared_stream if busy else self.stream
        around = torch.cuda.current_stream(self.device)
        if busy and not self.serving_waits and self.lead > 0:
            self._pace(around)
        if stream == around:
            yield None
            return
        stream.wait_stream(around)
        with torch.cuda.stream(stream):
            yield stream  # the stream switched to (None: the one around)
        around.wait_stream(stream)

    def _read_settings(self) -> None:
        self.lead = int(os.environ.get("DARK_TRAIN_LEAD", "2"))
        self.serving_waits = os.environ.get("DARK_SERVING_WAITS", "1") != "0"
        self._queued = []

    def _wait_while_serving(self) -> None:
        """While requests are served (on CUDA), the host waits here for the trainer's queued work: at the points of a
        step where it waited before steps ran with one wait (the passes' inputs, the rows of the loss, the check,
        the step's end). Measured on 2026-12-05 (H200 and H100): with the one wait alone, decode's p99 per-token
        latency during training went from ~2.1x solo to 17-19x (stalls of ~110 ms, about three a step), with the
        host's lead bounded while nothing was served (_pace) or not; the waits keep the queue during
        serving as it was when that ratio was measured. A step while nothing is served keeps its one wait.
        Measured with them on 2026-12-06 (H100, bench/RESULTS.md): p99 1.92x solo, longest token 12.4 ms; with
        DARK_SERVING_WAITS=0 (the host's lead bounded to DARK_TRAIN_LEAD pieces while serving instead) 2.04x / 2.09x
        (lead 2 / 1), longest tokens 42 / 35 ms. The GIL was never held over 10 ms in any of them (GilHolds in
        bench/bench_learn_gpu.py), so the old stalls were the host's unbounded lead on the device, not a held GIL."""
        if self.serving_waits and self.stream is not None and self.shared_stream is not None and self.serving_busy():
            torch.cuda.current_stream(self.device).synchronize()

    def _pace(self, around: torch.cuda.Stream) -> None:
        """Marks what is queued so far and waits (on the host) until the device has reached the mark made `lead`
        pieces ago: the host stays at most `lead` pieces ahead on the trainer's stream."""
        event = torch.cuda.Event()
        event.record(around)
        self._queued.append(event)
        if len(self._queued) > self.lead:
            self._queued.pop(0).synchronize()

    def _confirm(self, checked: list[Item], anchors: list[Item], lora, threshold: float,
                 cfg: LearnConfig) -> tuple[list[Item], bool]:
        """In the precision that serves (training ran under bf16 autocast): the items among `checked` whose taught
        reply misses (_failing), and whether every anchor's greedy choices are unchanged."""
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _, _, kept = self._sft_and_anchor_losses([], anchors, lora, cfg)
            return self._failing(checked, lora, cfg, threshold), bool(kept)

    def _failing(self, items: list[Item], lora, cfg: LearnConfig, threshold: float) -> list[Item]:
        """The items whose taught reply is not the greedy answer with margin on the current weights (some taught
        token's negative log-probability above threshold): passes without gradients, in consecutive parts of at
        most cfg.micro_tokens tokens (_micro_batches), each on the stream of the moment."""
        failing = []
        if not items:
            return failing
        with torch.no_grad():
            for group in self._micro_batches(items, cfg.micro_tokens):
                with self._step_stream():
                    chosen, owner, _, _ = self._token_logprobs([i.rendered for i in group], lora, cfg)
                    worst = torch.zeros(len(group), device=self.device).scatter_reduce(
                        0, owner, -chosen.float(), "amax")
                    missed = (worst > threshold).tolist()  # one sync per part
                failing += [i for i, m in zip(group, missed) if m]
        return failing

    @staticmethod
    def _pick(sft: list[Item], size: int, rng: random.Random) -> list[Item]:
        """The items checked for verification always train; rewordings join, as many again at most. (The replays
        that are only checked, LearnConfig.replay_check, are not among `sft` here: they neither train nor call
        for rewordings.)"""
        must = [i for i in sft if i.verify]
        rest = [i for i in sft if not i.verify]
        return must + rng.sample(rest, min(len(rest), max(0, min(size - len(must), len(must)))))

    def _joint_logprobs(self, first: list[Rendered], second: list[Rendered], lora, cfg: LearnConfig):
        """_token_logprobs of both lists, with the full rows of the second, in one pass when their lengths are
        alike (the shared prefix is then computed once), in two when one pass would mostly compute padding
        (short anchors beside long examples)."""
        lengths = [len(r.input_ids) for r in first], [len(r.input_ids) for r in second]
        if not first or not second or max(lengths[1]) * 2 >= max(lengths[0]) >= min(lengths[1]) // 2:
            return self._token_logprobs(first + second, lora, cfg, full_from=len(first))
        a, b = self._token_logprobs(first, lora, cfg), self._token_logprobs(second, lora, cfg, full_from=0)
        return torch.cat([a[0], b[0]]), torch.cat([a[1], b[1] + len(first)]), torch.cat([a[2], b[2]]), b[3]

    @staticmethod
    def _micro_batches(batch: list[Item], budget: int) -> list[list[Item]]:
        """The batch in consecutive parts of at most `budget` tokens each (an item alone may be longer); one part
        when it all fits or budget < 0."""
        if budget < 0 or sum(len(i.rendered.input_ids) for i in batch) <= budget:
            return [batch]
        groups, size = [[]], 0
        for item in batch:
            n = len(item.rendered.input_ids)
            if groups[-1] and size + n > budget:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += n
        return groups

    def _sft_and_anchor_losses(self, batch: list[Item], anchors: list[Item], lora, cfg: LearnConfig,
                               sft_weight: float = 1.0):
        """One forward pass over the taught items and the anchors (they share the template's prefix).

        Returns (loss, the worst negative log-probability of a taught token among the items checked for
        verification (0 when none), whether every anchor's greedy choices are unchanged), all three on the device:
        nothing here waits for it (the caller reads them in one copy). sft_weight scales the taught items' mean (a
        part of a batch weighs its share of the batch's examples).
        """
        dev = self.device
        worst, kept = torch.zeros((), device=dev), torch.ones((), dtype=torch.bool, device=dev)
        if not batch and not anchors:
            return torch.zeros((), device=dev), worst, kept
        chosen, owner, _, a_logp = self._joint_logprobs([i.rendered for i in batch], [a.rendered for a in anchors], lora, cfg)
        loss = torch.zeros((), device=dev)
        nb = len(batch)
        # the taught rows come first (sequence order), as many as the items' labelled tokens: a slice, where a
        # boolean mask would wait for the device to learn its size
        taught = self._target_count([i.rendered for i in batch])
        if nb and taught:
            nll, who = -chosen[:taught], owner[:taught]
            # each example counts the same, whatever its length
            count = torch.zeros(nb, device=dev).index_add(0, who, torch.ones_like(nll))
            loss = sft_weight * (torch.zeros(nb, device=dev).index_add(0, who, nll) / count.clamp(min=1)).mean()
            self._wait_while_serving()
            checked = on_device([i.verify for i in batch], dev)[who]
            # a log-probability is <= 0: the rows not checked count as 0, which is the answer when none is checked
            worst = torch.where(checked, nll.detach(), 0.0).amax().clamp(min=0)
        if anchors:
            a_chosen = chosen[taught:]  # a_logp: the anchors' rows, in the same order
            ref = torch.cat([a.ref for a in anchors])
            kept = (a_logp.argmax(-1) == ref.argmax(-1)).all()
            # "replay" (cross-entropy on the adapter-free model's own answers) has a gradient where the adapter
            # starts, unlike KL, so it holds near-ties from the first step instead of repairing them later
            anchor = -a_chosen.mean() if cfg.anchor_loss == "replay" else \
                F.kl_div(a_logp, ref, log_target=True, reduction="batchmean")
            loss = loss + cfg.kl_weight * anchor
        return loss, worst, kept

    def _pref_loss(self, prefs: list[Item], lora, cfg: LearnConfig) -> tuple[torch.Tensor, bool]:
        """DPO for corrections, and its one-sided form for unlearn; also whether every unlearned answer has
        stopped being the greedy one (some token of it is no longer the model's first choice)."""
        terms, forgotten = [], True
        for item in prefs:
            seqs = [item.rendered, item.rejected] if item.kind == "dpo" else [item.rejected]
            lp, owner, top, _ = self._token_logprobs(seqs, lora, cfg)
            total = torch.zeros(len(seqs), device=self.device).index_add(0, owner, lp)
            delta = total - item.ref
            margin = delta[0] - delta[1] if item.kind == "dpo" else -delta[0]
            terms.append(-F.logsigmoid(cfg.dpo_beta * margin))
            if item.kind == "unlearn":
                forgotten = forgotten and not bool((lp >= top).all())
        return torch.stack(terms).mean(), forgotten
