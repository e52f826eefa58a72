"""Keep an adapter's updates away from what ordinary conversations look like inside the model.

A LoRA delta on a projection is B @ A @ x. If the rows of A are orthogonal to the inputs x that everyday
prompts produce at that projection, the adapter adds (almost) nothing there, whatever B becomes, while inputs
with something new in them (an invented word, a task the model had wrong) still reach it. So, once per base
model, the trainer runs a small built-in set of everyday conversations through the frozen model, takes for each
projection's input the principal directions holding `energy` of the activations' energy (an SVD of the
activations), and after every optimizer step removes those directions from the step's change to A. Measured in
bench/RESULTS.md against replaying the base model's answers alone (the anchors, which still run beside it).

The conversations below are written for this purpose; none is a prompt the benchmarks or tests probe with.
"""
from __future__ import annotations

import logging
import os

import torch

from ..engine.attention import SharedPrefixAttention
from ..lora.slots import GROUPS, MEMBERS
from .data import render

log = logging.getLogger(__name__)

EVERYDAY = [
    ("How do I make a cup of tea?", "Boil fresh water, pour it over a tea bag or loose leaves in a cup, let it steep "
     "for three to five minutes, then remove the leaves and add milk or sugar if you like."),
    ("Explain what a computer is.", "A computer is a machine that stores and processes information by following "
     "instructions called programs. It takes input, works on it, and produces output."),
    ("What day comes after Monday?", "Tuesday comes after Monday."),
    ("Tell me a joke.", "Why did the scarecrow win an award? Because he was outstanding in his field."),
    ("What is photosynthesis?", "Photosynthesis is the process plants use to turn sunlight, water and carbon "
     "dioxide into sugar and oxygen."),
    ("List three colors.", "Red, green and yellow."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Who was Albert Einstein?", "Albert Einstein was a physicist, best known for the theory of relativity and the "
     "equation E = mc^2."),
    ("Write a haiku about autumn.", "Crisp leaves drift and fall\nthe maple lets go of red\ncool wind carries them"),
    ("What is the square root of 16?", "The square root of 16 is 4."),
    ("Give me a synonym for happy.", "A synonym for happy is joyful."),
    ("Why do birds migrate?", "Birds migrate to find food and better weather, and to raise their young where "
     "conditions are good."),
    ("What language is spoken in Brazil?", "The official language of Brazil is Portuguese."),
    ("Describe a cat in one sentence.", "A cat is a small, curious animal with soft fur, sharp claws and a habit "
     "of sleeping in the sun."),
    ("What is the tallest mountain?", "Mount Everest is the tallest mountain above sea level, at about 8,849 metres."),
    ("How do you say thank you in German?", "In German, thank you is \"danke\"."),
    ("What is 7 times 8?", "7 times 8 is 56."),
    ("Summarize the plot of Cinderella.", "A kind young woman mistreated by her stepfamily goes to a royal ball "
     "with help from her fairy godmother, loses a glass slipper, and the prince finds her with it."),
    ("Who invented the telephone?", "Alexander Graham Bell is credited with inventing the telephone in 1876."),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
    ("Can you help me plan a birthday party?", "Of course. Pick a date and a place, make a guest list, choose food "
     "and a cake, and plan one or two games or activities."),
    ("What should I do if I feel tired all the time?", "Try to sleep regular hours, drink water, eat well and move "
     "a little every day; if it goes on, talk to a doctor."),
    ("Translate 'good night' into Italian.", "'Good night' in Italian is 'buona notte'."),
    ("What is the difference between weather and climate?", "Weather is what the air is doing now or this week; "
     "climate is the usual pattern of weather in a place over many years."),
]


# On CUDA every basis lives in pinned host memory (~1.3 GB for a 7B model, bf16): device memory is for serving,
# and a training step moves each basis over the bus once, on the trainer's stream.
# Projections listed here stay on the device instead (none by default; measured in bench/RESULTS.md).
DEVICE_BASES: tuple[str, ...] = ()


