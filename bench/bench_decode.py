"""Decode throughput of dark's engine next to Hugging Face `generate`, on Qwen2.5-7B-Instruct shapes.

Random bf16 weights in the exact shapes (speed does not depend on the values), saved once as a safetensors
folder; fixed output lengths (ignore_eos / min_new_tokens). For each system and batch size:
  e2e tok/s    = batch * new_tokens / wall time of the whole generation (prefill included)
  decode tok/s = batch * (new_tokens - 1) / (T(new_tokens) - T(1)): the prefill and first token taken out
and, for dark, the p50 time between two tokens of one request.

    python bench/bench_decode.py --tokenizer .data/tok --out /tmp/bench.json
    python bench/bench_decode.py --tiny --device cpu --tokenizer .data/tok   # a smoke test of the script
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, head_dim=128, vocab_size=152064, rope_theta=1e6, tie_word_embeddings=False,
                 max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)
TINY = dict(QWEN25_7B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_folder(shape: dict, tokenizer: Path, folder: Path, device: torch.device) -> None:
    """A Qwen2 checkpoint of random bf16 weights (normal, std 0.02; norms 1; biases 0.02), with a tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = Qwen2Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.device("meta"):  # no slow default init: allocate in bf16 on the device, then fill
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    gc.collect()


def prompts_ids(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (batch, length), generator=g).tolist()  # valid in both vocabularies


# --- dark ---
class StepClock:
    """Wraps the engine's runner (bench-side only) to time each step: start, end, tokens in the step."""

    def __init__(self, runner):
        self.runner, self.real_run = runner, runner.run
        self.steps: list[tuple[float, float, int]] = []
        self.seqs: list[int] = []  # sequences in each step, beside self.steps
        runner.run = self.run

    def run(self, batch, **kw):
        t = time.perf_counter()
        out = self.real_run(batch, **kw)  # ends in a host sync (sampled tokens to a list)
        self.steps.append((t, time.perf_counter(), sum(n for _, n in batch)))
        self.seqs.append(len(batch))
        return out

    def clear(self) -> None:
        self.steps.clear()
        self.seqs.clear()

    def summary(self) -> dict:
        """Where a run's wall time went: steps that only decode (by batch size) and steps with prefill chunks."""
        import statistics as st

        if not self.steps:
            return {}
        dur = [(e - s, n, q) for (s, e, n), q in zip(self.steps, self.seqs)]
        decode = [(d, q) for d, n, q in dur if n == q]
        mixed = [(d, n, q) for d, n, q in dur if n != q]
        by_batch = {}
        for lo, hi in ((1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 10**9)):
            ds = [d for d, q in decode if lo <= q <= hi]
            if ds:
                by_batch[f"{lo}-{hi}"] = {"steps": len(ds), "median_ms": round(1000 * st.median(ds), 2),
                                          "seconds": round(sum(ds), 2)}
        return {"steps": len(dur), "wall_s": round(self.steps[-1][1] - self.steps[0][0], 2),
                "in_steps_s": round(sum(d for d, _, _ in dur), 2),
                "decode_steps": len(decode), "decode_s": round(sum(d for d, _ in decode), 2),
                "decode_tokens": sum(q for _, q in decode),
                "prefill_steps": len(mixed), "prefill_s": round(sum(d for d, _, _ in mixed), 2),
                "prefill_step_tokens": sum(n for _, n, _ in mixed),
                "prefill_median_ms": round(1000 * st.median(d for d, _, _ in mixed), 2) if mixed else None,
                "decode_by_batch": by_batch}

    def decode_steps(self) -> list[tuple[float, float, int]]:
        return self.steps[1:]  # the first step of a measured run holds the prefill


def run_ours(llm, prompts: list[list[int]], new_tokens: int, adapter=None, outputs: list | None = None) -> float:
    """Wall seconds from adding the requests until all have finished; `outputs` (a list as long as `prompts`), if
    given, gets each request's generated ids at its place."""
    from dark.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    left = [len(prompts)]
    done = threading.Event()
    errors: list[str] = []
    lock = threading.Lock()

    def on_output(out, i: int):
        if out.finished:
            if out.error is not None or out.completion_tokens != new_tokens:
                errors.append(f"{out.finish_reason} {out.error!r} after {out.completion_tokens} tokens")
            if outputs is not None:
                outputs[i] = list(out.output_ids or [])
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        llm.engine.add_request(ids, params, adapter, lambda out, i=i: on_output(out, i))
    if not done.wait(1200):
        raise SystemExit("dark: generation did not finish")
    if errors:
        raise SystemExit(f"dark: a request ended badly: {errors[0]}")
    return time.perf_counter() - t0


