"""Where the offline benchmark's prefill steps spend their time, and the packed flash attention against the
padded masked SDPA it replaces, on the GPU (Qwen2.5-7B shapes, random bf16 weights).

For each attention form (dark.engine.attention.VARLEN_ATTENTION on, then off) in one process: the offline run of
run_all.py (256 requests, prompt and output lengths uniform in 100..1024; output tok/s, prefill and decode
seconds, the runner's steps launched ahead), then one profiled batch of 16 prompts (one output token each) whose GPU
kernels are listed by time. Each form gets prompts of its own (the engine's prefix cache would serve repeats). Last,
with the packed form: GPU kernel time against wall time per decode step of 256 sequences (bench_decode.profile_ours).

    PYTHONPATH=$PWD python bench/profile_prefill.py --tokenizer .data/tok --out /tmp/prefill.json
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import profile_ours, prompts_ids  # noqa: E402
from run_all import run_requests, warm_requests  # noqa: E402


def profiled_prefill(llm, reqs) -> dict:
    from torch.profiler import ProfilerActivity, profile

    try:  # the engine runs on its own thread
        from torch._C._profiler import _ExperimentalConfig

        kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        kw = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **kw) as prof:
        secs, _ = run_requests(llm, reqs)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_time_total > 0 and "CUDA" in str(getattr(e, "device_type", ""))]
    total = sum(e.device_time_total for e in kernels) / 1000
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:25]
    return {"wall_s": round(secs, 3), "gpu_kernel_ms": round(total, 1),
            "top_kernels_ms": [(e.key[:100], e.count, round(e.device_time_total / 1000, 2)) for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--forms", nargs="+", default=["varlen", "padded"])
    a = ap.parse_args()
    import dark.engine.attention as attention

    from profile_offline import offline_engine

    dev = torch.device("cuda")
    llm, clock, tmp = offline_engine(a.tokenizer, a.requests, "dark-prefill-", adapter_slots=4)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "forms": {}}
    try:
        runner = llm.engine.runner
        for n, form in enumerate(a.forms):
            attention.VARLEN_ATTENTION = form == "varlen"
            seed = 100_000 * (n + 1)
            rng = random.Random(0)  # the same lengths for every form
            reqs = [(prompts_ids(1, rng.randint(100, 1024), seed + i)[0], rng.randint(100, 1024), None)
                    for i in range(a.requests)]
            warm = warm_requests(a.requests, seed + 5000)
            prof_rng = random.Random(1)
            prof_reqs = [(prompts_ids(1, prof_rng.randint(100, 1024), seed + 9000 + i)[0], 1, None) for i in range(16)]
            run_requests(llm, warm)
            clock.clear()
            counts = (runner.fast_steps, runner.ahead_launched, runner.ahead_used)
            secs, produced = run_requests(llm, reqs)
            fast, launched, used = (x - y for x, y in zip((runner.fast_steps, runner.ahead_launched, runner.ahead_used), counts))
            r = {"offline_tok_s": round(produced / secs, 1), "seconds": round(secs, 2), "steps": clock.summary(),
                 "decode_steps_fast": fast, "ahead_launched": launched, "ahead_used": used}
            clock.clear()
            r["profile_16_prompts"] = profiled_prefill(llm, prof_reqs)
            r["profile_steps"] = clock.summary()
            report["forms"][form] = r
            print(form, json.dumps({k: v for k, v in r.items() if k != "profile_16_prompts"}), flush=True)
            for row in r["profile_16_prompts"]["top_kernels_ms"][:15]:
                print("   ", row, flush=True)
        attention.VARLEN_ATTENTION = True
        prof = profile_ours(llm, clock, 512, 12, dev, batch=256)
        report["decode_256"] = prof
        print("decode 256:", json.dumps({k: v for k, v in prof.items() if not k.startswith("table")}), flush=True)
        print(prof["table_by_gpu"], flush=True)
    finally:
        llm.close()
        shutil.rmtree(tmp, ignore_errors=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