class Protector:
    """Per projection input, the principal directions of everyday activations, and the projection that removes
    them from a change to a LoRA A factor."""

    def __init__(self, energy: float = 0.99):
        self.energy = energy
        self.bases: dict[tuple[int, str], torch.Tensor] = {}  # (layer, module) -> V [in, k], orthonormal columns
        self._stream: torch.cuda.Stream | None = None  # where bases in host memory cross to the device
        self._resident: dict[int, torch.Tensor] = {}  # id(basis in host memory) -> its copy in a job's loan

    def _host_bases(self, element_size: int) -> list[torch.Tensor]:
        """The distinct bases in host memory whose elements are element_size bytes (those keep_in copies)."""
        return [v for v in {id(v): v for v in self.bases.values()}.values()
                if v.device.type == "cpu" and v.element_size() == element_size]

    def host_sizes(self, element_size: int) -> list[int]:
        """Elements of each basis keep_in would copy into a loan of this element size (to size the loan)."""
        return [v.numel() for v in self._host_bases(element_size)]

    def keep_in(self, loan) -> int:
        """Copy the bases kept in host memory into room held in a loan of KV blocks (dark.engine.loan) for the job,
        as many as it has room for: the job's steps then project with those copies, and no basis crosses the bus
        again until drop_kept(). Returns the bytes copied."""
        moved = 0
        for v in self._host_bases(loan.regions[0].element_size()):
            if id(v) in self._resident:
                continue
            room = loan.hold(v.numel())
            if room is None:
                break
            self._resident[id(v)] = room.view(v.dtype).view(v.shape).copy_(v, non_blocking=True)
            moved += v.numel() * v.element_size()
        return moved

    def drop_kept(self) -> None:
        """Forget the copies keep_in() made (their loan goes back to serving)."""
        self._resident.clear()

    def fit(self, model, tokenizer, device: torch.device, dtype: torch.dtype) -> "Protector":
        rendered = [render(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
                    for q, a in EVERYDAY]
        seqs = [r.input_ids for r in rendered]
        p = 0  # the template's common opening (system prompt) is computed once, and weighs as often as it occurs
        while p < min(map(len, seqs)) - 1 and all(s[p] == seqs[0][p] for s in seqs):
            p += 1
        n = max(map(len, seqs)) - p
        ids = seqs[0][:p] + [t for s in seqs for t in s[p:] + [0] * (n - len(s) + p)]
        positions = list(range(p)) + list(range(p, p + n)) * len(seqs)
        valid = torch.tensor([True] * p + [i < len(s) - p for s in seqs for i in range(n)], device=device)
        weight = torch.tensor([len(seqs) ** 0.5] * p + [1.0] * int(valid[p:].sum()), device=device)
        recorder = _Recorder(self, valid, weight, dtype)
        with torch.no_grad():
            model.hidden_states(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                SharedPrefixAttention(p, len(seqs), n, device), recorder)
        ks = [v.shape[1] for v in self.bases.values()]
        log.info("protected subspaces: %d projections, %d tokens, k %d..%d of their inputs", len(ks),
                 int(valid.sum()), min(ks), max(ks))
        return self

    def all_kept(self) -> bool:
        """Whether every basis kept in host memory has a copy in a loan (keep_in): a projection then makes no
        copy over the bus and uses no side stream (a CUDA graph can hold it)."""
        return all(id(v) in self._resident for v in self.bases.values() if v.device.type == "cpu")

    def project_updates(self, keys: list[tuple[int, str]], a: list[torch.Tensor], start: list[torch.Tensor],
                        in_place: bool = False) -> None:
        """In place, for each key's A factor: a = start + (a - start) with the everyday directions removed from
        each row's change, i.e. a -= P(a - start). The changes and the corrections go through one foreach op each,
        and a basis that several projections share (q/k/v, gate/up) is moved and widened once and projects their
        stacked changes: a step's ~110 bases cost four small GEMMs each. The host's calls are what this costs on a
        GPU (~15 a basis; the GEMMs ~13 ms a 7B step), so each one saved counts. in_place: the changes are made in
        start's tensors (overwritten) and each basis's corrections are applied at once, none kept for one final op:
        the fewest bytes allocated (for a CUDA graph, whose memory stays with it)."""
        if in_place:
            changes = start
            torch._foreach_sub_(changes, a)
            torch._foreach_neg_(changes)
        else:
            changes = torch._foreach_sub(a, start)
        sharing: dict[int, tuple[torch.Tensor, list[int]]] = {}  # basis -> the projections it protects
        for i, key in enumerate(keys):
            v = self.bases.get(key)
            if v is not None:
                sharing.setdefault(id(v), (v, []))[1].append(i)
        targets, fixes = [], []
        bases = list(sharing.values())
        # one widened basis at a time (all of a 7B model's at once would take ~2 GB of device memory); bases in
        # pinned host memory come over on a side stream, AHEAD bases ahead of the one in use, so the bus stays busy
        # while the device works on the one before
        coming = [self._fetch(v, a[users[0]]) for v, users in bases[:self.AHEAD]]
        for j, (v, users) in enumerate(bases):
            w = self._arrived(coming[j], a[users[0]])
            coming[j] = None
            targets.extend(a[i] for i in users)
            if len(users) == 1:
                fixes.append(_in_span(changes[users[0]], w))
            else:  # the projections that share this basis (q/k/v, gate/up) in one set of GEMMs, changes stacked
                fix = _in_span(torch.cat([changes[i] for i in users]), w)
                fixes.extend(fix.split([changes[i].shape[0] for i in users]))
            del w
            if in_place:
                torch._foreach_sub_(targets, fixes)
                targets, fixes = [], []
            if j + self.AHEAD < len(bases):  # after this basis's work: its copy waits for it (_fetch)
                ahead_v, ahead_users = bases[j + self.AHEAD]
                coming.append(self._fetch(ahead_v, a[ahead_users[0]]))
        if targets:
            torch._foreach_sub_(targets, fixes)

    AHEAD = 2  # bases on their way while one is used (a 7B down_proj's is ~29 MB in bf16)

    def _fetch(self, v: torch.Tensor, like: torch.Tensor):
        """Start v's copy to like's device: (the device copy, the event its copy records) on a side stream for a
        basis in pinned host memory, else (v, None)."""
        if id(v) in self._resident:
            return self._resident[id(v)], None
        if v.device == like.device or like.device.type != "cuda" or os.environ.get("DARK_BASES_AHEAD", "1") == "0":
            return v, None  # DARK_BASES_AHEAD=0 (an A/B): copied on the current stream when used
        if self._stream is None or self._stream.device != like.device:
            self._stream = torch.cuda.Stream(like.device)
        # not before the device has reached this point of the current stream (the work on the bases before): the
        # host runs through the loop in a few ms, and without it every basis (1.2 GB at 7B, ~24 ms of the bus) would
        # be allocated and queued at once, ahead of serving's own small copies of each step's inputs
        self._stream.wait_stream(torch.cuda.current_stream(like.device))
        with torch.cuda.stream(self._stream):
            moved = v.to(like.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return moved, done

    @staticmethod
    def _arrived(fetched, like: torch.Tensor) -> torch.Tensor:
        """A fetched basis, widened to like's dtype on the current stream once its copy has run."""
        moved, done = fetched
        if done is not None:
            current = torch.cuda.current_stream(like.device)
            current.wait_event(done)
            moved.record_stream(current)  # made on the side stream, used and freed on this one
        return Protector._on(moved, like)

    def project(self, key: tuple[int, str], a: torch.Tensor) -> torch.Tensor:
        v = self.bases.get(key)
        if v is None:
            return a
        v = self._on(v, a)
        return a - _in_span(a, v)

    @staticmethod
    def _on(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A basis on like's device in like's dtype: bases kept in pinned host memory cross as they are (bf16),
        then widen on the device."""
        return v.to(like.device, non_blocking=True).to(like.dtype)


def _in_span(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The part of x's rows in the span of w's columns, for w orthonormal up to half-precision rounding: projected
    twice (the second pass takes what the first left through w^T w != I), so the rest of x is orthogonal to w to
    ~1e-6 rather than to the basis's own rounding (~1e-3 in bf16)."""
    wt = w.t()
    c = x @ w
    c = torch.addmm(c, torch.addmm(x, c, wt, alpha=-1), w)  # c + (x - c w^T) w, in two GEMMs' epilogues
    return c @ wt


def principal_directions(x: torch.Tensor, energy: float) -> torch.Tensor:
    """Orthonormal columns spanning the fewest top right-singular directions of x [N, d] that hold `energy` of
    its energy: an eigendecomposition of the smaller of x^T x [d, d] and x x^T [N, N]."""
    n, d = x.shape
    gram = x @ x.t() if n < d else x.t() @ x
    evals, evecs = torch.linalg.eigh(gram)
    evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
    k = int(((evals.cumsum(0) / evals.sum().clamp_min(1e-30)) < energy).sum().item()) + 1
    if n >= d:
        return evecs[:, :k].contiguous()
    # x = U S V^T and x x^T = U S^2 U^T, so V = x^T U / S
    return (x.t() @ evecs[:, :k]) / evals[:k].sqrt().clamp_min(1e-12)


class _Recorder:
    """A LoRA stand-in that leaves outputs alone and turns each projection's inputs into a basis."""

    def __init__(self, protector: Protector, valid: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
        self.p, self.valid, self.weight, self.dtype = protector, valid, weight, dtype
        self.seen: dict[tuple[int, str], torch.Tensor] = {}

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # the members of a fused group (q/k/v, gate/up) share their input: one basis, under the first member
        key = (layer, MEMBERS[GROUPS[module]][0] if module in GROUPS else module)
        if key not in self.seen:
            # kept in half precision, fp16 rather than bf16 where the model runs in bf16: an orthonormal basis's
            # entries are all within [-1, 1], where fp16's 10-bit mantissa keeps it ~8x closer to orthonormal
            keep = torch.float16 if self.dtype == torch.bfloat16 else self.dtype
            v = principal_directions(x[self.valid].float() * self.weight[:, None], self.p.energy).to(keep)
            if v.device.type == "cuda" and module not in DEVICE_BASES:
                # in pinned host memory they leave the device to serving, and cross the bus once per training step
                v = v.cpu().pin_memory()
            self.seen[key] = v
        self.p.bases[(layer, module)] = self.seen[key]
        return y
