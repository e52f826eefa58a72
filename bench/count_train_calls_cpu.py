"""The host's work in a training step, counted on the CPU: a model of Qwen2's layout at tiny widths and 28 layers
(a 7B's depth), bf16, where a step's time is mostly Python and operator dispatch. For each trainer setting, two
steps and the final check of one job: Python function calls and C calls (sys.setprofile) and aten calls
(torch.profiler, nested calls included). Counts, not times: they do not move with the machine's load.

    python bench/count_train_calls_cpu.py --tokenizer .data/tok
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_learn_gpu import dark_items, train_dark  # noqa: E402
from conftest import make_tiny  # noqa: E402
from run_all import env_setting  # noqa: E402

SETTINGS = {  # label: LearnConfig overrides (a 2 x 256-token batch: micro_tokens 256 makes two parts)
    "checkpointed, two parts": {"checkpoint_tokens": 0, "micro_tokens": 256},
    "checkpointed, one part": {"checkpoint_tokens": 0, "micro_tokens": -1},
    "checkpointed, one part, reentrant": {"checkpoint_tokens": 0, "micro_tokens": -1},  # ENVS
    "not checkpointed, one part": {"checkpoint_tokens": -1, "micro_tokens": -1},
}
ENVS = {"checkpointed, one part, reentrant": "DARK_LAYER_PASS=0"}  # the layers through torch's reentrant checkpoint


def count(llm, items, overrides: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from dark.config import LearnConfig

    kw = dict(kl_weight=0.0, protect_energy=0.0, **overrides)
    train_dark(llm, items, LearnConfig(max_steps=1, min_steps=1, **kw).validate(), None)  # warm
    calls = {"python": 0, "c": 0}

    def hook(frame, event, arg):
        if event == "call":
            calls["python"] += 1
        elif event == "c_call":
            calls["c"] += 1

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sys.setprofile(hook)
        try:
            train_dark(llm, items, LearnConfig(max_steps=2, min_steps=2, **kw).validate(), None)
        finally:
            sys.setprofile(None)
    calls["aten"] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    walls = []
    for _ in range(3):  # unprofiled: the job's wall time, which on this machine is mostly the host's calls
        t = time.perf_counter()
        train_dark(llm, items, LearnConfig(max_steps=2, min_steps=2, **kw).validate(), None)
        walls.append(time.perf_counter() - t)
    calls["job_ms_median_of_3"] = round(1000 * statistics.median(walls), 1)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    a = ap.parse_args()
    from dark import OnlineLLM

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    make_tiny("qwen2", tmp / "model", a.tokenizer.resolve(), num_hidden_layers=28, tie_word_embeddings=False)
    with OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device="cpu", dtype="bfloat16") as llm:
        items = dark_items(argparse.Namespace(train_batch=2, seq_len=256, label_tokens=32))
        for label, overrides in SETTINGS.items():
            with env_setting(ENVS.get(label, "DARK_NOOP=1")):
                print(json.dumps({"setting": label, **count(llm, items, overrides)}), flush=True)


if __name__ == "__main__":
    main()
