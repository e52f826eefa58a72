"""LoRA training beside serving, on Qwen2.5-7B-Instruct shapes: dark's Trainer next to transformers + PEFT.

One run, random bf16 weights in the exact shapes (speed does not depend on the values), LoRA rank 16 (alpha 32)
on all 7 linear projections, baseline in the same process:

1. training throughput on SFT batches of `--train-batch` x `--seq-len` random token ids, loss on the last
   `--label-tokens` of each sequence: dark's Trainer (kl_weight=0, and again with the default anchor replay)
   and PEFT (AdamW, grad-norm clip 1.0, sdpa, bf16 base, fp32 LoRA factors: PEFT's defaults); tokens/s counts
   the batch's input tokens (8 x 512 = 4096 per step), peak GPU memory of each;
2. decode per-token latency p50/p99 of `--streams` concurrent greedy streams (fixed length, no adapter), solo
   and while a training loop of (1) runs without pause in another thread; training tokens/s during decode over
   solo. The same for HF `generate` (high-priority stream) + a PEFT training loop (low-priority stream);
3. seconds from `llm.submit_learn([one ~512-token example], max_steps=K, min_steps=K)` to its `done` event,
   for each K: a first job on a new adapter (creates the adapter, generates the anchor answers) and a second.
   Random weights never verify, so the steps are fixed.

    PYTHONPATH=$PWD python3 bench/bench_learn_gpu.py --tokenizer .data/tok --out $OUT/learn.json
    python bench/bench_learn_gpu.py --tiny --device cpu --tokenizer .data/tok   # a smoke test of the script
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import LORA_TARGETS, QWEN25_7B, TINY, StepClock, prompts_ids, run_ours, sync  # noqa: E402

WORDS = ("river stone window garden copper silent yellow market engine pocket winter thunder ladder orange "
         "paper mountain violet quiet harbor signal candle forest marble rocket velvet island number planet "
         "shadow bridge little summer travel wonder glass music anchor ribbon silver cotton valley").split()


class Stop(Exception):
    """Raised from a training loop's step callback to end it."""


