"""The whole speed table of the GPU issue in one command, with the Hugging Face + PEFT baseline in the same run.

Random bf16 weights in the exact Qwen2.5-7B-Instruct shapes (speed does not depend on the values), LoRA rank 16 on
all 7 linear projections. Each line of the table is measured in turn; a line that fails is recorded as an error
and the others still run. At the end the run's figures go to `bench/latest.json` (the keys of the issue) and a
dated table is appended to `bench/RESULTS.md`; `--copy-to DIR` also puts both there (the device tool's $OUT).

    # on the H200 (device tool; .data is gitignored, so carry the tokenizer folder), about 4 minutes:
    PYTHONPATH=$PWD python3 bench/run_all.py --tokenizer .data/tok --copy-to $OUT
    # check the script itself on a CPU with tiny shapes (writes to a temp folder unless --results is given):
    python bench/run_all.py --tiny --device cpu --tokenizer .data/tok

Lines (dark / baseline):
  decode_bs1_tok_s          batch-1 greedy decode tok/s, no adapter / HF generate
  decode_bs1_adapter_tok_s  the same with one active LoRA adapter / HF generate on the PEFT model
  multi_adapter_ratio       64 sequences over 32 distinct adapters: median decode step time of the same 64
                            sequences without adapters over it (1.0 = adapters cost nothing)
  offline_tok_s             256 requests, prompt and output lengths uniform in 100..1024, all submitted at once:
                            output tokens / wall time / HF generate, one batch of 32 (prompt 512, 128 new tokens)
  train_tok_s               LoRA training tokens/s on packed 2k sequences (2 x 2048 per step) / PEFT, same batch
  correction_to_publish_s   one ~512-token correction, submit_learn -> version published (1 step: random
                            weights never verify), a warm adapter's second job; the first job is reported too
  decode_p99_ratio_during_training, train_ratio_during_decode
                            8 greedy streams' p99 per-token latency while a training loop runs over solo, and the
                            loop's tokens/s during decode over its own rate alone just before (2 steps)
  memory_outside_kv_gb      peak device memory of the dark phase (serving, 32 adapters, training) less the KV
                            cache / HF + PEFT peak while training, in decimal GB (10^9 bytes, the issue's unit);
                            the details hold the GiB figures and each part's own peak (part_peak_gib)
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
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_decode import (QWEN25_7B, TINY, StepClock, bench_hf, bench_ours, graph_replay_ms,  # noqa: E402
                          hf_generate, prompts_ids, random_adapter, sync)
from bench_learn_gpu import (PeftRunner, bench_dark_decode, bench_dark_train, bench_learn_latency,  # noqa: E402
                             build_model, dark_items, mem, reset_peak, train_batch, train_dark)

TARGETS = {  # key: (target, "min" = at least / "max" = at most, the anchor)
    "decode_bs1_tok_s": (260, "min"), "decode_bs1_adapter_ratio": (0.95, "min"), "multi_adapter_ratio": (0.90, "min"),
    "offline_tok_s": (12000, "min"), "train_tok_s": (14000, "min"), "correction_to_publish_s": (1.0, "max"),
    "decode_p99_ratio_during_training": (1.3, "max"), "train_ratio_during_decode": (0.70, "min"),
    "memory_outside_kv_gb": (20, "max"),
}


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def gb(n: float) -> float:
    """Decimal gigabytes (10^9 bytes): the unit of the issue's memory target and its HF + PEFT anchor."""
    return round(n / 1e9, 2)


def run_requests(llm, requests: list[tuple[list[int], int, object]], timeout: float = 900) -> tuple[float, int]:
    """Submit every (prompt ids, max_tokens, adapter) at once; wall seconds until all finish, output tokens."""
    from dark.engine.sequence import SamplingParams

    left, done, lock, errors, produced = [len(requests)], threading.Event(), threading.Lock(), [], [0]

    def on_output(out):
        if out.finished:
            with lock:
                produced[0] += out.completion_tokens
                if out.error is not None:
                    errors.append(repr(out.error))
                left[0] -= 1
                if not left[0]:
                    done.set()

    t0 = time.perf_counter()
    for ids, n, adapter in requests:
        llm.engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), adapter, on_output)
    if not done.wait(timeout):
        raise RuntimeError(f"requests did not finish in {timeout} s")
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    return time.perf_counter() - t0, produced[0]


