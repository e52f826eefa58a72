"""The agent: MCP servers, tools in the model's prompt, an approve/edit/reject loop, and learning tool use."""
from .learning import TOOL_LORA, example_for_call, example_for_turn, examples_for_run, learn_from_run
from .loop import AgentRun, ToolCall, Turn
from .mcp_client import MCPManager, MCPServerError, ServerConfig, ToolResult, ToolSpec, load_config_file
from .service import AgentService
from .tools import Toolbox, format_call, parse_tool_calls, tools_system_prompt, validate_arguments

__all__ = ["AgentRun", "AgentService", "MCPManager", "MCPServerError", "ServerConfig", "TOOL_LORA", "ToolCall",
           "ToolResult", "ToolSpec", "Toolbox", "Turn", "example_for_call", "example_for_turn", "examples_for_run",
           "format_call", "learn_from_run", "load_config_file", "parse_tool_calls", "tools_system_prompt",
           "validate_arguments"]
