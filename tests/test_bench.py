"""The benchmark command of the GPU issue (bench/run_all.py), run as a user runs it, at tiny shapes on the CPU: it
must measure every line, write the issue's keys to its JSON and append a dated table to its results file. The
figures themselves are the GPU's business (bench/RESULTS.md); here the command must not rot between device runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the issue's keys (memory_outside_kv_gb only where there is a CUDA allocator to read) and their baselines
LINES = ["decode_bs1_tok_s", "decode_bs1_adapter_tok_s", "multi_adapter_ratio", "offline_tok_s", "train_tok_s",
         "correction_to_publish_s", "decode_p99_ratio_during_training", "train_ratio_during_decode"]
BASELINES = ["hf_decode_bs1_tok_s", "hf_decode_bs1_adapter_tok_s", "hf_offline_tok_s", "hf_train_tok_s"]


def run_tiny(script: str, tmp_path: Path, tokenizer: Path, *args: str) -> None:
    """bench/<script> at tiny shapes on the CPU as a user runs it: no Triton interpreter (conftest sets one for the
    kernels' own tests), so no Triton kernel may run on the CPU; fails with the end of its stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DARK_HOME": str(tmp_path / "home")}
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, f"bench/{script}", "--tiny", "--device", "cpu", "--tokenizer", str(tokenizer), *args]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_run_all_measures_every_line_and_writes_the_issue_keys(tmp_path, tokenizer_source):
    latest, results = tmp_path / "latest.json", tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nan earlier run's section, kept\n")
    run_tiny("run_all.py", tmp_path, tokenizer_source, "--json", str(latest), "--results", str(results))

    report = json.loads(latest.read_text())
    assert report["errors"] == [], report["errors"]
    assert report["device"].startswith("CPU") and report["shape"] == "tiny Qwen2"
    assert report["date"][:4].isdigit() and report["date"].endswith("UTC")
    for key in LINES + BASELINES:
        assert isinstance(report.get(key), (int, float)) and report[key] > 0, (key, report.get(key))
    assert 0 < report["multi_adapter_ratio"] < 2 and 0 < report["train_ratio_during_decode"] < 2
    assert report["correction_to_publish_s"] < 60
    assert "memory_outside_kv_gb" not in report  # the CPU has no allocator peak to read

    text = results.read_text()
    assert text.startswith("# Results\n\nan earlier run's section, kept\n")  # appended, not overwritten
    section = text[text.index(f"## run_all.py, {report['date']}"):]
    assert "| what | dark | HF + PEFT, same run | target | met |" in section
    row = next(line for line in section.splitlines() if line.startswith("| LoRA training, packed 2k"))
    assert f"| {report['train_tok_s']} | {report['hf_train_tok_s']} | >= 14000 |" in row


def test_bench_decode_runs_dark_and_the_baselines_at_tiny_shapes(tmp_path, tokenizer_source):
    """bench/bench_decode.py's smoke test as its docstring gives it (`--tiny --device cpu`), shortened: dark's rows
    (its default path: plain torch on a CPU) and Hugging Face's, with and without an adapter."""
    out = tmp_path / "decode.json"
    run_tiny("bench_decode.py", tmp_path, tokenizer_source, "--batch", "1", "2", "--new-tokens", "8",
             "--lora-new-tokens", "8", "--repeats", "1", "--out", str(out))
    rows = {(r["system"], r["batch"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("dark", 1), ("dark", 2), ("dark (no adapter)", 1), ("dark + LoRA r16", 1),
                         ("HF generate", 1), ("HF generate", 2), ("HF generate (no adapter)", 1),
                         ("PEFT + LoRA r16", 1)}
    for row in rows.values():
        assert row["new_tokens"] == 8 and row["decode_tok_s"] > 0
    assert rows[("dark", 2)]["p99_ms_per_token"] >= rows[("dark", 2)]["p50_ms_per_token"] > 0
