"""A/B of an environment setting on the engine's decode steps: graph replays and greedy tokens, in one process.

Builds the Qwen2.5-7B-shaped engine once (random bf16 weights), decodes `--batch` sizes greedily as served (their
CUDA graphs captured), times every captured graph's replay (bench_decode.graph_replay_ms), and keeps each request's
tokens; then for each `--env` setting (run_all.env_setting: NAME=VALUE[,NAME=VALUE]) drops the graphs, decodes the
same requests again and does the same. Reported per setting: ms a replay per bucket, its ratio to the default's,
and how many of the greedy tokens agree with the default's. Random weights make near-ties common, so a kernel that
sums in another order flips a token and the rest of that sequence after it, and so does a rerun of the same path
whose prompts' prefill batches form differently (27-33% of tokens agreed on the H100 for rows whose path a
setting did not change): compare with such a reference row; the kernels' own tests check correctness.
Optionally the same with a rank-16 adapter on every request (`--adapter`).

    PYTHONPATH=$PWD python3 bench/ab_decode_env.py --tokenizer .data/tok --env DARK_SKINNY=1 --adapter --out $OUT/ab.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import QWEN25_7B, TINY, graph_replay_ms, prompts_ids, random_adapter, run_ours  # noqa: E402
from bench_learn_gpu import build_model  # noqa: E402
from run_all import env_setting  # noqa: E402


def greedy(llm, prompts: list[list[int]], new_tokens: int, adapter=None) -> list[list[int]]:
    """Every request's generated ids (greedy: the engine's default sampling), decoded together as served."""
    outputs: list = [None] * len(prompts)
    run_ours(llm, prompts, new_tokens, adapter, outputs)
    return outputs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    total = sum(len(s) for s in a)
    first = [next((j for j, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
    return {"tokens_equal": round(same / max(total, 1), 4), "first_difference_at": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"))
    ap.add_argument("--env", nargs="+", required=True, help="settings to compare with the default")
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--adapter", action="store_true", help="also every request on a rank-16 adapter")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script (on a CPU: no graphs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from dark import OnlineLLM

    dev = torch.device(a.device)
    tmp = Path(tempfile.mkdtemp(prefix="dark-ab-"))
    hf = build_model(TINY if a.tiny else QWEN25_7B, a.tokenizer.resolve(), tmp / "model", dev)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    llm = OnlineLLM(str(tmp / "model"), data_dir=tmp / "data", device=a.device,
                    dtype="bfloat16" if dev.type == "cuda" else "float32", num_kv_blocks=1024,
                    max_num_seqs=max(a.batch), warm_learning=False)
    eng = llm.engine
    adapter = None
    if a.adapter:
        eng.adapters.publish("ab", 1, random_adapter(llm, 16, seed=1))
        adapter = ("ab", 1)
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "rows": {}}

    def measure() -> dict:
        row: dict = {"tokens": {}}
        for b in a.batch:
            prompts = prompts_ids(b, 64, b)
            row["tokens"][f"b{b}"] = greedy(llm, prompts, a.tokens)
            if adapter:
                row["tokens"][f"b{b}_lora"] = greedy(llm, prompts, a.tokens, adapter)
        row["replay_ms"] = graph_replay_ms(eng.runner) if dev.type == "cuda" and eng.runner.use_graphs else {}
        return row

    base = measure()
    report["rows"]["default"] = {"replay_ms": base["replay_ms"]}
    print(json.dumps({"default": base["replay_ms"]}), flush=True)
    for spec in a.env:
        with env_setting(spec):
            eng.call_between_steps(eng.runner._drop_graphs).result()
            row = measure()
        eng.call_between_steps(eng.runner._drop_graphs).result()
        out = {"replay_ms": row["replay_ms"],
               "default_over_this": {k: round(base["replay_ms"][k] / v, 3) for k, v in row["replay_ms"].items()
                                     if k in base["replay_ms"]},
               "agreement": {k: agreement(base["tokens"][k], v) for k, v in row["tokens"].items()}}
        report["rows"][spec] = out
        print(json.dumps({spec: out}), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
