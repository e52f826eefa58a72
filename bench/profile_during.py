"""What happens in decode's slow steps while a training loop runs (run_all.py's decode-during-training setup:
Qwen2.5-7B shapes, random bf16 weights, 8 greedy streams, a 2 x 2048 training loop on the trainer's SMs), under
torch.profiler on every thread.

Each decode step is marked ("decode_step" on the engine's thread). For each step slower than twice the median (--slow-x), the
script lists what overlapped it: the longest host calls of each thread (a long call that holds the GIL stops the
engine's thread), the GPU kernels running on each stream, and the gap before the step's start. The timeline goes
to --trace (Perfetto / chrome://tracing).

    PYTHONPATH=$PWD python3 bench/profile_during.py --tokenizer .data/tok --out $OUT/during.json --trace $OUT/during.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import TINY, prompts_ids, run_ours  # noqa: E402
from bench_learn_gpu import Stop, build_model, dark_items, train_dark  # noqa: E402
from probe_peak_memory import engine_7b  # noqa: E402


def mark_steps(runner) -> None:
    real = runner.run

    def run(batch, **kw):
        with torch.profiler.record_function("decode_step"):
            return real(batch, **kw)
    runner.run = run


def overlapping(events: list[dict], s: float, e: float) -> list[dict]:
    return [ev for ev in events if ev["ts"] < e and ev["ts"] + ev.get("dur", 0) > s]


def analyse(trace: dict, slow_x: float = 2.0) -> dict:
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in evs if e["name"] == "decode_step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    starts = [e["ts"] for e in steps]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    if not gaps:
        return {"error": "no decode steps in the trace"}
    med = statistics.median(gaps)
    engine_tid = steps[0]["tid"]
    host = [e for e in evs if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")]
    kernels = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    slow = []
    for i, g in enumerate(gaps):
        if g <= slow_x * med:
            continue
        s, e = starts[i], starts[i + 1]
        row = {"step": i, "gap_ms": round(g / 1000, 3), "in_step_ms": round(steps[i]["dur"] / 1000, 3)}
        by_thread = {}
        for ev in overlapping(host, s, e):
            key = "engine" if ev["tid"] == engine_tid else f"thread {ev['tid']}"
            by_thread.setdefault(key, []).append(ev)
        row["longest_host_calls"] = {
            k: [{"name": ev["name"][:80], "ms": round(ev.get("dur", 0) / 1000, 3),
                 "starts_ms": round((ev["ts"] - s) / 1000, 3)}
                for ev in sorted(v, key=lambda ev: -ev.get("dur", 0))[:8]]
            for k, v in by_thread.items()}
        ks = overlapping(kernels, s, e)
        by_stream = {}
        for ev in ks:
            st = f"stream {ev.get('args', {}).get('stream', '?')}"
            lo, hi = max(ev["ts"], s), min(ev["ts"] + ev.get("dur", 0), e)
            d = by_stream.setdefault(st, {"busy_ms": 0.0, "kernels": {}})
            d["busy_ms"] += (hi - lo) / 1000
            d["kernels"][ev["name"][:70]] = d["kernels"].get(ev["name"][:70], 0) + (hi - lo) / 1000
        row["gpu"] = {st: {"busy_ms": round(d["busy_ms"], 3),
                           "top": sorted(((round(v, 3), k) for k, v in d["kernels"].items()), reverse=True)[:6]}
                      for st, d in by_stream.items()}
        slow.append(row)
    # the same for a median step, to compare against
    mid = min(range(len(gaps)), key=lambda i: abs(gaps[i] - med))
    s, e = starts[mid], starts[mid + 1]
    typical = {}
    for ev in overlapping(kernels, s, e):
        st = f"stream {ev.get('args', {}).get('stream', '?')}"
        typical[st] = typical.get(st, 0) + (min(ev["ts"] + ev.get("dur", 0), e) - max(ev["ts"], s)) / 1000
    return {"steps": len(steps), "median_gap_ms": round(med / 1000, 3),
            "p99_gap_ms": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))] / 1000, 3),
            "typical_step_gpu_busy_ms": {k: round(v, 3) for k, v in typical.items()}, "slow": slow}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, default=Path("during.json"))
    ap.add_argument("--trace", type=Path, help="the timeline (.json.gz)")
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--no-profile", action="store_true", help="the same window without the profiler (its cost)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script, not speed")
    ap.add_argument("--slow-x", type=float, default=2.0, help="a step is slow above this many times the median")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from dark import OnlineLLM
    from dark.config import LearnConfig

    if a.tiny:
        import tempfile

        tmp = Path(tempfile.mkdtemp())
        build_model(TINY, a.tokenizer.resolve(), tmp / "model", torch.device("cpu"))
        llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cpu", dtype="bfloat16")
    else:
        llm = engine_7b(a.tokenizer)
        llm.learner.set_train_sms(-1)
    cuda = llm.engine.runner.device.type == "cuda"
    mark_steps(llm.engine.runner)
    run_ours(llm, prompts_ids(8, 128, 2), 8)  # warm
    items = dark_items(argparse.Namespace(train_batch=2, seq_len=64 if a.tiny else 2048, label_tokens=32 if a.tiny else 1024))
    cfg = LearnConfig(max_steps=10**6, min_steps=10**6, kl_weight=0.0).validate()
    stop, stamps = threading.Event(), []

    def on_step(step, loss):
        stamps.append(time.perf_counter())
        if stop.is_set():
            raise Stop

    def loop():
        try:
            train_dark(llm, items, cfg, on_step)
        except Stop:
            pass
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    while len(stamps) < 4:
        time.sleep(0.01)
    kw = {}
    try:
        from torch._C._profiler import _ExperimentalConfig

        kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        pass
    t0 = time.perf_counter()
    if a.no_profile:
        run_ours(llm, prompts_ids(8, 128, 11), a.tokens)
        out = {"no_profile": True}
    else:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, **kw) as prof:
            run_ours(llm, prompts_ids(8, 128, 11), a.tokens)
            if cuda:
                torch.cuda.synchronize()
        tmp = a.out.with_suffix(".trace.json")
        prof.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
        out = analyse(trace, a.slow_x)
        if a.trace:
            with gzip.open(a.trace, "wt") as f:
                json.dump(trace, f)
        tmp.unlink()
    out["train_steps_in_window"] = sum(t >= t0 for t in stamps)
    stop.set()
    th.join(timeout=120)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1)[:12000], flush=True)
    llm.close()


if __name__ == "__main__":
    main()