def warm_requests(n: int, seed: int) -> list[tuple[list[int], int, None]]:
    """n short requests whose batch shrinks through every graph bucket from n down to 1 as they finish (eight end
    at each length, the last eight one by one): a measured run after them captures no decode graph."""
    lengths = [1 + i // 8 for i in range(max(n - 8, 0))]
    lengths += [lengths[-1] + 1 + j if lengths else 1 + j for j in range(n - len(lengths))]
    return [(prompts_ids(1, 32, seed + i)[0], k, None) for i, k in enumerate(lengths)]


def decode_step_ms(clock: StepClock, batch: int) -> float:
    """Median wall time between consecutive steps in which every one of `batch` sequences decoded."""
    steps = [s for s in clock.steps if s[2] == batch]
    return 1000 * statistics.median(b[1] - a[1] for a, b in zip(steps, steps[1:]))


class Run:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": self.device_name(),
                       "torch": torch.__version__, "shape": "tiny Qwen2" if args.tiny else "Qwen2.5-7B-Instruct",
                       "figures": {}, "details": {}, "errors": {}, "seconds": {}}
        self.peak_before = 0  # the largest peak of the parts run so far (Run.part resets the counter per part)

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        import platform
        return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"

    def part(self, name: str, fn, measured: bool = True) -> None:
        """measured=False: an instrument's part (a profiled job): its peak is kept in the details, not in the
        memory line (the profiler's own device buffers are not the server's). A part left out by --parts is skipped."""
        if self.args.parts and name not in self.args.parts:
            return
        t = time.perf_counter()
        print(f"--- {name}", flush=True)
        cuda = self.device.type == "cuda"
        if cuda:  # each part's own peak (the memory line takes the largest of the dark parts')
            self.peak_before = max(self.peak_before, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            fn()
        except (Exception, SystemExit):  # the shared helpers end a failed generation with SystemExit
            self.report["errors"][name] = traceback.format_exc(limit=6)
            traceback.print_exc()
        self.report["seconds"][name] = round(time.perf_counter() - t, 1)
        if cuda:
            self.report["details"].setdefault("part_peak_gib", {})[name] = gib(torch.cuda.max_memory_allocated(self.device))
            if not measured:
                torch.cuda.reset_peak_memory_stats(self.device)
        self.save()

    def fig(self, key: str, value) -> None:
        self.report["figures"][key] = value
        print(f"{key} = {value}", flush=True)

    def save(self) -> None:
        if self.args.json:
            self.args.json.parent.mkdir(parents=True, exist_ok=True)
            self.args.json.write_text(json.dumps(self.latest(), indent=1, default=str))
            (self.args.json.parent / "run_all_details.json").write_text(json.dumps(self.report, indent=1, default=str))
            # after every part: a run cut off by a time limit still leaves its figures (--json already there: no copy)
            if self.args.copy_to and self.args.copy_to.resolve() != self.args.json.parent.resolve():
                self.args.copy_to.mkdir(parents=True, exist_ok=True)
                for name in ("latest.json", "run_all_details.json"):
                    shutil.copy(self.args.json.parent / name, self.args.copy_to / name)

    def latest(self) -> dict:
        out = {"date": self.report["date"], "device": self.report["device"], "shape": self.report["shape"]}
        out.update(self.report["figures"])
        out["errors"] = sorted(self.report["errors"])
        return out


# --- Hugging Face + PEFT ---
def hf_parts(run: Run, hf) -> None:
    a, dev = run.args, run.device
    run.part("hf_decode_bs1", lambda: run.fig("hf_decode_bs1_tok_s",
                                              bench_hf(hf, 1, a.prompt_len, a.bs1_tokens, dev, seed=10)["decode_tok_s"]))

    def offline():
        prompts = prompts_ids(a.hf_offline_batch, a.hf_offline_prompt, 7)
        hf_generate(hf, prompts[:2], 4, dev)
        secs = hf_generate(hf, prompts, a.hf_offline_new, dev)
        run.fig("hf_offline_tok_s", round(a.hf_offline_batch * a.hf_offline_new / secs, 1))
        run.report["details"]["hf_offline"] = {"batch": a.hf_offline_batch, "prompt": a.hf_offline_prompt,
                                               "new_tokens": a.hf_offline_new, "seconds": round(secs, 2)}
    run.part("hf_offline", offline)

    holder = {}

    def train():
        ids, labels = train_batch(a.train_batch, a.seq_len, a.label_tokens)
        reset_peak(dev)
        runner = holder["runner"] = PeftRunner(hf, ids, labels)
        for _ in range(a.warmup):
            runner.step()
        sync(dev)
        t = time.perf_counter()
        for _ in range(a.steps):
            runner.step()
        sync(dev)
        run.fig("hf_train_tok_s", round(a.steps * a.train_batch * a.seq_len / (time.perf_counter() - t), 1))
        if dev.type == "cuda":
            run.fig("hf_peak_memory_gb", gb(torch.cuda.max_memory_allocated(dev)))
    run.part("hf_train", train)

    def adapter():
        model = holder["runner"].model if "runner" in holder else None
        if model is None:
            raise RuntimeError("no PEFT model (its training part failed)")
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.no_grad():
            run.fig("hf_decode_bs1_adapter_tok_s", bench_hf(model, 1, a.prompt_len, a.bs1_tokens, dev, seed=10)["decode_tok_s"])
    run.part("hf_decode_bs1_adapter", adapter)
    holder.clear()


# --- dark ---
@contextmanager
def env_setting(spec: str):
    """Within the block, the environment variables of spec ("NAME=VALUE", several joined by commas) have those
    values; as they were after."""
    pairs = [part.partition("=") for part in spec.split(",") if part]
    before = {key: os.environ.get(key) for key, _, _ in pairs}
    os.environ.update({key: value for key, _, value in pairs})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def dark_parts(run: Run, llm) -> None:
    a, dev = run.args, run.device
    clock = StepClock(llm.engine.runner)
    eng = llm.engine

    from dark.models.decoder import kernel_module

    lora_kernels = kernel_module("lora")
    default_fused = getattr(lora_kernels, "FUSED", None)

    def lora_variant(fused) -> None:
        # the LoRA decode kernels: one fused launch per projection, or shrink + expand; graphs captured again
        if default_fused is not None:
            lora_kernels.FUSED = fused
            eng.call_between_steps(eng.runner._drop_graphs).result()

    def bs1():
        fig = bench_ours(llm, clock, 1, a.prompt_len, a.bs1_tokens, seed=10, repeats=a.repeats)
        run.fig("decode_bs1_tok_s", fig["decode_tok_s"])
        eng.adapters.publish("one", 1, random_adapter(llm, 16, seed=1))
        fig2 = bench_ours(llm, clock, 1, a.prompt_len, a.bs1_tokens, adapter=("one", 1), seed=10, repeats=a.repeats)
        run.fig("decode_bs1_adapter_tok_s", fig2["decode_tok_s"])
        run.fig("decode_bs1_adapter_ratio", round(fig2["decode_tok_s"] / fig["decode_tok_s"], 3))
        run.report["details"]["decode_bs1"] = {"base": fig, "adapter": fig2, "lora_fused": default_fused}
        if dev.type == "cuda" and eng.runner.use_graphs:
            run.report["details"]["graph_replay_ms"] = graph_replay_ms(eng.runner)
        if a.lora_variants and default_fused is not None:
            lora_variant(not default_fused)
            other = bench_ours(llm, clock, 1, a.prompt_len, a.bs1_tokens, adapter=("one", 1), seed=10,
                               repeats=a.repeats)
            run.report["details"]["decode_bs1"]["adapter_other_lora_kernels"] = other
            run.fig("decode_bs1_adapter_ratio_other_lora_kernels", round(other["decode_tok_s"] / fig["decode_tok_s"], 3))
            lora_variant(default_fused)
    run.part("decode_bs1", bs1)

    def multi():
        names = [f"m{i}" for i in range(a.adapters)]
        for i, name in enumerate(names):
            eng.adapters.publish(name, 1, random_adapter(llm, 16, seed=100 + i))
        prompts = prompts_ids(a.multi_batch, a.prompt_len, 21)
        mixed = [(p, a.multi_tokens, (names[i % len(names)], 1)) for i, p in enumerate(prompts)]
        plain = [(p, a.multi_tokens, None) for p in prompts]
        run_requests(llm, [(p, 4, ad) for p, _, ad in mixed])  # warm-up: graphs for this bucket, adapters resident
        run_requests(llm, [(p, 4, None) for p, _, _ in plain])
        times = {}
        for label, reqs in (("none", plain), ("mixed", mixed), ("none_again", plain), ("mixed_again", mixed)):
            clock.clear()
            run_requests(llm, reqs)
            times[label] = round(decode_step_ms(clock, a.multi_batch), 3)
        base = statistics.fmean([times["none"], times["none_again"]])
        adapters = statistics.fmean([times["mixed"], times["mixed_again"]])
        run.fig("multi_adapter_ratio", round(base / adapters, 3))
        run.report["details"]["multi_adapter_step_ms"] = times

        def mixed_once_more(label: str) -> None:  # after a change of kernels: warm up (new graphs), then time
            run_requests(llm, [(p, 4, ad) for p, _, ad in mixed])
            clock.clear()
            run_requests(llm, mixed)
            times[f"mixed_{label}"] = round(decode_step_ms(clock, a.multi_batch), 3)
            run.fig(f"multi_adapter_ratio_{label}", round(base / times[f"mixed_{label}"], 3))

        for spec in a.multi_ab:  # the same batch with an environment setting changed, graphs captured anew
            try:
                with env_setting(spec):
                    eng.call_between_steps(eng.runner._drop_graphs).result()
                    mixed_once_more(spec)
            finally:
                eng.call_between_steps(eng.runner._drop_graphs).result()
        if a.lora_variants and default_fused is not None:
            lora_variant(not default_fused)
            mixed_once_more("other_lora_kernels")
            lora_variant(default_fused)
    run.part("multi_adapter", multi)

    def offline():
        rng = random.Random(0)
        lo, hi = a.offline_range
        reqs = [(prompts_ids(1, rng.randint(lo, hi), 1000 + i)[0], rng.randint(lo, hi), None) for i in range(a.offline_requests)]
        run_requests(llm, warm_requests(a.offline_requests, 5000))
        clock.clear()
        secs, produced = run_requests(llm, reqs)
        run.fig("offline_tok_s", round(produced / secs, 1))
        run.report["details"]["offline"] = {"requests": len(reqs), "output_tokens": produced,
                                            "prompt_tokens": sum(len(p) for p, _, _ in reqs), "seconds": round(secs, 2),
                                            "steps": clock.summary()}
    run.part("offline", offline)

    train_args = SimpleNamespace(train_batch=a.train_batch, seq_len=a.seq_len, label_tokens=a.label_tokens,
                                 warmup=a.warmup, steps=a.steps, streams=a.streams, prompt_len=a.prompt_len,
                                 new_tokens=a.stream_tokens, decode_rounds=1, k=[1], example_tokens=a.example_tokens,
                                 job_timeout=120)
    sub = {"train": [], "decode": [], "learn": []}
    solo = {}
    run.part("train", lambda: solo.update(rate=bench_dark_train(llm, train_args, dev, sub, run.save, "dark",
                                                                kl_weight=0.0)))
    if "rate" in solo:
        run.fig("train_tok_s", solo["rate"])
    # the same with the layers' activations kept in the job's loan of free KV blocks switched off: every layer
    # checkpointed, its projections run again in backward (dark.engine.loan)
    run.part("train_without_kv_loan", lambda: run.fig("train_tok_s_without_kv_loan", bench_dark_train(
        llm, train_args, dev, sub, run.save, "dark, without the KV loan", kl_weight=0.0, kv_loan=False)))

    def train_profile():
        # where a training step's GPU time goes: 2 steps under torch.profiler, kernels grouped by name
        from torch.profiler import ProfilerActivity, profile

        from dark.config import LearnConfig

        items, cfg = dark_items(train_args), LearnConfig(max_steps=2, min_steps=2, kl_weight=0.0).validate()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        sync(dev)
        t = time.perf_counter()
        with profile(activities=acts) as prof:
            train_dark(llm, items, cfg, None)
            sync(dev)
        wall = time.perf_counter() - t
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and "CUDA" in str(getattr(e, "device_type", ""))]
        total = sum(e.device_time_total for e in kernels) / 1000
        top = sorted(kernels, key=lambda e: -e.device_time_total)[:25]
        run.report["details"]["train_profile"] = {
            "steps": 2, "wall_ms": round(1000 * wall, 1), "gpu_kernel_ms": round(total, 1),
            "launches": sum(e.count for e in kernels),
            "top": [{"name": e.key[:90], "count": e.count, "ms": round(e.device_time_total / 1000, 2)} for e in top]}
        print(json.dumps(run.report["details"]["train_profile"])[:3000], flush=True)
    if a.profile_train:
        run.part("train_profile", train_profile)

    def during():
        # the headline figures come from the first setting of --train-sms (the engine's default first); the others
        # are in the details, one row per setting: SMs the trainer may use (a green context), 0 = all of them
        # (--split-ab: each setting again with the other DARK_SPLIT_SMS, its row named N-split or N-unsplit)
        learner, by_sms = llm.learner, {}
        default = os.environ.get("DARK_SPLIT_SMS") or "0"

        def measured() -> dict:  # decode during training once more: its ratios to solo
            bench_dark_decode(llm, clock, train_args, dev, sub, run.save, solo.get("rate"))
            d = sub["decode"][-1]
            busy = [r["gil_holds"] for r in d["runs"] if r["mode"] == "while_training"]
            first = {m: [r["first_step_ms"] for r in d["runs"] if r["mode"] == m and r.get("first_step_ms")]
                     for m in ("solo", "while_training")}
            return {"p99_ratio": round(d["while_training"]["p99_ms"] / d["solo"]["p99_ms"], 3),
                    "p50_ratio": round(d["while_training"]["p50_ms"] / d["solo"]["p50_ms"], 3),
                    "train_ratio": d["train_ratio"],
                    # the GIL out of reach during the busy runs (bench_learn_gpu.GilHolds): late wakes over 50 ms
                    "gil_holds_over_50ms": sum(h["over_50ms"] for h in busy),
                    "gil_hold_max_ms": max((h["max_ms"] for h in busy), default=0.0),
                    # the prompts' first step (the streams' first token), median over runs: solo and while training
                    "first_step_ms_solo": statistics.median(first["solo"]) if first["solo"] else None,
                    "first_step_ms_during": statistics.median(first["while_training"]) if first["while_training"] else None}

        def redo_graphs() -> None:  # graphs captured under another setting would replay its kernels
            eng.call_between_steps(eng.runner._drop_graphs).result()

        for n in a.train_sms:
            for split in (default, "1" if default == "0" else "0") if a.split_ab else (default,):
                for spec in [""] + list(a.during_ab):  # "": as set; else the same with an environment setting
                    with env_setting(f"DARK_SPLIT_SMS={split}" + ("," + spec if spec else "")):
                        if spec:
                            redo_graphs()
                        learner.set_train_sms(n)
                        key = n if split == default else f"{n}-{'split' if split == '1' else 'unsplit'}"
                        key = f"{key}-{spec}" if spec else key
                        try:
                            by_sms[key] = {**measured(), "green_context": learner._green is not None,
                                           "partition": repr(learner._green)}
                        finally:
                            if spec:
                                redo_graphs()
                    print(json.dumps({"train_sms": key, **by_sms[key]}), flush=True)
                    run.report["details"]["during_training_by_sms"] = by_sms
                    if key == a.train_sms[0]:
                        run.fig("decode_p99_ratio_during_training", by_sms[key]["p99_ratio"])
                        run.fig("train_ratio_during_decode", by_sms[key]["train_ratio"])
        learner.set_train_sms(llm.engine.config.train_sms)
    run.part("decode_during_training", during)

    def correction():
        bench_learn_latency(llm, train_args, sub, run.save)
        jobs = sub["learn"]
        warm = [j for j in jobs if j["job"] == 2 and j["to_published_s"] is not None]
        if not warm:
            raise RuntimeError(f"no second job finished: {jobs}")
        # to the moment the new version serves (it is on disk and recorded before); the job's "done" event
        # follows once the optimizer's moments are off the device
        run.fig("correction_to_publish_s", warm[0]["to_published_s"])
        run.fig("correction_to_done_s", warm[0]["to_done_s"])
        run.fig("correction_first_job_s", jobs[0]["to_published_s"])
    run.part("correction", correction)

    def correction_profile():
        # a third job on the warm adapter under torch.profiler (every thread): where a correction's time goes
        from torch.profiler import ProfilerActivity, profile

        from bench_learn_gpu import example_of

        kw = {}
        try:
            from torch._C._profiler import _ExperimentalConfig

            kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
        except (ImportError, TypeError):
            pass
        ex = example_of(llm.tokenizer, a.example_tokens, seed=999)
        ex.pop("_tokens")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        t = time.perf_counter()
        with profile(activities=acts, **kw) as prof:
            rep = llm.submit_learn([ex], adapter="bench-k1", max_steps=1, min_steps=1).wait(120)
        wall = time.perf_counter() - t
        ev = prof.key_averages()
        kernels = [e for e in ev if e.device_time_total > 0 and "CUDA" in str(getattr(e, "device_type", ""))]
        ops = sorted((e for e in ev if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:20]
        by_count = sorted((e for e in ev if e.key.startswith("aten::")), key=lambda e: -e.count)[:30]
        run.report["details"]["correction_profile"] = {
            "wall_s": round(wall, 3), "timings": rep.get("timings"),
            "gpu_kernel_ms": round(sum(e.device_time_total for e in kernels) / 1000, 1),
            "kernel_launches": sum(e.count for e in kernels), "aten_calls": sum(e.count for e in ev if e.key.startswith("aten::")),
            "top_cpu_ops": [{"name": e.key, "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1)} for e in ops],
            "top_kernels": [{"name": e.key[:80], "count": e.count, "ms": round(e.device_time_total / 1000, 2)}
                            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:12]],
            "most_called_ops": [{"name": e.key, "count": e.count, "cpu_ms": round(e.cpu_time_total / 1000, 1)}
                                for e in by_count],
            "most_launched_kernels": [{"name": e.key[:80], "count": e.count, "ms": round(e.device_time_total / 1000, 2)}
                                      for e in sorted(kernels, key=lambda e: -e.count)[:20]]}
        print(json.dumps(run.report["details"]["correction_profile"])[:8000], flush=True)
    if a.profile_correction:
        run.part("correction_profile", correction_profile, measured=False)
    run.report["details"].update(sub)


def memory(run: Run, llm) -> None:
    if run.device.type != "cuda":
        return
    cache = llm.engine.cache.data
    kv = cache.numel() * cache.element_size()
    # the largest of the dark parts' peaks (Run.part resets the counter per part) and of anything between them
    peak = max(run.peak_before, torch.cuda.max_memory_allocated(run.device))
    slots = llm.engine.adapters.slots
    def storage_bytes(tensors) -> int:  # views of one storage (fused weights, grouped factors) count once
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    # A rows kept inside extended weights (AdapterSlots.extend_weights) count as the slots', not the weights'
    ext = {w.untyped_storage().data_ptr() for w, _, _ in slots.extended.values()}
    ext_a = sum(a.numel() * a.element_size() for a in slots._ext_A.values())
    lora = storage_bytes([t for t in list(slots.A.values()) + list(slots.B.values())
                          if t.untyped_storage().data_ptr() not in ext]) + ext_a
    weights = storage_bytes(list(llm.model.parameters())) - ext_a
    run.fig("memory_outside_kv_gb", gb(peak - kv))
    run.report["details"]["memory_gib"] = {"peak": gib(peak), "kv_cache": gib(kv), "adapter_slots": gib(lora),
                                          "weights": gib(weights), **mem(run.device)}


def no_checkpoint(run: Run, llm) -> None:
    """After the memory line: the same training without layer checkpointing (checkpoint_tokens=-1), its rate and
    what it adds to device memory: the other side of the memory / speed trade."""
    a, dev = run.args, run.device
    sub = {"train": []}
    args = SimpleNamespace(train_batch=a.train_batch, seq_len=a.seq_len, label_tokens=a.label_tokens,
                           warmup=a.warmup, steps=a.steps)
    rate = bench_dark_train(llm, args, dev, sub, run.save, "dark, no checkpointing", kl_weight=0.0, checkpoint_tokens=-1)
    run.fig("train_tok_s_no_checkpoint", rate)
    run.report["details"]["train_no_checkpoint"] = sub["train"]


def met(key: str, value) -> str:
    if key not in TARGETS or value is None:
        return ""
    target, kind = TARGETS[key]
    return "yes" if (value >= target if kind == "min" else value <= target) else "no"


def table(report: dict, partial: bool = False) -> str:
    """partial (--parts): a figure a run leaves out reads "not run", not "error"."""
    f = report["figures"]
    missing = "not run" if partial else "error"
    rows = [
        ("batch-1 decode, base (tok/s)", "decode_bs1_tok_s", "hf_decode_bs1_tok_s", ">= 260"),
        ("batch-1 decode, one adapter (tok/s)", "decode_bs1_adapter_tok_s", "hf_decode_bs1_adapter_tok_s", ""),
        ("  adapter / base", "decode_bs1_adapter_ratio", None, ">= 0.95"),
        ("64 seqs, 32 adapters: step time without / with", "multi_adapter_ratio", None, ">= 0.90"),
        ("offline 256 requests (output tok/s)", "offline_tok_s", "hf_offline_tok_s", ">= 12000"),
        ("LoRA training, packed 2k (tok/s)", "train_tok_s", "hf_train_tok_s", ">= 14000"),
        ("  the same without the loan of free KV blocks: every layer recomputed (tok/s)", "train_tok_s_without_kv_loan",
         None, ""),
        ("  the same without layer checkpointing (tok/s)", "train_tok_s_no_checkpoint", None, ""),
        ("512-token correction -> published (s)", "correction_to_publish_s", None, "<= 1"),
        ("decode p99 during training / solo", "decode_p99_ratio_during_training", None, "<= 1.3"),
        ("training rate during decode / solo", "train_ratio_during_decode", None, ">= 0.70"),
        ("device memory outside the KV cache (GB)", "memory_outside_kv_gb", "hf_peak_memory_gb", "<= 20"),
    ]
    lines = ["| what | dark | HF + PEFT, same run | target | met |", "| --- | --- | --- | --- | --- |"]
    for label, key, hf_key, target in rows:
        lines.append(f"| {label} | {f.get(key, missing if key else '')} | {f.get(hf_key, '') if hf_key else ''} | "
                     f"{target} | {met(key, f.get(key))} |")
    return "\n".join(lines)


def append_results(run: Run, path: Path) -> None:
    r, a = run.report, run.args
    text = (f"\n## run_all.py, {r['date']}, {r['device']}\n\n"
            f"Command: `PYTHONPATH=$PWD python3 bench/run_all.py {' '.join(sys.argv[1:])}`; "
            f"{r['shape']} shapes, random bf16 weights, LoRA r16 on all 7 projections; torch {r['torch']}. "
            f"Seconds per part: {json.dumps(r['seconds'])}.\n\n{table(r, bool(a.parts))}\n")
    if r["errors"]:
        text += "\nParts that failed: " + ", ".join(f"{k} ({v.strip().splitlines()[-1]})" for k, v in r["errors"].items()) + "\n"
    with path.open("a") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen2 shapes and sizes: checks the script, not speed")
    ap.add_argument("--json", type=Path, help="latest.json path (default bench/latest.json; --tiny: a temp folder)")
    ap.add_argument("--results", type=Path, help="RESULTS.md to append to (default bench/RESULTS.md; --tiny: none)")
    ap.add_argument("--copy-to", type=Path, help="also copy latest.json, the details and RESULTS.md here")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile-train", action="store_true", help="also profile 2 training steps (kernels by GPU time)")
    ap.add_argument("--profile-correction", action="store_true", help="also profile a third correction job")
    ap.add_argument("--multi-ab", nargs="*", default=[], metavar="ENV=VALUE",
                    help="also time 64 sequences over 32 adapters with each of these environment settings")
    ap.add_argument("--split-ab", action="store_true",
                    help="decode during training also with the other DARK_SPLIT_SMS setting, each --train-sms")
    ap.add_argument("--parts", nargs="*", default=[],
                    help="run only these dark parts (decode_bs1 multi_adapter offline train decode_during_training "
                         "correction train_no_checkpoint; default all; no memory line then)")
    ap.add_argument("--during-ab", nargs="*", default=[], metavar="ENV=VALUE",
                    help="decode during training again with each of these environment settings, at every --train-sms "
                         "(and --split-ab) setting, its graphs captured anew (A=1,B=2 sets two at once)")
    ap.add_argument("--lora-variants", action="store_true",
                    help="also time the adapter lines with the other LoRA decode kernels (fused <-> shrink + expand)")
    sizes = {"repeats": 2, "prompt_len": 128, "bs1_tokens": 128, "adapters": 32, "multi_batch": 64, "multi_tokens": 64,
             "offline_requests": 256, "hf_offline_batch": 32, "hf_offline_prompt": 512, "hf_offline_new": 128,
             "train_batch": 2, "seq_len": 2048, "label_tokens": 1024, "warmup": 1, "steps": 4, "streams": 8,
             "stream_tokens": 192, "example_tokens": 512}
    for name, default in sizes.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    ap.add_argument("--offline-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--train-sms", type=int, nargs="+", default=[-1],
                    help="decode during training once per value: SMs the trainer may use while serving (-1: half, "
                         "the engine's default; 0: all); the first is the headline")
    args = ap.parse_args()
    shape = QWEN25_7B
    if args.tiny:
        shape = TINY
        args.bs1_tokens, args.adapters, args.multi_batch, args.multi_tokens = 16, 4, 8, 8
        args.offline_requests, args.offline_range = 12, [8, 24]
        args.hf_offline_batch, args.hf_offline_prompt, args.hf_offline_new = 4, 16, 8
        args.train_batch, args.seq_len, args.label_tokens, args.steps = 1, 64, 32, 2
        args.streams, args.stream_tokens, args.example_tokens, args.repeats = 2, 12, 96, 1
    tmp = Path(tempfile.mkdtemp(prefix="dark-run-all-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    if args.json is None:
        args.json = tmp / "latest.json" if args.tiny else HERE / "latest.json"
    if args.results is None and not args.tiny:
        args.results = HERE / "RESULTS.md"
    run = Run(args)
    t_start = time.perf_counter()
    try:
        from dark import OnlineLLM

        folder = tmp / "model"
        t = time.perf_counter()
        hf = build_model(shape, args.tokenizer.resolve(), folder, run.device)
        run.report["seconds"]["build"] = round(time.perf_counter() - t, 1)
        if not args.skip_hf:
            hf_parts(run, hf)
        del hf
        gc.collect()
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(run.device)
            run.peak_before = 0  # the HF parts' peaks are not the dark phase's
        t = time.perf_counter()
        lo, hi = args.offline_range
        blocks = (args.offline_requests * 2 * hi) // 16 + 1024 if run.device.type == "cuda" else 2048
        llm = OnlineLLM(str(folder), data_dir=tmp / "data", device=str(run.device), dtype="bfloat16",
                        num_kv_blocks=blocks, max_num_seqs=max(args.offline_requests, args.multi_batch),
                        max_num_batched_tokens=8192, max_adapter_slots=args.adapters + 2, max_lora_rank=16)
        run.report["seconds"]["dark_load"] = round(time.perf_counter() - t, 1)
        try:
            dark_parts(run, llm)
            if not args.parts:
                memory(run, llm)
            run.part("train_no_checkpoint", lambda: no_checkpoint(run, llm))
        finally:
            llm.close()
    except Exception:
        run.report["errors"]["setup"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        run.report["seconds"]["total"] = round(time.perf_counter() - t_start, 1)
        run.save()
        if args.results:
            append_results(run, args.results)
        shutil.rmtree(tmp / "model", ignore_errors=True)
        if args.copy_to:
            args.copy_to.mkdir(parents=True, exist_ok=True)
            for p in (args.results,):
                if p and p.exists():
                    shutil.copy(p, args.copy_to / p.name)
    print(table(run.report, bool(args.parts)))


if __name__ == "__main__":
    main()
