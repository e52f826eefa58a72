"""What the first requests after a server starts pay that later ones do not: Triton compiles and CUDA graph captures.

Loads a Qwen2.5-7B-shaped model of random bf16 weights with the engine's default settings (what `python
websocket_server.py` gets on a GPU), then runs, one after the other: a request alone, another like it, four at once,
the first request on a published adapter, another on it, and one on the adapter's next version published by a real
correction. For each: time to the first token, the decode rate after it, and the Triton compiles (`JITFunction.
_do_compile`: kernel, host seconds) and CUDA graphs captured while it ran. Run it in a fresh process with an empty
Triton cache (`TRITON_CACHE_DIR`: a fresh machine or container) and again with the cache the first run filled (a
restart on the same machine).

    PYTHONPATH=$PWD python3 bench/probe_first_request.py --tokenizer .data/tok --out $OUT/first_request.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import QWEN25_7B, StepClock, build_folder, prompts_ids, random_adapter  # noqa: E402
from bench_learn_gpu import GcPauses  # noqa: E402
from probe_first_run import CompileLog, write_and_close  # noqa: E402


def timed_requests(llm, prompts: list[list[int]], new_tokens: int, adapter=None) -> dict:
    """Submit the prompts at once; per request: ms to its first token, ms a token after it, wall ms."""
    from dark.engine.sequence import SamplingParams

    firsts, ends, counts = {}, {}, {}
    done = threading.Event()
    lock = threading.Lock()

    def on_output(out):
        now = time.perf_counter()
        with lock:
            if out.token_ids and out.request_id not in firsts:
                firsts[out.request_id] = now
            if out.finished:
                ends[out.request_id] = now
                counts[out.request_id] = out.completion_tokens
                if out.error is not None:
                    print("request failed:", out.error, flush=True)
                if len(ends) == len(prompts):
                    done.set()

    t0 = time.perf_counter()
    for ids in prompts:
        llm.engine.add_request(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True), adapter, on_output)
    done.wait(600)
    ttft = [1000 * (firsts[r] - t0) for r in firsts]
    per_token = [1000 * (ends[r] - firsts[r]) / max(1, counts[r] - 1) for r in firsts]
    return {"requests": len(prompts), "ttft_ms": round(max(ttft), 1), "ms_per_token": round(statistics.fmean(per_token), 3),
            "wall_ms": round(1000 * (max(ends.values()) - t0), 1)}


def gaps_while_loading(llm, key, prompt_len: int, seed: int) -> dict:
    """Four streams decoding; once each has 8 tokens, a request on `key` (a version in no slot) arrives. The engine's
    longest interval between step starts from then until that request's first token (StepClock: a stall of the engine
    thread stalls every stream), against the median interval before."""
    from dark.engine.sequence import SamplingParams

    clock = StepClock(llm.engine.runner)
    counts: dict[int, int] = {}
    lock, done, got = threading.Lock(), threading.Event(), threading.Event()
    ids = prompts_ids(5, prompt_len, seed)
    streams = []

    def on_output(out):
        with lock:
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.token_ids)
            if out.finished:
                streams.append(out.request_id)
                if len(streams) == 4:
                    done.set()

    def on_new(out):
        if out.token_ids:
            got.set()

    try:
        rids = [llm.engine.add_request(p, SamplingParams(max_tokens=160, ignore_eos=True), None, on_output)
                for p in ids[:4]]
        while not all(counts.get(r, 0) >= 8 for r in rids):
            time.sleep(0.002)
        t_add = time.perf_counter()
        llm.engine.add_request(ids[4], SamplingParams(max_tokens=4, ignore_eos=True), key, on_new)
        got.wait(60)
        t_first = time.perf_counter()
        done.wait(120)
    finally:
        llm.engine.runner.run = clock.real_run
    starts = [s for s, _, _ in clock.steps]
    pairs = list(zip(starts, starts[1:]))
    before = [1000 * (b - a) for a, b in pairs if b <= t_add]
    during = [1000 * (b - a) for a, b in pairs if b > t_add and a < t_first]
    return {"new_request_ttft_ms": round(1000 * (t_first - t_add), 1),
            "median_step_interval_before_ms": round(statistics.median(before), 2),
            "max_step_interval_during_ms": round(max(during, default=0.0), 2), "steps_during": len(during)}


def slot_load(llm, key) -> dict:
    """What loading a published version into a slot costs, in phases: the version from the registry, its factors
    packed on the host (one buffer per dtype), that buffer's copy to the device, then the whole of acquire()
    (which does all of it again, plus the copies into the slot)."""
    mgr = llm.engine.adapters
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    w = mgr._get(*key)
    t1 = time.perf_counter()
    host = [t.reshape(-1) for k in mgr.slots.A if k in w.tensors for t in w.tensors[k]]
    flats = [torch.cat([t for t in host if t.dtype == d]) for d in {t.dtype for t in host}]
    t2 = time.perf_counter()
    for f in flats:
        f.to("cuda")
    torch.cuda.synchronize()
    llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", False)).result(30)  # load here, now
    t3 = time.perf_counter()
    slot = mgr.acquire(key)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    mgr.release(slot)
    llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", True)).result(30)
    # the same version staged from device factors (what a learn job hands over), then loaded into a free slot
    dev = {k: (a.cuda(), b.cuda()) for k, (a, b) in w.tensors.items()}
    staged = mgr.slots.stage(dev, w.scaling)
    free = next(s for s in range(mgr.slots.num_slots) if s not in mgr._slot_of.values())
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    mgr.slots.load(free, w, staged)
    torch.cuda.synchronize()
    t6 = time.perf_counter()
    mgr.slots.rank[free] = 0
    return {"staged_load_ms": round(1000 * (t6 - t5), 2), "get_ms": round(1000 * (t1 - t0), 2),
            "pack_ms": round(1000 * (t2 - t1), 2),
            "h2d_ms": round(1000 * (t3 - t2), 2), "acquire_ms": round(1000 * (t4 - t3), 2),
            "mb": round(sum(f.numel() * f.element_size() for f in flats) / 2**20, 1),
            "dtypes": sorted(str(t.dtype) for t in flats), "pinned": bool(host[0].is_pinned())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--label", default="")
    ap.add_argument("--settings", default="{}", help="JSON of extra OnlineLLM settings (e.g. '{\"warm_serving\": false}')")
    a = ap.parse_args()
    compiles = CompileLog()
    from dark import OnlineLLM

    tmp = Path(tempfile.mkdtemp(prefix="dark-first-req-", dir="/dev/shm"))
    build_folder(QWEN25_7B, a.tokenizer.resolve(), tmp / "model", torch.device("cuda"))
    torch.cuda.empty_cache()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "label": a.label, "settings": json.loads(a.settings), "steps": []}
    t = time.perf_counter()
    n0 = len(compiles.events)
    llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cuda", **json.loads(a.settings))
    report["load"] = {"s": round(time.perf_counter() - t, 2), "compiles": len(compiles.events) - n0,
                      "compile_s": round(sum(e["s"] for e in compiles.events[n0:]), 2),
                      "graphs": len(llm.engine.runner._graphs), "warm_serving_s": llm.warm_serving_seconds,
                      "warm_learning_s": llm.learner.warm_up_seconds}
    print("load", json.dumps(report["load"]), flush=True)
    runner = llm.engine.runner
    seed = iter(range(1000))

    gcp = GcPauses()

    def step(name, fn):
        n, g = len(compiles.events), len(runner._graphs)
        gcp.take()
        fig = fn()
        fig["gc"] = gcp.take()
        got = compiles.events[n:]
        fig.update({"name": name, "compiles": len(got), "compile_s": round(sum(e["s"] for e in got), 2),
                    "kernels": sorted({e["kernel"] for e in got}), "graphs_captured": len(runner._graphs) - g})
        report["steps"].append(fig)
        print(json.dumps(fig), flush=True)

    def alone(adapter=None):
        return lambda: timed_requests(llm, prompts_ids(1, a.prompt_len, next(seed)), a.new_tokens, adapter)

    try:
        step("the first request", alone())
        step("a second one", alone())
        step("four at once", lambda: timed_requests(llm, prompts_ids(4, a.prompt_len, next(seed)), a.new_tokens))
        step("four at once again", lambda: timed_requests(llm, prompts_ids(4, a.prompt_len, next(seed)), a.new_tokens))
        llm.engine.adapters.publish("skill", 1, random_adapter(llm, 16, seed=1))
        step("the first request on an adapter", alone(("skill", 1)))
        step("a second one on it", alone(("skill", 1)))
        t0 = time.perf_counter()
        rep = llm.submit_learn([{"prompt": "A greeting in Zoggian", "response": "zog"}], adapter="zog",
                               max_steps=1, min_steps=1).wait(300)
        report["correction_s"] = round(time.perf_counter() - t0, 3)
        version = rep.get("version")
        print("correction", report["correction_s"], "s; version", version, flush=True)
        if version is not None:
            step("the first request on a corrected skill", alone(("zog", version)))
            mgr = llm.engine.adapters
            weights = mgr._get("zog", version)
            # the same version under other names: one served after 2 s idle (no learn job's tail running), one
            # loaded (and timed) before its first request
            mgr.publish("zog-idle", 1, weights)
            time.sleep(2)
            step("the first request on a new version, 2 s after it was published", alone(("zog-idle", 1)))
            mgr.publish("zog-loaded", 1, weights)
            time.sleep(1)
            report["slot_load"] = slot_load(llm, ("zog-loaded", 1))
            print("slot load", json.dumps(report["slot_load"]), flush=True)
            step("the first request on a new version already in a slot", alone(("zog-loaded", 1)))
            # a version coming from host memory while four other streams decode: on the loader thread (the
            # default on CUDA), then on the engine thread as before
            for background in (True, False):
                llm.engine.call_between_steps(lambda b=background: setattr(mgr, "background_loads", b)).result(30)
                name = f"zog-stall-{int(background)}"
                mgr.publish(name, 1, weights)
                fig = gaps_while_loading(llm, (name, 1), a.prompt_len, next(seed))
                report[f"streams_while_loading_{'background' if background else 'engine_thread'}"] = fig
                print("streams while a version loads, background" if background else "... on the engine thread",
                      json.dumps(fig), flush=True)
                mgr.remove(name)
            llm.engine.call_between_steps(lambda: setattr(mgr, "background_loads", True)).result(30)
            rep = llm.submit_learn([{"prompt": "A farewell in Zoggian", "response": "zeg"}], adapter="zog",
                                   max_steps=1, min_steps=1).wait(300)
            time.sleep(2)  # the job's tail (moments to disk) done
            if rep.get("version") is not None:
                step("the first request on a corrected skill, 2 s after", alone(("zog", rep["version"])))
    finally:
        write_and_close(report, a.out, llm, tmp)


if __name__ == "__main__":
    main()
