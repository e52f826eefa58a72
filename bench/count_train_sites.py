"""Where the host's work in a training step comes from: every torch call made from Python during two steps and
the final check of one job (a torch function mode sees each call, nested ones too), counted by the line of dark/
that made it, beside the step's aten calls (torch.profiler, backward included). A model of Qwen2's layout at tiny
widths and 28 layers (a 7B's depth), so the counts are a 7B step's and the run takes seconds; on CUDA the fused
kernels' path, on the CPU the plain one.

    PYTHONPATH=$PWD python bench/count_train_sites.py --tokenizer .data/tok [--device cuda] [--out sites.json]
        [--cprofile 40]   (the job's own time by Python function: where the host's time goes)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_learn_gpu import dark_items, train_dark  # noqa: E402
from conftest import make_tiny  # noqa: E402

ROOT = str(Path(__file__).resolve().parent.parent / "dark") + "/"


def site_of(frame) -> str:
    """The innermost frame of dark/ on the stack, as path:line function."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn.startswith(ROOT):
            return f"dark/{fn[len(ROOT):]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also time the same job under cProfile and list the N functions with the most own time")
    ap.add_argument("--repeat", type=int, default=3, help="jobs timed without any profiler (median wall ms)")
    ap.add_argument("--walls-only", action="store_true", help="only the timed jobs: no counting, no profiler")
    ap.add_argument("--no-cudnn-attention", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)")
    a = ap.parse_args()
    from torch.overrides import TorchFunctionMode
    from torch.profiler import ProfilerActivity, profile

    from dark import OnlineLLM
    from dark.config import LearnConfig

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    make_tiny("qwen2", tmp / "model", a.tokenizer.resolve(), num_hidden_layers=28, tie_word_embeddings=False)
    sites, calls = collections.Counter(), collections.Counter()

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            site = site_of(sys._getframe(1))
            sites[site] += 1
            calls[(site, getattr(func, "__name__", str(func)))] += 1
            return func(*args, **(kwargs or {}))

    report = {}
    with OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device=a.device, dtype="bfloat16") as llm:
        items = dark_items(argparse.Namespace(train_batch=2, seq_len=a.seq_len, label_tokens=32))
        # checkpointed as a 7B step of 2 x 2048 is (checkpoint_tokens 0: whatever the length), one part
        kw = dict(checkpoint_tokens=0, micro_tokens=-1)
        if a.no_cudnn_attention:
            torch.backends.cuda.enable_cudnn_sdp(False)
        train_dark(llm, items, LearnConfig(max_steps=1, min_steps=1, **kw).validate(), None)  # warm
        two_steps = LearnConfig(max_steps=2, min_steps=2, **kw).validate()

        def job():
            train_dark(llm, items, two_steps, None)
        aten = collections.Counter()
        if not a.walls_only:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                job()
            aten.update({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})
            with Count():
                job()
        walls = []
        for _ in range(a.repeat):
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            job()
            walls.append(round(1000 * (time.perf_counter() - t), 1))
        report["job_wall_ms"] = walls
        report["settings"] = {"no_cudnn_attention": a.no_cudnn_attention,
                              "DISABLE_ADDMM_CUDA_LT": os.environ.get("DISABLE_ADDMM_CUDA_LT")}
        if a.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            job()
            prof.disable()
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:a.cprofile]
            report["cprofile_top_tottime"] = [
                [f"{Path(f).name}:{line} {fn}", n_calls, round(1000 * tt, 1), round(1000 * ct, 1)]
                for (f, line, fn), (_, n_calls, tt, ct, _) in rows]
        report.update({"device": a.device, "aten_calls": sum(aten.values()), "python_torch_calls": sum(sites.values()),
                       "top_aten": aten.most_common(a.top), "top_sites": sites.most_common(a.top),
                       "top_site_calls": [[f"{s} {f}", n] for (s, f), n in calls.most_common(a.top)]})
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: report[k] for k in ("device", "aten_calls", "python_torch_calls", "job_wall_ms", "settings")}))
    for name, calls_n, tt, ct in report.get("cprofile_top_tottime", []):
        print(f"{tt:8.1f} ms own {ct:8.1f} ms with callees {calls_n:7d} calls  {name}")
    for key in ("top_sites", "top_site_calls", "top_aten"):
        print("--", key)
        for name, n in report[key]:
            print(n, name)
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