def figures(batch, new_tokens, t_full, t_one, steps=None) -> dict:
    fig = {"batch": batch, "new_tokens": new_tokens, "seconds": round(t_full, 4),
           "e2e_tok_s": round(batch * new_tokens / t_full, 2),
           "decode_tok_s": round(batch * (new_tokens - 1) / max(t_full - t_one, 1e-9), 2),
           "ms_per_step": round(1000 * (t_full - t_one) / (new_tokens - 1), 3)}
    if steps:
        gaps = sorted(b[1] - a[1] for a, b in zip(steps, steps[1:]))
        inside = sorted(e - s for s, e, _ in steps)
        fig["p50_ms_per_token"] = round(1000 * statistics.median(gaps), 3)
        fig["p99_ms_per_token"] = round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 3)
        fig["p50_ms_in_runner"] = round(1000 * statistics.median(inside), 3)  # the rest: scheduler, detokenizer
    return fig


def median_of(runs: list[dict]) -> dict:
    """The run with the median decode rate, and the spread of all runs (host noise is large on a VM)."""
    runs = sorted(runs, key=lambda f: f["decode_tok_s"])
    fig = dict(runs[len(runs) // 2])
    fig["repeats"] = len(runs)
    fig["decode_tok_s_all"] = [f["decode_tok_s"] for f in runs]
    return fig


def bench_ours(llm, clock: StepClock, batch, prompt_len, new_tokens, adapter=None, seed=0, repeats=1) -> dict:
    run_ours(llm, prompts_ids(batch, prompt_len, seed + 1000), 8, adapter)  # warm-up at this batch size
    runs = []
    for r in range(repeats):
        t_one = run_ours(llm, prompts_ids(batch, prompt_len, seed + 1 + 10 * r), 1, adapter)
        clock.clear()
        t_full = run_ours(llm, prompts_ids(batch, prompt_len, seed + 2 + 10 * r), new_tokens, adapter)
        runs.append(figures(batch, new_tokens, t_full, t_one, clock.decode_steps()))
    return median_of(runs)


def random_adapter(llm, rank: int, seed: int = 0):
    from dark.config import LoraConfig
    from dark.lora.weights import AdapterWeights

    cfg = llm.model.config
    weights = AdapterWeights.init(LoraConfig(r=rank, alpha=2 * rank, target_modules=tuple(LORA_TARGETS)),
                                  cfg.projection_shapes(), cfg.num_layers, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for key, (a, b) in weights.tensors.items():
        b.normal_(0, 1e-3, generator=g)
    return weights


def graph_replay_ms(runner, reps: int = 50) -> dict:
    """GPU time of one decode step alone: replays of each captured graph, timed with events, back to back
    (what a step would cost with no host work at all). Replays rewrite the last step's cache slots."""
    return {"b%d%s" % (key[0], "_lora" if key[1] else ""): replay_ms(graph, reps)
            for key, (graph, _) in list(runner._graphs.items())}


def replay_ms(graph, reps: int) -> float:
    """Milliseconds per replay of a captured graph: one replay to warm up, then `reps` back to back, CUDA events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / reps, 3)


def lora_micro(device, layers: int = 28, rank: int = 16, reps: int = 20) -> dict:
    """GPU time of the LoRA work of one batch-1 decode step alone (every projection of every layer), captured in
    one CUDA graph, for a few tile shapes of the shrink/expand kernels; beside it, a graph of as many trivial
    kernels, which shows what a graph node costs by itself."""
    from dark.models.decoder import kernel_module

    lk = kernel_module("lora")
    shapes = [(3584, 3584), (3584, 512), (3584, 512), (3584, 3584), (3584, 18944), (3584, 18944), (18944, 3584)]
    g = torch.Generator(device=device).manual_seed(0)
    mats = [(torch.randn(8, 64, k, device=device, generator=g).to(torch.bfloat16) * 0.02,
             torch.randn(8, 64, n, device=device, generator=g).to(torch.bfloat16) * 0.02,
             torch.randn(1, k, device=device, generator=g).to(torch.bfloat16),
             torch.randn(1, n, device=device, generator=g).to(torch.bfloat16)) for _ in range(layers) for k, n in shapes]
    slot = torch.zeros(1, dtype=torch.int64, device=device)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return replay_ms(graph, reps)

    out = {"nodes": 2 * len(mats)}
    for chunk, bk, bn in [(512, 128, 256), (512, 512, 256), (1024, 256, 512)]:
        def run(chunk=chunk, bk=bk, bn=bn):
            for A, B, x, y in mats:
                lk.lora_expand(lk.lora_shrink(x, A, slot, rank, chunk=chunk, block_k=bk), B, slot, y, rank, block_n=bn)
        out[f"chunk{chunk}_bk{bk}_bn{bn}_ms"] = timed(run)
    tiny = torch.zeros(16, device=device)
    out["trivial_kernels_same_count_ms"] = timed(lambda: [tiny.add_(1) for _ in range(2 * len(mats))])
    return out


# --- Hugging Face ---
def hf_generate(model, prompts, new_tokens, device) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    sync(device)
    assert out.shape[1] == len(prompts[0]) + new_tokens
    return time.perf_counter() - t0


def bench_hf(model, batch, prompt_len, new_tokens, device, seed=0, repeats=1) -> dict:
    hf_generate(model, prompts_ids(batch, prompt_len, seed + 1000), 8, device)
    runs = []
    for r in range(repeats):
        t_one = hf_generate(model, prompts_ids(batch, prompt_len, seed + 1 + 10 * r), 1, device)
        t_full = hf_generate(model, prompts_ids(batch, prompt_len, seed + 2 + 10 * r), new_tokens, device)
        runs.append(figures(batch, new_tokens, t_full, t_one))
    return median_of(runs)


# --- profile ---
def _profiled(llm, prompts, new_tokens, device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:  # the engine runs on its own thread
        from torch._C._profiler import _ExperimentalConfig

        kw = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        kw = {}
    with profile(activities=acts, **kw) as prof:
        run_ours(llm, prompts, new_tokens)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_time_total > 0 and "CUDA" in str(getattr(e, "device_type", ""))]
    return prof, events, kernels


def profile_ours(llm, clock: StepClock, prompt_len, steps, device, batch=1) -> dict:
    """GPU kernel time and launches per decode step (a run of steps+1 tokens minus a run of 1), against the
    wall time per step: a step whose kernels take far less than its wall time is bound by the host."""
    run_ours(llm, prompts_ids(batch, prompt_len, 7), 4)
    _, _, k1 = _profiled(llm, prompts_ids(batch, prompt_len, 8), 1, device)
    clock.clear()
    prof, events, kn = _profiled(llm, prompts_ids(batch, prompt_len, 9), steps + 1, device)
    dec = clock.decode_steps()
    gpu_ms = (sum(e.device_time_total for e in kn) - sum(e.device_time_total for e in k1)) / 1000 / steps
    launches = (sum(e.count for e in kn) - sum(e.count for e in k1)) / steps
    wall = [b[1] - a[1] for a, b in zip(dec, dec[1:])]
    by_gpu = sorted(kn, key=lambda e: -e.device_time_total)
    return {
        "batch": batch,
        "decode_steps": steps,
        "wall_ms_per_step_p50": round(1000 * statistics.median(wall), 3) if wall else None,
        "runner_ms_per_step_p50": round(1000 * statistics.median(e - s for s, e, _ in dec), 3) if dec else None,
        "gpu_kernel_ms_per_step": round(gpu_ms, 3),
        "kernels_per_step": round(launches, 1),
        "top_kernels_ms_per_step": [(e.key[:90], round(e.count / (steps + 1), 1), round(e.device_time_total / 1000 / (steps + 1), 4))
                                    for e in by_gpu[:15]],
        "table_by_gpu": events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
        if device.type == "cuda" else "",
        "table_by_cpu": events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".data/tok"), help="folder with tokenizer files")
    ap.add_argument("--folder", type=Path, help="reuse (or create) the model folder here; default: a temp dir")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen2 shapes, to check the script itself")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is reported")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-lora", action="store_true")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps under torch.profiler; 0: none")
    ap.add_argument("--profile-only", action="store_true", help="skip the timings (dark's and HF's)")
    ap.add_argument("--lora-micro", action="store_true", help="time the LoRA kernels of one step alone, then exit")
    ap.add_argument("--modes", nargs="+", default=["fast"], choices=["plain", "fast"],
                    help="dark's decode paths to time, in this order: plain torch, or kernels + CUDA graphs")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from dark import OnlineLLM
    from dark.models.decoder import kernel_module

    device = torch.device(args.device)
    if args.lora_micro:
        print(json.dumps({"lora_micro": lora_micro(device)}), flush=True)
        return
    shape = TINY if args.tiny else QWEN25_7B
    tmp = None
    folder = args.folder
    if folder is None:
        shm = Path("/dev/shm")
        tmp = tempfile.mkdtemp(prefix="dark-bench-", dir=shm if shm.is_dir() else None)
        folder = Path(tmp) / "qwen2.5-7b-shapes"
    report = {"shape": shape, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "device": str(device),
              "torch": torch.__version__, "results": []}
    import transformers
    report["transformers"] = transformers.__version__
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    try:
        if not (folder / "config.json").is_file():
            t = time.perf_counter()
            build_folder(shape, args.tokenizer.resolve(), folder, device)
            print(f"built {folder} in {time.perf_counter() - t:.1f}s", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

        def add(system, fig):
            fig = {"system": system, **fig}
            report["results"].append(fig)
            print(json.dumps(fig), flush=True)

        # --- dark ---
        t = time.perf_counter()
        max_b = max(args.batch)
        blocks = max_b * (-(-(args.prompt_len + args.new_tokens + 16) // 16)) * 2 + 64
        llm = OnlineLLM(str(folder), device=str(device), dtype="bfloat16", num_kv_blocks=blocks, max_num_seqs=max(64, max_b),
                        max_num_batched_tokens=max(4096, max_b * args.prompt_len))
        print(f"dark loaded in {time.perf_counter() - t:.1f}s", flush=True)
        clock = StepClock(llm.engine.runner)
        runner = llm.engine.runner
        published = False
        for mode in args.modes:
            # "fast": the engine's own path, whose kernels exist only on CUDA (on a CPU both modes are plain torch)
            runner.set_fast(mode == "fast" and kernel_module().available(device))
            label = "dark" if mode == "fast" else "dark, plain torch"
            fast0 = runner.fast_steps
            try:
                for b in [] if args.profile_only else args.batch:
                    add(label, bench_ours(llm, clock, b, args.prompt_len, args.new_tokens, repeats=args.repeats))
                if not args.skip_lora and not args.profile_only:
                    if not published:
                        llm.engine.adapters.publish("a", 1, random_adapter(llm, args.lora_rank))
                        published = True
                    n = args.lora_new_tokens
                    add(f"{label} (no adapter)", bench_ours(llm, clock, 1, args.prompt_len, n, seed=10, repeats=args.repeats))
                    add(f"{label} + LoRA r{args.lora_rank}", bench_ours(llm, clock, 1, args.prompt_len, n, adapter=("a", 1),
                                                                       seed=10, repeats=args.repeats))
            except (Exception, SystemExit):  # one mode failing must not cost the other's figures
                traceback.print_exc()
                report.setdefault("errors", []).append(f"{mode}: {traceback.format_exc()[-2000:]}")
            report[f"fast_steps_{mode}"] = runner.fast_steps - fast0
            if mode == "fast" and device.type == "cuda":
                report["graph_replay_ms"] = graph_replay_ms(runner)
                print(json.dumps({"graph_replay_ms": report["graph_replay_ms"],
                                  "graphs": [list(k) for k in runner._graphs]}), flush=True)
        for b in ([1, max_b] if max_b > 1 else [1]) if args.profile_steps else []:
            try:
                prof = profile_ours(llm, clock, args.prompt_len, args.profile_steps, device, batch=b)
            except Exception:  # a profiler failure must not cost the timings
                traceback.print_exc()
                continue
            report[f"profile_b{b}"] = prof
            print(prof["table_by_gpu"] if device.type == "cuda" else prof["table_by_cpu"], flush=True)
            print(json.dumps({k: v for k, v in prof.items() if not k.startswith("table")}, indent=1), flush=True)
        llm.close()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

        # --- Hugging Face ---
        if not args.skip_hf and not args.profile_only:
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                      device_map=str(device) if device.type == "cuda" else None).eval()
            for b in args.batch:
                add("HF generate", bench_hf(hf, b, args.prompt_len, args.new_tokens, device, repeats=args.repeats))
            if not args.skip_peft and not args.skip_lora:
                from peft import LoraConfig, get_peft_model

                n = args.lora_new_tokens
                add("HF generate (no adapter)", bench_hf(hf, 1, args.prompt_len, n, device, seed=10, repeats=args.repeats))
                peft = get_peft_model(hf, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                     target_modules=LORA_TARGETS, init_lora_weights=False)).eval()
                peft.to(torch.bfloat16)
                add(f"PEFT + LoRA r{args.lora_rank}", bench_hf(peft, 1, args.prompt_len, n, device, seed=10,
                                                                       repeats=args.repeats))
        if device.type == "cuda":
            report["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    print()
    print("| system | batch | new tokens | e2e tok/s | decode tok/s (median) | decode tok/s (all runs) | ms/step "
          "| p50 / p99 ms/token | p50 ms in runner |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in report["results"]:
        p = f"{r['p50_ms_per_token']} / {r['p99_ms_per_token']}" if "p50_ms_per_token" in r else ""
        print(f"| {r['system']} | {r['batch']} | {r['new_tokens']} | {r['e2e_tok_s']} | {r['decode_tok_s']} | "
              f"{', '.join(map(str, r['decode_tok_s_all']))} | {r['ms_per_step']} | {p} | {r.get('p50_ms_in_runner', '')} |")


if __name__ == "__main__":
    main()
