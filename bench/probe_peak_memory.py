"""Where the dark phase's peak device memory comes from, at Qwen2.5-7B shapes (random bf16 weights), with the
engine set up as bench/run_all.py sets it up (34 adapter slots of rank 16, 256 sequences, 8192-token steps).

For each phase (decode at batch 1, 64 prompts over 32 adapters, a 512-token correction, a 2 x 2048 training step)
it prints the phase's peak less the KV cache, and for the learning phases which allocations are alive at the
peak, grouped by the innermost line of dark/ that made them (torch.cuda.memory history, Python frames).
CUDA only; writes $OUT/peak_memory.json (or --out).

    PYTHONPATH=$PWD python3 bench/probe_peak_memory.py --tokenizer .data/tok --out $OUT/peak_memory.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import QWEN25_7B, prompts_ids  # noqa: E402
from bench_learn_gpu import build_model, dark_items, example_of, lora_weights, train_dark  # noqa: E402
from run_all import run_requests  # noqa: E402

DEV = torch.device("cuda")


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replays an allocator trace: the most bytes alive at once (of those allocated inside it) and those blocks."""
    live, total, best, at_best = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, at_best = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return best, list(at_best.values())


def where(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "/dark/" in name:
            return f"{name.split('/dark/')[-1]}:{f.get('line')} {f.get('name')}"
    return frames[0].get("filename", "?").split("/")[-1] + ":" + str(frames[0].get("line")) if frames else "?"


def phase(name: str, fn, kv: int, out: dict, history: bool = False) -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if history:
        torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    rec = {"before_outside_kv_gib": round((before - kv) / 2**30, 3), "peak_outside_kv_gib": round((peak - kv) / 2**30, 3),
           "peak_outside_kv_gb": round((peak - kv) / 1e9, 3)}
    if history:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = [e for t in snap["device_traces"] for e in t]
        added, blocks = live_at_peak(trace)
        by = collections.Counter()
        for b in blocks:
            by[where(b.get("frames", []))] += b["size"]
        rec["added_at_peak_gib"] = round(added / 2**30, 3)
        rec["top"] = [{"where": k, "mib": round(v / 2**20, 1)} for k, v in by.most_common(25)]
    out[name] = rec
    print(name, json.dumps(rec, indent=1), flush=True)


def engine_7b(tokenizer: Path, kv_blocks: int = 2048):
    """An OnlineLLM over a random-weight model of Qwen2.5-7B's shapes (in a temporary folder), set up as
    bench/run_all.py sets it up: 34 adapter slots of rank 16, 256 sequences, 8192-token steps; kv_blocks blocks of
    16 tokens in the KV cache (run_all's 33,792 leave a training job its loan: dark.engine.loan)."""
    from dark import OnlineLLM

    tmp = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    build_model(QWEN25_7B, tokenizer.resolve(), tmp / "model", DEV)
    torch.cuda.empty_cache()
    return OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cuda", dtype="bfloat16", num_kv_blocks=kv_blocks,
                     max_num_seqs=256, max_num_batched_tokens=8192, max_adapter_slots=34, max_lora_rank=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, default=Path("peak_memory.json"))
    a = ap.parse_args()
    from dark.config import LearnConfig

    llm = engine_7b(a.tokenizer)
    cache = llm.engine.cache.data
    kv = cache.numel() * cache.element_size()
    out: dict = {"weights_gib": round(sum(p.numel() * p.element_size() for p in llm.model.parameters()) / 2**30, 3)}
    eng = llm.engine
    phase("decode_bs1", lambda: run_requests(llm, [(prompts_ids(1, 128, 1)[0], 32, None)]), kv, out)
    names = [f"m{i}" for i in range(32)]
    for i, n in enumerate(names):
        eng.adapters.publish(n, 1, lora_weights(llm, seed=100 + i))
    prompts = prompts_ids(64, 128, 21)
    phase("multi_64_over_32", lambda: run_requests(llm, [(p, 16, (names[i % 32], 1)) for i, p in enumerate(prompts)]),
          kv, out, history=True)

    def correction(seed):
        ex = example_of(llm.tokenizer, 512, seed=seed)
        ex.pop("_tokens")
        rep = llm.submit_learn([ex], adapter="probe", max_steps=1, min_steps=1).wait(120)
        out.setdefault("correction_timings", []).append(rep.get("timings"))
    correction(1)
    phase("correction", lambda: correction(2), kv, out, history=True)
    items = dark_items(argparse.Namespace(train_batch=2, seq_len=2048, label_tokens=1024))
    phase("train_2x2048", lambda: train_dark(llm, items, LearnConfig(max_steps=1, min_steps=1, kl_weight=0.0).validate(),
                                             None), kv, out, history=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