def mem(device) -> dict:
    if device.type != "cuda":
        return {}
    return {"peak_alloc_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}


def reset_peak(device) -> float:
    if device.type != "cuda":
        return 0.0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return round(torch.cuda.memory_allocated(device) / 2**30, 2)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def latency(gaps_s: list[float]) -> dict:
    ms = [1000 * g for g in gaps_s]
    return {"tokens_per_stream": len(ms), "p50_ms": round(statistics.median(ms), 3), "p99_ms": round(pct(ms, 0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3), "max_ms": round(max(ms), 3)}


def rate_between(stamps: list[float], t0: float, t1: float, tokens_per_step: int) -> dict:
    """Training tokens/s from the step-end times that fall inside [t0, t1]."""
    inside = [t for t in stamps if t0 <= t <= t1]
    if len(inside) < 2:
        return {"steps": len(inside), "tok_s": None}
    return {"steps": len(inside) - 1, "tok_s": round((len(inside) - 1) * tokens_per_step / (inside[-1] - inside[0]), 1)}


def train_batch(batch: int, length: int, label_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 40000, (batch, length), generator=g)
    labels = ids.clone()
    labels[:, :length - label_tokens] = -100
    return ids, labels


def build_model(shape: dict, tokenizer: Path, folder: Path, device: torch.device):
    """A Qwen2 model of random bf16 weights on the device (HF's own init, std 0.02), saved with the tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = Qwen2Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


# --- PEFT ---
class PeftRunner:
    def __init__(self, hf, ids, labels, lr: float = 1e-4):
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(hf, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr)
        dev = next(self.model.parameters()).device
        self.ids, self.labels = ids.to(dev), labels.to(dev)
        self.lora_dtype = str(self.params[0].dtype)

    def step(self) -> float:
        loss = self.model(input_ids=self.ids, labels=self.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()  # a training loop logs its loss: one host sync per step, as in dark's


class GenClock:
    """A stopping criterion that never stops and stamps the end of every generate step (after a sync)."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores, **kw):
        if self.device.type == "cuda":  # this thread's stream only: a device-wide sync would wait for training
            torch.cuda.current_stream(self.device).synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_decode(model, prompts, new_tokens, device) -> list[float]:
    from transformers import StoppingCriteriaList

    ids = torch.tensor(prompts, device=device)
    clock = GenClock(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                             stopping_criteria=StoppingCriteriaList([clock]))
    assert out.shape[1] == len(prompts[0]) + new_tokens, out.shape
    s = clock.stamps
    return [b - a for a, b in zip(s, s[1:])]  # the first stamp closes the prefill


def bench_peft(hf, args, device, report, save) -> None:
    ids, labels = train_batch(args.train_batch, args.seq_len, args.label_tokens)
    tokens = args.train_batch * args.seq_len
    before = reset_peak(device)
    runner = PeftRunner(hf, ids, labels)
    for _ in range(args.warmup):
        runner.step()
    sync(device)
    t = time.perf_counter()
    losses = [runner.step() for _ in range(args.steps)]
    sync(device)
    secs = time.perf_counter() - t
    solo = round(args.steps * tokens / secs, 1)
    report["train"].append({"system": "PEFT", "tok_s": solo, "ms_per_step": round(1000 * secs / args.steps, 1),
                            "steps": args.steps, "lora_dtype": runner.lora_dtype, "loss_last": round(losses[-1], 4),
                            "alloc_before_gib": before, **mem(device)})
    print(json.dumps(report["train"][-1]), flush=True)
    save()
    if args.skip_peft_decode:
        return
    prompts = prompts_ids(args.streams, args.prompt_len, 1)
    gen_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
    train_stream = torch.cuda.Stream(device, priority=0) if device.type == "cuda" else None
    with torch.cuda.stream(gen_stream) if gen_stream else nullcontext():
        hf_decode(runner.model, prompts_ids(args.streams, args.prompt_len, 2), 8, device)  # warm-up
        solo_gaps = hf_decode(runner.model, prompts, args.new_tokens, device)
    stop, stamps, errors = threading.Event(), [], []

    def loop():
        try:
            with torch.cuda.stream(train_stream) if train_stream else nullcontext():
                while not stop.is_set():
                    runner.step()
                    stamps.append(time.perf_counter())
        except Exception as e:
            errors.append(repr(e))
            traceback.print_exc()

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    while len(stamps) < 2 and th.is_alive():
        time.sleep(0.01)
    t0 = time.perf_counter()
    with torch.cuda.stream(gen_stream) if gen_stream else nullcontext():
        busy_gaps = hf_decode(runner.model, prompts_ids(args.streams, args.prompt_len, 3), args.new_tokens, device)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    during = rate_between(stamps, t0, t1, tokens)
    report["decode"].append({"system": "HF generate + PEFT adapter", "streams": args.streams, "solo": latency(solo_gaps),
                             "while_training": latency(busy_gaps), "train_tok_s_during": during["tok_s"],
                             "train_steps_during": during["steps"], "train_tok_s_solo": solo,
                             "train_ratio": round(during["tok_s"] / solo, 3) if during["tok_s"] else None,
                             "errors": errors})
    print(json.dumps(report["decode"][-1]), flush=True)
    save()


# --- dark ---
def lora_weights(llm, seed: int = 0):
    from dark.config import LoraConfig
    from dark.lora.weights import AdapterWeights

    mc = llm.model.config
    return AdapterWeights.init(LoraConfig(r=16, alpha=32.0, target_modules=tuple(LORA_TARGETS)),
                               mc.projection_shapes(), mc.num_layers, seed=seed)


def dark_items(args):
    from dark.learn.data import Rendered
    from dark.learn.trainer import Item

    ids, labels = train_batch(args.train_batch, args.seq_len, args.label_tokens)
    # verify=True on all: the trainer's batch takes every item checked for verification, so all 8 train each step
    return [Item(Rendered(i, l), "sft", verify=True) for i, l in zip(ids.tolist(), labels.tolist())]


def train_dark(llm, items, cfg, on_step):
    return llm.learner.trainer.train(lora_weights(llm), None, items, cfg, on_step)


def bench_dark_train(llm, args, device, report, save, label, **overrides) -> float:
    from dark.config import LearnConfig

    items = dark_items(args)
    tokens = args.train_batch * args.seq_len
    n = args.warmup + args.steps
    cfg = LearnConfig(max_steps=n, min_steps=n, **overrides).validate()
    stamps = []
    before = reset_peak(device)
    t = time.perf_counter()
    result = train_dark(llm, items, cfg, lambda step, loss: stamps.append(time.perf_counter()))
    wall = time.perf_counter() - t
    secs = stamps[n - 1] - stamps[args.warmup - 1]
    fig = {"system": label, "tok_s": round(args.steps * tokens / secs, 1), "ms_per_step": round(1000 * secs / args.steps, 1),
           "steps": args.steps, "loss_last": result.losses[-1], "train_call_s": round(wall, 2),
           "first_step_s": round(stamps[0] - t, 2), "alloc_before_gib": before, **mem(device),
           "config": {k: getattr(cfg, k) for k in ("kl_weight", "anchor_loss", "lr", "kv_loan")},
           "kv_loan": result.kv_loan}
    report["train"].append(fig)
    print(json.dumps(fig), flush=True)
    save()
    return fig["tok_s"]


class GcPauses:
    """Python garbage-collector pauses (any thread), to tell a collector pause from an engine stall."""

    def __init__(self):
        self.pauses, self._t = [], {}
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._t[threading.get_ident()] = time.perf_counter()
        elif (t := self._t.pop(threading.get_ident(), None)) is not None:
            self.pauses.append((info.get("generation"), time.perf_counter() - t))

    def take(self) -> dict:
        p, self.pauses = self.pauses, []
        return {"count": len(p), "gen2": sum(g == 2 for g, _ in p),
                "max_ms": round(1000 * max((d for _, d in p), default=0.0), 2)}


class GilHolds:
    """How long the interpreter's lock was out of reach: a thread that sleeps 1 ms at a time and records how late
    each wake came back. A late wake of tens of ms means some thread held the GIL that long (a C call that does not
    release it, such as a kernel launch blocked on a full launch queue, or a collector pause), which also stalls the
    serving loop; a stall of decode with no such late wake lies elsewhere (the device, a wait on an event)."""

    def __init__(self):
        self.late, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            if (late := time.perf_counter() - t - 0.001) > 0.01:
                self.late.append(late)

    def take(self) -> dict:
        late, self.late = self.late, []
        return {"over_10ms": len(late), "over_50ms": sum(x > 0.05 for x in late),
                "max_ms": round(1000 * max(late, default=0.0), 1)}

    def close(self):
        self._stop.set()
        self._thread.join()


def pooled_counts(a: dict, b: dict) -> dict:
    """Two runs' GcPauses / GilHolds figures as one: the counts added, the longest (max_ms) kept."""
    return {k: max(a[k], b[k]) if k == "max_ms" else a[k] + b[k] for k in a}


def bench_dark_decode(llm, clock, args, device, report, save, solo_rate) -> None:
    """Rounds of solo and while-training decode runs: solo, busy, solo, ... (2 * rounds - 1 runs, solo first and last
    when rounds > 1), each run's figures and all runs pooled."""
    from dark.config import LearnConfig

    def gaps():
        s = clock.decode_steps()
        return [b[1] - a[1] for a, b in zip(s, s[1:])]

    def one_run(seed):
        clock.clear()
        gcp.take()
        gil.take()
        t0 = time.perf_counter()
        run_ours(llm, prompts_ids(args.streams, args.prompt_len, seed), args.new_tokens)
        t1 = time.perf_counter()
        g = gaps()
        fig = latency(g)
        fig["runner_p50_ms"] = round(1000 * statistics.median(e - s for s, e, _ in clock.decode_steps()), 3)
        fig["gaps_over_2x_p50"] = sum(x > 2 * statistics.median(g) for x in g)
        # requests added -> the end of the run's first step (the prompts' prefill): the streams' first token
        fig["first_step_ms"] = round(1000 * (clock.steps[0][1] - t0), 3) if clock.steps else None
        fig["slowest_at_step"] = max(range(len(g)), key=g.__getitem__)
        fig["gc"] = gcp.take()
        fig["gil_holds"] = gil.take()  # late wakes of a 1 ms sleeper during the run (GilHolds)
        return fig, g, t0, t1

    gcp, gil = GcPauses(), GilHolds()
    run_ours(llm, prompts_ids(args.streams, args.prompt_len, 2), 8)  # warm-up
    items = dark_items(args)
    big = 10**6
    # BENCH_LEARN_CONFIG: LearnConfig fields as JSON for the training beside decode (run_all.py --during-ab)
    cfg = LearnConfig(max_steps=big, min_steps=big, kl_weight=0.0,
                      **json.loads(os.environ.get("BENCH_LEARN_CONFIG") or "{}")).validate()
    runs, pooled = [], {"solo": [], "while_training": []}
    order = ["solo", "while_training"] * args.decode_rounds + (["solo"] if args.decode_rounds > 1 else [])
    for i, mode in enumerate(order):
        if mode == "solo":
            fig, g, _, _ = one_run(10 + i)
        else:
            stop, stamps, errors = threading.Event(), [], []

            def on_step(step, loss, stamps=stamps, stop=stop):
                stamps.append(time.perf_counter())
                if stop.is_set():
                    raise Stop

            def loop(errors=errors, on_step=on_step):
                try:
                    train_dark(llm, items, cfg, on_step)
                except Stop:
                    pass
                except Exception as e:
                    errors.append(repr(e))
                    traceback.print_exc()

            th = threading.Thread(target=loop, daemon=True)
            th.start()
            # three steps alone first: the last two give the solo rate of this very loop, just before the window
            # (the rate of a separate training run moved ~30% between runs of the same code)
            while len(stamps) < 4 and th.is_alive():
                time.sleep(0.01)
            before = rate_between(stamps[1:], 0.0, time.perf_counter(), args.train_batch * args.seq_len)
            fig, g, t0, t1 = one_run(10 + i)
            tokens = args.train_batch * args.seq_len
            rounds = 1
            # a training rate needs two step ends inside the window, and a step slowed by serving can outlast one
            # run of the streams: more runs follow back to back (5 in all at most), their latencies pooled
            while rate_between(stamps, t0, t1, tokens)["tok_s"] is None and rounds < 5 and th.is_alive():
                more, g2, _, t1 = one_run(100 + 10 * i + rounds)
                g = g + g2
                rounds += 1
                fig.update(latency(g), gaps_over_2x_p50=sum(x > 2 * statistics.median(g) for x in g),
                           slowest_at_step=max(range(len(g)), key=g.__getitem__),
                           gc=pooled_counts(fig["gc"], more["gc"]),
                           gil_holds=pooled_counts(fig["gil_holds"], more["gil_holds"]))
            fig["rounds"] = rounds
            stop.set()
            th.join(timeout=120)
            during = rate_between(stamps, t0, t1, tokens)
            fig.update(train_tok_s_during=during["tok_s"], train_steps_during=during["steps"],
                       train_tok_s_before=before["tok_s"], trainer_stopped=not th.is_alive(), errors=errors)
        runs.append({"mode": mode, **fig})
        pooled[mode] += g
        print(json.dumps(runs[-1]), flush=True)
    gc.callbacks.remove(gcp)
    gil.close()
    busy = [r for r in runs if r["mode"] == "while_training" and r["train_tok_s_during"]]
    during = round(statistics.median(r["train_tok_s_during"] for r in busy), 1) if busy else None
    before = [r["train_tok_s_before"] for r in busy if r.get("train_tok_s_before")]
    adjacent = round(statistics.median(before), 1) if before else None
    ratio = (lambda solo: round(during / solo, 3) if during and solo else None)
    # the ratio against the same loop's rate just before the window where there is one, else the training part's
    fig = {"system": "dark", "streams": args.streams, "solo": latency(pooled["solo"]),
           "while_training": latency(pooled["while_training"]), "train_tok_s_during": during,
           "train_tok_s_solo": solo_rate, "train_tok_s_just_before": adjacent,
           "train_ratio": ratio(adjacent or solo_rate), "train_ratio_vs_training_part": ratio(solo_rate),
           "runs": runs}
    report["decode"].append(fig)
    print(json.dumps({k: v for k, v in fig.items() if k != "runs"}), flush=True)
    save()


def example_of(tokenizer, target: int, seed: int) -> dict:
    """A {"prompt", "response"} of random words whose rendered length is close to `target` tokens (<= target)."""
    from dark.learn.data import render

    rng = random.Random(seed)
    response = " ".join(rng.choice(WORDS) for _ in range(max(4, target // 16))) + "."
    words = [rng.choice(WORDS) for _ in range(4 * target)]

    def length(n):
        msgs = [{"role": "user", "content": " ".join(words[:n]) + "?"}, {"role": "assistant", "content": response}]
        return len(render(tokenizer, msgs).input_ids)

    lo, hi = 1, len(words)
    while lo < hi:  # the most words that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= target else (lo, mid - 1)
    return {"prompt": " ".join(words[:lo]) + "?", "response": response, "_tokens": length(lo)}


# allocator counters whose change over a job says whether it made the caching allocator ask the driver for memory
# (cudaMalloc / cudaFree), retry after freeing its cache, or wait for every stream (a stream's pool could not serve it)
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def job_counters(device) -> dict:
    """What a job's first-time costs can be told by: the caching allocator's counters (CUDA) and the kernels
    Triton has compiled into its cache folder so far (a new folder per compiled kernel variant)."""
    out = {}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out = {k: stats.get(k, 0) for k in ALLOCATOR_COUNTERS}
    try:
        from triton import knobs

        folder = Path(knobs.cache.dir)
        out["triton_cache_entries"] = sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0
    except Exception:  # no Triton, or a layout this version does not have: the allocator's counters alone
        pass
    return out


def bench_learn_latency(llm, args, report, save) -> None:
    anchors = llm.learner.dir.parent / "anchors.json"
    for k in args.k:
        # the first job of a fresh data folder: no anchor answers yet (bench-side reset of the trainer's cache)
        llm.learner.trainer._anchors = {}
        anchors.unlink(missing_ok=True)
        name = f"bench-k{k}"
        for job_no in (1, 2):
            ex = example_of(llm.tokenizer, args.example_tokens, seed=100 * k + job_no)
            toks = ex.pop("_tokens")
            events, done = [], threading.Event()

            def on_event(e, events=events, done=done):
                events.append((time.perf_counter(), e))
                if e["state"] in ("done", "failed"):
                    done.set()

            before = job_counters(llm.engine.device)
            t0 = time.perf_counter()
            job = llm.submit_learn([ex], adapter=name, max_steps=k, min_steps=k, on_event=on_event)
            t_sub = time.perf_counter() - t0
            ok = done.wait(args.job_timeout)
            t_end = time.perf_counter() - t0
            last = events[-1][1] if events else {}
            first_run = next((t - t0 for t, e in events if e["state"] == "running"), None)
            steps_at = [round(t - t0, 3) for t, e in events if e["state"] == "running" and e.get("step")]
            rep = job.report or {}
            after = job_counters(llm.engine.device)
            fig = {"k": k, "job": job_no, "adapter": name, "example_tokens": toks, "finished": ok,
                   "state": last.get("state"), "error": job.error, "submit_return_s": round(t_sub, 3),
                   "to_running_s": round(first_run, 3) if first_run is not None else None, "step_events_s": steps_at,
                   "to_done_s": round(t_end, 3) if ok else None,
                   # submit -> the new version serves (saved and recorded before); "done" comes after the
                   # optimizer's moments leave the device and the job's row is updated
                   "to_published_s": round(job.published_at - t0, 3) if ok and job.published_at else None,
                   "version": rep.get("version"),
                   "steps": rep.get("steps"), "verified": rep.get("verified"),
                   "job_seconds": rep.get("seconds"), "train_seconds": rep.get("train_seconds"),
                   "timings": rep.get("timings"),
                   "counters": {key: after[key] - before.get(key, 0) for key in after}}
            report["learn"].append(fig)
            print(json.dumps(fig), flush=True)
            save()
            if not ok:
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen2 shapes and sizes, to check the script itself")
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--label-tokens", type=int, default=256, help="loss on the last this many tokens of each sequence")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed training steps")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=384)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--example-tokens", type=int, default=512)
    ap.add_argument("--job-timeout", type=float, default=180)
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--skip-peft-decode", action="store_true")
    ap.add_argument("--decode-rounds", type=int, default=1, help="dark decode: solo, while training, ... (solo last if > 1)")
    ap.add_argument("--parts", nargs="+", default=["train", "decode", "learn"], choices=["train", "decode", "learn"],
                    help="dark's parts to run (PEFT runs unless --skip-peft)")
    args = ap.parse_args()
    if args.tiny:
        args.seq_len, args.label_tokens, args.train_batch = min(args.seq_len, 64), min(args.label_tokens, 32), min(args.train_batch, 2)
        args.steps, args.new_tokens, args.streams = min(args.steps, 2), min(args.new_tokens, 16), min(args.streams, 2)
        args.example_tokens = min(args.example_tokens, 128)

    import transformers

    from dark import OnlineLLM

    device = torch.device(args.device)
    shape = TINY if args.tiny else QWEN25_7B
    shm = Path("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="dark-learn-bench-", dir=shm if shm.is_dir() else None))
    folder = tmp / "qwen2.5-7b-shapes"
    report = {"date": time.strftime("%Y-%m-%d"), "shape": shape, "device": str(device), "torch": torch.__version__,
              "transformers": transformers.__version__, "args": {k: str(v) for k, v in vars(args).items()},
              "train": [], "decode": [], "learn": []}
    try:
        import peft

        report["peft"] = peft.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    t_start = time.perf_counter()
    try:
        t = time.perf_counter()
        hf = build_model(shape, args.tokenizer.resolve(), folder, device)
        report["build_s"] = round(time.perf_counter() - t, 1)
        print(f"built and saved {folder} in {report['build_s']}s", flush=True)
        if not args.skip_peft:
            try:
                bench_peft(hf, args, device, report, save)
            except Exception:
                report["peft_error"] = traceback.format_exc()
                traceback.print_exc()
        del hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

        t = time.perf_counter()
        blocks = 4096 if not args.tiny else 512
        llm = OnlineLLM(str(folder), data_dir=tmp / "data", device=str(device), dtype="bfloat16", num_kv_blocks=blocks)
        report["dark_load_s"] = round(time.perf_counter() - t, 1)
        report["dark_num_kv_blocks"] = blocks
        print(f"dark loaded in {report['dark_load_s']}s", flush=True)
        clock = StepClock(llm.engine.runner)
        solo = None
        if "train" in args.parts:
            solo = bench_dark_train(llm, args, device, report, save, "dark Trainer, kl_weight=0", kl_weight=0.0)
            bench_dark_train(llm, args, device, report, save, "dark Trainer, anchor replay (default)")
        if "decode" in args.parts:
            bench_dark_decode(llm, clock, args, device, report, save, solo)
        if "learn" in args.parts:
            bench_learn_latency(llm, args, report, save)
        llm.close()
    finally:
        report["total_s"] = round(time.perf_counter() - t_start, 1)
        save()
        shutil.rmtree(tmp, ignore_errors=True)
    print_tables(report)


def print_tables(report: dict) -> None:
    print("\n| training | tok/s | ms/step | peak alloc GiB (before) |\n| --- | --- | --- | --- |")
    for r in report["train"]:
        print(f"| {r['system']} | {r['tok_s']} | {r['ms_per_step']} | {r.get('peak_alloc_gib', '')} ({r['alloc_before_gib']}) |")
    print("\n| decode | streams | solo p50 / p99 ms | training p50 / p99 ms | train tok/s solo -> during (ratio) |\n"
          "| --- | --- | --- | --- | --- |")
    for r in report["decode"]:
        s, b = r["solo"], r["while_training"]
        print(f"| {r['system']} | {r['streams']} | {s['p50_ms']} / {s['p99_ms']} | {b['p50_ms']} / {b['p99_ms']} | "
              f"{r.get('train_tok_s_just_before') or r['train_tok_s_solo']} -> {r['train_tok_s_during']} "
              f"({r['train_ratio']}) |")
    print("\n| K | job | tokens | submit s | to running s | to done s | steps | train s |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in report["learn"]:
        print(f"| {r['k']} | {r['job']} | {r['example_tokens']} | {r['submit_return_s']} | {r['to_running_s']} | "
              f"{r['to_done_s']} | {r['steps']} | {r['train_seconds']} |")


if __name__ == "__main__":
    main()
