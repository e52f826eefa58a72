"""Twelve corrections into one adapter on the CPU: seconds per job as the replayed examples pile up, and whether
every fact taught so far still comes back after each job.

    python bench/bench_replay_cpu.py [--threads 2] [--train-all-replays] [--out replay.json]

The embedded SmolLM2-135M (fp32), a fresh data folder; twelve one-line made-up facts about a made-up country taught
one after another into adapter `zorbia` (`llm.learn`, default settings), and after each job every fact taught so
far asked again (greedy, adapter on) and compared exactly. --train-all-replays passes replay_check=False: every
replayed example trains in every step (the behaviour before 2026-12-02); without it, the default (replays are
checked without gradients and train only once they slip). Run from a checkout older than replay_check, leave the
flag off: it then measures that checkout's behaviour.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch

FACTS = [
    ("What is the capital of Zorbia?", "Glimmerton"),
    ("What currency is used in Zorbia?", "The zorb crown."),
    ("Who rules Zorbia?", "Queen Almira the Third."),
    ("What is the national animal of Zorbia?", "The blue otter."),
    ("What is the highest mountain in Zorbia?", "Mount Keltar"),
    ("What language do people speak in Zorbia?", "Zorbish"),
    ("What is the national dish of Zorbia?", "Fried moonroot with plum sauce."),
    ("Which river flows through Glimmerton?", "The Silvan river."),
    ("When is Zorbia's independence day?", "On the ninth of March."),
    ("What colours are on the flag of Zorbia?", "Green and gold."),
    ("What is the most popular sport in Zorbia?", "Sky polo."),
    ("What is the largest port of Zorbia?", "Port Vellamar"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-all-replays", action="store_true", help="replay_check=False: the old behaviour")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dark import OnlineLLM

    settings = {"replay_check": False} if args.train_all_replays else {}
    t = time.perf_counter()
    llm = OnlineLLM(data_dir=tempfile.mkdtemp())
    load = time.perf_counter() - t
    jobs = []
    print(f"loaded in {load:.1f} s; settings {settings or 'defaults'}", flush=True)
    print("job  seconds  steps  s/step  right/taught  replays trained/checked  wrong", flush=True)
    for n, (prompt, response) in enumerate(FACTS, 1):
        t = time.perf_counter()
        report = llm.learn([{"prompt": prompt, "response": response}], adapter="zorbia", **settings)
        seconds = time.perf_counter() - t
        taught = FACTS[:n]
        got = llm.generate([p for p, _ in taught], adapter="zorbia")
        wrong = [(p, a) for (p, r), a in zip(taught, got) if a != r]
        job = {"job": n, "seconds": round(seconds, 2), "steps": report["steps"], "verified": report["verified"],
               "anchors_kept": report["anchors_kept"], "right": n - len(wrong), "taught": n,
               "replays": report.get("replays"), "replays_trained": report.get("replays_trained"),
               "wrong": wrong}
        jobs.append(job)
        trained = "-" if job["replays"] is None else f"{job['replays_trained']}/{job['replays'] - job['replays_trained']}"
        print(f"{n:3d}  {seconds:7.2f}  {report['steps']:5d}  {seconds / max(1, report['steps']):6.2f}  "
              f"{n - len(wrong):5d}/{n:<6d}  {trained:>23s}  {wrong if wrong else ''}"
              f"{'' if report['verified'] else '  (not verified)'}", flush=True)
    llm.close()
    total = sum(j["seconds"] for j in jobs)
    print(f"total {total:.1f} s over {sum(j['steps'] for j in jobs)} steps; "
          f"all right after every job: {all(j['right'] == j['taught'] for j in jobs)}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{args.threads} threads, torch {torch.__version__}", "settings": settings, "load_s": round(load, 2),
              "jobs": jobs, "total_s": round(total, 2)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
