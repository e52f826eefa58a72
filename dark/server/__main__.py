"""`python -m dark.server`: the same as `python websocket_server.py`."""
import sys

from .cli import main

sys.exit(main())
