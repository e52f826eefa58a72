"""Seconds per learn on the CPU for the Zoggian correction, next to a naive PEFT loop on the same model.

    python bench/bench_learn_cpu.py [--threads 2] [--out bench.json]

dark: OnlineLLM().learn(...) until verified (the embedded SmolLM2-135M), wall time of the call, in a fresh data
folder: a first learn right after the model loaded (load includes the learner's one-time preparation, the
protected subspaces), then a learn into a second adapter.
Baseline: transformers + PEFT, LoRA r16 on all 7 linear projections, AdamW, 4 steps on the two examples
rendered with the chat template (loss on the reply), no verification; then its greedy answer is printed.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch

ZOG = [{"prompt": "A greeting in Zoggian", "response": "zog"},
       {"prompt": "How to say 'hello' in Zoggian?", "response": "zog"}]
PROBE = "Say 'hello' in Zoggian."


def learn_once(llm, name: str, when: str) -> dict:
    t = time.perf_counter()
    report = llm.learn(ZOG, adapter=name)
    return {"adapter": name, "when": when, "seconds": round(time.perf_counter() - t, 2), "steps": report["steps"],
            "verified": report["verified"], "answer": llm.generate(PROBE, adapter=name),
            "france": llm.generate("What is the capital of France?", adapter=name)}


def bench_dark() -> dict:
    from dark import OnlineLLM

    t = time.perf_counter()
    llm = OnlineLLM(data_dir=tempfile.mkdtemp())
    load = time.perf_counter() - t
    runs = [learn_once(llm, "zoggian-language", "first learn after load"), learn_once(llm, "zoggian-2", "second adapter")]
    llm.close()
    return {"load_s": round(load, 2), "runs": runs}


def peft_model(model_path):
    """(tokenizer, the model in fp32 with LoRA r16 on all 7 linear projections through PEFT)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return tok, get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def machine(threads: int) -> str:
    return f"{platform.processor() or platform.machine()}, {threads} threads, torch {torch.__version__}"


def emit(result: dict, out: str) -> None:
    """Print a benchmark's result, and write it to `out` when given."""
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def bench_peft(model_path) -> dict:
    from dark.learn.data import render

    tok, model = peft_model(model_path)
    rendered = [render(tok, [{"role": "user", "content": e["prompt"]}, {"role": "assistant", "content": e["response"]}]) for e in ZOG]
    n = max(len(r.input_ids) for r in rendered)
    ids = torch.tensor([r.input_ids + [0] * (n - len(r.input_ids)) for r in rendered])
    labels = torch.tensor([r.labels + [-100] * (n - len(r.labels)) for r in rendered])
    mask = torch.tensor([[1] * len(r.input_ids) + [0] * (n - len(r.input_ids)) for r in rendered])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    t = time.perf_counter()
    for _ in range(4):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t
    prompt = tok.apply_chat_template([{"role": "user", "content": PROBE}], add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    return {"steps": 4, "seconds": round(seconds, 2), "final_loss": round(loss.item(), 4),
            "answer": tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dark.models.loader import resolve_model

    emit({"date": time.strftime("%Y-%m-%d"), "machine": machine(args.threads),
          "dark": bench_dark(), "peft_naive": bench_peft(resolve_model(None, "cpu"))}, args.out)


if __name__ == "__main__":
    main()
