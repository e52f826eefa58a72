"""`python websocket_server.py` / `dark serve`: parse flags (over DARK_* variables), load the model once, serve."""
from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import threading
import time

from .settings import ServerSettings

log = logging.getLogger("dark.server")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dark serve",
        description="Serve a language model over a websocket, OpenAI-compatible HTTP and a browser UI, and learn "
                    "LoRA skills from corrections. Every flag can also be set as DARK_<FLAG> (e.g. DARK_API_KEY).")
    p.add_argument("--model", help="HF model id, model folder or .gguf file (default: the embedded SmolLM2-135M "
                                   "on a CPU machine, Qwen2.5-7B-Instruct on CUDA)")
    p.add_argument("--host", help="address to bind (default 0.0.0.0: set an API key, or 127.0.0.1 for this machine only)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--data-dir", help="where conversations, adapters and jobs live (default $DARK_HOME/data)")
    p.add_argument("--api-key", help="require this key from every client (prefer DARK_API_KEY: flags show in ps)")
    p.add_argument("--allowed-origins", help="comma-separated browser origins allowed besides the server's own; * for any")
    p.add_argument("--max-tokens", type=int, help="the most tokens one answer may ask for (default 4096)")
    p.add_argument("--max-frame-bytes", type=int, help="largest websocket frame / HTTP body (default 1 MiB)")
    p.add_argument("--web-dir", help="the UI's static files (default: web/ beside the package)")
    p.add_argument("--mcp-config", help="the agent's MCP servers, an {\"mcpServers\": ...} JSON file (default: "
                                        "<data dir>/mcp.json; the UI and API add and remove servers in it)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    engine = p.add_argument_group("engine")
    engine.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    engine.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on CUDA, float32 on the CPU (bfloat16 "
                                                        "decodes 1.3-1.6x faster on a CPU with AVX512-BF16 or AMX)")
    engine.add_argument("--max-model-len", type=int, help="context limit in tokens (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int, help="sequences decoded together (default 64)")
    return p


DTYPES = ["bfloat16", "float16", "float32"]
# the engine's flags: (name, type, choices); each also read from DARK_<NAME> when the flag is not given
ENGINE_FLAGS = (("device", str, None), ("dtype", str, DTYPES), ("max_model_len", int, None), ("max_num_seqs", int, None))


def engine_settings(args: argparse.Namespace, environ=None) -> dict:
    """The engine's settings: each flag, else its DARK_<FLAG> variable (e.g. DARK_MAX_MODEL_LEN), else None (the
    engine's default). A variable that cannot be the flag's value raises ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, kind, choices in ENGINE_FLAGS:
        value, var = getattr(args, name), "DARK_" + name.upper()
        raw = environ.get(var, "").strip()
        if value is None and raw:
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a whole number") from None
            if choices and value not in choices:
                raise ValueError(f"{var}={raw!r} is not one of {', '.join(choices)}")
            if kind is int and value <= 0:
                raise ValueError(f"{var}={raw!r} must be positive")
        out[name] = value
    return out


def build_llm(settings: ServerSettings, **engine):
    """The one OnlineLLM of this process; data_dir goes along when this dark's OnlineLLM takes it."""
    from ..llm import OnlineLLM

    kwargs = {k: v for k, v in engine.items() if v is not None}
    if "data_dir" in inspect.signature(OnlineLLM.__init__).parameters:
        kwargs["data_dir"] = settings.data_dir
    return _with_progress(f"loading {settings.model or 'the default model'}", lambda: OnlineLLM(settings.model, **kwargs))


def _with_progress(what: str, fn):
    """Run fn while a progress line shows the time spent (a bar on a terminal, log lines elsewhere)."""
    from tqdm import tqdm

    done = threading.Event()
    started = time.monotonic()
    bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", disable=not sys.stderr.isatty(), file=sys.stderr)

    def tick():
        while not done.wait(0.25):
            bar.update(0)
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    log.info("%s ...", what)
    try:
        return fn()
    finally:
        done.set()
        ticker.join()
        bar.close()
        log.info("%s: took %.1f s", what, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    args = parser().parse_args(argv)
    try:
        settings = ServerSettings.from_env(
            model=args.model, host=args.host, port=args.port, data_dir=args.data_dir, api_key=args.api_key,
            allowed_origins=args.allowed_origins, max_tokens=args.max_tokens, max_frame_bytes=args.max_frame_bytes,
            web_dir=args.web_dir, mcp_config=args.mcp_config, log_level=args.log_level)
        engine = engine_settings(args)
    except ValueError as e:
        print(f"dark serve: bad settings: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from .app import create_app

    from ..errors import DarkError

    try:
        llm = build_llm(settings, **engine)
    except DarkError as e:  # a model that cannot be found or loaded, a setting the engine refuses
        print(f"dark serve: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(llm, settings)
        log.info("serving %s on http://%s:%d (UI at /, websocket at /ws, OpenAI API at /v1)",
                 getattr(llm, "model_name", "model"), settings.host, settings.port)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                    ws_max_size=4 * settings.max_frame_bytes, proxy_headers=True)
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
