"""Corrections of different lengths, one after another, on Qwen2.5-7B-Instruct shapes (random bf16 weights).

run_all's correction line times a second job on the same adapter; a user's corrections each have their own
length. This probe asks whether a job's time depends on having met its shapes before, and what the attention
backend of the training passes has to do with it:

1. SDPA alone, the trainer's shapes (28 query heads, 4 key/value heads, head size 128, causal; GQA): forward +
   backward of a length met for the first time and again, under each backend torch may pick (its own choice,
   cuDNN, flash, memory-efficient), a new set of lengths per backend;
2. the whole correction: a fresh server (OnlineLLM; --warm: its warm-up step on, off, or run here on the main
   thread, profiled), the process's first job, then jobs of ~512-token examples whose lengths differ a little (as
   real corrections do), interleaved between two adapters: one trained with torch's own choice of attention
   backend (dark's default), one with flash (cuDNN's attention off: torch.backends.cuda.enable_cudnn_sdp);
   --replay-check on off: an adapter per setting of LearnConfig.replay_check as well (the earlier examples checked
   without gradients and trained once they slip, or all trained in every step), to see the jobs' growth with the
   adapter's history.

    PYTHONPATH=$PWD python3 bench/probe_correction_shapes.py --tokenizer .data/tok --out $OUT/shapes.json
    ... --skip-sdpa --modes torch --replay-check on off --lengths 512 505 ... (one job per length and setting)
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN25_7B, TINY  # noqa: E402
from bench_learn_gpu import build_model, example_of  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sdpa_probe(dev, dtype, heads, kv_heads, dim, lengths_by_backend: dict) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"default": None, "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION]}
    out = {}
    for name, lengths in lengths_by_backend.items():
        rows = []
        for n in lengths:
            q = torch.randn(1, heads, n, dim, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(1, kv_heads, n, dim, device=dev, dtype=dtype, requires_grad=True)
            v = torch.randn(1, kv_heads, n, dim, device=dev, dtype=dtype, requires_grad=True)
            times = []
            for _ in range(3):
                sync(dev)
                t = time.perf_counter()
                try:
                    if backends[name] is None:
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    else:
                        with sdpa_kernel(backends[name]):
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    o.sum().backward()
                    sync(dev)
                except RuntimeError as e:
                    rows.append({"length": n, "error": str(e)[:200]})
                    break
                times.append(round((time.perf_counter() - t) * 1000, 2))
            if times:
                rows.append({"length": n, "first_ms": times[0], "again_ms": times[1:]})
        out[name] = rows
        print(json.dumps({name: rows}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--first", default="torch", choices=["torch", "flash"],
                    help="the attention backends of the process's first job: torch's choice (dark's default) or "
                         "flash (cuDNN's attention off: torch.backends.cuda.enable_cudnn_sdp)")
    ap.add_argument("--warm", default="on", choices=["on", "off", "main"],
                    help="the server's warm-up step (warm_learning): on (default on CUDA), off, or off and run by "
                         "this script on the main thread instead (profiled), to tell per-thread from per-process costs")
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--model-dir", type=Path, help="reuse (or build once into) this folder")
    ap.add_argument("--modes", nargs="+", default=["flash", "torch"], choices=["flash", "torch"])
    ap.add_argument("--replay-check", nargs="+", default=["on"], choices=["on", "off"],
                    help="LearnConfig.replay_check of the probe jobs; both: one adapter each, interleaved")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 497, 483, 470, 455, 441],
                    help="example token targets, one job per mode each")
    args = ap.parse_args()
    dev = torch.device(args.device)
    shape = TINY if args.tiny else QWEN25_7B
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))

    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // heads
    if dev.type == "cuda" and not args.skip_sdpa:
        report["sdpa"] = sdpa_probe(dev, torch.bfloat16, heads, kv, dim, {
            "default": [1011, 1203, 1407], "cudnn": [1013, 1205, 1409], "flash": [1015, 1207, 1411],
            "efficient": [1017, 1209, 1413]})
        save()

    from dark import OnlineLLM

    tmp = Path(tempfile.mkdtemp(prefix="dark-shapes-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    model = args.model_dir or tmp / "model"
    if not (model / "config.json").is_file():
        hf = build_model(shape, args.tokenizer.resolve(), model, dev)
        del hf
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    t = time.perf_counter()
    llm = OnlineLLM(str(model), data_dir=tmp / "data", device=str(dev), dtype="bfloat16", warm_learning=args.warm == "on",
                    num_kv_blocks=4096 if dev.type == "cuda" else 512, max_adapter_slots=4, max_lora_rank=16)
    report["load_s"] = round(time.perf_counter() - t, 2)
    report["warm"] = {"mode": args.warm, "learn_thread_s": llm.learner.warm_up_seconds}
    jobs = report["jobs"] = []
    try:
        if args.warm == "main":
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                first = llm.learner.warm_up()
            again = llm.learner.warm_up()
            ev = prof.key_averages()
            top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:25]
            report["warm"].update({"main_thread_first_s": round(first, 3), "main_thread_again_s": round(again, 3),
                                   "first_top_self_cpu": [{"name": e.key[:90], "count": e.count,
                                                           "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1)}
                                                          for e in top]})
        print(json.dumps(report["warm"])[:3000], flush=True)
        save()
        seed = 0
        # the process's first job (its own adapter), then the modes' jobs interleaved, one adapter per mode, so
        # both meet the same growth of replayed examples; every job a length not met before
        variants = [(m, c) for m in args.modes for c in args.replay_check]
        name = (lambda m, c: "probe-" + m + ("" if len(args.replay_check) == 1 else "-check-" + c))
        plan = [(args.first, "on", 512, "first")] + [(m, c, n - 2 * j, name(m, c)) for n in args.lengths
                                                     for j, (m, c) in enumerate(variants)]
        for mode, check, target, adapter in plan:
            if dev.type == "cuda":  # process-wide: the learn thread's SDPA calls see it
                torch.backends.cuda.enable_cudnn_sdp(mode == "torch")
            seed += 1
            ex = example_of(llm.tokenizer, target if dev.type == "cuda" else target // 8, seed=seed)
            toks = ex.pop("_tokens")
            t0 = time.perf_counter()
            job = llm.submit_learn([ex], adapter=adapter, max_steps=1, min_steps=1, replay_check=check == "on")
            rep = job.wait(180)
            fig = {"adapter": adapter, "mode": mode, "replay_check": check, "example_tokens": toks,
                   "replays": rep.get("replays"), "replays_trained": rep.get("replays_trained"),
                   "to_published_s": round(job.published_at - t0, 3) if job.published_at else None,
                   "train_steps_s": (rep.get("timings") or {}).get("train_steps"),
                   "train_setup_s": (rep.get("timings") or {}).get("train_setup")}
            jobs.append(fig)
            print(json.dumps(fig), flush=True)
            save()
        for m, c in variants:
            mine = [j["to_published_s"] for j in jobs if j["adapter"] == name(m, c)]
            report.setdefault("by_mode", {})[name(m, c)] = {"jobs": len(mine), "mean_s": round(sum(mine) / len(mine), 3),
                                                            "last5_mean_s": round(sum(mine[-5:]) / len(mine[-5:]), 3)}
        print(json.dumps(report.get("by_mode")), flush=True)
    finally:
        llm.close()
        shutil.rmtree(tmp, ignore_errors=True)  # its data folder, and the model (~15 GB in /dev/shm) unless --model-dir
    save()


if __name__ == "__main__":
    main()
