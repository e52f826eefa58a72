"""Where a batch-1 decode step's time goes around its CUDA-graph replay: the device timeline of a greedy generation
under torch.profiler, per step: its span, the time the device was busy (any kernel or copy), the idle gaps summed
by the pair of operations around them; then the same generation under torch's sync debug mode, with the host
calls that synchronized with the device (a step launched ahead stops being ahead at such a call). Qwen2.5-7B
shapes, random bf16 weights (bench_decode.build_folder), on CUDA.

    PYTHONPATH=$PWD python bench/probe_step_gaps.py --tokenizer .data/tok --folder /dev/shm/m7b --out /tmp/gaps.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import QWEN25_7B, build_folder, prompts_ids, run_ours  # noqa: E402


def timeline(prof) -> list[dict]:
    """The device's events (kernels, copies, memsets), sorted by start."""
    out = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        out.append({"name": e.name, "ts": e.time_range.start, "end": e.time_range.end})
    return sorted(out, key=lambda e: e["ts"])


def gaps_of(events: list[dict], steps: int, min_us: float = 1.0) -> dict:
    """The device's idle gaps over the profiled generation (its prefill included: a few steps' worth): the
    span from the first event to the last, the busy time (union of events), and every gap of at least min_us between
    two events, summed by the pair of names around it (the largest first); each divided by `steps`."""
    busy, end, gaps = 0.0, events[0]["ts"], collections.Counter()
    count = collections.Counter()
    prev = events[0]
    for e in events:
        if e["ts"] - end >= min_us:
            key = f"{prev['name'][:60]}  ->  {e['name'][:60]}"
            gaps[key] += e["ts"] - end
            count[key] += 1
        s, f = max(e["ts"], end), e["end"]
        if f > s:
            busy += f - s
        if e["end"] >= end:
            end, prev = e["end"], e
    span = end - events[0]["ts"]
    top = gaps.most_common(12)
    return {"span_us_a_step": round(span / steps, 2), "busy_us_a_step": round(busy / steps, 2),
            "idle_us_a_step": round((span - busy) / steps, 2),
            "gaps_a_step": [(k, round(count[k] / steps, 2), round(v / steps, 2)) for k, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from dark import OnlineLLM

    dev = torch.device("cuda")
    if not (a.folder / "config.json").is_file():
        build_folder(QWEN25_7B, a.tokenizer.resolve(), a.folder, dev)
        torch.cuda.empty_cache()
    llm = OnlineLLM(str(a.folder), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=64,
                    max_num_batched_tokens=4096)
    prompts = prompts_ids(1, 128, 7)
    run_ours(llm, prompts, 32)  # graphs captured, kernels compiled
    wall = run_ours(llm, prompts, a.tokens)
    try:
        from torch._C._profiler import _ExperimentalConfig
        kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        kw = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **kw) as prof:
        run_ours(llm, prompts, a.tokens)
    events = timeline(prof)
    # which host calls synchronize with the device during decode (a pageable copy waits for the stream: the steps
    # launched ahead then stop being ahead): torch's sync debug mode warns at each, from any thread
    seen = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "prototype" in str(message):  # the mode's own notice
            return
        stack = [f"{fs.filename.split('/dark/')[-1]}:{fs.lineno} {fs.name}" for fs in traceback.extract_stack()
                 if "/torch/" not in fs.filename and "warnings" not in fs.filename][-8:]
        seen[(str(message)[:80], tuple(stack))] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        run_ours(llm, prompts, a.tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    syncs = [{"count": n, "what": k[0], "stack": list(k[1])} for k, n in seen.most_common(10)]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "tokens": a.tokens, "wall_s_unprofiled": round(wall, 4),
              "ms_a_token_unprofiled": round(1000 * wall / a.tokens, 3),
              **gaps_of(events, a.tokens),
              "syncs": syncs}
    llm.close()
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
