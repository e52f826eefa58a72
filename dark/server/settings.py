"""Server settings: one validated pydantic model, filled from DARK_* environment variables and then flags."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

ENV_PREFIX = "DARK_"
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


class ServerSettings(BaseModel):
    """Everything the app needs to know besides the model it serves.

    Each field can be set with an environment variable named DARK_<FIELD> (DARK_API_KEY, DARK_PORT, ...);
    list fields take comma-separated values.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(None, description="HF id, folder or .gguf file; empty: the default for the device")
    host: str = "0.0.0.0"  # reachable on a rented GPU; without an API key this prints a loud warning
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path | None = Field(None, description="conversations, adapters and jobs; default $DARK_HOME/data")
    api_key: SecretStr | None = Field(None, description="when set, every route but /health and the UI files needs it")
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser origins allowed to open the websocket (and CORS); empty: the server's own origin; '*': any")
    max_tokens: int = Field(4096, ge=1, description="the most tokens one answer may ask for")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request gives none")
    max_frame_bytes: int = Field(1 << 20, ge=1024, description="largest websocket frame or HTTP body accepted")
    rate_limit: float = Field(20.0, gt=0, description="websocket messages per second, per connection (sustained)")
    rate_burst: int = Field(60, ge=1, description="websocket messages a connection may send at once")
    max_inflight: int = Field(8, ge=1, description="generations one connection may have running at once")
    max_connections: int = Field(256, ge=1, description="open websockets at once, all clients together")
    correction_kind: str = Field("preference", pattern="^(preference|sft)$",
                                 description="how a correction trains: preference (old reply rejected) or sft")
    web_dir: Path | None = Field(None, description="the UI's static files; default: web/ of this checkout")
    mcp_config: Path | None = Field(None, description="the agent's MCP servers ({\"mcpServers\": ...} JSON, written "
                                                      "back when servers are added or removed); default: "
                                                      "<data dir>/mcp.json")
    log_level: str = Field("info", pattern="^(debug|info|warning|error|critical)$")

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, v):
        if isinstance(v, str):
            v = [o for o in (s.strip() for s in v.split(",")) if o]
        return [o.rstrip("/") for o in v]

    @field_validator("api_key", mode="before")
    @classmethod
    def _check_key(cls, v):
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        if isinstance(v, str) and not (v.isascii() and v.isprintable() and v == v.strip()):
            raise ValueError("the API key must be printable ASCII without surrounding spaces (HTTP headers carry it)")
        return v

    @field_validator("model", mode="before")
    @classmethod
    def _empty_model_is_none(cls, v):
        return None if isinstance(v, str) and not v.strip() else v

    @classmethod
    def from_env(cls, environ: dict | None = None, **overrides) -> "ServerSettings":
        """Settings from DARK_* variables, then keyword overrides (flags) that are not None."""
        environ = os.environ if environ is None else environ
        values = {}
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def key(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None

    @property
    def binds_beyond_loopback(self) -> bool:
        if self.host in LOOPBACK_NAMES:
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name other than localhost may resolve to anything
            return True

    def resolved_data_dir(self) -> Path:
        if self.data_dir is not None:
            return Path(self.data_dir).expanduser()
        from ..models.loader import dark_home

        return dark_home() / "data"

    def resolved_web_dir(self) -> Path:
        return Path(self.web_dir) if self.web_dir else Path(__file__).resolve().parents[2] / "web"

    def public_limits(self) -> dict:
        """The limits a client may want to know; never anything secret."""
        return {"max_tokens": self.max_tokens, "default_max_tokens": self.default_max_tokens,
                "max_frame_bytes": self.max_frame_bytes, "rate_limit": self.rate_limit,
                "rate_burst": self.rate_burst, "max_inflight": self.max_inflight}
