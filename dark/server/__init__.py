"""The server: FastAPI app with the websocket protocol, REST and OpenAI-compatible routes, and the web UI."""
from .app import create_app
from .protocol import PROTOCOL_VERSION
from .settings import ServerSettings

__all__ = ["create_app", "ServerSettings", "PROTOCOL_VERSION"]
