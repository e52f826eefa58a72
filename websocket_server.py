#!/usr/bin/env python3
"""Start dark: `python websocket_server.py [--model M] [--host H] [--port P] [--api-key K] ...`; --help lists all.

Loads the model once, then serves the UI at /, the websocket at /ws and the OpenAI-compatible API at /v1.
"""
import sys

from dark.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
