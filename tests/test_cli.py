"""The serve command itself (`python websocket_server.py`, what `make serve` runs): settings from flags and DARK_*
variables, a bad value refused before the model loads, the real server answering, and a clean stop on Ctrl-C."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dark.server.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


def serve_env(**variables) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARK_") or k == "DARK_HOME"}
    env.update(variables)
    return env


def test_engine_settings_come_from_flags_then_variables():
    from dark.server.cli import engine_settings, parser

    args = parser().parse_args(["--max-model-len", "512"])
    env = {"DARK_MAX_MODEL_LEN": "9", "DARK_DTYPE": "bfloat16", "DARK_MAX_NUM_SEQS": " 8 ", "DARK_DEVICE": ""}
    assert engine_settings(args, env) == {"device": None, "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 8}
    assert engine_settings(parser().parse_args([]), {}) == dict.fromkeys(["device", "dtype", "max_model_len", "max_num_seqs"])
    for var, raw, says in [("DARK_DTYPE", "bf16", "is not one of bfloat16, float16, float32"),
                           ("DARK_MAX_NUM_SEQS", "many", "is not a whole number"),
                           ("DARK_MAX_MODEL_LEN", "0", "must be positive")]:
        with pytest.raises(ValueError) as e:
            engine_settings(argparse.Namespace(device=None, dtype=None, max_model_len=None, max_num_seqs=None), {var: raw})
        assert str(e.value) == f"{var}={raw!r} {says}"


@pytest.mark.parametrize("variable,value,says", [("DARK_DTYPE", "bf16", "DARK_DTYPE='bf16' is not one of"),
                                                 ("DARK_PORT", "eighty", "port")])
def test_a_bad_variable_stops_the_command_before_loading(tmp_path, variable, value, says):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "websocket_server.py", "--data-dir", str(tmp_path / "data")], cwd=ROOT,
                         env=serve_env(**{variable: value}), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "dark serve: bad settings:" in out.stderr and says in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "data").exists()  # nothing was loaded or written
    assert time.monotonic() - start < 60


def test_serve_command_answers_and_stops_on_ctrl_c(tmp_path, smollm_path):
    """The default model (the embedded SmolLM2 on this CPU machine) behind the command a user runs, with a context
    limit given as DARK_MAX_MODEL_LEN: it answers through the OpenAI route, refuses a prompt over the limit, and a
    Ctrl-C ends it cleanly (exit 0)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "websocket_server.py", "--host", "127.0.0.1", "--port", str(port),
                             "--data-dir", str(tmp_path / "data")], cwd=ROOT,
                            env=serve_env(DARK_MAX_MODEL_LEN="200", DARK_LOG_LEVEL="warning"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the server exited: {proc.stdout.read()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 300 s"
            time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=120) as client:
            models = client.get("/v1/models").json()["data"]
            base = models[0]["id"]
            r = client.post("/v1/chat/completions", json={
                "model": base, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["message"]["content"]
            long = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)  # ~400 tokens
            r = client.post("/v1/chat/completions", json={
                "model": base, "max_tokens": 4, "messages": [{"role": "user", "content": long}]})
            assert r.status_code == 400, r.text
            assert "200" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    output = proc.stdout.read()
    assert rc == 0, output[-3000:]
    assert "Traceback" not in output
    assert (tmp_path / "data").is_dir()
