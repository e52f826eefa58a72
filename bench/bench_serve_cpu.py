"""Serving on the CPU (a laptop's case): dark's engine next to Hugging Face `generate` on the embedded model.

    python bench/bench_serve_cpu.py [--threads 2] [--new-tokens 128] [--dtypes float32 bfloat16] [--out serve.json]

The embedded SmolLM2-135M-Instruct in each of --dtypes (both systems in the same one), greedy, fixed output
lengths (ignore_eos / min_new_tokens), the same
prompts for both. For batch 1 and a batch of 8 prompts: output tok/s over the whole generation (prefill included).
For dark also: the p50 / p99 time between two streamed tokens of one request alone, and the same while a learn job
trains in the same process (the chat while it learns), with the job's seconds.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time

import torch

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
           "List some uses of baking soda.", "Describe the water cycle.", "What makes a good cup of tea?",
           "Tell me about the history of the printing press.", "How do bees make honey?",
           "Give advice to someone learning to cook."]


def gaps(stream) -> list[float]:
    """Seconds between successive text deltas of a stream (the first one's wait left out)."""
    out, last = [], None
    for _ in stream:
        now = time.perf_counter()
        if last is not None:
            out.append(now - last)
        last = now
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_dark(new: int, repeats: int, dtype: str) -> dict:
    from dark import OnlineLLM

    llm = OnlineLLM(data_dir=tempfile.mkdtemp(), dtype=dtype)
    args = dict(max_tokens=new, ignore_eos=True)
    llm.generate(PROMPTS[0], max_tokens=8)  # warm-up
    res = {}
    for batch in (1, 8):
        best = None
        for _ in range(repeats):
            t = time.perf_counter()
            outs = [llm.complete(p, **args) for p in PROMPTS[:1]] if batch == 1 else None
            if batch > 1:
                llm.generate(PROMPTS[:batch], **args)
                tokens = batch * new
            else:
                tokens = sum(o.completion_tokens for o in outs)
            rate = tokens / (time.perf_counter() - t)
            best = max(best or 0, rate)
        res[f"bs{batch}_tok_s"] = round(best, 1)
    solo = gaps(llm.stream(PROMPTS[1], **args))
    res["solo_gap_ms"] = {"p50": round(1000 * statistics.median(solo), 2), "p99": round(1000 * pct(solo, 0.99), 2)}
    # the same stream while a learn job trains
    job = {}

    def learn():
        t = time.perf_counter()
        r = llm.learn([{"prompt": "A greeting in Zoggian", "response": "zog"},
                       {"prompt": "How to say 'hello' in Zoggian?", "response": "zog"}], adapter="zog")
        job.update(seconds=round(time.perf_counter() - t, 2), steps=r["steps"], verified=r["verified"])

    th = threading.Thread(target=learn)
    th.start()
    time.sleep(0.5)
    during, t_during = [], time.perf_counter()
    while th.is_alive() and time.perf_counter() - t_during < 120:
        during += gaps(llm.stream(PROMPTS[1], **args))
    th.join()
    res["during_learn_gap_ms"] = {"p50": round(1000 * statistics.median(during), 2),
                                  "p99": round(1000 * pct(during, 0.99), 2), "tokens": len(during)}
    res["learn_job"] = job
    llm.close()
    return res


def bench_hf(new: int, repeats: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dark.models.loader import resolve_model

    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    res = {}
    for batch in (1, 8):
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in PROMPTS[:batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=gen["pad_token_id"])
            best = 0.0
            for _ in range(repeats):
                t = time.perf_counter()
                model.generate(**enc, **gen)
                best = max(best, batch * new / (time.perf_counter() - t))
        res[f"bs{batch}_tok_s"] = round(best, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "new_tokens": a.new_tokens}
    for dtype in a.dtypes:
        row = report[dtype] = {"dark": bench_dark(a.new_tokens, a.repeats, dtype),
                               "hf": bench_hf(a.new_tokens, a.repeats, dtype)}
        for k in ("bs1_tok_s", "bs8_tok_s"):
            row[f"ratio_{k}"] = round(row["dark"][k] / row["hf"][k], 2)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
