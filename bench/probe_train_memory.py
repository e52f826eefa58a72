"""Peak device memory and time of a checkpointed training step (2 x 2048 tokens) at Qwen2.5-7B widths with fewer
layers (LAYERS, default 8): the fused training kernels on and off, the once-per-pass LoRA casts on and off, the
batch in micro parts (micro_tokens 3072) or in one pass. CUDA only; prints each case and writes $OUT/mem_probe.json.

    LAYERS=8 PYTHONPATH=$PWD python3 bench/probe_train_memory.py --tokenizer .data/tok
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import QWEN25_7B  # noqa: E402
from bench_learn_gpu import build_model, dark_items, lora_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    a = ap.parse_args()
    from dark import OnlineLLM
    from dark.config import LearnConfig
    import dark.learn.trainer as trainer

    shape = dict(QWEN25_7B, num_hidden_layers=int(os.environ.get("LAYERS", "8")))
    tmp = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    build_model(shape, a.tokenizer.resolve(), tmp / "model", torch.device("cuda"))  # the HF copy is dropped here
    torch.cuda.empty_cache()
    llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cuda", dtype="bfloat16", num_kv_blocks=256,
                    max_lora_rank=16)
    tr = llm.learner.trainer
    items = dark_items(argparse.Namespace(train_batch=2, seq_len=2048, label_tokens=1024))
    out, prepared = {}, trainer.TrainLoRA.prepared
    try:
        for fused in (True, False):
            llm.model.use_fused_kernels(fused)
            for prep in (True, False):
                trainer.TrainLoRA.prepared = prepared if prep else (lambda self, dtype: self)
                for micro in (3072, -1):
                    cfg = LearnConfig(max_steps=2, min_steps=2, kl_weight=0.0, micro_tokens=micro).validate()
                    tr.train(lora_weights(llm), None, items, cfg)  # warm: kernels compiled, protector fitted
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    t = time.perf_counter()
                    r = tr.train(lora_weights(llm), None, items, cfg)
                    torch.cuda.synchronize()
                    key = f"fused={fused} prepared={prep} micro={micro}"
                    out[key] = {"peak_over_base_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3),
                                "s": round(time.perf_counter() - t, 3), "losses": r.losses}
                    print(key, out[key], flush=True)
    finally:
        trainer.TrainLoRA.prepared = prepared
        llm.model.use_fused_kernels(True)
        llm.close()
    Path(os.environ.get("OUT", "/tmp"), "mem_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
