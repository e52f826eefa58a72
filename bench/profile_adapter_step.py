"""Where a batch-1 decode step with one adapter spends the time the base step does not (Qwen2.5-7B shapes, random
bf16 weights, LoRA rank 16 on all 7 projections), kernel by kernel.

The engine captures its batch-1 step as a CUDA graph with and without the adapter; this script replays each graph
back to back (no host work at all) and, under the profiler, reads every kernel's start and end. A kernel's
*increment* is how far it moves the end of the step: its end minus the latest end of the kernels before it. Under
programmatic dependent launch kernels overlap, so their own durations overlap too, but the increments add up to
the step. Kernels are labelled by name and grid (the GEMVs share a name; their grids tell q/k/v, o, gate/up and
down apart), and each label's increments are summed over the step, for the base graph and the adapter's, side by
side. `--variants` replays the same with DARK_PDL=0 as well (graphs captured anew: each kernel's own time).

    PYTHONPATH=$PWD python bench/profile_adapter_step.py --tokenizer .data/tok --out /tmp/adapter_step.json
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN25_7B, build_folder, prompts_ids, random_adapter, replay_ms  # noqa: E402
from run_all import env_setting  # noqa: E402


def kernels_of(prof_json: Path) -> list[dict]:
    """The trace's GPU kernels, in start order: name, grid, start and end (us)."""
    trace = json.loads(prof_json.read_text())
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        grid = e.get("args", {}).get("grid", [0, 0, 0])
        out.append({"name": e["name"], "grid": "x".join(str(g) for g in grid), "ts": float(e["ts"]),
                    "end": float(e["ts"]) + float(e["dur"]), "dur": float(e["dur"])})
    return sorted(out, key=lambda k: k["ts"])


def timeline(graph, reps: int, tmp: Path) -> dict:
    """Replay `graph` reps times under the profiler; per label: kernels a step, summed increment and own time
    (us a step), from the middle replays (the first and last are left out)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    path = tmp / "trace.json"
    prof.export_chrome_trace(str(path))
    ks = kernels_of(path)
    per = len(ks) // reps
    middle = ks[per:per * (reps - 1)]
    steps = reps - 2
    inc = collections.defaultdict(float)
    own = collections.defaultdict(float)
    count = collections.Counter()
    last_end = ks[per - 1]["end"] if per else 0.0
    order = []
    for k in middle:
        label = f"{k['name'][:60]} [{k['grid']}]"
        step_inc = max(0.0, k["end"] - last_end)
        last_end = max(last_end, k["end"])
        inc[label] += step_inc
        own[label] += k["dur"]
        count[label] += 1
        if len(order) < per:
            order.append((label, round(step_inc, 2), round(k["dur"], 2)))
    span = (middle[-1]["end"] - ks[per - 1]["end"]) / steps if middle else 0.0
    labels = sorted(inc, key=lambda x: -inc[x])
    return {"kernels_per_step": per, "step_us": round(span, 1),
            "by_label": [{"label": x, "a_step": round(count[x] / steps, 2), "increment_us": round(inc[x] / steps, 1),
                          "own_us": round(own[x] / steps, 1)} for x in labels],
            "first_step_order": order}


def graphs_for(llm):
    """(base graph, adapter graph) of batch 1, captured by serving one request each way."""
    from dark.engine.sequence import SamplingParams

    runner = llm.engine.runner
    for ref in (None, ("a0", 1)):
        done = threading.Event()
        llm.engine.add_request(prompts_ids(1, 128, 5)[0], SamplingParams(max_tokens=24, ignore_eos=True), ref,
                               lambda out: out.finished and done.set())
        assert done.wait(300), "a request did not finish"
    base = [g for key, (g, _) in runner._graphs.items() if key[0] == 1 and not key[1]]
    lora = [g for key, (g, _) in runner._graphs.items() if key[0] == 1 and key[1]]
    assert base and lora, f"no batch-1 graphs captured: {list(runner._graphs)}"
    return base[-1], lora[-1]


def compare(llm, tmp: Path, reps: int) -> dict:
    base, lora = graphs_for(llm)
    r = {"base_ms": replay_ms(base, 100), "adapter_ms": replay_ms(lora, 100)}
    r["ratio"] = round(r["base_ms"] / r["adapter_ms"], 3)
    r["base"], r["adapter"] = timeline(base, reps, tmp), timeline(lora, reps, tmp)
    b = {x["label"]: x for x in r["base"]["by_label"]}
    diff = []
    for x in r["adapter"]["by_label"]:
        y = b.get(x["label"], {"increment_us": 0.0, "own_us": 0.0, "a_step": 0})
        diff.append({"label": x["label"], "a_step": x["a_step"], "base_a_step": y["a_step"],
                     "increment_us": x["increment_us"], "base_increment_us": y["increment_us"],
                     "delta_us": round(x["increment_us"] - y["increment_us"], 1),
                     "own_us": x["own_us"], "base_own_us": y["own_us"]})
    r["delta"] = sorted(diff, key=lambda d: -abs(d["delta_us"]))
    print(json.dumps({k: r[k] for k in ("base_ms", "adapter_ms", "ratio")}), flush=True)
    for d in r["delta"][:16]:
        print("  %-72s %5.1f/%5.1f  inc %8.1f vs %8.1f (%+.1f)  own %8.1f vs %8.1f" % (
            d["label"], d["a_step"], d["base_a_step"], d["increment_us"], d["base_increment_us"], d["delta_us"],
            d["own_us"], d["base_own_us"]), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--variants", nargs="*", default=[],
                    help="NAME=SETTING=VALUE[,SETTING=VALUE]: also compare with these settings (graphs captured anew); a "
                         "setting is an environment variable, or module.ATTR for a knob of dark.kernels.<module>")
    a = ap.parse_args()
    from dark import OnlineLLM
    from dark.models.decoder import kernel_module

    dev = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    tmp = Path(tempfile.mkdtemp(prefix="dark-adapter-step-", dir="/dev/shm"))
    try:
        build_folder(QWEN25_7B, a.tokenizer.resolve(), tmp / "model", dev)
        llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cuda", dtype="bfloat16",
                        num_kv_blocks=2048, max_num_seqs=8, max_adapter_slots=4, max_lora_rank=16)
        try:
            llm.engine.adapters.publish("a0", 1, random_adapter(llm, 16, seed=100))
            report["default"] = compare(llm, tmp, a.reps)
            for spec in a.variants:
                name, _, settings = spec.partition("=")
                pairs = [s.split("=", 1) for s in settings.split(",") if s]
                # module.ATTR=value sets a knob of dark.kernels.<module>; anything else is an environment variable
                knobs = [(kernel_module(k.split(".")[0]), k.split(".")[1], ast.literal_eval(v)) for k, v in pairs if "." in k]
                envs = ",".join(f"{k}={v}" for k, v in pairs if "." not in k)
                old_knobs = [(m, attr, getattr(m, attr)) for m, attr, _ in knobs]
                for m, attr, v in knobs:
                    setattr(m, attr, v)
                print("variant", name, flush=True)
                try:
                    with env_setting(envs):
                        llm.engine.runner.set_fast(True)
                        report[name] = compare(llm, tmp, a.reps)
                finally:
                    for m, attr, v in old_knobs:
                        setattr(m, attr, v)
                    llm.engine.runner.set_fast(True)
        finally:
            llm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
