"""A prompt that arrives while others stream, on the CPU: how long the engine step that prefills it beside their next
tokens takes, with the single-token rows attended apart from the prompt's chunk and padded with it (A/B, one process).

    python bench/bench_mixed_step_cpu.py [--threads 2] [--streams 4] [--prompt 400] [--rounds 3] [--out mixed.json]

The embedded SmolLM2-135M-Instruct (float32): --streams requests of 64 random tokens decode; once each has 8 tokens
out, a prompt of --prompt random tokens arrives and joins them in one step (its chunk and their next tokens). The
step's wall time is read from the engine's runner (bench_decode.StepClock), alternately with
dark.engine.attention.SPLIT_DECODE_ROWS on and off. The same step without the streams (the prompt alone) is the floor.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading

import torch

from bench_decode import StepClock, prompts_ids
from bench_learn_cpu import emit, machine


def one_round(llm, clock: StepClock, streams: int, prompt: int, seed: int) -> float:
    """Seconds of the step that holds the prompt's chunk (beside the streams' tokens when there are any)."""
    from dark.engine.sequence import SamplingParams

    engine = llm.engine
    out_of = [0] * streams
    ready, done = threading.Event(), threading.Event()
    left = [streams + 1]
    lock = threading.Lock()

    def on_stream(i):
        def cb(out):
            with lock:
                out_of[i] += len(out.token_ids)
                if all(n >= 8 for n in out_of):
                    ready.set()
                if out.finished:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return cb

    def on_prompt(out):
        if out.finished:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

    for i, ids in enumerate(prompts_ids(streams, 64, seed)):
        engine.add_request(ids, SamplingParams(max_tokens=40, ignore_eos=True), None, on_stream(i))
    if streams:
        assert ready.wait(120)
    clock.clear()
    engine.add_request(prompts_ids(1, prompt, seed + 99)[0], SamplingParams(max_tokens=1, ignore_eos=True), None,
                       on_prompt)
    assert done.wait(300)
    mixed = [e - s for (s, e, tok), q in zip(clock.steps, clock.seqs) if tok >= prompt]
    return mixed[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import dark.engine.attention as attention
    from dark import OnlineLLM

    llm = OnlineLLM(data_dir=tempfile.mkdtemp(), dtype="float32")
    clock = StepClock(llm.engine.runner)
    one_round(llm, clock, a.streams, a.prompt, 1)  # warm-up
    ms: dict[str, list[float]] = {"apart": [], "padded together": [], "prompt alone": []}
    for r in range(a.rounds):
        for label, split in (("apart", True), ("padded together", False)):
            attention.SPLIT_DECODE_ROWS = split
            ms[label].append(round(1000 * one_round(llm, clock, a.streams, a.prompt, 100 * r + 7 + split), 1))
        attention.SPLIT_DECODE_ROWS = True
        ms["prompt alone"].append(round(1000 * one_round(llm, clock, 0, a.prompt, 100 * r + 50), 1))
    llm.close()
    emit({"machine": machine(a.threads), "model": "SmolLM2-135M-Instruct float32", "streams": a.streams,
          "prompt_tokens": a.prompt, "step_ms": ms, "median_ms": {k: statistics.median(v) for k, v in ms.items()}},
         a.out)


if __name__ == "__main__":
    main()
