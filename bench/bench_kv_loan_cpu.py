"""A long correction's training steps on the CPU with and without the KV loan, next to PEFT on the same example.

    python bench/bench_kv_loan_cpu.py [--threads 2] [--reply-words 420] [--steps 3] [--rounds 2] [--out f.json]

dark: the embedded SmolLM2-135M (fp32), one example whose reply is long enough that its pass (~600 tokens) is
checkpointed (LearnConfig.checkpoint_tokens, 384), trained `steps` steps by Trainer.train with kv_loan off and on,
in alternating rounds (ms a step: the median over the steps after the first, all rounds pooled); the job's loan and
the two settings' final weights (equal up to fp32 rounding) are reported. Baseline: transformers + PEFT, LoRA r16 on
all 7 linear projections, AdamW, the same rendered example, `steps` steps (ms a step after the first).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learn_cpu import emit, machine, peft_model  # noqa: E402

WORDS = ("the river bends north past the old mill where the miller keeps a ledger of every sack of grain and every "
         "visitor who asks for the road to the coast").split()


def example(words: int) -> dict:
    reply = " ".join(WORDS[i % len(WORDS)] for i in range(words)) + "."
    return {"prompt": "Tell me the long story of the mill, exactly as you told it yesterday.", "response": reply}


def bench_dark(ex: dict, steps: int, rounds: int) -> dict:
    from dark import OnlineLLM
    from dark.config import LearnConfig, LoraConfig
    from dark.learn.data import normalize_examples
    from dark.lora.weights import AdapterWeights

    llm = OnlineLLM(data_dir=tempfile.mkdtemp())
    try:
        tr, mc = llm.learner.trainer, llm.model.config
        start = AdapterWeights.init(LoraConfig().validate(), mc.projection_shapes(), mc.num_layers)
        per = {False: [], True: []}
        last, loans, tokens = {}, [], 0
        for _ in range(rounds):
            for loan in (False, True):
                cfg = LearnConfig(max_steps=steps, min_steps=steps, kl_weight=0.0, kv_loan=loan).validate()
                items = [i for i in tr.build_items(normalize_examples([ex], "sft"), [], "sft", cfg) if i.kind == "sft"][:1]
                tokens = len(items[0].rendered.input_ids)
                stamps = [time.perf_counter()]
                result = tr.train(start, None, items, cfg, lambda step, loss: stamps.append(time.perf_counter()))
                per[loan] += [b - a for a, b in zip(stamps[1:], stamps[2:])]
                last[loan] = result.weights
                if loan:
                    loans.append(result.kv_loan)
        num = sum(float((u - v).square().sum()) for k in start.tensors
                  for u, v in zip(last[True].tensors[k], last[False].tensors[k]))
        den = sum(float((v - s).square().sum()) for k in start.tensors
                  for v, s in zip(last[False].tensors[k], start.tensors[k]))
        return {"tokens": tokens, "ms_per_step_without_loan": round(1000 * statistics.median(per[False]), 1),
                "ms_per_step_with_loan": round(1000 * statistics.median(per[True]), 1),
                "steps_timed": {str(k): len(v) for k, v in per.items()}, "loan": loans[-1],
                "weights_relative_distance": (num / den) ** 0.5}
    finally:
        llm.close()


def bench_peft(model_path, ex: dict, steps: int) -> dict:
    from dark.learn.data import render

    tok, model = peft_model(model_path)
    r = render(tok, [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["response"]}])
    ids, labels = torch.tensor([r.input_ids]), torch.tensor([r.labels])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return {"tokens": len(r.input_ids), "ms_per_step": round(1000 * statistics.median(times[1:] or times), 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reply-words", type=int, default=420)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dark.models.loader import resolve_model

    ex = example(args.reply_words)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(args.threads),
              "dark": bench_dark(ex, args.steps, args.rounds),
              "peft": bench_peft(resolve_model(None, "cpu"), ex, args.steps)}
    d = result["dark"]
    result["ratios"] = {"loan_speedup": round(d["ms_per_step_without_loan"] / d["ms_per_step_with_loan"], 3),
                        "peft_over_dark_with_loan": round(result["peft"]["ms_per_step"] / d["ms_per_step_with_loan"], 3)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
