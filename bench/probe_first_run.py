"""Why the first offline run in a process is slower than the next: what compiles, allocates or captures in it.

Sets the engine up as profile_offline.py does (Qwen2.5-7B shapes, random bf16 weights), then runs run_all's offline
run (256 requests after the short warm-up requests) four times, each with new tokens (no run finds another's
prefixes in the cache): twice with run_all's prompt and output lengths, then twice with other lengths (a cost that
comes back with new lengths depends on the shapes of the steps). For each run: tok/s, its prefill steps' wall times, the Triton
compiles inside it (kernel, seconds on the host, whether the disk cache had it), CUDA graphs captured, and the
allocator's device allocations.

    PYTHONPATH=$PWD python3 bench/probe_first_run.py --tokenizer .data/tok --out $OUT/first_run.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from profile_offline import offline, offline_engine  # (its import puts the checkout on the path)


class CompileLog:
    """Every Triton kernel compile in the process (a miss of the in-memory cache): name, host seconds."""

    def __init__(self):
        from triton.runtime.jit import JITFunction

        self.events: list[dict] = []
        real = JITFunction._do_compile

        def logged(fn, key, signature, device, constexprs, options, attrs, warmup):
            t = time.perf_counter()
            out = real(fn, key, signature, device, constexprs, options, attrs, warmup)
            self.events.append({"t": t, "kernel": fn.fn.__name__, "s": round(time.perf_counter() - t, 4),
                                "key": str(key)[:300]})
            return out

        JITFunction._do_compile = logged

    def since(self, t0: float) -> list[dict]:
        return [dict(e, t=round(e["t"] - t0, 3)) for e in self.events if e["t"] >= t0]


class GcLog:
    """The garbage collector's passes: (generation, seconds) each."""

    def __init__(self):
        import gc

        self.passes: list[tuple[int, float]] = []
        self._t = 0.0

        def hook(phase, info):
            if phase == "start":
                self._t = time.perf_counter()
            else:
                self.passes.append((info["generation"], time.perf_counter() - self._t))

        gc.callbacks.append(hook)

    def summary(self, since: int) -> dict:
        p = self.passes[since:]
        return {f"gen{g}": {"count": sum(1 for x, _ in p if x == g), "s": round(sum(d for x, d in p if x == g), 3)}
                for g in (0, 1, 2)}


def write_and_close(report: dict, out: Path, llm, tmp: Path) -> None:
    """A probe's end, whatever happened in it: its report written, the model closed, its model folder gone."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    llm.close()
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=256)
    a = ap.parse_args()
    compiles = CompileLog()
    gcs = GcLog()
    dev = torch.device("cuda")
    llm, clock, tmp = offline_engine(a.tokenizer, a.requests, "dark-first-")
    runner = llm.engine.runner
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
              "load_compiles": len(compiles.events), "runs": []}
    try:
        for i, seed in enumerate((0, 0, 1, 1)):
            graphs, gc_from = len(runner._graphs), len(gcs.passes)
            allocs = torch.cuda.memory_stats(dev).get("num_device_alloc", 0)
            t0 = time.perf_counter()
            r = offline(llm, clock, a.requests, salt=10_000 * i, seed=seed)
            steps = [(round(1000 * (e - s), 1), tok, q) for (s, e, tok), q in zip(clock.steps, clock.seqs)]
            r.pop("buckets", None)
            r.update({"lengths_seed": seed, "compiles_incl_warmup": compiles.since(t0),
                      "measured_from_s": round(clock.steps[0][0] - t0, 3),
                      "graphs_captured": len(runner._graphs) - graphs, "gc_incl_warmup": gcs.summary(gc_from),
                      "device_allocs": torch.cuda.memory_stats(dev).get("num_device_alloc", 0) - allocs,
                      "prefill_steps_ms": [(ms, tok, q) for ms, tok, q in steps if tok != q],
                      "slowest_decode_steps_ms": sorted((x for x in steps if x[1] == x[2]), reverse=True)[:12]})
            report["runs"].append(r)
            print(json.dumps({k: r[k] for k in ("lengths_seed", "tok_s", "graphs_captured", "device_allocs",
                                                 "gc_incl_warmup")}),
                  {k: r["summary"].get(k) for k in ("prefill_s", "prefill_median_ms", "decode_s")},
                  "compiles", [(e["kernel"], e["s"], e["t"]) for e in r["compiles_incl_warmup"]],
                  "prefill", r["prefill_steps_ms"], flush=True)
    finally:
        write_and_close(report, a.out, llm, tmp)


if __name__ == "__main__":
    main()
