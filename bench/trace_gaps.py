"""Where a GPU stream sat idle in a torch.profiler timeline (profile_train.py --trace, profile_during.py --trace):
each gap between two kernels on the busiest stream, split into host-bound (the next kernel started as soon as the
host launched it: the GPU waited for the host) and waiting (the kernel was launched well before it started: it
waited on another stream, a copy, an event), with the host calls that ran on the launching thread during the
host-bound gaps, by name.

    python bench/trace_gaps.py trace.json.gz [--stream N] [--min-us 20]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def gaps(events: list[dict], stream: int | None = None, min_us: float = 20.0) -> dict:
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream = collections.Counter()
    for k in kernels:
        by_stream[k.get("args", {}).get("stream")] += k.get("dur", 0)
    if stream is None:
        stream = by_stream.most_common(1)[0][0]
    ks = sorted((k for k in kernels if k.get("args", {}).get("stream") == stream), key=lambda k: k["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")),
                  key=lambda e: e["ts"])
    host_ts = [e["ts"] for e in host]
    span = ks[-1]["ts"] + ks[-1].get("dur", 0) - ks[0]["ts"]
    busy = sum(k.get("dur", 0) for k in ks)
    bound = waiting = 0.0
    blame: collections.Counter = collections.Counter()
    biggest = []
    end = ks[0]["ts"] + ks[0].get("dur", 0)
    for k in ks[1:]:
        gap = k["ts"] - end
        if gap > min_us:
            launch = launches.get(k.get("args", {}).get("correlation"))
            launched = launch["ts"] + launch.get("dur", 0) if launch else k["ts"]
            host_part = max(0.0, min(gap, launched - end))  # the part of the gap before the host had launched it
            bound += host_part
            waiting += gap - host_part
            if host_part > 0 and launch:
                # the host calls of the launching thread inside the host-bound part, the innermost ones
                tid = launch["tid"]
                lo = bisect.bisect_left(host_ts, end - 5e5)
                names = collections.Counter()
                for e in host[lo:]:
                    if e["ts"] > launched:
                        break
                    if e["tid"] != tid:
                        continue
                    s, t = max(e["ts"], end), min(e["ts"] + e.get("dur", 0), launched)
                    if t > s and e.get("dur", 0) < 5e4:  # enclosing ranges (a step, a layer) left out
                        names[e["name"][:60]] += t - s
                for n, us in names.most_common(3):
                    blame[n] += us
            biggest.append((round(gap, 1), round(host_part, 1), k["name"][:60], round((k["ts"] - ks[0]["ts"]) / 1000, 2)))
        end = max(end, k["ts"] + k.get("dur", 0))
    biggest.sort(reverse=True)
    return {"stream": stream, "span_ms": round(span / 1000, 1), "busy_ms": round(busy / 1000, 1),
            "idle_ms": round((span - busy) / 1000, 1), "idle_host_bound_ms": round(bound / 1000, 1),
            "idle_waiting_ms": round(waiting / 1000, 1),
            "host_calls_in_host_bound_gaps_ms": [(n, round(us / 1000, 2)) for n, us in blame.most_common(25)],
            "largest_gaps (us, host-bound us, next kernel, at ms)": biggest[:25],
            "busy_ms_by_stream": {str(s): round(us / 1000, 1) for s, us in by_stream.most_common(6)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--stream", type=int)
    ap.add_argument("--min-us", type=float, default=20.0)
    a = ap.parse_args()
    print(json.dumps(gaps(load(a.trace), a.stream, a.min_us), indent=1))


if __name__ == "__main__":
    main()
