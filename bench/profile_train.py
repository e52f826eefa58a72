"""Where a LoRA training step's time goes, at Qwen2.5-7B shapes (random bf16 weights, rank 16 on all 7
projections, 2 x 2048 packed tokens as in run_all.py's training line): the step time of several trainer settings
in one process (each setting's steps back to back), then two steps of the default under torch.profiler: GPU
kernel time against wall time (a step whose kernels take much less than its wall time waits for the host), the
host's operator calls a step, and the kernels and operators that take the most.

    PYTHONPATH=$PWD python3 bench/profile_train.py --tokenizer .data/tok --out $OUT/profile_train.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learn_gpu import dark_items, train_dark  # noqa: E402
from probe_peak_memory import engine_7b  # noqa: E402
from run_all import env_setting  # noqa: E402

# (label, LearnConfig overrides, protector bases kept on the device)
VARIANTS = [
    ("default", {}, None),
    ("without the KV loan", {"kv_loan": False}, None),
    ("projection without the CUDA graph", {}, None),  # ENVS
    ("layer inputs on the device", {"inputs_to_host_tokens": -1}, None),
    ("two parts of 2048 tokens", {"micro_tokens": 2048}, None),
    ("two parts, inputs on the device", {"micro_tokens": 2048, "inputs_to_host_tokens": -1}, None),
    ("no checkpointing", {"checkpoint_tokens": -1}, None),
    ("no protector", {"protect_energy": 0.0}, None),
    ("bases on the device", {}, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("default again", {}, None),
    ("flash attention (cuDNN's attention off)", {}, None),  # torch.backends.cuda.enable_cudnn_sdp
    ("default (torch's choice: cuDNN) once more", {}, None),
    ("logits chunks of 256 rows", {"logits_chunk": 256}, None),
    ("logits chunks of 512 rows", {"logits_chunk": 512}, None),
    ("autograd through each logits chunk", {}, None),  # ENVS
    ("layers through the reentrant checkpoint", {}, None),  # ENVS
]
ENVS = {"autograd through each logits chunk": "DARK_HEAD_DIRECT=0",  # a variant's environment setting
        "projection without the CUDA graph": "DARK_PROTECT_GRAPH=0",
        "layers through the reentrant checkpoint": "DARK_LAYER_PASS=0"}


ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def steps_of(llm, items, overrides: dict, steps: int) -> dict:
    from dark.config import LearnConfig

    cfg = LearnConfig(max_steps=steps, min_steps=steps, kl_weight=0.0, **overrides).validate()
    stamps = []
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    t = time.perf_counter()
    train_dark(llm, items, cfg, lambda step, loss: stamps.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    after = torch.cuda.memory_stats()
    # the caching allocator's trips to the driver over the job: a cudaFree (a retry after a failed allocation, or
    # a release of cached blocks) waits for the whole device, which leaves the stream waiting for the host
    return {"first_step_s": round(stamps[0] - t, 3), "step_ms": [round(1000 * g, 1) for g in gaps],
            "median_step_ms": round(1000 * statistics.median(gaps), 1),
            "allocator": {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR}}


def phases(llm, items, steps: int = 4, overrides: dict | None = None) -> dict:
    """Where a step's wall time goes without a profiler: the trainer's phases (forward, targets, loss, backward,
    clip, optimizer, protector, the step's end) each timed on the host and, through CUDA events on the stream it
    ran on, on the device, all on one clock (an event recorded at the step's start, when the device is idle after
    the last step's loss sync, fixes the offset). Per phase: host ms, device ms from its start event to its end
    event, and lag: how far the device was behind the host when the phase began (0: the device waited for the
    host, whose calls were then the step's time)."""
    from dark.config import LearnConfig
    from dark.learn import protect, trainer

    marks: list = []  # (phase, host start, host end, start event, end event)
    anchors: list = []  # (host time, event) at each step's start

    def timed(name, fn):
        def run(*args, **kwargs):
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            h0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                h1 = time.perf_counter()
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record()
                marks.append((name, h0, h1, e0, e1))
        return run

    patched = [(trainer.Trainer, "_forward"), (trainer.Trainer, "_targets"), (trainer.Trainer, "_logprob_rows"),
               (torch.Tensor, "backward"), (torch.nn.utils, "clip_grad_norm_"), (torch.optim.AdamW, "step"),
               (protect.Protector, "project_updates")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name, fn in saved:
        setattr(owner, name, timed(name, fn))

    def on_step(step, loss):
        torch.cuda.synchronize()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        anchors.append((time.perf_counter(), e))
        marks.append(("step end", anchors[-1][0], anchors[-1][0], e, e))

    cfg = LearnConfig(max_steps=steps, min_steps=steps, kl_weight=0.0, **(overrides or {})).validate()
    try:
        train_dark(llm, items, cfg, on_step)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    torch.cuda.synchronize()
    h_ref, e_ref = anchors[0]  # the device idle: the event's time is the host's
    rows = []
    for name, h0, h1, e0, e1 in marks:
        if h0 < h_ref:
            continue
        g0, g1 = h_ref + e_ref.elapsed_time(e0) / 1000, h_ref + e_ref.elapsed_time(e1) / 1000
        rows.append({"phase": name, "host_ms": round(1000 * (h1 - h0), 2), "device_ms": round(1000 * (g1 - g0), 2),
                     "lag_ms": round(1000 * (g0 - h0), 2), "t_ms": round(1000 * (h0 - h_ref), 1)})
    return {"rows": rows}


def host_syncs(llm, items, overrides: dict | None = None) -> dict:
    """One job of two steps with torch's sync debug mode on: each operation that makes the host wait for the device
    (an .item(), a copy to pageable memory, a nonzero, ...), counted by the innermost dark frame that called it."""
    import traceback
    import warnings

    from dark.config import LearnConfig

    cfg = LearnConfig(max_steps=2, min_steps=2, kl_weight=0.0, **(overrides or {})).validate()
    where: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/dark/" in f.filename or "/bench/" in f.filename]
        f = frames[-1] if frames else None
        where[f"{Path(f.filename).name}:{f.lineno} {f.name}" if f else f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_dark(llm, items, cfg, None)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return {"syncs": sum(where.values()), "by_caller": where.most_common(40)}


CATEGORIES = [  # (category, substrings of a kernel's name), first match wins
    ("copy", ("Memcpy", "Memset")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("attention", ("flash", "fmha", "cudnn", "attention")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "catarray")),
    ("reduce", ("reduce_kernel", "softmax", "cross_entropy")),
    ("triton", ("_kernel",)),  # dark's Triton kernels: _name_kernel (checked after torch's own *_kernel names)
]


def kernel_category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return cat
    return "other"


def profiled(llm, items, steps: int = 2, overrides: dict | None = None, trace: Path | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from dark.config import LearnConfig

    cfg = LearnConfig(max_steps=steps, min_steps=steps, kl_weight=0.0, **(overrides or {})).validate()
    train_dark(llm, items, LearnConfig(max_steps=1, min_steps=1, kl_weight=0.0, **(overrides or {})).validate(), None)  # warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_dark(llm, items, cfg, None)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    if trace is not None:  # the timeline, for chrome://tracing or Perfetto (gzip'd JSON)
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_time_total > 0 and "CUDA" in str(getattr(e, "device_type", ""))]
    # the CUDA runtime calls the host made (launches, copies, syncs, allocations): count and host time
    runtime = sorted((e for e in ev if e.key.startswith("cuda") and e.device_time_total == 0),
                     key=lambda e: -e.cpu_time_total)
    ops = [e for e in ev if e.key.startswith("aten::")]
    gpu = sum(e.device_time_total for e in kernels) / 1000
    by_count = collections.Counter({e.key: e.count for e in ops})
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:60]
    cats = collections.Counter()
    for e in kernels:
        cats[kernel_category(e.key)] += e.device_time_total / 1000
    return {"steps": steps + 1, "wall_ms_profiled": round(1000 * wall, 1), "gpu_kernel_ms": round(gpu, 1),
            "kernel_launches": sum(e.count for e in kernels), "aten_calls": sum(by_count.values()),
            "ms_by_category": {k: round(v, 1) for k, v in cats.most_common()},
            "top_kernels": [{"name": e.key[:100], "count": e.count, "ms": round(e.device_time_total / 1000, 2)} for e in top],
            "top_ops_by_count": by_count.most_common(30),
            "runtime_calls": [{"name": e.key, "count": e.count, "host_ms": round(e.cpu_time_total / 1000, 2)}
                              for e in runtime[:20]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, default=Path("profile_train.json"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--variants", nargs="*", help="labels of VARIANTS to run (default all)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-variants", nargs="*", default=["default"],
                    help="labels of VARIANTS (without protector bases) to profile, each in its own profile")
    ap.add_argument("--trace", type=Path, help="write the first profile's timeline here (.json.gz)")
    ap.add_argument("--syncs", action="store_true", help="count the default's host syncs (torch's sync debug mode)")
    ap.add_argument("--phases", action="store_true", help="time the default's phases on the host and the device")
    ap.add_argument("--kv-blocks", type=int, default=2048,
                    help="the engine's KV blocks (run_all.py's 33792 leave training its loan of free blocks)")
    a = ap.parse_args()
    from dark.learn import protect

    llm = engine_7b(a.tokenizer, a.kv_blocks)
    items = dark_items(argparse.Namespace(train_batch=2, seq_len=2048, label_tokens=1024))
    out: dict = {"tokens_per_step": 4096, "variants": {}}
    default_bases = protect.DEVICE_BASES
    for label, overrides, bases in VARIANTS:
        if a.variants and label not in a.variants:
            continue
        protect.DEVICE_BASES = bases if bases is not None else default_bases
        torch.backends.cuda.enable_cudnn_sdp(not label.startswith("flash"))
        llm.learner.trainer._protectors.clear()  # refitted with this placement of the bases
        torch.cuda.reset_peak_memory_stats()
        with env_setting(ENVS.get(label, "DARK_NOOP=1")):
            rec = steps_of(llm, items, overrides, a.steps)
        rec["tok_s"] = round(4096 / (rec["median_step_ms"] / 1000), 1)
        rec["peak_alloc_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["variants"][label] = rec
        print(label, json.dumps(rec), flush=True)
    protect.DEVICE_BASES = default_bases
    torch.backends.cuda.enable_cudnn_sdp(True)
    llm.learner.trainer._protectors.clear()
    if a.phases:
        out["phases"] = phases(llm, items)
        for r in out["phases"]["rows"]:
            print(json.dumps(r), flush=True)
    if a.syncs:
        out["host_syncs"] = host_syncs(llm, items)
        print("host syncs", json.dumps(out["host_syncs"], indent=1), flush=True)
    if not a.no_profile:
        settings = {label: overrides for label, overrides, _ in VARIANTS}
        for label in a.profile_variants:
            key = "profile" if label == "default" else f"profile ({label})"
            with env_setting(ENVS.get(label, "DARK_NOOP=1")):
                out[key] = profiled(llm, items, overrides=settings[label], trace=a.trace)
            a.trace = None
            print(key, json.dumps(out[key], indent=1)[:6000], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
